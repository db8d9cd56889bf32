"""Balanced merge of sorted k-tuples: the equal-count, uncapped case of greedy in log2 passes."""

from __future__ import annotations

import numpy as np

__all__ = ["merge_rows"]


def merge_rows(rows: np.ndarray) -> np.ndarray:
    """Final slot of every cell when k-tuples (rows, each sorted descending) are merged pairwise.

    Merging pairs the heaviest slot of one tuple with the lightest of the other, which never
    widens the spread beyond the larger of the two: log2(rows) vectorized passes give what
    LPT rounds give one round at a time. An odd tuple out passes through to the next level
    (no padding to a power of two); slots are resolved top-down, one scatter per level.
    """
    r, k = rows.shape
    loads = rows
    sorts = []  # per level: (tuples before padding, flat source cell of every merged slot)
    while loads.shape[0] > 1:
        t = loads.shape[0]
        if t % 2:  # an odd tuple merges with an empty one (a zero row), i.e. passes through
            loads = np.concatenate((loads, np.zeros((1, k))))
        merged = loads[0::2] + loads[1::2, ::-1]
        srt = np.argsort(-merged, axis=1)
        srt += (np.arange(srt.shape[0], dtype=np.int64) * k)[:, None]
        sorts.append((t, srt))
        loads = merged.ravel()[srt]
    # Walk back down: final slot of every cell, level by level (one scatter per level).
    final = np.broadcast_to(np.arange(k, dtype=np.int64), (loads.shape[0], k))
    for t, srt in reversed(sorts):
        h = srt.shape[0]
        at_merged = np.empty((h, k), dtype=np.int64)
        at_merged.ravel()[srt.ravel()] = final.ravel()  # merged cell -> final slot
        final = np.empty((2 * h, k), dtype=np.int64)
        final[0::2] = at_merged  # left tuple's cell c is merged cell c
        final[1::2] = at_merged[:, ::-1]  # right tuple's cell c is merged cell k-1-c
        final = final[:t]
    return np.ascontiguousarray(final)
