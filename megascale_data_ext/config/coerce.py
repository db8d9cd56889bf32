"""OmegaConf node -> schema dataclasses, checking every key and type on the way.

:func:`to_plain` resolves the node leaf by leaf (an interpolation that fails is reported at its
own path), :func:`build` walks the plain value against a dataclass's type hints: unknown keys,
wrong types and values outside a field's choices become problems, and the bad field keeps its
default, so the walk goes on and the checks after it see a complete config.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

from megascale_data_ext.config.problems import Problems, did_you_mean
from megascale_data_ext.errors import ConfigError

MISSING = "???"
_BAD = object()
_WHAT = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}


@dataclass(frozen=True, slots=True)
class Rules:
    """What the walk checks beyond types.

    Attributes:
        choices: Allowed values of str-typed fields, by ``(dataclass, field)``, read when checked.
        unknown_key_hints: Text added to an unknown key's problem, by dataclass.
    """

    choices: Mapping[tuple[type, str], Callable[[], list[str]]] = field(default_factory=dict)
    unknown_key_hints: Mapping[type, str] = field(default_factory=dict)


def to_plain(node: Any, path: str, problems: Problems) -> Any:
    """DictConfig/ListConfig -> dicts/lists, resolving each leaf so every bad one is named."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    if isinstance(node, DictConfig | ListConfig) and (node._is_missing() or node._is_none()):
        return MISSING if node._is_missing() else None
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
            out[key] = to_plain(node[key], sub, problems)
        except MissingMandatoryValue:
            out[key] = MISSING
        except OmegaConfBaseException as e:  # reported here; the MISSING left behind stays silent
            problems.add(sub, f"cannot resolve {node._get_node(key)._value()!r}: {str(e).splitlines()[0]}")
            out[key] = MISSING
    return {str(k): v for k, v in out.items()} if isinstance(node, Mapping) else list(out.values())


def _coerce(tp: Any, value: Any, path: str, problems: Problems, rules: Rules) -> Any:
    """``value`` as type ``tp`` (the subset of types the dataclasses use), or ``_BAD``."""
    if isinstance(value, str) and value == MISSING:
        problems.add(path, "is missing (???): set it in the YAML or on the command line")
        return _BAD
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(inner[0], value, path, problems, rules)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, problems, rules)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list | tuple),
        dict: isinstance(value, Mapping),
    }.get(origin or tp, True)
    if not ok:
        problems.add(path, f"must be {_WHAT[origin or tp]}, got {value!r} ({type(value).__name__})")
        return _BAD
    if origin is list:
        items = [_coerce(get_args(tp)[0], v, f"{path}[{i}]", problems, rules) for i, v in enumerate(value)]
        return _BAD if any(v is _BAD for v in items) else items
    if origin is dict:
        out = {str(k): _coerce(get_args(tp)[1], v, f"{path}.{k}", problems, rules) for k, v in value.items()}
        return _BAD if any(v is _BAD for v in out.values()) else out
    return float(value) if tp is float else value


def build(cls: type, value: Any, path: str, problems: Problems, rules: Rules) -> Any:
    """Instance of dataclass ``cls`` from a mapping; bad fields keep their default (and are reported)."""
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        problems.add(path, f"must be a mapping with keys {[f.name for f in dataclasses.fields(cls)]}, got {value!r}")
        return cls()
    hints = get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    hint = rules.unknown_key_hints.get(cls, "")
    for key in sorted(set(value) - set(allowed)):
        problems.add(f"{path}.{key}", f"unknown key; {did_you_mean(key, allowed)}allowed: {sorted(allowed)}{hint}")
    kwargs = {}
    for name in (n for n in allowed if n in value):
        sub = f"{path}.{name}"
        v = _coerce(hints[name], value[name], sub, problems, rules)
        if v is _BAD:
            continue
        choices = rules.choices.get((cls, name))
        if choices is not None and v is not None and v not in choices():
            allowed_now = choices()
            problems.add(sub, f"got {v!r}; {did_you_mean(str(v), allowed_now)}allowed: {allowed_now}")
            continue
        kwargs[name] = v
    own = getattr(cls, "field_problems", None)
    if own is not None:  # a runtime dataclass that checks its own fields: report them by config path
        found = own(kwargs)
        for key, message in found:
            problems.add(f"{path}.{key}", message)
        if found:
            return cls()
    try:
        return cls(**kwargs)
    except ConfigError as e:
        problems.add(path, str(e))
        return cls()
