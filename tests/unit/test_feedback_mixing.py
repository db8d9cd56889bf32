"""Loss-driven mixing end to end on the planner: step k's report shapes exactly step k + d, so
runs and resumes are reproducible whatever the report timing; weights follow the loss."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext import ClientPlaceTree, InProcessService, ServiceConfig
from megascale_data_ext.errors import PlanError
from megascale_data_ext.sources.demo_data import make_demo_data
from tests.harness import check_save_load

TREE = ClientPlaceTree.from_sizes(dp=2)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=8, rows=200, text_sources=2, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True) for s in out]


def config(specs, delay=2, **kw) -> ServiceConfig:
    mixing = {"type": "feedback", "base_weights": [1.0, 1.0], "lr": 0.5, "smoothing": 0.0, "min_weight": 0.1,
              "delay": delay}
    return ServiceConfig(sources=specs, seed=3, samples_per_step=20, num_microbatches=2, seq_length=4096,
                         strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64,
                         mixing=mixing, **kw)


def loss(step: int) -> dict[int, float]:
    return {0: 3.0 + 0.1 * (step % 3), 1: 1.0}  # source 0 is the harder one


def test_weights_move_toward_the_high_loss_source(specs):
    planner = InProcessService(config(specs, delay=1), TREE).planner
    counts = []
    for step in range(8):
        counts.append(planner.plan(step).counts_per_source().tolist())
        planner.report_loss(step, loss(step))
    assert counts[0] == [10, 10]  # step 0: no report yet, the base mixture
    assert all(c[0] > 10 for c in counts[1:])  # from step 1 on (step 0's report, delay 1): source 0 favoured
    assert sum(c[0] for c in counts[1:]) > 0.65 * sum(map(sum, counts[1:]))
    assert planner.mixer.schedule.weights(8)[0] > 0.65


def test_step_k_report_applies_exactly_at_k_plus_d_whatever_the_timing(specs):
    early = InProcessService(config(specs), TREE).planner
    for step in range(10):  # every report long before it is needed
        early.report_loss(step, loss(step))
    late = InProcessService(config(specs), TREE).planner
    plans = []
    for step in range(10):  # each report right after its step was planned
        plans.append(late.plan(step).position.tolist())
        late.report_loss(step, loss(step))
    assert [early.plan(step).position.tolist() for step in range(10)] == plans
    assert early.mixer.schedule.last_step == late.mixer.schedule.last_step == 10 - 1 - 2


def test_resume_keeps_reports_not_yet_applied(specs):
    cfg = config(specs)

    def advance(planner, step):
        plan = planner.plan(step)
        planner.report_loss(step, loss(step))
        return plan.source, plan.position

    check_save_load(lambda: InProcessService(cfg, TREE).planner, advance, steps=9, resume_at=[0, 1, 4, 8])


def test_a_missing_report_is_a_named_error_not_a_hang(specs):
    planner = InProcessService(config(specs, delay=1), TREE).planner
    planner.report_timeout_s = 0.05
    planner.plan(0)
    with pytest.raises(PlanError, match=r"needs the per-source loss of step 0 .*install\(client, report_loss=True\)"):
        planner.plan(1)
    assert (planner.reports.waiting, planner.reports.most_waiting) == (0, 1)  # counted, and no longer waiting
    with pytest.raises(PlanError, match="unknown source 'nope'"):
        planner.report_loss(0, {"nope": 1.0})
    planner.report_loss(0, loss(0))
    with pytest.raises(PlanError, match="reported twice with different values"):
        planner.report_loss(0, {0: 9.0, 1: 1.0})
    assert planner.plan(1).step == 1


def test_constructors_split_the_loss_per_source(specs):
    svc = InProcessService(config(specs), TREE)
    batch, info = svc.get(0, 0, 0)
    ids = batch["source_ids"][0]
    bounds = batch["cu_seqlens"]
    for doc, (src, _pos, _idx) in enumerate(info["samples"].tolist()):
        assert set(ids[bounds[doc]:bounds[doc + 1]].tolist()) == {src}
    assert np.all(ids[bounds[len(info["samples"])]:] == -1)  # padding belongs to no source


def test_planning_ahead_stops_where_a_report_is_missing_and_plans_what_one_at_a_time_would(specs):
    """`Planner.planned_ahead` (a loader asking for a few steps' plans at once) never waits for a
    loss report, and a step it plans early is the step planned on request."""
    ahead = InProcessService(config(specs, delay=2), TREE).planner
    ahead.plan(0)
    got = ahead.planned_ahead(1, 4)  # step 1 needs no report (delay 2); step 2 needs step 0's
    assert [p.step for p in got] == [1] and ahead.next_step == 2
    ahead.report_loss(0, loss(0))
    ahead.report_loss(1, loss(1))
    assert [p.step for p in ahead.planned_ahead(1, 4)] == [1, 2, 3]  # step 4 needs step 2's report
    one = InProcessService(config(specs, delay=2), TREE).planner
    for step in range(4):
        one.plan(step)
        if step < 2:
            one.report_loss(step, loss(step))
    assert [ahead.plan(s).position.tolist() for s in range(4)] == [one.plan(s).position.tolist() for s in range(4)]


def test_planning_ahead_stops_at_the_plan_cache_budget(specs):
    static = ServiceConfig(sources=specs, seed=3, samples_per_step=20, num_microbatches=2, seq_length=4096,
                           strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64)
    planner = InProcessService(static, TREE).planner
    planner.plan(0)
    planner.plan_cache_bytes = 0  # every plan kept is over the budget: nothing is planned early
    assert planner.planned_ahead(1, 4) == []
    planner.plan_cache_bytes = 1 << 30
    assert [p.step for p in planner.planned_ahead(1, 4)] == [1, 2, 3, 4]
    assert [p.step for p in planner.planned_ahead(2, 2)] == [2, 3]  # planned ones are returned as they are


def test_nothing_is_asked_for_or_built_before_it_can_be_planned(specs):
    """Under feedback mixing of delay d a fetcher on step p means step p - 1 was reported, so steps up
    to p + d - 1 can be planned: the service's clients ask at most d - 1 steps ahead and constructors
    prefetch no further than d - 1 past their most advanced fetcher, so no call waits in the Planner
    for a report the trainer has yet to make. Counted from the most advanced fetcher: a pipeline's
    last stage asks for a step only after its first stage ran it (from the slowest, delay 1 hung)."""
    from megascale_data_ext.runtime.constructor import DataConstructor
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.topology import ServiceTopology

    asked = FaultToleranceConfig()  # client_prefetch 4
    cfg = config(specs, delay=3)
    assert cfg.report_delay == 3
    assert asked.within_report_delay(3).client_prefetch == 2 and asked.client_prefetch == 4
    one = asked.within_report_delay(1)
    assert one.client_prefetch == 0 and one.max_lead(1) >= 2  # a first stage one step ahead never waits
    assert asked.within_report_delay(8) is asked  # far enough: nothing to lower
    assert asked.within_report_delay(None) is asked  # no feedback: nothing waits for a report
    mixing = {k: v for k, v in cfg.mixing.items() if k != "delay"}
    assert dataclasses.replace(cfg, mixing=mixing).report_delay == 3  # the schedule's own default
    assert dataclasses.replace(cfg, mixing=None).report_delay is None  # the sources' weights: static

    pipeline = ClientPlaceTree.from_sizes(pp=2, dp=1)  # fetchers: rank 0 (first stage), rank 1 (last stage)
    built = []

    def constructor(c, start_step=0):
        return DataConstructor([0], c, ServiceTopology.of(c, pipeline), get_plans=lambda s, b: built.append(s),
                               fetch=None, pad_id=0, max_lead=FaultToleranceConfig().max_lead(c.prefetch),
                               start_step=start_step)

    made = constructor(cfg)
    assert [made.plannable(s) for s in range(4)] == [True, True, True, False]  # both on step 0
    made.held.arrive(0, 1)  # the first stage is on step 1 (step 0 reported), the last stage still on 0
    assert [made.plannable(s) for s in range(5)] == [True, True, True, True, False]
    assert made.held.within_lead(3)
    assert constructor(dataclasses.replace(cfg, mixing=None)).plannable(100)  # static mixing: anything
    assert not constructor(cfg, start_step=None).plannable(0)  # restarted: nothing before a rank says where it is
