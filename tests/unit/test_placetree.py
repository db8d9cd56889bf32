"""ClientPlaceTree against Megatron's own RankGenerator (pure Python, no process group)."""

from __future__ import annotations

import math
import pickle
import sys
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megascale_data_ext.dataplane.placetree import (
    DEFAULT_ORDER,
    BucketAxis,
    BucketLayout,
    ClientPlaceTree,
)
from megascale_data_ext.errors import ConfigError, ParallelLayoutError

RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator

# Tree group name -> (generator, token) exactly as initialize_model_parallel builds them.
DECODER_GROUPS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp-cp": "dp-cp", "tp-cp": "tp-cp",
                  "mp": "tp-pp", "tp-dp": "tp-dp", "tp-dp-cp": "tp-dp-cp"}
EXPERT_GROUPS = {"ep": "ep", "edp": "dp", "etp": "tp"}


def megatron_generators(*, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int, order: str) -> tuple[Any, Any]:
    world = tp * cp * pp * dp
    dec = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    exp = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    return dec, exp


def megatron_accepts(*, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int, order: str) -> bool:
    """The checks initialize_model_parallel makes, run on Megatron's own generators."""
    world = tp * cp * pp * dp
    if world % (etp * ep * pp):
        return False
    try:
        dec, exp = megatron_generators(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)
    except RuntimeError:
        return False
    edp = world // (etp * ep * pp)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return False
    return dec.get_ranks("pp") == exp.get_ranks("pp")


def assert_matches_megatron(tree: ClientPlaceTree) -> None:
    """Every group of every rank, and every coordinate, equals Megatron's."""
    dec, exp = megatron_generators(tp=tree.tp, cp=tree.cp, pp=tree.pp, dp=tree.dp, ep=tree.ep,
                                   etp=tree.etp, order=tree.order)
    covered: dict[str, set[int]] = {}
    for gens, table in ((dec, DECODER_GROUPS), (exp, EXPERT_GROUPS)):
        for name, token in table.items():
            for ranks in gens.get_ranks(token):
                for index, r in enumerate(ranks):
                    assert tree.group(name, r) == ranks, (name, r)
                    covered.setdefault(name, set()).add(r)
                    # A rank's index in its (ascending) group is Megatron's get_*_rank().
                    if name in ("tp", "cp", "dp", "pp", "ep"):
                        assert tree.coords(r)[name] == index, (name, r)
    assert all(c == set(range(tree.world_size)) for c in covered.values())
    for r in range(tree.world_size):
        c = tree.coords(r)
        assert tree.rank_of(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == r


LAYOUTS = [
    dict(tp=2, pp=2, world_size=8),
    dict(tp=2, cp=2, world_size=8),
    dict(cp=2, pp=2, world_size=8),
    dict(pp=8, world_size=8),
    dict(tp=2, cp=2, pp=2, world_size=16),
    dict(tp=4, cp=2, pp=3, world_size=48),
    dict(tp=2, ep=2, world_size=8),
    dict(tp=2, pp=2, ep=4, world_size=32),
    dict(tp=1, cp=2, ep=4, world_size=8),
    dict(tp=4, ep=4, etp=1, world_size=16),
    dict(tp=2, pp=2, world_size=8, order="tp-pp-dp"),
    dict(tp=2, pp=2, world_size=16, order="tp-dp-pp"),
    dict(tp=2, pp=3, world_size=12, order="pp-tp-dp"),
    dict(tp=2, cp=2, pp=2, world_size=16, order="cp-tp-dp-pp"),
    dict(tp=2, cp=1, pp=2, world_size=16, order="dp-pp-tp"),
    dict(tp=2, cp=2, pp=2, world_size=16, order="tp-cp-dp-pp"),
    dict(tp=2, pp=2, ep=2, world_size=16, order="ep-tp-dp-pp"),
    dict(tp=2, pp=2, world_size=8, order="dp-tp-pp"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_from_sizes_equals_megatron_rank_generator(layout: dict[str, Any]) -> None:
    tree = ClientPlaceTree.from_sizes(**layout)
    assert tree.world_size == layout["world_size"]
    assert_matches_megatron(tree)


def test_default_order_formula_and_megatron_docstring_example() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=3, pp=2, dp=4)
    for r in range(tree.world_size):
        c = tree.coords(r)
        assert r == c["tp"] + 2 * (c["cp"] + 3 * (c["dp"] + 4 * c["pp"]))
    # initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4.
    t = ClientPlaceTree.from_sizes(tp=2, pp=4, world_size=16)
    assert sorted({tuple(t.group("dp", r)) for r in range(16)}) == [
        (0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert sorted({tuple(t.group("pp", r)) for r in range(16)}) == [
        (0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]


def test_dp_group_excludes_ep_folding_and_ep_coordinate_is_expert_group_index() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, pp=2, ep=2, world_size=16)
    assert tree.dp == 4 and tree.edp == 2
    assert tree.group("dp", 0) == [0, 2, 4, 6]  # get_data_parallel_group: ep is inside dp
    assert tree.group("ep", 0) == [0, 2] and tree.group("edp", 0) == [0, 4]
    assert [tree.coords(r)["ep"] for r in (0, 2, 4, 6)] == [0, 1, 0, 1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2, 3]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 3]),
    dp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([1, 2, 4]), etp=st.sampled_from([None, 1, 2]),
    perm=st.permutations(["tp", "cp", "ep", "dp", "pp"]), drop=st.sets(st.sampled_from(["cp", "ep", "dp"])),
)
def test_property_random_layouts_match_megatron_or_are_rejected(
    tp: int, cp: int, pp: int, dp: int, ep: int, etp: int | None, perm: list[str], drop: set[str]
) -> None:
    order = "-".join(t for t in perm if t not in drop)
    real_etp = tp if etp is None else etp
    if megatron_accepts(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=real_etp, order=order):
        tree = ClientPlaceTree.from_sizes(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)
        assert_matches_megatron(tree)
    else:
        with pytest.raises(ParallelLayoutError):
            ClientPlaceTree.from_sizes(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)


def test_big_world_is_vectorised_and_consistent() -> None:
    tree = ClientPlaceTree.from_sizes(tp=8, cp=2, pp=4, ep=8, world_size=4096)
    assert tree.dp == 64
    world = tree.buckets("WORLD")
    assert world.num_buckets == 4096 and world.bucket_of_rank(4095) == 4095
    dp = tree.buckets("DP", group_size=8)
    assert dp.num_buckets == 64 and len(dp.groups) == 8
    assert sorted(r for b in dp.bucket_ranks for r in b) == list(range(4096))
    assert tree.buckets("DP", group_size=8) is dp  # cached


# ---------------------------------------------------------------- buckets
def test_dp_buckets_list_every_rank_with_that_dp_coordinate() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, pp=2, world_size=16)
    layout = tree.buckets("dp")
    assert isinstance(layout, BucketLayout) and layout.axis is BucketAxis.DP
    assert layout.num_buckets == 2
    assert layout.bucket_coords == ({"dp": 0}, {"dp": 1})
    assert layout.bucket_ranks == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    assert layout.groups == ((0, 1),)
    assert [layout.bucket_of_rank(r) for r in range(16)] == [tree.coords(r)["dp"] for r in range(16)]


def test_cp_buckets_are_dp_times_cp_consumers() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, pp=2, world_size=16)
    layout = tree.buckets("CP")
    assert layout.num_buckets == 4
    assert layout.bucket_coords == ({"dp": 0, "cp": 0}, {"dp": 0, "cp": 1}, {"dp": 1, "cp": 0}, {"dp": 1, "cp": 1})
    assert layout.bucket_ranks == ((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15))
    for r in range(16):
        c = tree.coords(r)
        assert layout.bucket_of_rank(r) == c["dp"] * 2 + c["cp"]


def test_world_buckets_one_per_rank_with_full_coords() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, pp=2, ep=2, world_size=8)
    layout = tree.buckets(BucketAxis.WORLD)
    assert layout.num_buckets == 8
    assert layout.bucket_ranks == tuple((r,) for r in range(8))
    assert layout.bucket_coords == tuple(tree.coords(r) for r in range(8))


@pytest.mark.parametrize("n_dp,g", [(7, 3), (8, 8), (8, 1), (5, 10)])
def test_group_size_gives_ceil_n_over_g_contiguous_subgroups(n_dp: int, g: int) -> None:
    layout = ClientPlaceTree.from_sizes(dp=n_dp).buckets("DP", group_size=g)
    assert len(layout.groups) == math.ceil(n_dp / g)
    assert [b for grp in layout.groups for b in grp] == list(range(n_dp))
    assert all(len(grp) == g for grp in layout.groups[:-1])


def test_bucket_errors_name_allowed_values() -> None:
    tree = ClientPlaceTree.from_sizes(dp=4)
    with pytest.raises(ParallelLayoutError, match="DP.*CP.*WORLD"):
        tree.buckets("TP")
    with pytest.raises(ParallelLayoutError, match="group_size"):
        tree.buckets("DP", group_size=0)
    with pytest.raises(ParallelLayoutError, match=r"rank 4 is outside"):
        tree.buckets("DP").bucket_of_rank(4)


# ---------------------------------------------------------------- inspection
def test_describe_shows_tree_and_fetchers() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, pp=2, world_size=16)
    text = tree.describe(fetching=[6, 14])
    assert "DP 1" in text and "CP 1  pp0: [6* 7]  pp1: [14* 15]" in text
    assert "*" not in tree.describe().split("\n", 2)[2]  # nothing marked: the tree alone decides no fetching
    big = ClientPlaceTree.from_sizes(tp=8, pp=4, world_size=4096).describe(max_dp=2)
    assert "126 more DP replicas" in big and len(big.splitlines()) < 20
    assert repr(ClientPlaceTree.from_sizes(dp=2)).startswith("ClientPlaceTree(world=2")


# ---------------------------------------------------------------- errors
def test_impossible_sizes_list_every_problem() -> None:
    with pytest.raises(ParallelLayoutError) as err:
        ClientPlaceTree.from_sizes(tp=0, cp=-1, pp=2, world_size=8, ep=True)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "`tp`" in msg and "`cp`" in msg and "`ep`" in msg
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=3, world_size=8), r"world_size 8 is not divisible by tp\*cp\*pp"),
        (dict(tp=2, dp=3, world_size=8), r"dp=3 .* not world_size=8"),
        (dict(tp=2), r"give `dp` or `world_size`"),
        (dict(tp=2, ep=3, world_size=8), r"not divisible by etp\*ep\*pp"),
        (dict(cp=2, world_size=8, order="tp-dp-pp"), r"lacks 'cp'"),
        (dict(world_size=8, order="tp-xx-dp"), r"unknown tokens \['xx'\]"),
        (dict(world_size=8, order="tp-dp-dp"), r"repeats"),
        (dict(pp=1, vpp=2, world_size=8), r"vpp.*needs pp > 1"),
        (dict(tp=2, pp=2, ep=2, world_size=8, order="tp-pp-ep-dp"), r"does not end in 'pp'"),
    ],
)
def test_layout_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ParallelLayoutError, match=match):
        ClientPlaceTree.from_sizes(**kwargs)


def test_query_errors() -> None:
    tree = ClientPlaceTree.from_sizes(tp=2, world_size=4)
    with pytest.raises(ParallelLayoutError, match=r"\[0, 4\)"):
        tree.coords(4)
    with pytest.raises(ParallelLayoutError, match="tp=2 not in"):
        tree.rank_of(tp=2)
    with pytest.raises(ParallelLayoutError, match="group axis must be one of"):
        tree.group("xp", 0)
    with pytest.raises(ParallelLayoutError, match="broadcast dim"):
        tree.broadcast_source(0, "pp")


# ---------------------------------------------------------------- from_megatron (mocked parallel_state)
def fake_parallel_state(rank: int, *, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int, order: str,
                        vpp: int | None = None) -> types.ModuleType:
    """A stand-in for parallel_state after initialize_model_parallel, built from RankGenerator."""
    dec, exp = megatron_generators(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)

    def mine(gen: Any, token: str) -> list[int]:
        return next(g for g in gen.get_ranks(token) if rank in g)

    ps = types.ModuleType("megatron.core.parallel_state")
    groups = {tok: mine(dec, tok) for tok in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp")}
    ep_group = mine(exp, "ep")
    ps.__dict__.update(
        model_parallel_is_initialized=lambda: True,
        get_tensor_model_parallel_world_size=lambda: tp,
        get_pipeline_model_parallel_world_size=lambda: pp,
        get_context_parallel_world_size=lambda: cp,
        get_data_parallel_world_size=lambda: dp,
        get_expert_model_parallel_world_size=lambda: ep,
        get_expert_tensor_parallel_world_size=lambda: etp,
        get_virtual_pipeline_model_parallel_world_size=lambda: vpp,
        get_tensor_model_parallel_rank=lambda: groups["tp"].index(rank),
        get_pipeline_model_parallel_rank=lambda: groups["pp"].index(rank),
        get_context_parallel_rank=lambda: groups["cp"].index(rank),
        get_data_parallel_rank=lambda: groups["dp"].index(rank),
        get_expert_model_parallel_rank=lambda: ep_group.index(rank),
        _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS=groups["tp"],
        _PIPELINE_GLOBAL_RANKS=groups["pp"],
        _DATA_PARALLEL_GLOBAL_RANKS=groups["dp"],
        _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP=groups["dp-cp"],
        _CONTEXT_PARALLEL_GLOBAL_RANKS=groups["cp"],
        _MODEL_PARALLEL_GLOBAL_RANKS=groups["tp-pp"],
        _EXPERT_MODEL_PARALLEL_RANKS=ep_group,
    )
    return ps


MOCK_LAYOUTS = [
    dict(tp=2, cp=2, pp=2, dp=2, ep=1, etp=2, order=DEFAULT_ORDER, vpp=4),
    dict(tp=2, cp=1, pp=3, dp=2, ep=2, etp=2, order=DEFAULT_ORDER),
    dict(tp=3, cp=1, pp=2, dp=2, ep=1, etp=3, order="tp-pp-dp"),
    dict(tp=2, cp=1, pp=2, dp=2, ep=1, etp=2, order="pp-dp-tp"),
    dict(tp=2, cp=2, pp=2, dp=2, ep=1, etp=2, order="cp-tp-dp-pp"),
    dict(tp=4, cp=1, pp=1, dp=2, ep=4, etp=1, order=DEFAULT_ORDER),
]


@pytest.mark.parametrize("layout", MOCK_LAYOUTS, ids=lambda d: d["order"] + f"-tp{d['tp']}ep{d['ep']}")
def test_from_megatron_reads_sizes_and_infers_order(monkeypatch: pytest.MonkeyPatch, layout: dict[str, Any]) -> None:
    truth = ClientPlaceTree.from_sizes(**layout)
    world = truth.world_size
    for rank in range(world):
        monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake_parallel_state(rank, **layout))
        tree = ClientPlaceTree.from_megatron()
        assert (tree.tp, tree.cp, tree.pp, tree.dp, tree.ep, tree.etp, tree.vpp) == (
            layout["tp"], layout["cp"], layout["pp"], layout["dp"], layout["ep"], layout["etp"], layout.get("vpp"))
        for r in range(world):
            assert tree.coords(r) == truth.coords(r)
            for name in ("tp", "cp", "dp", "pp", "dp-cp", "mp", "ep", "edp"):
                assert tree.group(name, r) == truth.group(name, r)
    if layout["order"] in (DEFAULT_ORDER, "tp-pp-dp"):
        assert tree.order == layout["order"]  # spelled as the user wrote it


def test_from_megatron_raises_on_uninitialised_and_on_foreign_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = dict(tp=2, cp=1, pp=2, dp=2, ep=1, etp=2, order=DEFAULT_ORDER)
    ps = fake_parallel_state(0, **layout)
    ps.model_parallel_is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    with pytest.raises(ParallelLayoutError, match="initialize_model_parallel"):
        ClientPlaceTree.from_megatron()
    ps = fake_parallel_state(0, **layout)
    ps._DATA_PARALLEL_GLOBAL_RANKS = [0, 3]  # no rank order produces this
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    with pytest.raises(ParallelLayoutError, match=r"no rank order reproduces .* global rank 0"):
        ClientPlaceTree.from_megatron()
    ps = fake_parallel_state(0, **layout)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    with pytest.raises(ParallelLayoutError, match="order 'tp-pp-dp'"):
        ClientPlaceTree.from_megatron(order="tp-pp-dp")


def test_tree_is_an_immutable_value() -> None:
    a = ClientPlaceTree.from_sizes(tp=2, world_size=8)
    assert a == ClientPlaceTree.from_sizes(tp=2, dp=4) and a != ClientPlaceTree.from_sizes(tp=4, dp=2)
    with pytest.raises(AttributeError):
        a.tp = 4  # type: ignore[misc]
    assert a.layout() == {"world_size": 8, "tp": 2, "cp": 1, "pp": 1, "dp": 4, "ep": 1, "etp": 2, "vpp": None,
                          "order": DEFAULT_ORDER}
    assert a.coords(np.int64(3)) == a.coords(3)
    # Ray ships trees to actors: a round trip keeps the value and a working cache.
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b.coords(5) == a.coords(5)
    assert b.buckets("CP").bucket_ranks == a.buckets("CP").bucket_ranks
