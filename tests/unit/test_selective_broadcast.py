"""Selective broadcasting on the data side: the runtime fetches exactly where the plan says, and a
whole pack broadcast over cp slices on every rank exactly as the constructor would have."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext import Client, ClientPlaceTree, InProcessService, ServiceConfig, ServiceTopology
from megascale_data_ext.dataplane.cp_slicing import slice_for_cp
from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.errors import PlanError
from megascale_data_ext.sources.demo_data import make_demo_data

TREE = ClientPlaceTree.from_sizes(tp=2, cp=2, dp=2)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=4, rows=40, text_sources=2, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True) for s in out]


def config(specs, **strategy_args) -> ServiceConfig:
    return ServiceConfig(sources=specs, seed=5, samples_per_step=8, num_microbatches=2, seq_length=1024,
                         strategy="llm_balance", strategy_args={"model": "gpt-tiny", **strategy_args}, buffer_size=32)


@pytest.mark.parametrize(("args", "fetchers"), [
    ({}, [0, 2, 4, 6]),                                   # Megatron's TP-rank-0 broadcast
    ({"broadcast": ["tp", "cp"]}, [0, 4]),                # one fetcher per TP x CP group
    ({"broadcast": ["cp"]}, [0, 1, 4, 5]),                # every TP rank fetches, CP ranks receive
    ({"broadcast": []}, list(range(8))),                  # everyone fetches
    ({"broadcast": ["tp", "cp"], "axis": "CP"}, [0, 2, 4, 6]),  # cp ranks are buckets: cp not broadcast
    ({"broadcast": ["tp", "cp"], "group_size": 1}, [0, 4]),     # balanced per bucket, same fetchers
])
def test_runtime_fetches_where_the_plan_says(specs, args, fetchers):
    svc = InProcessService(config(specs, **args), TREE)
    plan = svc.planner.plan(0)
    assert list(plan.fetch_ranks) == svc.topology.fetch_ranks() == fetchers
    for rank in range(TREE.world_size):
        group = svc.topology.broadcast_group(rank)
        assert svc.topology.broadcast_source(rank) in fetchers and rank in group
        assert (svc.topology.broadcast_source(rank) == rank) == (rank in fetchers)


def test_a_pack_broadcast_over_cp_is_sliced_on_every_rank_as_the_constructor_would(specs):
    whole = InProcessService(config(specs, broadcast=["tp", "cp"]), TREE)
    sliced = InProcessService(config(specs), TREE)
    assert whole.topology.client_slices_cp and not sliced.topology.client_slices_cp
    for step in range(2):
        for dp in range(2):
            for j in range(2):
                pack, info = whole.get(step, j, TREE.rank_of(dp=dp))  # the one fetcher of the TP x CP group
                for cp in range(2):
                    want, want_info = sliced.get(step, j, TREE.rank_of(dp=dp, cp=cp))
                    got = slice_for_cp(pack, cp_size=2, cp_rank=cp)
                    assert info["samples"].tolist() == want_info["samples"].tolist()
                    assert sorted(got) == sorted(want)
                    for key in want:
                        np.testing.assert_array_equal(got[key], want[key])
    fetcher = Client(whole.topology, TREE.rank_of(dp=1), source=whole, num_microbatches=2, broadcast=False)
    mine = fetcher.get(2, 0)  # the fetcher keeps its own (cp 0) slice of the pack it received
    np.testing.assert_array_equal(mine["tokens"].numpy(), sliced.get(2, 0, TREE.rank_of(dp=1))[0]["tokens"])


def test_a_strategy_whose_broadcast_at_disagrees_with_its_declaration_is_refused(specs):
    from megascale_data_ext.dataplane.strategies import LLMBalance

    class Inconsistent(LLMBalance):
        def __call__(self, g):
            return super().__call__(g).broadcast_at("cp")  # broadcasts over cp without declaring it

    cfg = config(specs)
    svc = InProcessService(cfg, TREE)
    svc.planner.strategy = Inconsistent(num_microbatches=2, cap=1024, model="gpt-tiny")
    with pytest.raises(PlanError, match="must name the dims its broadcast_at"):
        svc.planner.plan(0)


def test_topology_is_plain_data():
    topo = ServiceTopology(tree=TREE, distribution=Distribution(), constructor_groups=((0,), (1,)), num_sources=2,
                           namespace="x")
    assert topo.broadcast_dims == ("tp",) and topo.broadcast_group(3) == [2, 3]
