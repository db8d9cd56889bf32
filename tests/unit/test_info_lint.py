"""`megascale-data info`, `lint` and `heatmap` through the real CLI entry point, on demo data."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from megascale_data_ext.cli import main
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.images import image_patch_count

ROWS = 60


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """What conf/sources/demo_text.yaml and demo_vlm.yaml point at: text-0..2, megatron-text, coyo-0..1."""
    out = tmp_path_factory.mktemp("demo")
    make_demo_data(out, seed=2, rows=ROWS, image_rows=12, text_sources=3, image_sources=2, rows_per_file=25,
                   max_image_patches=256)
    return out


def _parquet_texts(directory: Path) -> list[str]:
    return [t for f in sorted(directory.glob("*.parquet"))
            for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]


def _info(capsys, *argv: str) -> dict:
    assert main(["info", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_counts_equal_an_independent_count(root, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    info = _info(capsys, "sources=demo_text", f"data.data_root={root}", "--steps", "100")
    cap = 1024  # conf/train_gpt.yaml: seq_length 1024, demo_text sources truncate
    assert info["samples_per_step"] == 12 and info["seq_length"] == cap
    expect = {}
    for k in range(3):  # byte-level tokenizer: one token per UTF-8 byte, plus EOD
        expect[f"text-{k}"] = np.array([len(t.encode()) + 1 for t in _parquet_texts(root / f"text-{k}")])
    docs = IndexedDataset(str(root / "megatron-text" / "text_document"))
    expect["megatron-text"] = np.asarray(docs.sequence_lengths, dtype=np.int64) + 1
    by_name = {r["name"]: r for r in info["sources"]}
    assert list(by_name) == ["text-0", "text-1", "text-2", "megatron-text"]
    for name, n in expect.items():
        r = by_name[name]
        assert r["files"] == (3 if name.startswith("text") else 1)  # 60 rows, 25 per file
        assert r["rows"] == len(n) == ROWS
        assert r["uncut_tokens"] == n.sum() and r["uncut_max_tokens"] == n.max()
        assert r["tokens"] == np.minimum(n, cap).sum() and r["max_tokens"] == min(n.max(), cap)
        assert r["mean_tokens"] == pytest.approx(np.minimum(n, cap).mean())
        assert r["over_cap"] == (n > cap).sum() and r["images"] == r["patches"] == 0
        assert r["share"] == pytest.approx(0.25)
        assert r["expected_samples"] == pytest.approx(100 * 12 * 0.25)
        assert r["expected_epochs"] == pytest.approx(100 * 12 * 0.25 / ROWS)
    assert info["total"]["rows"] == 4 * ROWS
    assert info["total"]["tokens"] == sum(np.minimum(n, cap).sum() for n in expect.values())
    assert main(["info", "sources=demo_text", f"data.data_root={root}", "--steps", "100"]) == 0
    table = capsys.readouterr().out
    assert "megatron-text" in table and "samples/100 steps" in table and "5.000" in table


def test_info_counts_images_patches_and_weights(root, capsys):
    info = _info(capsys, "sources=demo_vlm", f"data.data_root={root}", "--steps", "10")
    by_name = {r["name"]: r for r in info["sources"]}
    assert [r["weight"] for r in info["sources"]] == [1.0, 2.0, 1.0]
    assert by_name["coyo-0"]["share"] == pytest.approx(0.5)
    for name in ("coyo-0", "coyo-1"):
        images = [im[0] for f in sorted((root / name).glob("*.parquet"))
                  for im in pq.read_table(f, columns=["image"])["image"].to_pylist()]
        patches = 0
        for data in images:
            w, h = Image.open(io.BytesIO(data)).size
            patches += image_patch_count(w, h, patch_size=16, max_patches=256)
        assert by_name[name]["images"] == len(images) == 12 and by_name[name]["patches"] == patches


def test_info_of_a_plain_yaml_file_with_overrides(tmp_path, capsys):
    texts = ["hello", "a somewhat longer line", "x"]
    (tmp_path / "web.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"data_root: {tmp_path}\nsources:\n  - {{name: web, format: jsonl, paths: [web.jsonl]}}\n")
    info = _info(capsys, str(cfg), "samples_per_step=6", "--steps", "4")
    (r,) = info["sources"]
    assert (r["rows"], r["tokens"], r["max_tokens"]) == (3, sum(len(t) + 1 for t in texts), 23)
    assert r["expected_samples"] == 24 and r["expected_epochs"] == pytest.approx(8.0)


def test_info_reports_config_errors_with_exit_2(tmp_path, capsys):
    assert main(["info", "sources=demo_text", f"data.data_root={tmp_path / 'nowhere'}"]) == 2
    assert "error:" in capsys.readouterr().err


def test_lint_clean_demo_data_exits_0(root, capsys):
    assert main(["lint", "sources=demo_vlm", f"data.data_root={root}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "lint: clean, 3 sources" in out and f"{ROWS + 24:,} rows checked" in out


def _jsonl_config(tmp_path: Path, lines: list[str]) -> tuple[Path, Path]:
    data = tmp_path / "web.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"data_root: {tmp_path}\nsources:\n  - {{name: web, format: jsonl, paths: [web.jsonl]}}\n")
    return data, cfg


def test_lint_finds_a_planted_bad_jsonl_line_with_its_line_number(tmp_path, capsys):
    lines = [json.dumps({"text": f"document {i}"}) for i in range(8)]
    lines.insert(2, "")  # a blank line: not a row, but it counts for line numbers
    lines[6] = '{"text": "cut off'  # line 7 of the file, row 5 of the source
    lines.append(json.dumps({"text": ""}))  # line 10: no tokens
    data, cfg = _jsonl_config(tmp_path, lines)
    report = tmp_path / "lint.json"
    assert main(["lint", str(cfg), "--no-progress", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert f"web: {data}:7: invalid JSON" in out
    assert f"web: {data}:10: no tokens (empty text) besides the EOD" in out
    assert "lint: 2 problem(s) (2 bad rows, 0 file problems) in 1 of 1 sources, 9 rows checked" in out
    (src,) = json.loads(report.read_text())["sources"]
    assert [(f["line"], f["row"]) for f in src["findings"]] == [(7, 5), (10, 8)]
    assert src["rows"] == 9 and src["bad_rows"] == 2


def test_lint_clean_jsonl_exits_0(tmp_path, capsys):
    _, cfg = _jsonl_config(tmp_path, [json.dumps({"text": f"document {i}"}) for i in range(5)])
    assert main(["lint", str(cfg), "--no-progress"]) == 0
    assert "lint: clean, 1 sources, 5 rows checked" in capsys.readouterr().out


def test_lint_names_bad_files_rows_and_stale_cost_columns(tmp_path, capsys):
    from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

    d = tmp_path / "web"
    d.mkdir()
    pq.write_table(pa.table({"text": ["fine", "also fine"]}), d / "a.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), d / "b.parquet")  # wrong type: the file is a problem
    pq.write_table(pa.table({"text": ["abc", "abcdef"], "num_tokens": pa.array([4, 3], pa.int64())}),
                   d / "c.parquet")  # row 1: the cost column promises 3 tokens, the text has 7
    write_indexed_dataset(tmp_path / "mg" / "doc", [[5, 6, 7], [], [8, 9]], vocab_size=259)
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"data_root: {tmp_path}\nsources:\n"
                   "  - {name: web, format: parquet, paths: [web]}\n"
                   "  - {name: mg, format: megatron, paths: [mg/doc]}\n"
                   "  - {name: gone, format: jsonl, paths: [missing.jsonl]}\n")
    assert main(["lint", str(cfg), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"web: {d / 'b.parquet'}: column 'text' is int64, expected a string" in out
    assert f"web: {d / 'c.parquet'} row 1: cost metadata says 3 tokens, the payload has 7" in out
    assert f"mg: {tmp_path / 'mg' / 'doc'} row 1: no tokens (empty text) besides the EOD" in out
    assert "gone: " in out and "missing.jsonl" in out and "not found" in out
    assert "lint: 4 problem(s) (2 bad rows, 2 file problems) in 3 of 3 sources" in out


def test_heatmap_writes_a_png_of_the_real_plans(root, tmp_path, capsys):
    png, data = tmp_path / "img" / "heat.png", tmp_path / "heat.json"
    assert main(["heatmap", "sources=demo_text", f"data.data_root={root}", "data.samples_per_step=16",
                 "--world-size", "2", "--tp", "1", "--pp", "1", "--steps", "3", "--out", str(png), "--json", str(data)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = json.loads(data.read_text())
    assert got["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 2} and got["axis"] == "DP" and got["strategy"] == "llm_balance"
    vanilla, balanced = np.asarray(got["vanilla"]), np.asarray(got["balanced"])
    assert vanilla.shape == balanced.shape == (3, 2)
    np.testing.assert_allclose(vanilla.sum(axis=1), balanced.sum(axis=1))  # the same samples, split two ways
    out = capsys.readouterr().out
    assert out.startswith("step  samples  vanilla max/mean  balanced max/mean")
    assert main(["heatmap", "--world-size", "3", "--tp", "2", "--out", str(png)]) == 2


def test_every_command_spells_the_layout_the_same_way(root, tmp_path, capsys):
    """--world-size with --tp/--pp/--cp, sizes defaulting to the config's `parallel` node, in plan,
    heatmap and serve; a layout that does not divide is one error naming the keys."""
    base = ["sources=demo_text", f"data.data_root={root}"]
    for argv in (["plan", *base, "--steps", "1", "--out", str(tmp_path / "p"), "--world-size", "6"],
                 ["heatmap", *base, "--world-size", "6", "--out", str(tmp_path / "h.png")],
                 ["serve", *base, "--world-size", "6"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "world size 6 is not divisible by tp*pp*cp = 2*2*1 = 4" in err, (argv[0], err)  # train_gpt's parallel
    assert main(["heatmap", *base, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                 "--steps", "1", "--out", str(tmp_path / "h.png"), "--json", str(tmp_path / "h.json")]) == 0
    assert json.loads((tmp_path / "h.json").read_text())["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 4}


def test_info_and_lint_take_dataset_paths_without_a_training_config(root, capsys):
    """A Parquet directory and a Megatron prefix (given by its .idx) become one source each."""
    prefix = next((root / "megatron-text").glob("*.idx"))
    assert main(["info", str(root / "text-0"), str(prefix), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = {s["name"]: s for s in got["sources"]}
    assert set(rows) == {"text-0", prefix.stem} and rows["text-0"]["format"] == "parquet"
    assert rows[prefix.stem]["format"] == "megatron" and rows["text-0"]["rows"] == ROWS
    assert main(["lint", str(root / "coyo-0"), "--no-progress"]) == 0
    assert "coyo-0" in capsys.readouterr().out
    assert main(["info", str(root / "no-such-dir")]) == 2  # not a dataset: an override Hydra refuses, named
