"""Counts of the Ray calls the service's actors make to each other, by kind.

Each actor owns a `CallCounter` and bumps it wherever it submits a ``.remote()`` call on the
data path (plans, routes, metadata, fetches); its ``stats()`` report the snapshot under
``"ray_calls"``. `calls_per_step` turns two sums over every actor into calls per step, which
is how `bench startup` shows that the calls do not grow with the number of sources.

Plain class (no Ray): unit tests and the in-process service can use it as is.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["CallCounter", "calls_per_step", "sum_calls"]


class CallCounter:
    """Ray calls made by one actor, by kind (``"loader>planner plans"``, ...); thread-safe."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def sum_calls(snapshots: Iterable[Mapping[str, int] | None]) -> dict[str, int]:
    """The per-kind sum of several actors' snapshots (None: an actor that died for good)."""
    out: Counter[str] = Counter()
    for snap in snapshots:
        out.update(snap or {})
    return dict(out)


def calls_per_step(before: Mapping[str, int], after: Mapping[str, int], steps: int) -> dict[str, float]:
    """Calls per step by kind between two `sum_calls` results `steps` steps apart, plus ``"total"``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    kinds = sorted(set(before) | set(after))
    out = {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in kinds}
    out["total"] = sum(out.values())
    return out
