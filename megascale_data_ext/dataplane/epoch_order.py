"""The order in which one source's samples are drawn in an epoch: a seeded permutation.

Global shuffling draws any sample next, so a Parquet reader decodes a whole row group (512 MB -
1 GB in production) for each sample it needs and keeps row groups cached to make that pay: a
loader's memory is row groups, not samples. A *window* shuffle draws in storage order, the way
Megatron-Energon streams WebDataset shards through a shuffle buffer: the source's blocks (Parquet
row groups; windows where a source has no blocks) in a seeded order, each block's rows in
consecutive windows of W, the rows of every window in a seeded order. Consecutive positions then
fall in one window, and a reader holds a few windows of W rows per source instead of row groups.
Every sample is still drawn exactly once per epoch, and the order is a pure function of (seed,
source, epoch, sizes), so a restarted loader recomputes it.

Plain numpy; no Ray, no torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_permutation", "window_of_rows"]


def epoch_permutation(size: int, *, seed: int, source_id: int, epoch: int, shuffle: bool = True,
                      window: int = 0, blocks: np.ndarray | None = None) -> np.ndarray:
    """Row index drawn at each position of `epoch` (int64, a permutation of ``range(size)``).

    Args:
        size: Rows in the source.
        seed, source_id, epoch: Seed the permutation (the same ones give the same order).
        shuffle: False = storage order.
        window: 0 = shuffle the whole source; W > 0 = the window shuffle of the module docstring.
        blocks: Start row of each storage block and `size` last (Parquet row groups:
            ``[0, r0, r0 + r1, ..., size]``); None = windows of W rows are the blocks.
    """
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    rng = np.random.default_rng([seed, source_id, epoch])
    if window <= 0:
        return rng.permutation(size)
    bounds = np.asarray(blocks if blocks is not None else [0, size], dtype=np.int64)
    if bounds[0] != 0 or bounds[-1] != size or np.any(np.diff(bounds) < 0):
        raise ValueError(f"blocks must rise from 0 to the source's {size} rows, got {bounds[:4]}...{bounds[-2:]}")
    starts, lens = bounds[:-1], np.diff(bounds)
    if blocks is None:  # no storage blocks: every window is one
        starts = np.arange(0, size, window, dtype=np.int64)
        lens = np.minimum(window, size - starts)
    keep = lens > 0
    starts, lens = starts[keep], lens[keep]
    order = rng.permutation(len(starts))
    rows = np.concatenate([np.arange(starts[b], starts[b] + lens[b], dtype=np.int64) for b in order.tolist()])
    # window number of each row: windows restart at each block, so one never spans two blocks
    first_row = np.repeat(np.cumsum(lens[order]) - lens[order], lens[order])
    windows = np.repeat(np.arange(len(order)), lens[order]) * (int(lens.max()) // window + 1) \
        + (np.arange(size, dtype=np.int64) - first_row) // window
    return rows[np.lexsort((rng.random(size), windows))]


def window_of_rows(offsets: np.ndarray, window: int) -> np.ndarray:
    """Window number of each row offset inside its block (0 for ``window <= 0``: the whole block)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    return offsets // window if window > 0 else np.zeros_like(offsets)
