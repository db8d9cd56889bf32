"""ServiceConfig: everything the runtime needs to start loaders, planner and constructors.

Plain dataclasses (no Hydra import) so actors can receive them; `megascale_data_ext.config`
builds one from the Hydra/YAML group and validates it eagerly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.sources.base import SourceSpec


@dataclass(slots=True, kw_only=True)
class ServiceConfig:
    """Batch shape, strategy, mixing and runtime knobs of one data service.

    Attributes:
        sources: The sources, in mixing order.
        seed: Seeds epoch shuffles and random mixing; same seed + step -> same samples.
        samples_per_step: Samples in one global batch (before packing).
        num_microbatches: Microbatches per DP rank per step (Megatron's GBS / (DP * MBS)).
        seq_length: Token cap of one packed microbatch (the context length).
        strategy: Name of a registered strategy ("vanilla", "llm_balance", "vlm_balance").
        strategy_args: Keyword arguments of the strategy (model, method, level, ...).
        mixing: Mixing schedule mapping for `mixing.build_schedule` (default: source weights).
        mix_mode: "deterministic" (Megatron-like error minimisation) or "random".
        overflow: "defer": samples of a step that do not fit DP x num_microbatches x seq_length
            tokens wait for the next step (`samples_per_step` is then a maximum); "error": stop
            with a CapacityError naming the sample.
        shuffle: Shuffle each source's order per epoch (seeded).
        buffer_size: Samples per source whose metadata the planner may look at.
        prefetch: Steps planned and assembled ahead of the trainer.
        constructor_group: DP buckets served by one Data Constructor (1 = one per DP rank).
        with_attention_mask: Build the block-diagonal causal mask (needed without THD kernels).
        pad_to_multiple_of: Packed length granularity (multiplied by 2*cp for CP slicing).
        middle_stage_masks: Middle pipeline stages (pp > 2) also fetch the attention mask and
            cu_seqlens, so packed documents never attend across boundaries on any stage.
        namespace: Ray namespace of the named actors.
        ray_address: None = embedded local Ray; "auto" or "ray://..." for a cluster.
    """

    sources: list[SourceSpec]
    seed: int = 1234
    samples_per_step: int = 32
    num_microbatches: int = 2
    seq_length: int = 1024
    strategy: str = "llm_balance"
    strategy_args: dict[str, Any] = field(default_factory=dict)
    mixing: dict[str, Any] | None = None
    mix_mode: str = "deterministic"
    shuffle: bool = True
    buffer_size: int = 4096
    prefetch: int = 2
    constructor_group: int = 1
    with_attention_mask: bool = True
    pad_to_multiple_of: int = 8
    overflow: str = "defer"
    middle_stage_masks: bool = True
    namespace: str = "megascale"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        # A sample can never be longer than the context: sources without their own limit get
        # seq_length; their `truncate` flag decides between cutting and a named error.
        self.sources = [s if s.max_tokens is not None else replace(s, max_tokens=self.seq_length) for s in self.sources]
        problems = []
        if not self.sources:
            problems.append("`sources` is empty: give at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            problems.append(f"`sources` names must be unique, got {names}")
        for key in ("samples_per_step", "num_microbatches", "seq_length", "buffer_size", "prefetch", "constructor_group"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                problems.append(f"`{key}` must be a positive integer, got {value!r}")
        if self.mix_mode not in ("deterministic", "random"):
            problems.append(f"`mix_mode` must be 'deterministic' or 'random', got {self.mix_mode!r}")
        if self.overflow not in ("defer", "error"):
            problems.append(f"`overflow` must be 'defer' or 'error', got {self.overflow!r}")
        if problems:
            raise ConfigError("invalid data service config:\n  - " + "\n  - ".join(problems))

    def service_tree(self, tree: Any) -> Any:
        """The tree the service plans and delivers for: with `middle_stage_masks`, every
        pipeline stage fetches (middle stages get only the masks)."""
        from megascale_data_ext.dataplane.placetree import FetchStages

        if self.middle_stage_masks and tree.pp > 2 and tree.fetch_stages is FetchStages.ENDS:
            return replace(tree, fetch_stages=FetchStages.ALL)
        return tree

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    def mixing_config(self) -> dict[str, Any]:
        if self.mixing is not None:
            return dict(self.mixing)
        return {"type": "constant", "weights": [s.weight for s in self.sources]}

    def fingerprint(self) -> dict[str, Any]:
        """Fields that decide the delivered stream; a resume must match them (see ResumeError)."""
        return {
            "sources": [(s.name, s.format, sorted(s.paths)) for s in self.sources],
            "seed": self.seed,
            "samples_per_step": self.samples_per_step,
            "num_microbatches": self.num_microbatches,
            "seq_length": self.seq_length,
            "strategy": [self.strategy, json.dumps(self.strategy_args, sort_keys=True, default=str)],
            "mixing": json.dumps(self.mixing_config(), sort_keys=True, default=str),
            "mix_mode": self.mix_mode,
            "shuffle": self.shuffle,
            "overflow": self.overflow,
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
