"""Smoke runs of `bench balance` and `bench planner` through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megascale_data_ext.cli import main


def test_bench_balance_quick_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "balance.json", tmp_path / "img" / "fig3.png"
    assert main(["bench", "balance", "--quick", "--json", str(out), "--plot", str(png),
                 "--plot-row", "navit:8:4096"]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["workload"] for r in rows] == ["coyo", "navit", "long-short"]
    for r in rows:
        assert r["dp"] == 8 and r["context"] == 4096 and r["samples"] > 0
        vanilla, greedy, kk = (r["variants"][k] for k in ("vanilla", "greedy", "kk"))
        assert vanilla["speedup"] == pytest.approx(1.0)
        for v in (greedy, kk):  # capped at the context, never worse than vanilla, near the lower bound
            assert v["max_bin_tokens"] <= 4096
            assert v["speedup"] >= 1.0 and v["max_over_lb"] <= 1.05
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| coyo | 8 | 4k |" in capsys.readouterr().out


def test_bench_planner_quick_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planner.json"
    assert main(["bench", "planner", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["world"] == 288 and row["dp"] == 9 and row["samples"] == 288 * 72
    # the comparison printed is the paper's figure over this run's median, row by row
    assert row["balance_speedup"] == pytest.approx(row["paper_balance_s"] / row["balance_median_s"])
    assert row["cost_speedup"] == pytest.approx(row["paper_cost_s"] / row["cost_median_s"])
    assert row["balance_min_s"] <= row["balance_median_s"]
    assert row["backbone_max_over_mean"] < 1.01 and row["encoder_max_over_mean"] < 1.05
    assert "288 GPUs (baseline)" in capsys.readouterr().out
