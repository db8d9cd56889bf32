"""`bench gpu-balance` and `profile --model` on CPU: the real megatron GPT timed at a tiny shape.

One module-scoped run of each command (the model build dominates); the tests read its JSON,
its saved calibration and its output.
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.commands import _profile_model as pm
from megascale_data_ext.commands import bench_gpu_balance as gb
from megascale_data_ext.dataplane.calibration import load_calibration
from megascale_data_ext.dataplane.costs import TransformerCost
from megascale_data_ext.errors import ConfigError

ROW_FIELDS = {"workload", "dp", "cap", "speedup_measured", "speedup_predicted", "max_over_mean_measured",
              "peak_mem_gb", "speedup_predicted_flops", "speedup_predicted_fitted", "rank_ms_vanilla",
              "rank_ms_balanced", "predicted_by", "max_over_mean_predicted", "balanced_by"}
pytestmark = pytest.mark.skipif(pm.cuda_available(), reason="the CPU smoke shape; a GPU runs the full bench")


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("profile") / "run" / "model_calibration.json"
    parser = argparse.ArgumentParser()
    pm.add_model_arguments(parser)
    # Dense attention: CPU per-document attention loops over documents in Python (slow on 64-doc packs).
    args = parser.parse_args(["--model", "--model-seq", "64", "--model-repeats", "1", "--model-attention", "dense",
                              "--model-out", str(out)])
    assert pm.run_model_profile(args) == 0
    return out


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, calibration) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("gpu-balance") / "rows.json"
    argv = ["bench", "gpu-balance", "--json", str(path), "--dp", "2", "--microbatches", "2", "--caps", "128",
            "--workloads", "long-short", "navit", "--calibration", str(calibration)]
    assert main(argv) == 0
    return json.loads(path.read_text()), str(calibration)


def test_cpu_smoke_writes_every_row_field(smoke, capsys) -> None:
    data, calibration = smoke
    assert data["smoke"] is True and data["device"] == "cpu" and data["timing"] == "time.perf_counter"
    assert data["shape"]["hidden"] == pm.CPU_SMOKE["hidden"]
    assert data["shape"]["attention"] == pm.resolve_attention_choice("auto", device="cpu")
    assert [(r["workload"], r["dp"], r["cap"]) for r in data["rows"]] == [("long-short", 2, 128), ("navit", 2, 128)]
    for row in data["rows"]:
        assert ROW_FIELDS <= set(row)
        assert row["peak_mem_gb"] is None  # CPU: not measured, never invented
        assert row["predicted_by"] == f"calibrated:{calibration}"
        assert row["speedup_measured"] > 0 and row["speedup_predicted"] > 0 and row["max_over_mean_measured"] >= 1.0
        assert len(row["rank_ms_vanilla"]) == len(row["rank_ms_balanced"]) == 2
        assert row["max_microbatch_tokens_balanced"] <= 128  # balanced microbatches respect the cap
        # Measured ratios are the recorded rank times' ratios, per token (the steps carry different amounts)
        assert row["speedup_measured"] == pytest.approx(
            max(row["rank_ms_vanilla"]) / max(row["rank_ms_balanced"]) * row["tokens"] / row["tokens_vanilla"], rel=1e-3)
        # vanilla is Megatron's: DP x m full windows of cap tokens
        assert row["tokens_vanilla"] == 2 * 2 * 128 and row["max_microbatch_tokens_vanilla"] == 128
        assert row["tokens"] <= 0.9 * 2 * 2 * 128
    assert [m["attention"] for m in data["memory"]] == [pm.per_document_backend("cpu") or "per-document", "dense"]
    assert all(m["peak_mem_gb"] is None and "not measured" in m["note"] for m in data["memory"])
    assert data["self_fit"]["report"]["observations"] >= 4
    assert all(row["balanced_by"] == f"calibrated:{calibration}" for row in data["rows"])
    timed = data["observations"]["rows"]  # every timed microbatch, for an offline refit
    assert timed and all(len(t) == 8 and t[5] > 0 and t[6] > 0 and sum(t[4]) > 0 for t in timed)
    assert all(len(t[7]) == data["repeats"] and min(t[7]) <= t[5] <= max(t[7]) for t in timed)  # median of the runs
    assert all(row["launch_bound_share"] is None for row in data["rows"])  # CPU: no separate device clock
    for row in data["rows"]:  # a rank's time is the sum of its timed microbatches
        for variant in ("vanilla", "balanced"):
            for r, ms in enumerate(row[f"rank_ms_{variant}"]):
                mine = [t[5] for t in timed if t[:4] == [row["workload"], row["cap"], variant, r]]
                assert sum(mine) * 1e3 == pytest.approx(ms, abs=1e-2)
    assert data["complete"] is True and data["torch"] and data["command"].startswith("megascale-data bench gpu-balance")


def test_json_report_keeps_the_rows_measured_before_a_failure(tmp_path) -> None:
    """The file is rewritten after every row: an OOM in the late dense memory row loses nothing."""
    path = tmp_path / "rows.json"
    report = gb.JsonReport(path, {"device": "cpu"})
    row = gb.Row(workload="navit", dp=2, cap=128, microbatches=2, samples=3, tokens=100, tokens_vanilla=512,
                 speedup_measured=1.1,
                 speedup_predicted=1.2, predicted_by="x", speedup_predicted_flops=1.3, max_over_mean_measured=1.0,
                 vanilla_max_over_mean_measured=1.2, max_over_mean_predicted=1.0, balanced_by="flops",
                 rank_ms_vanilla=[1.0, 2.0], rank_ms_balanced=[1.5, 1.5],
                 max_microbatch_tokens_vanilla=90, max_microbatch_tokens_balanced=64, peak_mem_gb=None)
    report.write([row])
    partial = json.loads(path.read_text())
    assert partial["complete"] is False and [r["workload"] for r in partial["rows"]] == ["navit"]
    report.write([row], memory=[{"attention": "dense", "peak_mem_gb": None}], complete=True)
    assert json.loads(path.read_text())["complete"] is True and not list(tmp_path.glob("*.tmp"))


def test_flops_prediction_matches_the_cost_model_on_the_planned_split() -> None:
    shape = pm.resolve_shape(hidden=None, layers=None, heads=None, vocab=None, seq=128, device="cpu")
    cost = TransformerCost(shape.cost_config())
    ranks, samples, tokens = gb.plan_row("long-short", dp=2, m=2, cap=128, fill=0.9, seed=0, method="kk", cost=cost)
    balanced_docs = [d for rank in ranks["balanced"] for mb in rank for d in mb]
    assert len(balanced_docs) == samples and sum(balanced_docs) == tokens  # the balanced batch, each document once
    assert gb.tokens_of(ranks["vanilla"]) == 2 * 2 * 128  # Megatron's DP x m full windows of the same stream
    vanilla = [sum(float(cost(np.array(mb)).sum()) for mb in rank) for rank in ranks["vanilla"]]
    balanced = [sum(float(cost(np.array(mb)).sum()) for mb in rank) for rank in ranks["balanced"]]
    ratio = tokens / gb.tokens_of(ranks["vanilla"])
    assert gb.speedup(gb.flops_per_rank(ranks["vanilla"], cost), gb.flops_per_rank(ranks["balanced"], cost),
                      ratio) == pytest.approx(max(vanilla) / max(balanced) * ratio)


def test_profile_saves_a_fit_of_the_timed_packs(calibration, capsys) -> None:
    model = load_calibration(calibration)
    assert model.fitted_for["device"] == "cpu" and model.fitted_for["hidden"] == pm.CPU_SMOKE["hidden"]
    assert model.fitted_for["attention"] == "dense"
    assert model.fit["observations"] == len(pm.profile_packs(64))
    assert model.microbatch_seconds([128]) > 0
    packs = pm.profile_packs(128)
    assert {sum(p) for p in packs} == {16, 32, 64, 80, 96, 112, 128} and {len(p) for p in packs} >= {1, 4, 16}


def test_bad_flags_name_the_flag(tmp_path, capsys) -> None:
    assert main(["bench", "gpu-balance", "--dp", "0", "--caps", "8"]) == 2
    assert re.search(r"^error: .*--dp must be >= 1, got 0.*--caps must be >= 16 tokens, got 8", capsys.readouterr().err)
    assert main(["bench", "gpu-balance", "--calibration", str(tmp_path / "nope.json")]) == 2
    assert re.search(r"calibration file .*nope\.json.* does not exist", capsys.readouterr().err)
    with pytest.raises(ConfigError, match="--model-hidden must be >= 1"):
        pm.resolve_shape(hidden=0, layers=None, heads=None, vocab=None, seq=None, device="cpu")
    parser = argparse.ArgumentParser()
    pm.add_model_arguments(parser)
    assert pm.run_model_profile(parser.parse_args(["--model", "--model-attention", "sparse"])) == 2
    assert "attention must be one of" in capsys.readouterr().err
