"""Shared state and checks of the balancers: running bin loads, per-bin caps, input validation.

Every method (`lpt`, `karmarkar_karp`), `registry.partition` and the levels (`levels`) place
items into the same `Bins` and report a sample that fits no bin the same way (`no_room`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megascale_data_ext.errors import CapacityError, ConfigError, PlanError

__all__ = ["Bins", "cap_array", "check_inputs", "no_room"]


@dataclass(slots=True, kw_only=True)
class Bins:
    """Running loads of k bins; `tok`/`left` exist only when a cap / sizes constrain them."""

    load: np.ndarray
    weight: np.ndarray | None = None
    tok: np.ndarray | None = None
    cap: np.ndarray | None = None  # per-bin token cap (bins of a group stage differ)
    left: np.ndarray | None = None

    def level(self) -> np.ndarray:
        return self.load if self.weight is None else self.load / self.weight

    def place_one(self, i: int, cost: float, tokens: np.ndarray | None) -> int:
        """Least-loaded bin that still has room for item i (sequential fallback)."""
        ok = np.ones(self.load.shape[0], dtype=bool)
        if self.tok is not None and tokens is not None:
            ok &= self.tok + tokens[i] <= self.cap
        if self.left is not None:
            ok &= self.left > 0
        if not ok.any():
            raise no_room(i, tokens, self)
        j = int(np.argmin(np.where(ok, self.level(), np.inf)))
        self.load[j] += cost
        if self.tok is not None and tokens is not None:
            self.tok[j] += tokens[i]
        if self.left is not None:
            self.left[j] -= 1
        return j


def cap_array(cap: float | np.ndarray | None, k: int) -> np.ndarray | None:
    """A writable per-bin copy of a scalar or per-bin token cap (None: no cap)."""
    return None if cap is None else np.broadcast_to(np.asarray(cap, dtype=np.float64), (k,)).copy()


def no_room(i: int, tokens: np.ndarray | None, bins: Bins) -> PlanError:
    """The error for item i that fits no bin: over the cap by itself, or the bins are full."""
    cap = None if bins.cap is None else float(bins.cap.max())
    if tokens is not None and cap is not None and tokens[i] > cap:
        return PlanError(
            f"item {i} has {int(tokens[i])} tokens but the per-bin token cap is {cap:g} (a microbatch's context, "
            f"`data.seq_length`, unless the strategy's `cap` is set): set `truncate: true` on its source to cut "
            f"samples to the context, or raise the cap (`data.seq_length`)"
        )
    used = "" if bins.tok is None else f" (bins hold {int(bins.tok.sum())} tokens, cap {cap:g} each)"
    return CapacityError(
        f"item {i}" + ("" if tokens is None else f" ({int(tokens[i])} tokens)") + f" fits no bin{used}: "
        "the step has more tokens than its bins can hold; add micro-batches, raise the cap or sample fewer tokens"
    )


def check_inputs(costs: np.ndarray, k: int, tokens: np.ndarray | None, cap: float | None,
                 sizes: Sequence[int] | np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """`costs` (float64), `tokens` and `sizes` (int64) of one partition, or a ConfigError listing every problem."""
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    problems = []
    if costs.ndim != 1:
        problems.append(f"`costs` must be 1-D, got shape {costs.shape}")
    elif costs.size and not (costs.min() >= 0.0 and np.isfinite(costs.max())):  # NaN fails the min test
        problems.append("`costs` must be finite and >= 0 (check the cost model)")
    if int(k) != k or k <= 0:
        problems.append(f"`k` (number of bins) must be a positive integer, got {k!r}")
    tok = None
    if tokens is not None:
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.shape != costs.shape:
            problems.append(f"`tokens` has shape {tok.shape}, `costs` has {costs.shape}")
        elif tok.size and tok.min() < 0:
            problems.append("`tokens` must be >= 0")
    if cap is not None and tokens is None:
        problems.append("`cap` needs `tokens` (per-item token counts)")
    if cap is not None and not cap > 0:
        problems.append(f"`cap` must be > 0, got {cap!r}")
    sz = None
    if sizes is not None:
        sz = np.asarray(sizes, dtype=np.int64)
        if sz.shape != (k,) or (sz.size and sz.min() < 0) or int(sz.sum()) != costs.shape[0]:
            problems.append(f"`sizes` must be {k} non-negative counts summing to {costs.shape[0]} items, got {sizes!r}")
    if problems:
        raise ConfigError("partition(): " + "; ".join(problems))
    return costs, tok, sz
