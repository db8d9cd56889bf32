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
        assert plan.loader_do_plans([len(specs) + 5]) == {}  # sources with nothing in the step: an empty answer


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


def test_plan_cache_asks_once_for_several_steps():
    """`PlanCache` with `get_plans_ahead`: the steps an answer brings are served from the cache."""
    from megascale_data_ext.runtime.loader_group import PlanCache

    asked = []

    def ahead(step, sources, count):
        asked.append((step, count))
        last = max(step + 1, min(step + count, 7))  # beyond step 6 only the step asked for (it waits)
        return {s: {src: f"plan {s}/{src}" for src in sources} for s in range(step, last)}

    cache = PlanCache(None, [3, 1], get_plans_ahead=ahead, ahead=4)
    assert [cache._step(s)[1] for s in range(9)] == [f"plan {s}/1" for s in range(9)]
    assert asked == [(0, 4), (4, 4), (7, 4), (8, 4)]  # steps 0-3, 4-6 (all it had), then one at a time


def test_plan_cache_waits_only_for_an_ask_that_may_bring_its_step():
    """A miss on step 5 while an ask for step 4 is in flight waits for it (and is served by it);
    a miss on step 2 never waits behind that ask (it may be waiting for step 2's loss report)."""
    import threading

    from megascale_data_ext.runtime.loader_group import PlanCache

    release, asked = threading.Event(), []

    def ahead(step, sources, count):
        asked.append(step)
        if step == 4:
            release.wait(10)
        return {s: {0: s} for s in range(step, step + (1 if step == 2 else count))}  # the Planner stops at 2

    cache = PlanCache(None, [0], get_plans_ahead=ahead, ahead=4)
    slow = threading.Thread(target=cache._step, args=(4,))
    slow.start()
    while 4 not in asked:
        threading.Event().wait(0.01)
    assert cache._step(2) == {0: 2}  # answered at once: its own ask
    later = threading.Thread(target=cache._step, args=(5,))
    later.start()
    later.join(0.2)
    assert later.is_alive() and asked == [4, 2]  # step 5 waits for the ask of 4, which brings it
    release.set()
    slow.join(5)
    later.join(5)
    assert asked == [4, 2] and cache._step(7) == {0: 7}


def test_read_ahead_never_waits_for_a_step_the_planner_cannot_make_yet():
    """`drawn_if_planned` asks without waiting (``wait=False``): a step whose loss report is not in
    gives None and is not cached, so the fetch of that step later asks (and waits) itself."""
    from megascale_data_ext.runtime.loader_group import PlanCache
    from megascale_data_ext.dataplane.plan import LoaderPlan

    def plan(step, src, n):
        idx = np.arange(n, dtype=np.int64)
        return LoaderPlan(step=step, source=src, positions=idx, indices=idx, bucket=idx * 0)

    asked = []

    def ahead(step, sources, count, wait=True):
        asked.append((step, wait))
        if not wait and step >= 3:  # steps from 3 on need a report that is not in yet
            return {}
        last = max(step + 1, min(step + count, 3))  # the step asked for (once its report came), then what is ready
        return {s: {0: plan(s, 0, 2), 1: plan(s, 1, 0)} for s in range(step, last)}

    cache = PlanCache(None, [0, 1], get_plans_ahead=ahead, ahead=4)
    assert cache.drawn_if_planned(1) == [0]  # source 1 has nothing in the step
    assert cache.drawn_if_planned(3) is None and asked == [(1, False), (3, False)]
    assert cache.drawn_if_planned(2) == [0] and len(asked) == 2  # brought by the first answer
    assert cache.get(3, 0).step == 3 and asked[-1] == (3, True)  # the fetch asks, waiting
