"""`bench balance --vs megatron`: megatron-core's BalancedCPScheduler and the planner on the same batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule", reason="megatron-core >= 0.16")

from megascale_data_ext.cli import main  # noqa: E402
from megascale_data_ext.commands import _vs_megatron as vs  # noqa: E402
from megascale_data_ext.dataplane.workloads import fill_workload  # noqa: E402


@pytest.mark.parametrize("workload", ["long-short", "coyo"])
def test_every_side_carries_the_whole_batch_once(workload) -> None:
    lens = fill_workload(workload, int(0.9 * 8 * 4 * 1024), seed=3, context=1024).seq_lens()
    total = float((lens.astype(float) ** 2).sum())
    megatron, step, _ = vs.megatron_gpu_costs(lens, 8, 1024, "s2")
    planner, _ = vs.planner_gpu_costs(lens, 8, 4, 1024, "s2")
    assert megatron.sum() == pytest.approx(total) and planner.sum() == pytest.approx(total)
    assert step >= megatron.max() - 1e-6  # barriers after every group never make the step shorter
    vanilla = vs.vanilla_gpu_costs(lens, 8, 1024, "calibrated")
    windows = -(-int(lens.sum()) // 1024)
    fixed, linear, _ = vs._terms("calibrated")
    assert vanilla.sum() >= windows * fixed + linear * lens.sum()  # every token in some window


def test_cli_writes_the_issue_rows(tmp_path) -> None:
    out = tmp_path / "vs.json"
    assert main(["bench", "balance", "--vs", "megatron", "--gpus", "8", "--caps", "1024", "--batches", "2",
                 "--workloads", "navit", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["gpus"], r["cap"], r["cost_model"]) for r in rows] == [
        ("navit", 8, 1024, "s2"), ("navit", 8, 1024, "calibrated")]
    for r in rows:
        assert {"planner_max", "megatron_max", "vanilla_max", "planner_max_over_mean", "megatron_max_over_mean",
                "planner_ms", "megatron_ms"} <= set(r)
        assert r["planner_max_over_mean"] >= 1.0 and r["megatron_max_over_mean"] >= 1.0 and np.isfinite(r["planner_ms"])
