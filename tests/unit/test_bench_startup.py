"""`megascale-data bench startup` at a tiny size: the rows' keys and positive seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.commands.bench_startup import ROW_KEYS, write_prefixes

TINY = ["--prefixes", "2", "--docs", "40", "--dp", "2", "--seq-length", "512"]


def _rows(out: Path) -> list[dict]:
    rows = json.loads(out.read_text())["rows"]
    assert [r["prefixes"] for r in rows] == [2] and rows[0]["documents"] == 80
    assert all(tuple(r) == ROW_KEYS for r in rows)
    return rows


def test_bench_startup_without_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", *TINY, "--skip-ray", "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    (row,) = _rows(out)
    assert all(row[k] > 0 for k in ("megatron_cold_s", "megatron_warm_s", "service_inproc_s"))
    assert row["service_ray_cold_s"] is None and row["ray_init_s"] is None
    assert "in-proc/mcold" in capsys.readouterr().out
    # the prefixes are reused by a later run with the same size and seed
    again = write_prefixes(tmp_path / "w" / "data-2", prefixes=2, docs=40, seq_length=512, seed=1234)
    assert all(Path(p + ".idx").stat().st_size > 0 for p in again)


def test_bench_startup_bad_arguments_are_named(capsys) -> None:
    assert main(["bench", "startup", "--prefixes", "0", "--docs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(r"`--docs` must be a positive integer, got 0(.|\n)*`--prefixes`", err)


@pytest.mark.slow
def test_bench_startup_every_column_is_positive(tmp_path: Path) -> None:
    out, png = tmp_path / "startup.json", tmp_path / "img" / "startup.png"
    assert main(["bench", "startup", *TINY, "--workdir", str(tmp_path / "w"), "--json", str(out),
                 "--plot", str(png)]) == 0
    (row,) = _rows(out)
    assert all(row[k] > 0 for k in ROW_KEYS)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
