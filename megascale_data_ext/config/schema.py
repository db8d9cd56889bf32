"""The ``data`` node's schema: the dataclasses Hydra/OmegaConf type the YAML with.

Nothing here is a copy of a runtime field list: the batch shape is the runtime's
:class:`~megascale_data_ext.runtime.config.BatchConfig` (inherited), Ray is its
:class:`~megascale_data_ext.runtime.config.RayConfig`, and :data:`SourceConfig` is derived
from :class:`~megascale_data_ext.sources.base.SourceSpec`'s fields, so a field added to a
runtime dataclass is a YAML key at once.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from megascale_data_ext.dataplane.mixing import MixMode, ScheduleType
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import (
    DEFAULT_STRATEGY,
    AutoscaleConfig,
    BatchConfig,
    PlacementConfig,
    RayConfig,
    ServiceConfig,
)
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.sources.base import SourceSpec

GLOB_CHARS = frozenset("*?[")


def _optional_in_yaml() -> dict[str, tuple[Any, Any]]:
    """SourceSpec fields a YAML source may leave out, as (YAML type, default): ``name`` defaults
    to the first path's file name, and the added ``path`` is a one-path shorthand for ``paths``."""
    return {"name": (str | None, None), "format": (str, "parquet"), "path": (str | None, None),
            "paths": (list[str], field(default_factory=list))}


def _yaml_type(tp: Any) -> Any:
    """``tp`` as OmegaConf can check it: ``Literal[...]`` becomes ``str`` (also inside ``| None``)."""
    if get_origin(tp) is Literal:
        return str
    if get_origin(tp) in (Union, types.UnionType):
        return functools.reduce(operator.or_, (_yaml_type(a) for a in get_args(tp)))
    return tp


def source_config_class(spec: type = SourceSpec, name: str = "SourceConfig") -> type:
    """A YAML schema dataclass with every field of the ``spec`` dataclass (defaults kept).

    ``Literal`` types become ``str`` (OmegaConf matches no ``Literal``; the spec's own check
    names the allowed values), and the fields in :func:`_optional_in_yaml` become optional.
    """
    hints, optional = get_type_hints(spec), _optional_in_yaml()
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(spec):
        if f.name == "paths":
            fields.append(("path", *optional["path"]))
        if f.name in optional:
            fields.append((f.name, *optional[f.name]))
        else:
            fields.append((f.name, _yaml_type(hints[f.name]),
                           field(default=f.default, default_factory=f.default_factory)))
    doc = (f"One source in YAML: the fields of :class:`{spec.__name__}` (see it for their meaning).\n\n"
           "``path`` is a one-path shorthand for ``paths`` (Energon-style ``- weight: 5 path: ./coco``);\n"
           "``name`` defaults to the first path's file name without suffix.")
    return dataclasses.make_dataclass(name, fields, kw_only=True, slots=True,
                                      namespace={"__module__": __name__, "__doc__": doc})


SourceConfig = source_config_class()


def source_paths(s: Any) -> list[str]:
    """The paths of a :data:`SourceConfig`: ``path`` (if given) then ``paths``."""
    return ([s.path] if s.path is not None else []) + list(s.paths)


def source_name(s: Any, index: int) -> str:
    """The name of source ``index``: its ``name``, else its first path's file name, else ``source<i>``."""
    if s.name is not None:
        return s.name
    paths = source_paths(s)
    base = os.path.basename(paths[0].rstrip("/")) if paths else ""
    for suffix in (".parquet", ".jsonl", ".bin", ".idx"):
        base = base.removesuffix(suffix)
    return base if base and not (GLOB_CHARS & set(base)) else f"source{index}"


@dataclass(slots=True, kw_only=True)
class MixingConfig:
    """Mixing schedule: ``type`` plus that type's ``params`` for ``mixing.build_schedule``.

    ``type: constant`` with empty ``params`` mixes by the sources' ``weight`` fields.
    """

    type: str = ScheduleType.CONSTANT.value
    mode: str = MixMode.DETERMINISTIC.value
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class StrategyConfig:
    """A registered strategy by ``name``, or any strategy class/factory by ``_target_``.

    ``args`` are its keyword arguments; ``num_microbatches`` and (except for vanilla) ``cap``
    default to ``data.num_microbatches`` / ``data.seq_length`` as in the Planner.
    """

    name: str | None = DEFAULT_STRATEGY
    _target_: str | None = None
    args: dict[str, Any] = field(default_factory=dict)


def locate(target: str) -> Any:
    """Import ``pkg.module.Attr`` the way Hydra's ``instantiate`` resolves ``_target_``."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception as e:  # Hydra wraps ImportError/AttributeError in its own messages
        raise ConfigError(" ".join(str(e).split())) from e
    if not callable(obj):
        raise ConfigError(f"it is a {type(obj).__name__}, not a strategy class or factory")
    return obj


@dataclass(slots=True, kw_only=True)
class ValidationConfig:
    """``data.validation``: held-out sources the trainer evaluates on every ``train.eval_interval``
    steps, served by a second service of the same batch shape and layout (namespace
    ``<data.ray.namespace>-valid``); mixed by their ``weight``. None of their files may be a
    training source's (it would not be held out)."""

    sources: list[SourceConfig] = field(default_factory=list)


VALID_NAMESPACE_SUFFIX = "-valid"


@dataclass(slots=True, kw_only=True)
class MegascaleDataConfig(BatchConfig):
    """The ``data`` node: the batch shape (:class:`BatchConfig`), sources, mixing, strategy, Ray.

    Build it with :func:`~megascale_data_ext.config.load_config`, which validates; relative
    paths resolve against ``data_root`` (else the current directory).
    """

    data_root: str | None = None
    sources: list[SourceConfig] = field(default_factory=list)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def resolve_path(self, path: str) -> str:
        """Absolute form of a config path: ``~`` expanded, relative ones under ``data_root``."""
        p = os.path.expanduser(path)
        if not os.path.isabs(p) and self.data_root is not None:
            p = os.path.join(os.path.expanduser(self.data_root), p)
        return os.path.abspath(p)

    def source_specs(self, sources: list[Any] | None = None) -> list[SourceSpec]:
        """The sources (default: the training ones) as runtime specs (absolute paths, derived
        names filled in)."""
        specs = []
        for i, s in enumerate(self.sources if sources is None else sources):
            kwargs = {f.name: getattr(s, f.name) for f in dataclasses.fields(SourceSpec)}
            kwargs["name"] = source_name(s, i)
            kwargs["paths"] = [self.resolve_path(p) for p in source_paths(s)]
            kwargs["tokenizer"] = None if s.tokenizer is None else self.resolve_path(s.tokenizer)
            specs.append(SourceSpec(**kwargs))
        return specs

    def strategy_name(self) -> str:
        """The name the runtime builds the strategy by; registers a ``_target_`` if needed."""
        from megascale_data_ext.dataplane.strategies import STRATEGIES, register_strategy

        if self.strategy._target_ is None:
            return str(self.strategy.name)
        target = locate(self.strategy._target_)
        name = next((n for n, f in STRATEGIES.items() if f is target), None)
        if name is None:  # registered under its dotted path in this process only
            name = self.strategy._target_
            register_strategy(name, target)
        return name

    def to_service_config(self) -> ServiceConfig:
        """The runtime's config: the batch fields as they are, sources, strategy, mixing, Ray."""
        mixing = None
        if self.mixing.type != ScheduleType.CONSTANT or self.mixing.params:
            mixing = {"type": self.mixing.type, **self.mixing.params}
        batch = {f.name: getattr(self, f.name) for f in dataclasses.fields(BatchConfig)}
        ray = dataclasses.replace(self.ray, resources=dict(self.ray.resources))
        return ServiceConfig(
            sources=self.source_specs(), strategy=self.strategy_name(), strategy_args=dict(self.strategy.args),
            mixing=mixing, mix_mode=self.mixing.mode, ray=ray,
            fault_tolerance=dataclasses.replace(self.fault_tolerance),
            autoscale=dataclasses.replace(self.autoscale, profiles=None if self.autoscale.profiles is None
                                          else self.resolve_path(self.autoscale.profiles)),
            placement=dataclasses.replace(self.placement, trainer_nodes=list(self.placement.trainer_nodes)), **batch,
        )

    def validation_service_config(self) -> ServiceConfig | None:
        """The validation service's config: the training one with the held-out sources, mixed by
        their weights, in its own namespace and checkpoint directory, without fault injection
        or online loader scaling; None without ``validation.sources``."""
        if not self.validation.sources:
            return None
        train = self.to_service_config()
        ft = train.fault_tolerance
        return dataclasses.replace(
            train, sources=self.source_specs(self.validation.sources), mixing=None,
            ray=dataclasses.replace(train.ray, namespace=train.ray.namespace + VALID_NAMESPACE_SUFFIX),
            fault_tolerance=dataclasses.replace(ft, inject="", checkpoint_dir=None if ft.checkpoint_dir is None
                                                else os.path.join(ft.checkpoint_dir, "valid")),
            autoscale=dataclasses.replace(train.autoscale, scaling=False, profiles=None), replay_dir=None)
