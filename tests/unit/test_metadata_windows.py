"""The Planner's metadata windows follow what the mixture draws, not the buffer size.

A blend of many sources draws a few samples of each per step: the Planner asks each source for
about `SUMMARY_AHEAD_STEPS` steps of its draws (at least `SUMMARY_MIN_ROWS`), none of a source a
step does not draw, and a token-budget step that draws more than its estimate asks again for the
short sources. The plans must not depend on any of it: windows exactly as long as a step's draws,
the default and very long ones plan the same steps, in count mode and in token-budget mode.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime import planner as planner_module
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.runtime.token_budget import TokenBudget
from megascale_data_ext.sources.demo_data import make_demo_data

SOURCES, STEPS = 48, 8


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    base = make_demo_data(tmp_path_factory.mktemp("windows"), seed=3, rows=300, text_sources=2, image_sources=0,
                          megatron_source=False)
    return [dataclasses.replace(base[i % 2], name=f"src{i}", truncate=True) for i in range(SOURCES)]


def config(specs, **kw) -> ServiceConfig:
    args = dict(sources=specs, seed=5, samples_per_step=24, num_microbatches=2, seq_length=1024,
                strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=256)
    args.update(kw)
    return ServiceConfig(**args)


def run(cfg: ServiceConfig) -> tuple[list, list[list[tuple[int, int, int]]], list[int]]:
    """(what each step planned, every metadata request batch, request batches per step) of a Planner
    over in-process loaders."""
    svc = InProcessService(cfg, ClientPlaceTree.from_sizes(dp=2))
    asked: list[list[tuple[int, int, int]]] = []

    def summarize_many(requests):
        asked.append(list(requests))
        return [svc.loaders[s].summary_buffer(start, n) for s, start, n in requests]

    planner = Planner(cfg, svc.topology, None, summarize_many=summarize_many)
    plans, per_step = [], []
    for step in range(STEPS):
        before = len(asked)
        plans.append(planner.plan(step))
        per_step.append(len(asked) - before)
    return ([(p.source.tolist(), p.position.tolist(), p.bucket.tolist(), p.microbatch.tolist()) for p in plans],
            asked, per_step)


@pytest.mark.parametrize("mode", ["count", "tokens"])
def test_plans_do_not_depend_on_the_windows(specs, mode, monkeypatch) -> None:
    cfg = config(specs, tokens_per_step=2 * 2 * 1024) if mode == "tokens" else config(specs)
    plans, asked, per_step = run(cfg)
    rows = sum(n for batch in asked for _, _, n in batch)
    assert rows < SOURCES * cfg.buffer_size / 2  # 8 steps; the old start asked every source for buffer_size + 4,096
    first = {s for s, _, _ in asked[0]}
    assert len(first) < SOURCES or mode == "tokens"  # 24 samples of 48 sources: not every source is asked
    assert max(per_step) <= 1  # at most one round trip a step

    monkeypatch.setattr(planner_module, "SUMMARY_AHEAD_STEPS", 0)  # windows exactly a step's draws
    monkeypatch.setattr(planner_module, "SUMMARY_MIN_ROWS", 0)
    monkeypatch.setattr(TokenBudget, "draw_estimate", lambda self: 1)  # token steps: always short at first
    tight, _, tight_per_step = run(cfg)
    assert tight == plans
    if mode == "tokens":
        assert tight_per_step[0] > 1  # an estimate of 1 document: the short windows were asked again

    monkeypatch.setattr(planner_module, "SUMMARY_AHEAD_STEPS", 1000)
    assert run(cfg)[0] == plans


def test_a_step_drawing_more_than_the_buffer_is_still_refused_naming_it(specs) -> None:
    cfg = config(specs[:1], samples_per_step=300, buffer_size=64, overflow="defer")
    svc = InProcessService(cfg, ClientPlaceTree.from_sizes(dp=2))
    with pytest.raises(PlanError, match="buffer_size"):
        svc.planner.plan(0)
    assert np.all(svc.planner.cursors == 0)  # nothing was taken
