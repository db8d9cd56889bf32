"""The Planner keeps its plans within a byte budget beyond the ones a constructor still needs.

A 4,096-GPU StepPlan is ~28 MiB: 16 of them kept behind the newest was 482 MiB (issue 21's bound
at that size is 256 MiB). Plans a constructor has not passed and the newest always stay; older
ones go oldest first once the budget is spent; their (small) states stay for `keep` steps, so a
checkpoint of such a step still works.
"""

from __future__ import annotations

import dataclasses

import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.traffic import plan_nbytes
from megascale_data_ext.errors import ResumeError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.planner import PLAN_CACHE_BYTES, Planner
from megascale_data_ext.sources.demo_data import make_demo_data


@pytest.fixture(scope="module")
def planner_parts(tmp_path_factory):
    specs = make_demo_data(tmp_path_factory.mktemp("cache"), seed=2, rows=400, text_sources=2, image_sources=0,
                           megatron_source=False)
    specs = [dataclasses.replace(spec, truncate=True) for spec in specs]
    cfg = ServiceConfig(sources=specs, seed=1, samples_per_step=16, num_microbatches=2, seq_length=1024,
                        strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=128)
    return cfg, InProcessService(cfg, ClientPlaceTree.from_sizes(dp=2))


def make_planner(parts, **kw) -> Planner:
    cfg, svc = parts
    return Planner(cfg, svc.topology, None, constructors=1,
                   summarize_many=lambda reqs: [svc.loaders[s].summary_buffer(a, n) for s, a, n in reqs], **kw)


def test_plans_beyond_the_budget_go_oldest_first_never_one_a_constructor_needs(planner_parts) -> None:
    planner = make_planner(planner_parts, keep=16)
    assert planner.plan_cache_bytes == PLAN_CACHE_BYTES
    planner.plan_cache_bytes = int(3.5 * plan_nbytes(planner.plan(0)))
    for step in range(1, 12):
        planner.plan(step)
    assert sorted(planner.plans) == list(range(12))  # the constructor is still at step 0: all needed
    sizes = {step: plan_nbytes(plan) for step, plan in planner.plans.items()}
    planner.constructor_floor(0, 10)
    kept = sorted(planner.plans)  # 0-9 passed: the newest of them, as many as fit the budget with 10 and 11
    assert kept == list(range(kept[0], 12)) and 0 < kept[0] < 10
    assert sum(sizes[s] for s in kept) <= planner.plan_cache_bytes < sum(sizes[s] for s in range(kept[0] - 1, 12))
    assert planner.state_dict(3)["step"] == 3  # its state is still kept (keep=16)
    with pytest.raises(ResumeError, match="plan_cache_bytes"):
        planner.plan(3)


def test_the_default_budget_keeps_the_whole_keep_window_of_small_plans(planner_parts) -> None:
    planner = make_planner(planner_parts, keep=4)
    for step in range(10):
        planner.plan(step)
    planner.constructor_floor(0, 9)
    assert sorted(planner.plans) == list(range(5, 10))  # the newest and keep=4 behind it, no more
