"""JSONL sources and the deterministic demo corpora."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq

from megascale_data_ext.sources import ByteTokenizer, JsonlSource, SourceSpec, make_demo_data, open_source
from megascale_data_ext.sources.images import header_patch_count, synthetic_jpeg


def test_jsonl_text_and_images(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(synthetic_jpeg(64, 200, seed=1))
    (tmp_path / "imgs" / "b.jpg").write_bytes(synthetic_jpeg(300, 40, seed=2))
    lines = [
        {"text": "plain text"},
        {"text": "one image", "image": "imgs/a.jpg"},
        "{broken json",
        {"text": "two images", "image": ["imgs/a.jpg", "imgs/b.jpg"]},
        {"text": "missing image", "image": "imgs/zzz.jpg"},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    spec = SourceSpec(
        name="j", format="jsonl", paths=[str(tmp_path / "d.jsonl")], image_column="image", max_bad_fraction=0.5
    )
    src = open_source(spec)
    assert isinstance(src, JsonlSource) and len(src) == 5
    meta = src.metadata()
    a, b = (header_patch_count((tmp_path / "imgs" / n).read_bytes()) for n in ("a.jpg", "b.jpg"))
    assert meta["num_images"].tolist() == [0, 1, 0, 2, 1]
    assert meta["image_patch_counts"].tolist() == [a, a, b, 0]
    report = src.read_report(np.arange(5))
    assert [s.index for s in report.samples] == [0, 1, 3]
    assert [(s.index, s.row) for s in report.skipped] == [(2, 2), (4, 4)]
    assert "invalid JSON" in report.skipped[0].reason and "zzz.jpg" in report.skipped[1].reason
    for s in report.samples:
        assert len(s.tokens) == meta["text_tokens"][s.index]
        assert [im.shape[0] for im in s.images] == meta["image_patch_counts"][
            meta["image_offsets"][s.index] : meta["image_offsets"][s.index + 1]
        ].tolist()
    assert ByteTokenizer().decode(report.samples[2].tokens[:-1]) == "two images"


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
