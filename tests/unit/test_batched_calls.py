"""Batched calls between the plain runtime classes (what their Ray façades send once per loader
actor): the Planner's metadata, a loader group's plans, a constructor's fetch; and the counter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.calls import CallCounter, calls_per_step, sum_calls
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.loader_group import LoaderGroup
from megascale_data_ext.runtime.planner import SUMMARY_AHEAD_STEPS, SUMMARY_MIN_ROWS, Planner
from megascale_data_ext.sources.demo_data import make_demo_data


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    specs = make_demo_data(tmp_path_factory.mktemp("demo"), seed=5, rows=80, text_sources=3, image_sources=0,
                           megatron_rows=60)
    return [dataclasses.replace(s, truncate=True, max_tokens=1024) for s in specs]


def _config(specs, **overrides) -> ServiceConfig:
    kwargs = dict(sources=specs, seed=3, samples_per_step=16, num_microbatches=2, seq_length=1024,
                  strategy="vanilla", buffer_size=32)
    kwargs.update(overrides)
    return ServiceConfig(**kwargs)


@pytest.mark.parametrize("tokens", [False, True])
def test_loader_do_plans_is_loader_do_plan_of_each_source(specs, tokens: bool) -> None:
    overrides = {"strategy": "llm_balance", "strategy_args": {"model": "gpt-tiny"}, "tokens_per_step": 2 * 2 * 1024,
                 "split_documents": True} if tokens else {}
    svc = InProcessService(_config(specs, **overrides), ClientPlaceTree.from_sizes(dp=2))
    for step in range(4):
        plan = svc.planner.plan(step)
        every = plan.loader_do_plans(range(len(specs)))
        for s in range(len(specs)):
            one = plan.loader_do_plan(s)
            if not len(one.positions):
                assert s not in every
                continue
            got = every[s]
            assert (got.step, got.source) == (one.step, one.source)
            for field in ("positions", "indices", "bucket"):
                np.testing.assert_array_equal(getattr(got, field), getattr(one, field))
        assert set(plan.loader_do_plans([1])) <= {1}


def test_planner_asks_for_metadata_once_per_step_for_every_source(specs) -> None:
    svc = InProcessService(_config(specs), ClientPlaceTree.from_sizes(dp=2))
    batches: list[list[tuple[int, int, int]]] = []

    def summarize_many(requests):
        batches.append(list(requests))
        return [svc.loaders[s].summary_buffer(start, n) for s, start, n in requests]

    planner = Planner(svc.config, svc.topology, None, summarize_many=summarize_many)
    for step in range(6):
        plan = planner.plan(step)
        np.testing.assert_array_equal(plan.position, svc.planner.plan(step).position)  # same plans as per source
    drawn = svc.planner.plan(0).counts_per_source().tolist()
    assert all(drawn) and svc.config.buffer_size > max(drawn)  # every source drawn at step 0
    # one batch, every source, sized by what the step draws of it (not the buffer size) ...
    assert batches[0] == [(s, 0, n * (1 + SUMMARY_AHEAD_STEPS) + SUMMARY_MIN_ROWS) for s, n in enumerate(drawn)]
    assert len(batches) == 1  # ... and covering the next steps: no more calls
    with pytest.raises(ValueError, match="summarize"):
        Planner(svc.config, svc.topology, None)


def test_loader_group_asks_for_plans_once_per_step(specs) -> None:
    svc = InProcessService(_config(specs), ClientPlaceTree.from_sizes(dp=2))
    asked: list[tuple[int, list[int]]] = []

    def get_plans(step, sources):
        asked.append((step, list(sources)))
        return svc.planner.plan(step).loader_do_plans(sources)

    members = [(ShardRef(source=s, shard=0, num_shards=1), spec) for s, spec in enumerate(specs)]
    group = LoaderGroup(members, seed=svc.config.seed, shuffle=svc.config.shuffle, read_ahead=0, get_plans=get_plans)
    for step in range(3):
        for s in range(len(specs)):
            got = group.fetch(s, step, [0, 1])
            want = svc.loaders[s].fetch(step, [0, 1])
            assert [(b, p) for b, p, _ in got["samples"]] == [(b, p) for b, p, _ in want["samples"]]
    assert asked == [(step, list(range(len(specs)))) for step in range(3)]
    group.close()


def test_constructor_fetches_a_step_in_one_call(specs) -> None:
    svc = InProcessService(_config(specs), ClientPlaceTree.from_sizes(dp=2))
    con = svc.constructors[0]
    calls: list[tuple[int, list[int]]] = []
    inner = con.fetch

    def fetch(step, sources, buckets):
        calls.append((step, list(sources)))
        return inner(step, sources, buckets)

    con.fetch = fetch
    for rank in svc.topology.fetch_ranks():
        for j in range(svc.config.num_microbatches):
            svc.get(0, j, rank)
    assert [step for step, _ in calls] == [0] and len(calls[0][1]) > 1


def test_calls_per_step_counts_by_kind() -> None:
    a, b = CallCounter(), CallCounter()
    a.add("x", 2)
    b.add("y")
    before = sum_calls([a.snapshot(), None, b.snapshot()])
    a.add("x", 8)
    b.add("y", 4)
    assert calls_per_step(before, sum_calls([a.snapshot(), b.snapshot()]), 4) == {"x": 2.0, "y": 1.0, "total": 3.0}
    with pytest.raises(ValueError):
        calls_per_step(before, before, 0)
