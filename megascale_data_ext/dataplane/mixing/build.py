"""`build_schedule`: a schedule from a plain dict (a Hydra/YAML node), the inverse of `to_config`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megascale_data_ext.dataplane.mixing.checks import raise_problems
from megascale_data_ext.dataplane.mixing import schedules as sch
from megascale_data_ext.errors import ConfigError

__all__ = ["WEIGHT_KEYS", "build_schedule", "required_keys"]

# type -> (class, required keys, optional keys)
_SPECS: dict[sch.ScheduleType, tuple[Callable[..., sch.MixingSchedule], tuple[str, ...], tuple[str, ...]]] = {
    sch.ScheduleType.CONSTANT: (sch.ConstantSchedule, ("weights",), ()),
    sch.ScheduleType.PIECEWISE: (sch.PiecewiseSchedule, ("boundaries", "weights"), ("unit", "steps_per_epoch")),
    sch.ScheduleType.RAMP: (sch.LinearRampSchedule, ("start", "end", "warmup_steps"), ("start_step",)),
    sch.ScheduleType.FEEDBACK: (sch.FeedbackSchedule, ("base_weights",), ("lr", "smoothing", "min_weight", "delay")),
}
WEIGHT_KEYS = ("weights", "start", "end", "base_weights")  # a weight per source (a list or {name: w})


def _weights_from_mapping(key: str, value: Any, names: Sequence[str] | None, problems: list[str]) -> Any:
    """Accept ``{source_name: weight}`` (YAML-friendly) as well as a list; missing names weigh 0."""
    if not isinstance(value, Mapping):
        return value
    if names is None:
        problems.append(f"`{key}` is a mapping {dict(value)!r} but no source names were given; pass source_names")
        return value
    unknown = sorted(set(map(str, value)) - set(names))
    if unknown:
        problems.append(f"`{key}` names unknown sources {unknown} (sources: {list(names)})")
    return [float(value.get(n, 0.0)) for n in names]


def required_keys(schedule_type: str) -> tuple[str, ...]:
    """The arguments a schedule `schedule_type` cannot go without (none for an unknown type)."""
    try:
        return _SPECS[sch.ScheduleType(schedule_type)][1]
    except ValueError:
        return ()


def build_schedule(config: Mapping[str, Any], *, source_names: Sequence[str] | None = None) -> sch.MixingSchedule:
    """Build a schedule from a plain dict (a Hydra/YAML node), the inverse of ``to_config``.

    Args:
        config: ``{"type": "constant"|"piecewise"|"ramp"|"feedback", ...}`` with that type's
            arguments; weight lists may be ``{source_name: weight}`` mappings.
        source_names: Names of the sources, in order; enables mappings and names in errors.

    Raises:
        ConfigError: listing every problem (unknown type or keys, bad weights, ...).
    """
    raw_type = config.get("type", sch.ScheduleType.CONSTANT.value)
    allowed = [t.value for t in sch.ScheduleType]
    if raw_type not in allowed:
        raise ConfigError(f"mixing schedule `type` must be one of {allowed}, got {raw_type!r}")
    kind = sch.ScheduleType(raw_type)
    cls, required, optional = _SPECS[kind]
    unknown = sorted(set(config) - set(required) - set(optional) - {"type"})
    allowed_keys = [*required, *optional]
    problems = [f"unknown keys {unknown} for type {kind.value!r} (allowed: {allowed_keys})"] if unknown else []
    problems += [f"missing key `{k}` for type {kind.value!r}" for k in required if k not in config]
    args = {k: config[k] for k in (*required, *optional) if k in config}
    for key in WEIGHT_KEYS:
        if key in args:
            if kind is sch.ScheduleType.PIECEWISE:
                args[key] = [_weights_from_mapping(f"{key}[{i}]", w, source_names, problems)
                             for i, w in enumerate(args[key])]
            else:
                args[key] = _weights_from_mapping(key, args[key], source_names, problems)
    raise_problems(problems, "mixing schedule config")
    return cls(**args, source_names=source_names)
