"""The `Stateful` protocol every resumable part speaks, and the schema that stamps its state.

Megatron's checkpointing, torch and torchdata call ``state_dict()`` / ``load_state_dict()``;
every stateful part here (Planner, Mixer and its schedules, Source Loaders' stream positions,
the trainer-side Client's data position, and what later parts add) implements exactly that
pair, and describes its checkpoint with one `StateSchema`:

* ``kind`` names the part, so a state handed to the wrong part is refused;
* ``version`` is bumped when the layout of the state changes;
* ``fields`` are the persisted fields, declared (Energon's ``_savable_fields``): a state with
  a field missing or an unknown one is refused instead of half-loaded;
* the ``fingerprint`` holds the settings that decide the stream (seed, sources, batch shape,
  layout...): a resume under other settings would silently deliver another stream, so it is
  refused with a `ResumeError` naming each changed setting and what to do.

Plain Python (no numpy, Ray or torch): the data plane, the actors and the trainer all use it.
States are JSON-normal (lists, dicts, str, int, float, bool, None) so they round-trip through
a checkpoint file unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from megascale_data_ext.errors import ResumeError

__all__ = ["Stateful", "StateSchema", "plain"]

_META = ("kind", "version", "fingerprint")

#: Where the fingerprint keys the service stamps are set, so a refused resume names the key to fix.
_CONFIG_KEYS = {
    **{k: f"data.{k}" for k in ("seed", "samples_per_step", "num_microbatches", "seq_length", "shuffle", "overflow",
                                "tokens_per_step", "split_documents", "sources", "strategy", "mixing")},
    "mix_mode": "data.mixing.mode",
    "world": "the parallel layout (tensor/context/pipeline/data-parallel sizes)",
}
_FRESH = "to start a new data stream instead, restore the model checkpoint without loading this data state"


def _fix(key: str, saved: Any) -> str:
    """What to do about one changed fingerprint key: set its config key back to the saved value."""
    where = _CONFIG_KEYS.get(key)
    if key == "world":
        return f"relaunch with {where} of the saved run"
    value = f"{saved!r}" if isinstance(saved, (str, int, float, bool)) or saved is None else "the saved value"
    return f"set `{where}` back to {value}" if where else f"set it back to {value}"


@runtime_checkable
class Stateful(Protocol):
    """Something whose position can be saved and restored (torch / torchdata style)."""

    def state_dict(self) -> dict[str, Any]:
        """The state to save: JSON-normal, stamped by the part's `StateSchema`."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where `state` was taken; raises `ResumeError` if it cannot."""
        ...


_ATOMS = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """JSON-normal copy (tuples -> lists, numpy -> numbers and lists, int keys -> strings) of a
    state or fingerprint: what a JSON round trip gives, built directly (a state is thousands of
    numbers at 1,000+ sources; encoding them to text and back was most of the Planner's step)."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None or kind is Fingerprint:
        return value  # a Fingerprint is JSON-normal already and read-only: shared, not copied
    if kind is list or kind is tuple:
        if set(map(type, value)) <= _ATOMS:  # numbers (an array's tolist()): one C-level pass, no recursion
            return list(value)
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {_key(k): plain(v) for k, v in value.items()}
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):  # IntEnum and other int subclasses: JSON writes the number
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):  # str enums: JSON writes the string's value, not str() of the enum
        return str.__str__(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars, without importing numpy here
        return plain(value.tolist())
    return str(value)


def _key(key: Any) -> str:
    """A dict key as JSON writes it."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is True or key is False or key is None:
        return json.dumps(key)
    if isinstance(key, (int, float)):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


class Fingerprint(dict):
    """A fingerprint already in JSON-normal form, made once and shared by every state its part
    stamps: at 1,000+ sources a Planner's is ~80 KB, and re-encoding it for the state it saves
    after every step was a third of its step. Read-only by contract (states share it)."""

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> Fingerprint:
        return cls(plain(dict(value)))


@dataclass(frozen=True, slots=True)
class StateSchema:
    """How one kind of part stamps and checks its state.

    Attributes:
        kind: Name of the part ("planner", "mixer", "data_position", ...).
        version: Layout version of the state; a different saved version is refused.
        fields: The persisted fields besides ``kind``, ``version`` and ``fingerprint``.
        hint: What to do when a resume is refused (appended to the error).
    """

    kind: str
    version: int
    fields: tuple[str, ...]
    hint: str = "resume with the settings the state was saved with"

    def stamp(self, fingerprint: Mapping[str, Any] | None = None, **values: Any) -> dict[str, Any]:
        """The state: ``kind``, ``version``, ``fingerprint`` and exactly the declared fields."""
        got = set(values)
        if got != set(self.fields):
            raise ValueError(f"{self.kind} state: fields {sorted(got)} != declared {sorted(self.fields)}")
        fp = fingerprint if isinstance(fingerprint, Fingerprint) else plain(dict(fingerprint or {}))
        return {"kind": self.kind, "version": self.version, "fingerprint": fp, **plain(values)}

    def check(self, state: Mapping[str, Any], fingerprint: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Validate a saved state against this schema and the current fingerprint.

        Returns:
            The declared fields of `state` (JSON-normal).

        Raises:
            ResumeError: listing every problem at once: not a mapping, another kind or version,
                missing or unknown fields, and each fingerprint key whose value changed
                (saved vs now).
        """
        if not isinstance(state, Mapping):
            raise ResumeError(f"{self.kind} state must be a mapping, got {type(state).__name__}")
        problems: list[str] = []
        if state.get("kind") != self.kind:
            problems.append(f"it is a {state.get('kind')!r} state, not a {self.kind!r} state")
        elif state.get("version") != self.version:
            problems.append(f"state version {state.get('version')!r} != {self.version} (saved by another release)")
        else:
            missing = sorted(set(self.fields) - set(state))
            unknown = sorted(set(state) - set(self.fields) - set(_META))
            if missing:
                problems.append(f"fields missing: {missing}")
            if unknown:
                problems.append(f"unknown fields: {unknown}")
            saved, now = plain(state.get("fingerprint") or {}), plain(dict(fingerprint or {}))
            for key in sorted(set(saved) | set(now)):
                if saved.get(key) != now.get(key):
                    problems.append(f"`{key}` changed: saved {saved.get(key)!r}, now {now.get(key)!r} "
                                    f"({_fix(key, saved.get(key))} to continue the saved stream)")
        if problems:
            raise ResumeError(f"cannot resume the {self.kind} state: " + "; ".join(problems)
                              + f". What to do: {self.hint}; {_FRESH}")
        return plain({k: state[k] for k in self.fields})
