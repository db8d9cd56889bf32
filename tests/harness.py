"""One save/load equivalence harness for every `Stateful` part (torchdata's `run_test_save_load_state`).

``check_save_load(make, advance, steps=N, resume_at=[...])`` runs a fresh part N steps as the
reference; then, for each resume point k, runs another fresh part k steps, takes its
``state_dict()`` through a JSON round trip (as a checkpoint file would), loads it into a third
fresh part and runs steps k..N-1 there. Every output and the final state must equal the
reference's. It also checks that a state of another version, another kind or with a field
missing is refused with `ResumeError` and leaves the part usable.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from megascale_data_ext.errors import ResumeError
from megascale_data_ext.state import Stateful

T = TypeVar("T", bound=Stateful)


def _normal(value: Any) -> Any:
    """Comparable form of an output: arrays -> lists (recursively)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # torch tensors, numpy scalars
        return value.tolist()
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def saved(part: Stateful) -> dict[str, Any]:
    """The part's state as a checkpoint file would give it back."""
    return json.loads(json.dumps(part.state_dict()))


def check_save_load(
    make: Callable[[], T],
    advance: Callable[[T, int], Any],
    *,
    steps: int,
    resume_at: Iterable[int],
) -> list[Any]:
    """Resume at every point of `resume_at` equals the uninterrupted run; returns its outputs."""
    ref = make()
    reference = [_normal(advance(ref, i)) for i in range(steps)]
    final_state = saved(ref)
    points = sorted(set(resume_at))
    assert points and all(0 <= k < steps for k in points), f"resume points {points} outside [0, {steps})"
    for k in points:
        first = make()
        for i in range(k):
            advance(first, i)
        state = saved(first)
        resumed = make()
        resumed.load_state_dict(state)
        got = [_normal(advance(resumed, i)) for i in range(k, steps)]
        assert got == reference[k:], f"resume at {k}: outputs differ from the uninterrupted run"
        assert saved(resumed) == final_state, f"resume at {k}: final state differs"
    _check_refusals(make, final_state)
    return reference


def _check_refusals(make: Callable[[], Stateful], state: dict[str, Any]) -> None:
    wrong: list[dict[str, Any]] = []
    other_version = copy.deepcopy(state)
    other_version["version"] = int(other_version.get("version", 0)) + 1
    wrong.append(other_version)
    if "kind" in state:
        other_kind = copy.deepcopy(state)
        other_kind["kind"] = "something_else"
        wrong.append(other_kind)
    field = next((k for k in state if k not in ("kind", "version", "fingerprint")), None)
    if field is not None:
        missing = copy.deepcopy(state)
        del missing[field]
        wrong.append(missing)
    for bad in wrong:
        part = make()
        with pytest.raises(ResumeError):
            part.load_state_dict(bad)
        part.load_state_dict(state)  # still usable after a refused resume


def refuses(part: Stateful, state: dict[str, Any], *needles: str) -> str:
    """Loading `state` into `part` raises ResumeError whose message holds every needle."""
    with pytest.raises(ResumeError) as err:
        part.load_state_dict(state)
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def epoch_boundary(cursor_rows: Sequence[Sequence[int]], sizes: Sequence[int]) -> int:
    """First step whose plan made some source start a new epoch (cursor crossing its size)."""
    for step, (before, after) in enumerate(zip(cursor_rows, cursor_rows[1:], strict=False)):
        if any(b // n != a // n for b, a, n in zip(before, after, sizes, strict=True)):
            return step
    raise AssertionError("no source reached an epoch boundary: make the sources smaller or run more steps")
