"""`megascale-data bench memory` through the CLI at the smallest grid: real rank processes, real actors."""

from __future__ import annotations

import json

import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.commands.bench_memory import colocated_mib, colocated_model, fit_line
from megascale_data_ext.commands.profile import process_memory


def test_extrapolation_is_the_fitted_per_source_cost() -> None:
    assert fit_line([8, 32], [100.0, 160.0]) == pytest.approx((80.0, 2.5))
    points = {8: {"loader_pss": 20.0}, 32: {"loader_pss": 44.0}}
    model = colocated_model(points, workers=2)
    assert model["per_source_per_rank_mib"] == pytest.approx(1.0)
    assert colocated_mib(model, 16, 32) == pytest.approx(16 * 44.0)
    assert colocated_mib(model, 16, 128) == pytest.approx(16 * 140.0)
    assert fit_line([8], [30.0]) == (30.0, 0.0)  # one point: flat in sources, never extrapolated upwards
    mem = process_memory()
    assert 0 < mem["uss"] <= mem["pss"] <= mem["rss"]


def test_a_rank_that_dies_is_an_error_not_a_hang() -> None:
    """A measured baseline rank that dies before it reports (here: its target raises at once) ends the
    measurement with one named error; before, the parent held the rank's end of the pipe too and waited forever."""
    import operator

    from megascale_data_ext.commands._colocated_memory import measure_ranks

    with pytest.raises(RuntimeError, match=r"rank process \(truediv\) died before it was measured"):
        measure_ranks(operator.truediv, (), ranks=1)  # truediv(conn, rank): TypeError in the rank


@pytest.mark.slow
def test_tiny_grid_reports_every_field(tmp_path, capsys) -> None:
    out = tmp_path / "mem.json"
    argv = ["bench", "memory", "--workload", "text", "--ranks", "2", "--sources", "2", "--measure-sources", "2",
            "--measure-ranks", "1", "--workers", "1", "--docs", "20", "--train-samples", "64", "--steps", "1",
            "--ranks-per-node", "0", "--json", str(out), "--plot", str(tmp_path / "mem.png")]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    for key in ("ranks", "sources", "colocated_mib", "service_mib", "ratio", "constructors_mib", "shadow_mib",
                "loader_actors", "colocated", "service"):
        assert key in row
    assert row["colocated_mib"] > 0 and row["service_mib"] > 0 and row["shadow_mib"] > 0
    assert row["ratio"] == pytest.approx(row["colocated_mib"] / row["service_mib"], abs=0.01)
    assert row["colocated"].startswith("measured") and row["service"] == "measured"
    assert row["workload"] == "text"
    assert row["constructors_mib"] == 0 and row["constructors"].startswith("not measured")
    assert (tmp_path / "mem.png").stat().st_size > 0
    assert "baseline MiB" in capsys.readouterr().out
    assert row["baseline"] == "megatron"
    for key in ("ray_daemons_mib", "object_store_mib", "trainer_core_workers_mib", "service_all_in_mib"):
        assert row[key] >= 0
    assert row["ray_daemons_mib"] > 0 and row["trainer_core_workers_mib"] > 0  # GCS, raylet...; a rank's core worker
    assert row["service_all_in_mib"] > row["service_mib"]


def _navit_argv(out, *, ranks: int, extra: list[str]) -> list[str]:
    """`bench memory` on the navit workload at the smallest size (2 sources of 2 small row groups)."""
    return ["bench", "memory", "--workload", "navit", "--ranks", str(ranks), "--sources", "2", "--measure-sources",
            "2", "--measure-ranks", "1", "--workers", "1", "--row-group-mib", "0.25", "--row-groups", "2",
            "--train-samples", "64", "--steps", "1", "--max-fill-steps", "2", "--ranks-per-node", "0",
            *extra, "--json", str(out), "--plot", ""]


@pytest.mark.slow
def test_navit_smoke_reports_every_field(tmp_path) -> None:
    """navit workload at the smallest size: Parquet sources, real rank process and worker, real actors."""
    out = tmp_path / "mem.json"
    argv = _navit_argv(out, ranks=1, extra=["--baselines", "own_reader"])
    assert main(argv) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["baseline"] == "own_reader"
    for key in ("workload", "ranks", "sources", "colocated_mib", "service_mib", "ratio", "shadow_mib",
                "loader_actors", "colocated", "service", "service_steps", "service_row_groups_held"):
        assert key in row
    assert row["workload"] == "navit" and (row["ranks"], row["sources"]) == (1, 2)
    assert row["colocated_mib"] > 0 and row["service_mib"] > 0
    assert row["colocated"].startswith("measured") and row["service"] == "measured"
    navit = res["workloads"]["navit"]
    assert navit["row_group_cache"] >= 1 and navit["row_group_mib_decoded"] > 0
    (info,) = navit["colocated_points"]["2"]["ranks_info"]
    assert info["row_groups_held"] > 0  # the worker read row groups of the sources


def test_energon_shards_hold_the_parquet_rows(tmp_path) -> None:
    """The Energon baseline reads the service's navit rows: one tar per row group, a .jpg and a .txt
    per row, in order, bytes unchanged (no Energon needed to write them)."""
    import tarfile

    import pyarrow.parquet as pq

    from megascale_data_ext.commands._colocated_memory import write_navit_sources
    from megascale_data_ext.commands._energon_baseline import write_shards
    from megascale_data_ext.sources.profiling import source_files

    (spec,), _ = write_navit_sources(tmp_path / "data", sources=1, row_group_mib=0.25, row_groups=3, seed=3)
    rows = write_shards(spec, tmp_path / "wds")
    (path,) = source_files(spec)
    table = pq.read_table(path, columns=[spec.text_column, spec.image_column])
    assert rows == table.num_rows
    tars = sorted((tmp_path / "wds").glob("*.tar"))
    assert len(tars) == pq.ParquetFile(path).num_row_groups == 3
    members = {}
    for t in tars:
        with tarfile.open(t) as tar:
            members.update({m.name: tar.extractfile(m).read() for m in tar.getmembers()})
    assert len(members) == 2 * rows
    for i, (text, images) in enumerate(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True)):
        assert members[f"{i:09d}.txt"].decode() == text and members[f"{i:09d}.jpg"] == images[0]


def test_energon_baseline_without_energon_is_one_line(monkeypatch, capsys) -> None:
    import megascale_data_ext.commands._energon_baseline as energon

    monkeypatch.setattr(energon, "missing", lambda: "the Energon baseline needs megatron-energon: pip install ...")
    assert main(["bench", "memory", "--workload", "navit", "--json", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the Energon baseline needs megatron-energon: pip install ..."]
    assert main(["bench", "memory", "--workload", "navit", "--baselines", "own_reader,vendor"]) == 2
    assert "unknown ['vendor']" in capsys.readouterr().err


@pytest.mark.slow
def test_navit_against_energon_when_installed(tmp_path) -> None:
    """With megatron-energon installed, the navit grid also has an Energon row, measured."""
    from megascale_data_ext.commands._energon_baseline import missing

    if missing() is not None:
        pytest.skip(missing())
    out = tmp_path / "mem.json"
    argv = _navit_argv(out, ranks=2, extra=["--energon-batches", "50"])
    assert main(argv) == 0
    rows = {r["baseline"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"own_reader", "energon"}
    assert rows["energon"]["colocated_mib"] > 0 and rows["energon"]["colocated"].startswith("measured")
    assert rows["energon"]["service_mib"] == rows["own_reader"]["service_mib"]
