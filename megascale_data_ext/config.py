"""The `data` Hydra config group: structured schema, eager validation, ServiceConfig.

A Megatron run adopts the service with ``defaults: [data: megascale, strategy: llm_balance,
sources: ..., ray: local]`` (see ``conf/train_gpt.yaml``); :func:`load_config` turns the
composed ``data`` node into a :class:`MegascaleDataConfig` and :meth:`~MegascaleDataConfig.
to_service_config` into the runtime's :class:`~megascale_data_ext.runtime.config.ServiceConfig`.

Why a validator of our own next to the Hydra schema: OmegaConf stops at the first bad key or
type, while a user fixing a config wants the whole list. :func:`load_config` walks the node
against the dataclasses below and raises one ``ConfigError`` naming every problem's config
path (``data.sources[2].weight``), bad value and allowed values. The dataclasses are also
registered in Hydra's ConfigStore as ``data/megascale_schema`` (compose-time typing, opt-in).

The YAML lives in ``conf/`` at the repository root, found from this package's location, so an
editable install (``pip install -e .``) needs nothing else; elsewhere set ``MEGASCALE_CONF_DIR``
(or ``config_dir``). Own ``@hydra.main`` apps add :func:`conf_dir` to ``hydra.searchpath``.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import inspect
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.sources.base import SourceSpec

__all__ = [
    "CheckpointConfig",
    "MegascaleDataConfig",
    "MixingConfig",
    "RayConfig",
    "SourceConfig",
    "StrategyConfig",
    "compose_config",
    "conf_dir",
    "load_config",
    "register_configs",
]

CONF_DIR_ENV = "MEGASCALE_CONF_DIR"
_GLOB_CHARS = frozenset("*?[")
_MISSING = "???"
#: Fields MegascaleDataConfig passes to ServiceConfig unchanged.
_SHARED_FIELDS = ("seed", "samples_per_step", "num_microbatches", "seq_length", "shuffle", "buffer_size", "prefetch",
                  "constructor_group", "with_attention_mask", "pad_to_multiple_of", "overflow", "middle_stage_masks")


@dataclass(slots=True, kw_only=True)
class SourceConfig:
    """One source; the fields mirror :class:`SourceSpec` (see it for their meaning).

    ``path`` is a one-path shorthand for ``paths`` (Energon-style ``- weight: 5 path: ./coco``);
    ``name`` defaults to the first path's file name without suffix.
    """

    name: str | None = None
    format: str = "parquet"
    path: str | None = None
    paths: list[str] = field(default_factory=list)
    weight: float = 1.0
    text_column: str = "text"
    tokens_column: str | None = None
    image_column: str | None = None
    tokenizer: str | None = None
    patch_size: int = 16
    max_image_patches: int = 1024
    decode_images: str = "loader"
    max_tokens: int | None = None
    truncate: bool = False
    max_bad_fraction: float = 0.0
    append_eod: bool = True
    eod_token_id: int | None = None
    num_workers: int = 0
    row_group_cache: int = 4


@dataclass(slots=True, kw_only=True)
class MixingConfig:
    """Mixing schedule: ``type`` plus that type's ``params`` for ``mixing.build_schedule``.

    ``type: constant`` with empty ``params`` mixes by the sources' ``weight`` fields.
    """

    type: str = "constant"
    mode: str = "deterministic"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class StrategyConfig:
    """A registered strategy by ``name``, or any strategy class/factory by ``_target_``.

    ``args`` are its keyword arguments; ``num_microbatches`` and (except for vanilla) ``cap``
    default to ``data.num_microbatches`` / ``data.seq_length`` as in the Planner.
    """

    name: str | None = "llm_balance"
    _target_: str | None = None
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class RayConfig:
    """Where the service's actors run: ``address=None`` starts an embedded local Ray."""

    address: str | None = None
    namespace: str = "megascale"
    num_cpus: int | None = None
    resources: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class CheckpointConfig:
    """Where the data state goes: ``dir=None`` = inside Megatron's ``--save`` directory."""

    dir: str | None = None
    save_with_megatron: bool = True


@dataclass(slots=True, kw_only=True)
class MegascaleDataConfig:
    """The ``data`` node: sources, mixing, strategy, batch shape and runtime knobs.

    Defaults equal :class:`ServiceConfig`'s. Build it with :func:`load_config`, which
    validates; relative paths resolve against ``data_root`` (else the current directory).
    """

    data_root: str | None = None
    sources: list[SourceConfig] = field(default_factory=list)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    samples_per_step: int = 32
    num_microbatches: int = 2
    seq_length: int = 1024
    pad_to_multiple_of: int = 8
    with_attention_mask: bool = True
    shuffle: bool = True
    seed: int = 1234
    prefetch: int = 2
    buffer_size: int = 4096
    constructor_group: int = 1
    overflow: str = "defer"
    middle_stage_masks: bool = True
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def resolve_path(self, path: str) -> str:
        """Absolute form of a config path: ``~`` expanded, relative ones under ``data_root``."""
        p = os.path.expanduser(path)
        if not os.path.isabs(p) and self.data_root is not None:
            p = os.path.join(os.path.expanduser(self.data_root), p)
        return os.path.abspath(p)

    def source_specs(self) -> list[SourceSpec]:
        """The sources as runtime specs (absolute paths, derived names filled in)."""
        specs = []
        for i, s in enumerate(self.sources):
            kwargs = {f.name: getattr(s, f.name) for f in dataclasses.fields(SourceSpec)}
            kwargs["name"] = _source_name(s, i)
            kwargs["paths"] = [self.resolve_path(p) for p in _source_paths(s)]
            kwargs["tokenizer"] = None if s.tokenizer is None else self.resolve_path(s.tokenizer)
            specs.append(SourceSpec(**kwargs))
        return specs

    def strategy_name(self) -> str:
        """The name the runtime builds the strategy by; registers a ``_target_`` if needed."""
        from megascale_data_ext.dataplane.strategies import STRATEGIES, register_strategy

        if self.strategy._target_ is None:
            return str(self.strategy.name)
        target = _locate(self.strategy._target_)
        name = next((n for n, f in STRATEGIES.items() if f is target), None)
        if name is None:  # registered under its dotted path in this process only (see the report)
            name = self.strategy._target_
            register_strategy(name, target)
        return name

    def to_service_config(self) -> ServiceConfig:
        """The runtime's config: sources, batch shape, strategy, mixing, Ray namespace/address."""
        mixing = None
        if self.mixing.type != "constant" or self.mixing.params:
            mixing = {"type": self.mixing.type, **self.mixing.params}
        same = {k: getattr(self, k) for k in _SHARED_FIELDS}
        return ServiceConfig(
            sources=self.source_specs(), strategy=self.strategy_name(), strategy_args=dict(self.strategy.args),
            mixing=mixing, mix_mode=self.mixing.mode, namespace=self.ray.namespace, ray_address=self.ray.address,
            **same,
        )

    def ray_init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.init`` (num_cpus/resources only for an embedded Ray)."""
        local = {"num_cpus": self.ray.num_cpus, "resources": dict(self.ray.resources) or None}
        extra = {k: v for k, v in local.items() if v is not None} if self.ray.address is None else {}
        return {"address": self.ray.address, "namespace": self.ray.namespace, **extra}


def _choices() -> dict[tuple[type, str], Callable[[], list[str]]]:
    """Allowed values of the str-typed choice fields, read from their owners (never copied).

    They are ``str`` in the dataclasses because OmegaConf matches enum fields by member name.
    """
    from megascale_data_ext.dataplane.mixing import MixMode, ScheduleType
    from megascale_data_ext.dataplane.strategies import STRATEGIES
    from megascale_data_ext.sources.base import DecodeMode
    from megascale_data_ext.sources.registry import source_formats

    return {
        (SourceConfig, "format"): source_formats,
        (SourceConfig, "decode_images"): lambda: list(get_args(DecodeMode)),
        (MixingConfig, "type"): lambda: [t.value for t in ScheduleType],
        (MixingConfig, "mode"): lambda: [m.value for m in MixMode],
        (StrategyConfig, "name"): lambda: sorted(STRATEGIES),
    }


def _strategy_arg_choices() -> dict[str, Callable[[], list[str]]]:
    """Allowed values of well-known strategy arguments, checked when they are strings."""
    from megascale_data_ext.dataplane.balancers import Level, balancer_names
    from megascale_data_ext.dataplane.costs import TransformerConfig
    from megascale_data_ext.dataplane.placetree import BucketAxis

    axes = [a.value for a in BucketAxis]
    return {
        "model": TransformerConfig.preset_names,
        "encoder_model": TransformerConfig.preset_names,
        "method": balancer_names,
        "encoder_method": balancer_names,
        "level": lambda: list(get_args(Level)),
        "axis": lambda: axes,
        "encoder_axis": lambda: axes,
    }


@dataclass(slots=True)
class _Problems:
    """Collects ``path: message`` lines; a path reported once silences checks below it."""

    items: list[str] = field(default_factory=list)
    bad: set[str] = field(default_factory=set)

    def add(self, path: str, msg: str) -> None:
        if not self.blocked(path):
            self.items.append(f"`{path}`: {msg}")
            self.bad.add(path)

    def blocked(self, path: str) -> bool:
        """True when ``path`` or a config node above it was already reported."""
        return any(path == b or path.startswith((b + ".", b + "[")) for b in self.bad)

    def raise_if_any(self) -> None:
        if self.items:
            n = len(self.items)
            raise ConfigError(f"invalid data config ({n} problem{'s' * (n > 1)}):\n  - " + "\n  - ".join(self.items))


def _did_you_mean(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _to_plain(node: Any, path: str, problems: _Problems) -> Any:
    """DictConfig/ListConfig -> dicts/lists, resolving each leaf so every bad one is named."""
    from omegaconf import ListConfig
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    if isinstance(node, DictConfig | ListConfig) and (node._is_missing() or node._is_none()):
        return _MISSING if node._is_missing() else None
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, Mapping):
        keys = [(k, f"{path}.{k}") for k in node.keys()]
    elif isinstance(node, list | tuple | ListConfig):
        keys = [(i, f"{path}[{i}]") for i in range(len(node))]
    else:
        return node
    out: dict[Any, Any] = {}
    for key, sub in keys:
        try:
            out[key] = _to_plain(node[key], sub, problems)
        except MissingMandatoryValue:
            out[key] = _MISSING
        except OmegaConfBaseException as e:  # reported here; the _MISSING left behind stays silent
            problems.add(sub, f"cannot resolve {node._get_node(key)._value()!r}: {str(e).splitlines()[0]}")
            out[key] = _MISSING
    return {str(k): v for k, v in out.items()} if isinstance(node, Mapping) else list(out.values())


_BAD = object()


def _coerce(tp: Any, value: Any, path: str, problems: _Problems, choices: dict) -> Any:
    """``value`` as type ``tp`` (the subset of types the dataclasses use), or ``_BAD``."""
    if isinstance(value, str) and value == _MISSING:
        problems.add(path, "is missing (???): set it in the YAML or on the command line")
        return _BAD
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(inner[0], value, path, problems, choices)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems, choices)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list | tuple),
        dict: isinstance(value, Mapping),
    }.get(origin or tp, True)
    if not ok:
        what = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
            origin or tp, "a mapping")
        problems.add(path, f"must be {what}, got {value!r} ({type(value).__name__})")
        return _BAD
    if origin is list:
        items = [_coerce(get_args(tp)[0], v, f"{path}[{i}]", problems, choices) for i, v in enumerate(value)]
        return _BAD if any(v is _BAD for v in items) else items
    if origin is dict:
        out = {str(k): _coerce(get_args(tp)[1], v, f"{path}.{k}", problems, choices) for k, v in value.items()}
        return _BAD if any(v is _BAD for v in out.values()) else out
    return float(value) if tp is float else value


def _build(cls: type, value: Any, path: str, problems: _Problems, choices: dict) -> Any:
    """Instance of dataclass ``cls`` from a mapping; bad fields keep their default (and are reported)."""
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        problems.add(path, f"must be a mapping with keys {[f.name for f in dataclasses.fields(cls)]}, got {value!r}")
        return cls()
    hints = get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in sorted(set(value) - set(allowed)):
        hint = " (strategy arguments go under `args`)" if cls is StrategyConfig else ""
        problems.add(f"{path}.{key}", f"unknown key; {_did_you_mean(key, allowed)}allowed: {sorted(allowed)}{hint}")
    kwargs = {}
    for name in allowed:
        if name not in value:
            continue
        sub = f"{path}.{name}"
        v = _coerce(hints[name], value[name], sub, problems, choices)
        if v is _BAD:
            continue
        allowed_values = choices.get((cls, name))
        if allowed_values is not None and v is not None and v not in allowed_values():
            allowed_now = allowed_values()
            problems.add(sub, f"got {v!r}; {_did_you_mean(str(v), allowed_now)}allowed: {allowed_now}")
            continue
        kwargs[name] = v
    return cls(**kwargs)


def _source_paths(s: SourceConfig) -> list[str]:
    return ([s.path] if s.path is not None else []) + list(s.paths)


def _source_name(s: SourceConfig, index: int) -> str:
    if s.name is not None:
        return s.name
    paths = _source_paths(s)
    base = os.path.basename(paths[0].rstrip("/")) if paths else ""
    for suffix in (".parquet", ".jsonl", ".bin", ".idx"):
        base = base.removesuffix(suffix)
    return base if base and not (_GLOB_CHARS & set(base)) else f"source{index}"


def _missing_files(fmt: str, path: str) -> str | None:
    """What is absent for one configured path: a glob's matches, the file/dir, or .bin/.idx."""
    if _GLOB_CHARS & set(path):
        return None if glob.glob(path, recursive=True) else f"glob {path!r} matches nothing"
    if fmt == "megatron":
        prefix = path.removesuffix(".bin").removesuffix(".idx")
        missing = [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
        return f"Megatron files {missing} do not exist" if missing else None
    return None if os.path.exists(path) else f"{path!r} does not exist"


def _spec_problems(s: SourceConfig, name: str, sp: str, problems: _Problems) -> None:
    """SourceSpec's own field checks (the single truth), re-addressed to config paths."""
    kwargs = {f.name: getattr(s, f.name) for f in dataclasses.fields(SourceSpec)}
    try:
        SourceSpec(**{**kwargs, "name": name, "paths": _source_paths(s) or ["-"]})
    except ConfigError as e:
        for line in str(e).splitlines()[1:]:
            m = re.match(r"\s*- `sources\.(?:.*)\.(\w+)` (.*)", line)
            problems.add(f"{sp}.{m.group(1)}" if m else sp, m.group(2) if m else line.strip(" -"))


def _check_sources(cfg: MegascaleDataConfig, path: str, problems: _Problems, check_paths: bool) -> None:
    where = f"{path}.sources"
    if not cfg.sources and not problems.blocked(where):
        problems.add(where, "is empty: pick a sources group (e.g. `sources=demo_text`) or list sources under it")
    names = [_source_name(s, i) for i, s in enumerate(cfg.sources)]
    for i, s in enumerate(cfg.sources):
        sp = f"{where}[{i}]"
        if s.path is not None and s.paths:
            problems.add(f"{sp}.path", f"give `path` or `paths`, not both (path={s.path!r}, paths={s.paths!r})")
        elif not _source_paths(s):
            problems.add(f"{sp}.paths", "is empty: give files, globs, directories or Megatron prefixes")
        if names.count(names[i]) > 1:
            users = [j for j, n in enumerate(names) if n == names[i]]
            problems.add(f"{sp}.name", f"{names[i]!r} is used by sources {users}; names must be unique")
        if s.max_tokens is not None and s.max_tokens > cfg.seq_length:
            problems.add(f"{sp}.max_tokens", f"must be <= {path}.seq_length ({cfg.seq_length}) or null, got "
                                             f"{s.max_tokens!r}: a longer sample cannot be packed")
        _spec_problems(s, names[i], sp, problems)
        if check_paths:
            for j, p in enumerate(_source_paths(s)):
                at = f"{sp}.path" if s.path is not None else f"{sp}.paths[{j}]"
                miss = _missing_files(s.format, cfg.resolve_path(p))
                if miss and not problems.blocked(at):
                    problems.add(at, f"{miss} (configured {p!r}, data_root={cfg.data_root!r}); "
                                     f"check the path or `{path}.data_root`")
            if s.tokenizer is not None and not os.path.isfile(cfg.resolve_path(s.tokenizer)):
                problems.add(f"{sp}.tokenizer", f"tokenizer file {cfg.resolve_path(s.tokenizer)!r} does not exist")


def _check_mixing(cfg: MegascaleDataConfig, path: str, problems: _Problems) -> None:
    from megascale_data_ext.dataplane.mixing import build_schedule

    where = f"{path}.mixing"
    if problems.blocked(where) or problems.blocked(f"{path}.sources"):
        return
    names = [_source_name(s, i) for i, s in enumerate(cfg.sources)]
    if cfg.mixing.type == "constant" and not cfg.mixing.params:
        weights = [s.weight for s in cfg.sources]
        if weights and all(w >= 0 for w in weights) and sum(weights) <= 0:
            problems.add(f"{path}.sources[*].weight", f"weights must sum to > 0, got {weights!r} (sources: {names})")
        return
    if "type" in cfg.mixing.params:
        problems.add(f"{where}.params.type", f"the schedule type goes in `{where}.type`, not in params")
        return
    try:
        build_schedule({"type": cfg.mixing.type, **cfg.mixing.params}, source_names=names)
    except (ConfigError, TypeError, ValueError) as e:
        problems.add(f"{where}.params", f"{str(e).replace(chr(10), ' ')} (params: {cfg.mixing.params!r})")


def _locate(target: str) -> Any:
    """Import ``pkg.module.Attr`` the way Hydra's ``instantiate`` resolves ``_target_``."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception as e:  # Hydra wraps ImportError/AttributeError in its own messages
        raise ConfigError(" ".join(str(e).split())) from e
    if not callable(obj):
        raise ConfigError(f"it is a {type(obj).__name__}, not a strategy class or factory")
    return obj


def _check_strategy(cfg: MegascaleDataConfig, path: str, problems: _Problems) -> None:
    from megascale_data_ext.dataplane.strategies import STRATEGIES

    where, sc = f"{path}.strategy", cfg.strategy
    if problems.blocked(where):
        return
    if (sc.name is None) == (sc._target_ is None):
        problems.add(where, f"set exactly one of `name` (one of {sorted(STRATEGIES)}) or `_target_` "
                            f"(a strategy class/factory path), got name={sc.name!r}, _target_={sc._target_!r}")
        return
    if sc._target_ is not None:
        try:
            factory = _locate(sc._target_)
        except ConfigError as e:
            problems.add(f"{where}._target_", f"cannot import {sc._target_!r}: {e}")
            return
        name = next((n for n, f in STRATEGIES.items() if f is factory), sc._target_)
    else:
        name, factory = str(sc.name), STRATEGIES[str(sc.name)]
    arg_choices = _strategy_arg_choices() if factory in STRATEGIES.values() else {}  # user classes: own meaning
    for key, value in sc.args.items():
        if key in arg_choices and isinstance(value, str):
            allowed = arg_choices[key]()
            norm = value.upper() if key.endswith("axis") else value.strip().lower() if key.endswith("model") else value
            if norm not in allowed:
                problems.add(f"{where}.args.{key}", f"got {value!r}; {_did_you_mean(value, allowed)}allowed: {allowed}")
    args = dict(sc.args)
    args.setdefault("num_microbatches", cfg.num_microbatches)  # as runtime.planner.make_strategy
    if name != "vanilla":
        args.setdefault("cap", cfg.seq_length)
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in sorted(set(sc.args) - set(params)):
            problems.add(f"{where}.args.{key}", f"{name!r} takes no argument {key!r}; "
                                                f"{_did_you_mean(key, list(params))}allowed: {sorted(params)}")
    if not any(b.startswith(f"{where}.args") for b in problems.bad):
        try:
            factory(**args)
        except (TypeError, ValueError) as e:
            problems.add(f"{where}.args", f"cannot build strategy {name!r} from {sc.args!r}: {e}")


def _check_scalars(cfg: MegascaleDataConfig, path: str, problems: _Problems, cp: int) -> None:
    for key in ("samples_per_step", "num_microbatches", "seq_length", "pad_to_multiple_of", "prefetch",
                "buffer_size", "constructor_group"):
        if getattr(cfg, key) < 1:
            problems.add(f"{path}.{key}", f"must be a positive integer, got {getattr(cfg, key)!r}")
    if cfg.seed < 0:
        problems.add(f"{path}.seed", f"must be >= 0 (numpy SeedSequence), got {cfg.seed!r}")
    mult = cfg.pad_to_multiple_of * 2 * cp
    if not problems.blocked(f"{path}.seq_length") and cfg.pad_to_multiple_of >= 1 and cfg.seq_length % mult:
        fix = (cfg.seq_length // mult + 1) * mult
        problems.add(f"{path}.seq_length", f"{cfg.seq_length} is not a multiple of 2 * pad_to_multiple_of "
                                           f"({cfg.pad_to_multiple_of}) * context_parallel_size ({cp}) = {mult} "
                                           f"(packed microbatches are padded to it); use e.g. {fix}")
    if cfg.ray.num_cpus is not None and cfg.ray.num_cpus < 1:
        problems.add(f"{path}.ray.num_cpus", f"must be >= 1 or null, got {cfg.ray.num_cpus!r}")
    for key, amount in [(k, a) for k, a in cfg.ray.resources.items() if a < 0]:
        problems.add(f"{path}.ray.resources.{key}", f"must be >= 0, got {amount!r}")
    if cfg.checkpoint.dir is not None and os.path.isfile(cfg.resolve_path(cfg.checkpoint.dir)):
        problems.add(f"{path}.checkpoint.dir", f"{cfg.resolve_path(cfg.checkpoint.dir)!r} is a file, not a directory")


def load_config(
    cfg: Any, *, path: str = "data", check_paths: bool = True, context_parallel_size: int = 1
) -> MegascaleDataConfig:
    """Validate a ``data`` node eagerly and build the structured config.

    Args:
        cfg: The ``data`` DictConfig/mapping (a whole composed config with a ``data`` key is
            accepted too), or a :class:`MegascaleDataConfig`.
        path: Config path prefix used in messages.
        check_paths: Check that source and tokenizer files exist (off when the data lives
            only on the cluster the config is sent to).
        context_parallel_size: Megatron's CP size; ``seq_length`` must divide by
            ``2 * pad_to_multiple_of * cp`` because CP slicing splits each sequence in 2·cp.

    Raises:
        ConfigError: listing every problem, each as ``path: message`` with the bad value and
            the allowed values.
    """
    problems = _Problems()
    if isinstance(cfg, Mapping) and "data" in cfg and "sources" not in cfg:  # a whole composed config
        cfg = cfg["data"]
    plain = _to_plain(cfg, path, problems)
    built = _build(MegascaleDataConfig, plain, path, problems, _choices())
    _check_scalars(built, path, problems, max(1, int(context_parallel_size)))
    _check_sources(built, path, problems, check_paths)
    _check_mixing(built, path, problems)
    _check_strategy(built, path, problems)
    problems.raise_if_any()
    return built


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as group ``data``, name ``megascale_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="data", name="megascale_schema", node=MegascaleDataConfig)


def conf_dir() -> Path:
    """The YAML config directory: ``$MEGASCALE_CONF_DIR``, else ``conf/`` next to the package."""
    env = os.environ.get(CONF_DIR_ENV)
    d = Path(env) if env else Path(__file__).resolve().parent.parent / "conf"
    if not (d / "data" / "megascale.yaml").is_file():
        raise ConfigError(f"no Hydra config group at {str(d)!r} (expected data/megascale.yaml); install the "
                          f"package editable (`pip install -e .`) or set {CONF_DIR_ENV} to the repository's conf/")
    return d


def compose_config(
    overrides: Sequence[str] = (), config_name: str = "train_gpt", *, config_dir: str | os.PathLike[str] | None = None
) -> DictConfig:
    """Compose ``config_name`` from the conf directory with command-line style overrides.

    Uses Hydra's compose API in its own GlobalHydra scope (restored afterwards), so it also
    works inside a running Hydra app or a test.

    Raises:
        ConfigError: Hydra cannot compose (unknown group option, bad override syntax, a key
            that is not in the config); Hydra's message lists the available options.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    d = Path(config_dir).resolve() if config_dir is not None else conf_dir()
    try:
        with initialize_config_dir(config_dir=str(d), version_base="1.3", job_name="megascale_data"):
            return compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        msg = f"cannot compose {config_name!r} from {str(d)!r} with overrides {list(overrides)}: {e}"
        raise ConfigError(msg) from e


register_configs()
