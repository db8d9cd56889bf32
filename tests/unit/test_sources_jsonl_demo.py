"""JSONL sources and the deterministic demo corpora."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

import numpy as np
import pyarrow.parquet as pq
import pytest

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources import ByteTokenizer, JsonlSource, SourceSpec, make_demo_data, open_source
from megascale_data_ext.sources.images import header_patch_count, synthetic_jpeg


def _write_jsonl(tmp_path, lines) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    return str(path)


def _mixed_lines(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(synthetic_jpeg(64, 200, seed=1))
    (tmp_path / "imgs" / "b.jpg").write_bytes(synthetic_jpeg(300, 40, seed=2))
    return _write_jsonl(tmp_path, [
        {"text": "plain text"},
        {"text": "one image", "image": "imgs/a.jpg"},
        "{broken json",
        {"text": "two images", "image": ["imgs/a.jpg", "imgs/b.jpg"]},
        {"text": 17},
        {"text": "missing image", "image": "imgs/zzz.jpg"},
        "",
        {"caption": "no text field"},
    ])


def test_jsonl_bad_rows_refused_at_open_each_named_once(tmp_path):
    path = _mixed_lines(tmp_path)
    spec = SourceSpec(name="j", format="jsonl", paths=[path], image_column="image", max_bad_fraction=0.5)
    with pytest.raises(SourceError) as err:
        open_source(spec)
    msg = str(err.value)
    assert msg.startswith("source 'j': 4 of 7 rows are bad, found when opening it (`data.sources.j.max_bad_fraction=0.5` "
                          "allows 3): ")
    assert f"{path} line 3: invalid JSON (" in msg
    assert f"{path} line 5: field 'text' (`text_column`) is a int, expected a string" in msg
    assert f"{path} line 6: image file '{tmp_path}/imgs/zzz.jpg' not found" in msg
    assert f"{path} line 8: field 'text' (`text_column`) is missing, expected a string" in msg
    assert "Fix or delete those lines, leave them out of the source with `data.sources.j.on_bad_rows=skip`, or " \
           "skip them when read with `data.sources.j.max_bad_fraction=0.572`" in msg
    assert [msg.count(f"line {n}:") for n in (3, 5, 6, 8)] == [1, 1, 1, 1]  # counted once each


def test_jsonl_skip_leaves_bad_rows_out_and_reports_them_once(tmp_path, caplog):
    path = _mixed_lines(tmp_path)
    spec = SourceSpec(name="j", format="jsonl", paths=[path], image_column="image", on_bad_rows="skip")
    with caplog.at_level(logging.WARNING, logger="megascale_data_ext.sources.jsonl"):
        src = open_source(spec)
    assert isinstance(src, JsonlSource) and len(src) == 3
    assert [(b.line, b.reason.split(" (")[0]) for b in src.bad_rows] == [
        (3, "invalid JSON"), (5, "field 'text'"), (6, f"image file '{tmp_path}/imgs/zzz.jpg' not found"),
        (8, "field 'text'")]
    (record,) = [r for r in caplog.records if "bad row" in r.getMessage()]
    assert "left out (`data.sources.j.on_bad_rows=skip`) 4 bad row(s)" in record.getMessage()
    meta = src.metadata()
    a, b = (header_patch_count((tmp_path / "imgs" / n).read_bytes()) for n in ("a.jpg", "b.jpg"))
    assert meta["num_images"].tolist() == [0, 1, 2]
    assert meta["image_patch_counts"].tolist() == [a, a, b]
    report = src.read_report(np.arange(3))
    assert [s.index for s in report.samples] == [0, 1, 2] and report.skipped == [] and src.bad_samples == []
    for s in report.samples:
        assert len(s.tokens) == meta["text_tokens"][s.index]
        assert [im.shape[0] for im in s.images] == meta["image_patch_counts"][
            meta["image_offsets"][s.index] : meta["image_offsets"][s.index + 1]
        ].tolist()
    assert ByteTokenizer().decode(report.samples[2].tokens[:-1]) == "two images"
    assert src.where(2) == f"{path} line 4"


def test_jsonl_bad_rows_within_max_bad_fraction_are_skipped_when_read(tmp_path):
    path = _mixed_lines(tmp_path)
    spec = SourceSpec(name="j", format="jsonl", paths=[path], image_column="image", max_bad_fraction=0.6)
    src = open_source(spec)  # 4 of 7 bad <= 0.6: they stay samples, as other bad samples do
    assert len(src) == 7 and len(src.bad_rows) == 4
    assert src.metadata()["text_tokens"].tolist() == [11, 10, 1, 11, 1, 14, 1]  # a bad row costs only its EOD
    report = src.read_report(np.arange(7))
    assert [s.index for s in report.samples] == [0, 1, 3]
    assert [(s.index, s.row) for s in report.skipped] == [(2, 2), (4, 4), (5, 5), (6, 6)]  # row: non-blank lines
    assert "field 'text' (`text_column`) is a int" in report.skipped[1].reason
    assert src.samples_read == 7 and len(src.bad_samples) == 4  # each counted once for one read


def test_jsonl_all_rows_bad_or_blank_is_an_empty_source(tmp_path):
    spec = SourceSpec(name="j", format="jsonl", paths=[_write_jsonl(tmp_path, ["[1, 2]", "nope"])], on_bad_rows="skip")
    with pytest.raises(SourceError) as err:
        open_source(spec)
    msg = str(err.value)
    assert "source 'j' is empty: no usable lines in" in msg and "(all 2 rows are bad: " in msg
    assert "line 1: the line is a JSON list, expected an object" in msg
    assert "point `data.sources.j.paths` at data, or remove the source from `data.sources`" in msg


def test_jsonl_over_long_sample_refused_when_planning_starts(tmp_path):
    """The loader reads metadata when it starts: an over-long row fails there, naming keys and line."""
    from megascale_data_ext.runtime.loader import SourceLoader

    path = _write_jsonl(tmp_path, [{"text": "short"}, {"text": "x" * 40}, {"text": "y" * 30}])
    spec = SourceSpec(name="web", format="jsonl", paths=[path], max_tokens=16)
    with pytest.raises(SourceError) as err:
        SourceLoader(0, spec, seed=0)
    msg = str(err.value)
    assert "source 'web': 2 of 3 samples are longer than the 16-token limit (`data.sources.web.max_tokens`, which " \
           "defaults to `data.seq_length`)" in msg
    assert f"the longest has 41 tokens (sample 1, {path} line 2)" in msg
    assert "`data.sources.web.truncate=true`" in msg  # pasteable overrides (tests/unit/test_hints.py pastes them)
    assert "`data.seq_length=128 data.sources.web.max_tokens=128`" in msg
    assert "`data.sources.web.max_bad_fraction=0.667`" in msg
    cut = open_source(dataclasses.replace(spec, truncate=True))
    assert cut.metadata()["text_tokens"].tolist() == [6, 16, 16]
    assert [len(s.tokens) for s in cut.read([0, 1, 2])] == [6, 16, 16]


def _digest(root) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_demo_data_deterministic_and_shaped(tmp_path):
    kw = dict(seed=3, text_sources=2, image_sources=1, rows=300, rows_per_file=120, megatron_source=False)
    specs = make_demo_data(tmp_path / "a", **kw)
    make_demo_data(tmp_path / "b", **kw)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert make_demo_data(tmp_path / "c", **{**kw, "seed": 4}) and _digest(tmp_path / "c") != _digest(tmp_path / "a")
    assert [s.name for s in specs] == ["text-0", "text-1", "coyo-0"]
    text = open_source(specs[0])
    assert text.num_files == 3 and len(text) == 300
    lengths = text.metadata()["text_tokens"]
    assert lengths.max() > 10 * np.median(lengths)  # long-short mixture
    coyo = open_source(specs[2])
    meta = coyo.metadata()
    assert set(coyo.columns_read("metadata")) == {"num_tokens", "image_patches"}
    assert (meta["num_images"] == 1).all() and len(np.unique(meta["image_patch_counts"])) > 20
    assert pq.ParquetFile(coyo.paths[0]).schema_arrow.field("image").type.value_type.equals("binary")
    idx = np.arange(0, len(coyo), 9)
    samples = coyo.read(idx)
    assert [len(s.tokens) for s in samples] == meta["text_tokens"][idx].tolist()
    assert [s.images[0].shape[0] for s in samples] == meta["image_patch_counts"][idx].tolist()


def test_demo_caption_skew_like_coyo(tmp_path):
    from megascale_data_ext.sources.demo_data import caption_lengths

    n = caption_lengths(np.random.default_rng(0), 200_000) + 1  # + EOD
    long = n > 64
    assert 0.97 < (~long).mean() < 0.99  # paper: 98.23% <= 64 tokens
    assert 0.06 < n[long].sum() / n.sum() < 0.13  # paper: the long ones carry 9.3% of tokens


def test_demo_with_megatron_source(tmp_path):
    specs = make_demo_data(tmp_path, text_sources=1, image_sources=1, rows=200)
    assert specs[-1].name == "megatron-text" and specs[-1].format == "megatron"
    src = open_source(specs[-1])
    assert len(src) == 200
    samples = src.read([0, 199])
    assert [len(s.tokens) for s in samples] == src.metadata(np.array([0, 199]))["text_tokens"].tolist()
