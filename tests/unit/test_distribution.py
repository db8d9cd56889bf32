"""Distribution: which ranks fetch, which receive by broadcast, which stages read — on any tree."""

from __future__ import annotations

import pickle

import pytest

from megascale_data_ext.dataplane.distribution import Distribution, FetchStages
from megascale_data_ext.dataplane.placetree import BucketAxis, ClientPlaceTree
from megascale_data_ext.errors import ParallelLayoutError


def test_default_fetch_is_tp0_of_first_and_last_stage() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, pp=3, world_size=24)
    dist = Distribution()
    expected = [r for r in range(24) if tree.coords(r)["tp"] == 0 and tree.coords(r)["pp"] in (0, 2)]
    assert dist.fetch_ranks(tree) == expected == Distribution(BucketAxis.CP).fetch_ranks(tree)
    assert [dist.fetches(tree, r) for r in range(24)] == [r in expected for r in range(24)]
    middle = [r for r in range(24) if tree.coords(r)["pp"] == 1]
    assert not any(dist.fetches(tree, r) or dist.needs_data(tree, r) for r in middle)
    for r in range(24):
        assert dist.broadcast_source(tree, r) == tree.group("tp", r)[0] == tree.broadcast_source(r, "tp")


def test_selective_broadcast_over_tp_cp() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, pp=2, world_size=16)
    dist = Distribution("DP", ("tp", "cp"))
    assert dist.fetch_ranks(tree) == [0, 4, 8, 12]
    # CP buckets are distinct consumers, so cp cannot be broadcast over: each cp index of tp0 fetches.
    on_cp = Distribution("CP", ("tp", "cp"))
    assert on_cp.broadcast_dims == ("tp",) and on_cp.fetch_ranks(tree) == [0, 2, 4, 6, 8, 10, 12, 14]
    for r in range(16):
        assert dist.broadcast_source(tree, r) == tree.group("tp-cp", r)[0]
    assert tree.broadcast_source(7, "tp") == 6 and tree.broadcast_source(7, "cp") == 5


def test_no_broadcast_every_rank_of_first_and_last_stage_fetches() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, pp=4, world_size=8)
    dist = Distribution(broadcast=())
    assert dist.fetch_ranks(tree) == [0, 1, 6, 7]
    assert dist.broadcast_source(tree, 3) == 3


def test_stages_and_world_axis() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, pp=3, world_size=24)
    assert Distribution(stages=FetchStages.FIRST).fetch_ranks(tree) == [0, 2, 4, 6]
    every = Distribution(stages="all")
    assert all(every.needs_data(tree, r) for r in range(24)) and len(every.fetch_ranks(tree)) == 12
    world = Distribution("world")  # every rank its own consumer: nothing broadcast, every stage reads
    assert world.broadcast_dims == () and world.fetch_ranks(tree) == list(range(24))


def test_big_world_is_vectorised() -> None:
    tree = ClientPlaceTree.from_sizes(tp=8, cp=2, pp=4, ep=8, world_size=4096)
    # tp0 of every cp index, first and last stage, of every dp replica
    assert len(Distribution().fetch_ranks(tree)) == 2 * 64 * 2


def test_bad_values_are_named_and_the_value_pickles() -> None:
    with pytest.raises(ParallelLayoutError, match="broadcast dims"):
        Distribution(broadcast=("dp",))
    with pytest.raises(ParallelLayoutError, match="bucket axis"):
        Distribution("TP")
    with pytest.raises(ParallelLayoutError, match=r"\[0, 4\)"):
        Distribution().fetches(ClientPlaceTree.from_sizes(tp=2, world_size=4), 4)
    d = Distribution("CP", ["tp", "cp"], "first")
    assert pickle.loads(pickle.dumps(d)) == d == Distribution(BucketAxis.CP, ("tp", "cp"), FetchStages.FIRST)
