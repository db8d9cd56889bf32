"""Cost models: training FLOPs of a sample (or image) as a function of its length.

The planner balances *compute*, not tokens: attention grows with the square of each packed
sub-sequence while projections and MLPs grow linearly, so two microbatches with equal token
counts can differ several-fold in FLOPs (paper Sec. 2.3, Fig. 3). A cost model maps an array
of lengths to an array of float64 costs in one vectorized expression, because the planner
calls it on every sample (~20k) and every image of every step.

Models:
    * `TransformerCost` — decoder/backbone FLOPs from a `TransformerConfig` (QKV/out
      projections, dense or top-k MoE MLP, s² attention per sub-sequence, LM head), ×3 for
      forward + backward.
    * `ViTCost` — encoder FLOPs of each image (each image is its own attention sequence).
    * `TokenCost` — cost = tokens (the "balance tokens" baseline).

`get_cost_model(name_or_callable, kind=...)` resolves a name ("tokens", a preset such as "llama-12b",
"vit:<preset>", or "calibrated:<path>" for a fit saved by `megascale-data profile --model`, see
`calibration.py`) or a `TransformerConfig`, or passes a callable through; the strategies
resolve their models through it. `register_cost_model` adds names, `cost_model_names` lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from megascale_data_ext.dataplane.calibration import load_calibration
from megascale_data_ext.errors import ConfigError

__all__ = [
    "CostModel",
    "TokenCost",
    "TransformerConfig",
    "TransformerCost",
    "ViTCost",
    "cost_model_names",
    "get_cost_model",
    "register_cost_model",
    "segment_sum",
]

#: Forward + backward ≈ 3× the forward FLOPs (backward computes grads for inputs and weights).
FWD_BWD_FACTOR = 3.0


@runtime_checkable
class CostModel(Protocol):
    """Anything that maps an array of lengths to an array of float64 costs of the same shape."""

    def __call__(self, lengths: np.ndarray) -> np.ndarray: ...


@dataclass(slots=True, kw_only=True, frozen=True)
class TransformerConfig:
    """Shape of a transformer stack, enough to count its matmul FLOPs.

    `ffn` defaults to 4·hidden; `num_query_groups` (GQA) defaults to `heads` (plain MHA).
    For MoE (`moe_experts > 0`) each token runs `moe_topk` experts of width `ffn` plus the
    router. `swiglu` uses three MLP matrices instead of two.
    """

    hidden: int
    layers: int
    heads: int
    ffn: int = 0
    num_query_groups: int | None = None
    vocab: int = 0
    moe_experts: int = 0
    moe_topk: int = 0
    swiglu: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        problems = []
        for field in ("hidden", "layers", "heads"):
            if getattr(self, field) <= 0:
                problems.append(f"`{field}` must be > 0, got {getattr(self, field)!r}")
        if self.hidden > 0 and self.heads > 0 and self.hidden % self.heads:
            problems.append(f"`hidden` ({self.hidden}) must be divisible by `heads` ({self.heads})")
        groups = self.num_query_groups
        if groups is not None and (groups <= 0 or self.heads % groups):
            problems.append(f"`num_query_groups` must divide `heads` ({self.heads}), got {groups!r}")
        if self.moe_experts < 0 or self.moe_topk < 0 or self.moe_topk > max(self.moe_experts, 0):
            problems.append(
                f"MoE needs 0 <= `moe_topk` <= `moe_experts`, got topk={self.moe_topk}, experts={self.moe_experts}"
            )
        if self.ffn < 0 or self.vocab < 0:
            problems.append(f"`ffn` and `vocab` must be >= 0, got ffn={self.ffn}, vocab={self.vocab}")
        if problems:
            raise ConfigError(f"TransformerConfig {self.name or '(unnamed)'}: " + "; ".join(problems))
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)

    @classmethod
    def preset(cls, name: str) -> TransformerConfig:
        """A model of the paper's Table 1 (case-insensitive), or "gpt-tiny" for tests."""
        key = name.strip().lower()
        if key not in _PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(_PRESETS)}")
        return _PRESETS[key]

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)


# Table 1 gives layers/heads/hidden; the remaining fields are the public models these sizes
# come from (ViT-g/14 and ViT-G/14 MLP widths, Llama-style SwiGLU, Mixtral's published config).
# tMoE-25B's expert count/width are our assumption, chosen so its parameters total ≈ 25B.
_PRESETS: dict[str, TransformerConfig] = {
    c.name.lower(): c
    for c in (
        TransformerConfig(name="ViT-1B", layers=39, heads=16, hidden=1408, ffn=6144),
        TransformerConfig(name="ViT-2B", layers=48, heads=16, hidden=1664, ffn=8192),
        TransformerConfig(name="Llama-12B", layers=45, heads=36, hidden=4608, ffn=12288, swiglu=True, vocab=32000),
        TransformerConfig(
            name="tMoE-25B", layers=42, heads=16, hidden=2048, ffn=5632, swiglu=True, vocab=32000,
            moe_experts=16, moe_topk=2,
        ),
        TransformerConfig(
            name="Mixtral-8x7B", layers=32, heads=32, hidden=4096, ffn=14336, swiglu=True, vocab=32000,
            num_query_groups=8, moe_experts=8, moe_topk=2,
        ),
        TransformerConfig(name="gpt-tiny", layers=2, heads=4, hidden=64, vocab=128),
    )
}


def _coefficients(cfg: TransformerConfig, *, lm_head: bool) -> tuple[float, float]:
    """(linear, quadratic) FLOPs coefficients of the whole stack, forward + backward.

    A matmul of (s × a) by (a × b) costs 2·s·a·b FLOPs. Per layer and sub-sequence of s tokens:
    QKV 2·s·h·(h + 2·h_kv), output 2·s·h², MLP 2·s·h·ffn·(3 if SwiGLU else 2) per active
    expert, router 2·s·h·E; attention scores QKᵀ and context AV 2·s²·h each.
    """
    h = float(cfg.hidden)
    kv = h * (cfg.num_query_groups or cfg.heads) / cfg.heads
    mlp_mats = 3.0 if cfg.swiglu else 2.0
    active = float(cfg.moe_topk) if cfg.moe_experts > 0 else 1.0
    linear = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * h * cfg.ffn * mlp_mats * active
    if cfg.moe_experts > 0:
        linear += 2 * h * cfg.moe_experts
    linear *= cfg.layers
    if lm_head:
        linear += 2 * h * cfg.vocab
    quadratic = 4 * h * cfg.layers
    return FWD_BWD_FACTOR * linear, FWD_BWD_FACTOR * quadratic


def _as_lengths(lengths: np.ndarray | float | int) -> np.ndarray:
    return np.asarray(lengths, dtype=np.float64)


class TransformerCost:
    """FLOPs (fwd+bwd) of the whole layer stack plus LM head for each packed sub-sequence.

    Each array element is one sub-sequence: packed documents attend only within themselves,
    so the s² term is per element. Sum the elements of a sample (see `segment_sum`) for a
    sample made of several sub-sequences. Stateless and thread-safe.
    """

    __slots__ = ("config", "linear", "quadratic", "__name__")

    def __init__(self, config: TransformerConfig | str):
        self.config = TransformerConfig.preset(config) if isinstance(config, str) else config
        self.linear, self.quadratic = _coefficients(self.config, lm_head=True)
        self.__name__ = f"TransformerCost({self.config.name or 'custom'})"

    def flops(self, seq_lens: np.ndarray) -> np.ndarray:
        s = _as_lengths(seq_lens)
        return s * (self.linear + self.quadratic * s)

    def attention_flops(self, seq_lens: np.ndarray) -> np.ndarray:
        """Only the s² score/context term: the part packing changes."""
        s = _as_lengths(seq_lens)
        return self.quadratic * s * s

    __call__ = flops

    def __repr__(self) -> str:
        return self.__name__


class ViTCost:
    """FLOPs (fwd+bwd) of a ViT encoder for each image, from its patch count.

    Args:
        config: The encoder's shape (no LM head is counted, `vocab` is ignored).
        patch_tokens: Extra tokens each image carries besides its patches (class/register
            tokens), added to the sequence length before costing.
    """

    __slots__ = ("config", "patch_tokens", "linear", "quadratic", "__name__")

    def __init__(self, config: TransformerConfig | str, patch_tokens: int = 0):
        self.config = TransformerConfig.preset(config) if isinstance(config, str) else config
        if patch_tokens < 0:
            raise ConfigError(f"ViTCost `patch_tokens` must be >= 0, got {patch_tokens!r}")
        self.patch_tokens = int(patch_tokens)
        self.linear, self.quadratic = _coefficients(self.config, lm_head=False)
        self.__name__ = f"ViTCost({self.config.name or 'custom'})"

    def flops(self, image_patches: np.ndarray) -> np.ndarray:
        s = _as_lengths(image_patches)
        if self.patch_tokens:
            s = np.where(s > 0, s + self.patch_tokens, 0.0)
        return s * (self.linear + self.quadratic * s)

    def attention_flops(self, image_patches: np.ndarray) -> np.ndarray:
        s = _as_lengths(image_patches)
        if self.patch_tokens:
            s = np.where(s > 0, s + self.patch_tokens, 0.0)
        return self.quadratic * s * s

    def per_sample(self, image_offsets: np.ndarray, image_patch_counts: np.ndarray) -> np.ndarray:
        """Encoder FLOPs of each sample: the sum over its images (ragged offsets, n+1)."""
        return segment_sum(self.flops(image_patch_counts), image_offsets)

    __call__ = flops

    def __repr__(self) -> str:
        return self.__name__


class TokenCost:
    """Cost = number of tokens: what a token-count balancer (or Megatron's packing) equalizes."""

    __slots__ = ()
    __name__ = "TokenCost"

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        return _as_lengths(lengths).copy()

    flops = __call__

    def __repr__(self) -> str:
        return "TokenCost()"


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum `values[offsets[i]:offsets[i+1]]` for every i, empty segments giving 0.

    Uses one cumsum instead of `np.add.reduceat`, which mishandles empty segments.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    csum = np.empty(len(values) + 1, dtype=np.float64)
    csum[0] = 0.0
    np.cumsum(values, out=csum[1:])
    return csum[offsets[1:]] - csum[offsets[:-1]]


#: `get_cost_model("calibrated:<path>")` loads a `CalibratedCost` fitted to measured step times.
CALIBRATED_PREFIX = "calibrated:"

CostFactory = Callable[[], Callable[[np.ndarray], np.ndarray]]
_REGISTRY: dict[str, CostFactory] = {"tokens": TokenCost}


def register_cost_model(name: str, factory: CostFactory) -> None:
    """Make `get_cost_model(name)` return `factory()`; names are case-insensitive."""
    _REGISTRY[name.strip().lower()] = factory


def get_cost_model(
    name_or_callable: str | TransformerConfig | Callable[[np.ndarray], np.ndarray],
    *,
    kind: type[TransformerCost] | type[ViTCost] | None = None,
) -> Callable:
    """Resolve a cost model: the one path from a name or config to a cost callable.

    Accepts a callable (returned as is), a `TransformerConfig`, a registered name ("tokens"),
    a preset name ("llama-12b"), "vit:<preset>" to force the encoder model, or
    "calibrated:<path>" for a `CalibratedCost` (seconds, not FLOPs) loaded from a saved fit. A config or
    preset is costed by `kind` (`TransformerCost` for a backbone, `ViTCost` for an encoder);
    without one, presets starting with "vit" get `ViTCost` and all others `TransformerCost`.

    Raises:
        ConfigError: an unknown name (the message lists the known ones), a value that is
            neither a name, a config nor a callable, or a calibration file that is missing or invalid.
    """
    if isinstance(name_or_callable, TransformerConfig):
        return (kind or TransformerCost)(name_or_callable)
    if callable(name_or_callable):
        return name_or_callable
    if not isinstance(name_or_callable, str):
        raise ConfigError(f"cost model must be a name or a callable, got {type(name_or_callable).__name__}")
    key = name_or_callable.strip().lower()
    if key.startswith(CALIBRATED_PREFIX):  # the path keeps its case
        path = name_or_callable.strip()[len(CALIBRATED_PREFIX):]
        if not path:
            raise ConfigError(f"cost model {name_or_callable!r} names no file; use 'calibrated:<path to the JSON "
                              "written by `megascale-data profile --model`>'")
        return load_calibration(path)
    if key in _REGISTRY:
        return _REGISTRY[key]()
    if key.startswith("vit:"):
        return ViTCost(TransformerConfig.preset(key[4:]))
    if key.startswith(SHAPE_PREFIX):
        return (kind or TransformerCost)(parse_shape(key))
    if key in _PRESETS:
        return (kind or (ViTCost if key.startswith("vit") else TransformerCost))(_PRESETS[key])
    raise ConfigError(f"unknown cost model {name_or_callable!r}; known: {cost_model_names()}, or pass a callable")


def cost_model_names() -> list[str]:
    """The names `get_cost_model` accepts: registered names, presets, "vit:<preset>", "calibrated:<path>",
    "transformer:layers=..,hidden=..,heads=.." (any `TransformerConfig` field)."""
    return sorted(_REGISTRY) + sorted(_PRESETS) + ["vit:<preset>", f"{CALIBRATED_PREFIX}<path>",
                                                   f"{SHAPE_PREFIX}layers=<n>,hidden=<n>,heads=<n>"]


SHAPE_PREFIX = "transformer:"
"""A cost model given by its shape: ``transformer:layers=2,hidden=64,heads=4`` (what a config's
``model.*`` derives, `shape_name`)."""


def shape_name(**fields: int | bool) -> str:
    """The cost-model name of a transformer shape (`TransformerConfig` fields; zero/None left out)."""
    return SHAPE_PREFIX + ",".join(f"{k}={int(v)}" for k, v in fields.items() if v)


def parse_shape(name: str) -> TransformerConfig:
    """`TransformerConfig` of a ``transformer:key=value,...`` name."""
    allowed = {f.name for f in dataclasses.fields(TransformerConfig)} - {"name"}
    fields: dict[str, int | bool] = {}
    for part in filter(None, name.strip()[len(SHAPE_PREFIX):].split(",")):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in allowed or not value.strip().lstrip("-").isdigit():
            raise ConfigError(f"cost model {name!r}: {part!r} is not <field>=<integer> with a field of "
                              f"{sorted(allowed)}; e.g. {SHAPE_PREFIX}layers=32,hidden=4096,heads=32")
        fields[key] = bool(int(value)) if key == "swiglu" else int(value)
    missing = [k for k in ("layers", "hidden", "heads") if k not in fields]
    if missing:
        raise ConfigError(f"cost model {name!r} lacks {missing}; e.g. {SHAPE_PREFIX}layers=32,hidden=4096,heads=32")
    return TransformerConfig(name=name.strip(), **fields)


def replace_config(config: TransformerConfig, **changes: object) -> TransformerConfig:
    """`dataclasses.replace` for configs (e.g. the paper's 8-layer memory-fitted backbone)."""
    return dataclasses.replace(config, **changes)
