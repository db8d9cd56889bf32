"""Rows grouped by a small integer key (bucket, source, group): one stable sort, not a scan per key.

The planner and its serving ask "which rows have key j" for every j of a step: scanning all rows
once per key is O(rows × keys) (at 4,096 GPUs, 295k rows × 128 buckets or 1,000 sources).
Keys below 2^16 take numpy's 16-bit radix sort, ~6× faster than the int64 timsort at 300k rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["grouped_rows", "ranks_within", "stable_order"]


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for integer keys in [0, bound)."""
    return np.argsort(keys.astype(np.uint16) if bound <= 65536 else keys, kind="stable")


def grouped_rows(keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ordered by key in [0, k), ascending inside a key, and where each key's rows start
    (k + 1 offsets): the rows of key j are ``order[start[j]:start[j + 1]]``."""
    start = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=k), out=start[1:])
    return stable_order(keys, k), start


def ranks_within(keys: np.ndarray, k: int) -> np.ndarray:
    """For each row, how many earlier rows have its key in [0, k) (0 for the first of each key)."""
    order, start = grouped_rows(keys, k)
    first = start[:-1]
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = np.arange(len(keys), dtype=np.int64) - first[keys[order]]
    return rank
