"""Balancers by name and `partition`, the checked entry point to them.

A balancer maps item costs to bin indices under an optional per-bin token cap and optional
exact bin sizes; ``greedy`` (LPT) and ``kk`` (Karmarkar–Karp) are built in and
`register_balancer` adds more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from megascale_data_ext.dataplane.balancers.bins import Bins, cap_array, check_inputs, no_room
from megascale_data_ext.dataplane.balancers.karmarkar_karp import kk
from megascale_data_ext.dataplane.balancers.lpt import greedy
from megascale_data_ext.errors import ConfigError, PlanError

__all__ = ["Balancer", "balancer_names", "get_balancer", "partition", "register_balancer"]


class Balancer(Protocol):
    """A partitioning method: returns the bin index (0..k-1) of every item."""

    def __call__(self, costs: np.ndarray, k: int, *, tokens: np.ndarray | None, cap: float | None,
                 sizes: np.ndarray | None) -> np.ndarray: ...


_BALANCERS: dict[str, Balancer] = {"greedy": greedy, "kk": kk}


def register_balancer(name: str, fn: Balancer) -> None:
    """Make `fn(costs, k, *, tokens, cap, sizes) -> bins` available as `method=name`."""
    if not callable(fn):
        raise ConfigError(f"balancer {name!r} must be callable, got {type(fn).__name__}")
    _BALANCERS[name] = fn


def get_balancer(name: str) -> Balancer:
    if name not in _BALANCERS:
        raise ConfigError(f"unknown balancing method {name!r}; known methods: {balancer_names()}")
    return _BALANCERS[name]


def balancer_names() -> list[str]:
    return sorted(_BALANCERS)


def partition(costs: np.ndarray, k: int, *, method: str = "greedy", tokens: np.ndarray | None = None,
              cap: float | None = None, sizes: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Bin index (int64, 0..k-1) of every item, balancing the bins' summed costs.

    Args:
        costs: Per-item cost (>= 0).
        k: Number of bins.
        method: A registered balancer name ("greedy", "kk", or one added by `register_balancer`).
        tokens: Per-item token counts, needed with `cap`.
        cap: Maximum tokens per bin; an item that fits no bin raises `PlanError`.
        sizes: Exact number of items per bin (e.g. m micro-batches for every bucket).
    """
    fn = get_balancer(method)
    costs, tok, sz = check_inputs(costs, k, tokens, cap, sizes)
    if tok is not None and cap is not None and tok.size and tok.max() > cap:
        i = int(np.argmax(tok > cap))
        raise no_room(i, tok, Bins(load=np.zeros(1), cap=cap_array(cap, 1)))
    out = np.asarray(fn(costs, int(k), tokens=tok, cap=None if cap is None else float(cap), sizes=sz), dtype=np.int64)
    if out.shape != costs.shape or (out.size and (out.min() < 0 or out.max() >= k)):
        raise PlanError(f"balancer {method!r} returned an invalid assignment (shape {out.shape}, k={k})")
    return out
