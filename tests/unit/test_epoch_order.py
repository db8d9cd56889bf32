"""The order of a source's draws in an epoch (`dataplane.epoch_order`): global, or in storage order."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.epoch_order import epoch_permutation

BLOCKS = np.array([0, 300, 300, 650, 1000])  # an empty row group in the middle, as Parquet files can have


def test_the_global_shuffle_is_the_order_every_earlier_run_drew():
    """Checkpoints of runs before the window shuffle resume onto the same stream."""
    got = epoch_permutation(1000, seed=3, source_id=2, epoch=1)
    assert np.array_equal(got, np.random.default_rng([3, 2, 1]).permutation(1000))
    assert np.array_equal(epoch_permutation(7, seed=3, source_id=2, epoch=1, shuffle=False, window=4), np.arange(7))


@pytest.mark.parametrize("blocks", [BLOCKS, None], ids=["row-groups", "no-blocks"])
def test_a_window_shuffle_draws_every_row_once_one_window_of_one_block_at_a_time(blocks):
    window, size = 64, 1000
    perm = epoch_permutation(size, seed=3, source_id=2, epoch=1, window=window, blocks=blocks)
    assert sorted(perm.tolist()) == list(range(size))
    edges = BLOCKS if blocks is not None else np.arange(0, size + window, window).clip(max=size)
    block = np.searchsorted(edges, perm, side="right") - 1
    win = (perm - edges[block]) // window
    units = list(zip(block.tolist(), win.tolist()))
    runs = [units[0]] + [u for prev, u in zip(units, units[1:]) if u != prev]
    assert len(runs) == len(set(runs))  # each window is drawn whole before the next one starts
    within = perm[:len([u for u in units if u == units[0]])]
    assert not np.array_equal(within, np.sort(within))  # and its rows are shuffled
    if blocks is not None:  # windows follow each other in storage order inside a row group
        for b in set(block.tolist()):
            order = [w for (bb, w) in runs if bb == b]
            assert order == sorted(order)


def test_the_window_order_is_seeded_by_seed_source_and_epoch():
    args = dict(window=64, blocks=BLOCKS)
    base = epoch_permutation(1000, seed=3, source_id=2, epoch=1, **args)
    assert np.array_equal(base, epoch_permutation(1000, seed=3, source_id=2, epoch=1, **args))
    for other in ({"seed": 4, "source_id": 2, "epoch": 1}, {"seed": 3, "source_id": 5, "epoch": 1},
                  {"seed": 3, "source_id": 2, "epoch": 2}):
        assert not np.array_equal(base, epoch_permutation(1000, **other, **args))


def test_blocks_that_do_not_cover_the_source_are_refused():
    with pytest.raises(ValueError, match="blocks must rise from 0"):
        epoch_permutation(1000, seed=0, source_id=0, epoch=0, window=8, blocks=np.array([0, 500, 900]))
