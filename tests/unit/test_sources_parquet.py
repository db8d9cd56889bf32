"""ParquetSource on real Parquet files: indexing across files/row groups, cost columns, reads."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascale_data_ext.sources import (
    ByteTokenizer,
    ParquetSource,
    PreparedParquetWriter,
    SourceSpec,
    decode_images,
    open_source,
)
from megascale_data_ext.sources.images import decode_patches, header_patch_count, synthetic_jpeg
from megascale_data_ext.sources.parquet import KV_TOKENIZER

TOK = ByteTokenizer()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        "".join(chr(97 + c) for c in rng.integers(0, 26, int(k))) + f" #{i} é"
        for i, k in enumerate(rng.integers(0, 40, n))
    ]


def _write_text_files(tmp_path, sizes=(7, 0, 13, 5), rg=4) -> list[str]:
    texts = _texts(sum(sizes))
    paths, start = [], 0
    for f, n in enumerate(sizes):
        path = tmp_path / f"shard-{f}.parquet"
        pq.write_table(pa.table({"text": texts[start : start + n], "other": list(range(n))}), path, row_group_size=rg)
        paths.append(str(path))
        start += n
    return texts


def _meta_vs_read(src, idx):
    meta = src.metadata(idx)
    samples = src.read(idx)
    assert [s.index for s in samples] == list(idx)
    assert [len(s.tokens) for s in samples] == meta["text_tokens"].tolist()
    assert [len(s.images) for s in samples] == meta["num_images"].tolist()
    got = [im.shape[0] for s in samples for im in s.images]
    assert got == meta["image_patch_counts"].tolist()
    return samples


def test_many_files_row_groups_global_index(tmp_path):
    # One empty file in the middle: global indices must skip it without a gap.
    texts = _write_text_files(tmp_path)
    spec = SourceSpec(name="t", format="parquet", paths=[str(tmp_path / "shard-*.parquet")])
    src = open_source(spec)
    assert isinstance(src, ParquetSource)
    assert (
        len(src) == 25 and src.num_files == 4 and src.num_row_groups == 2 + 1 + 4 + 2
    )  # the empty file has one 0-row group
    idx = np.array([24, 0, 7, 6, 19, 3, 7, 12])  # unordered, spans files and row groups, a duplicate
    samples = _meta_vs_read(src, idx)
    for s in samples:
        np.testing.assert_array_equal(s.tokens, np.append(TOK.encode(texts[s.index]), TOK.eod_id))
        assert s.tokens.dtype == np.int64 and s.tokens[-1] == TOK.eod_id
    full = src.metadata()
    np.testing.assert_array_equal(full["text_tokens"], [len(t.encode()) + 1 for t in texts])
    assert full["image_offsets"].tolist() == [0] * 26
    src.close()


def test_row_group_reads_are_grouped_and_cached(tmp_path):
    _write_text_files(tmp_path, sizes=(16,), rg=4)
    spec = SourceSpec(name="t", format="parquet", paths=[str(tmp_path)], row_group_cache=2)
    with ParquetSource(spec) as src:
        src.read([0, 9, 1, 10, 2])  # row groups 0 and 2, interleaved: each read once
        assert {(p, c): n for (p, _, c), n in src.io_counts.items() if p == "read"} == {("read", ("text",)): 2}
        src.read([3, 8])  # both cached
        assert src.columns_read("read")["text"] == 2
        src.read([12, 4])  # two new groups; LRU keeps 2
        assert src.columns_read("read")["text"] == 4
        assert src.cache_stats()["row_groups"] == 2
        assert "other" not in src.columns_read("read")  # payload columns only


def _image_text_file(tmp_path, n=12, *, multi=False, name="img") -> tuple[str, list[list[bytes]]]:
    rng = np.random.default_rng(1)
    images = []
    for i in range(n):
        k = 1 + int(i % 3 == 0) if multi else 1
        images.append(
            [synthetic_jpeg(int(rng.integers(20, 300)), int(rng.integers(20, 300)), seed=i * 7 + j) for j in range(k)]
        )
    with PreparedParquetWriter(tmp_path / name, kind="image-text", tokenizer=TOK, row_group_rows=5) as w:
        for i, ims in enumerate(images):
            w.add(f"caption {i} " + "x" * (i * 3), ims)
    return str(tmp_path / name), images


def test_metadata_reads_only_cost_columns(tmp_path, monkeypatch):
    path, images = _image_text_file(tmp_path, multi=True)
    calls: list[tuple[str, tuple]] = []
    for meth in ("read", "read_row_group", "read_row_groups", "iter_batches"):
        orig = getattr(pq.ParquetFile, meth)

        def spy(self, *a, _orig=orig, _m=meth, **kw):
            calls.append((_m, tuple(kw.get("columns") or ())))
            return _orig(self, *a, **kw)

        monkeypatch.setattr(pq.ParquetFile, meth, spy)
    spec = SourceSpec(name="coyo", format="parquet", paths=[path], image_column="image")
    src = ParquetSource(spec)
    meta = src.metadata()
    assert calls and all(set(cols) <= {"num_tokens", "image_patches"} for _, cols in calls), calls
    assert set(src.columns_read("metadata")) == {"num_tokens", "image_patches"}
    expected = [header_patch_count(b) for ims in images for b in ims]
    assert meta["image_patch_counts"].tolist() == expected
    assert meta["num_images"].tolist() == [len(x) for x in images]
    calls.clear()
    _meta_vs_read(src, np.arange(len(src))[::-1])
    assert {c for _, cols in calls for c in cols} == {"text", "image"}


def test_precomputed_costs_trusted_only_for_same_tokenizer(tmp_path):
    # Cost column deliberately "wrong" (999): used as-is when the fingerprint matches, proving
    # metadata() never tokenized; recomputed from the text when it was made by another tokenizer.
    texts = ["a", "bb", "ccc"]
    for name, fp in (("same", TOK.fingerprint()), ("other", "hf-0123456789abcdef")):
        schema = pa.schema([("text", pa.string()), ("num_tokens", pa.int32())], metadata={KV_TOKENIZER: fp})
        pq.write_table(pa.table({"text": texts, "num_tokens": [999] * 3}, schema=schema), tmp_path / f"{name}.parquet")
    same = ParquetSource(SourceSpec(name="s", format="parquet", paths=[str(tmp_path / "same.parquet")]))
    assert same.metadata()["text_tokens"].tolist() == [999] * 3
    other = ParquetSource(SourceSpec(name="o", format="parquet", paths=[str(tmp_path / "other.parquet")]))
    assert other.metadata()["text_tokens"].tolist() == [2, 3, 4]
    assert set(other.columns_read("metadata")) == {"text"}


@pytest.mark.parametrize("layout", ["binary", "struct", "list"])
def test_image_column_layouts_without_cost_columns(tmp_path, layout):
    ims = [synthetic_jpeg(40 + 30 * i, 90 - 10 * i, seed=i) for i in range(5)]
    if layout == "binary":
        col = pa.array(ims, pa.binary())
    elif layout == "struct":
        col = pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(ims)])
    else:
        col = pa.array([[b, b] for b in ims], pa.list_(pa.binary()))
    pq.write_table(pa.table({"caption": [f"c{i}" for i in range(5)], "jpg": col}), tmp_path / "x.parquet")
    spec = SourceSpec(
        name="x",
        format="parquet",
        paths=[str(tmp_path / "x.parquet")],
        text_column="caption",
        image_column="jpg",
        patch_size=14,
        max_image_patches=20,
    )
    src = ParquetSource(spec)
    samples = _meta_vs_read(src, np.arange(5))
    assert src.metadata()["image_patch_counts"].max() <= 20
    for s in samples:
        assert s.images[0].shape[1] == 14 * 14 * 3 and s.images[0].dtype == np.float32
        ref, grid = decode_patches(ims[s.index], patch_size=14, max_patches=20)
        np.testing.assert_array_equal(s.images[0], ref)
        assert s.extra["image_grids"][0] == grid


def test_deferred_decoding_matches_metadata(tmp_path):
    path, images = _image_text_file(tmp_path)
    spec = SourceSpec(name="c", format="parquet", paths=[path], image_column="image", decode_images="constructor")
    src = ParquetSource(spec)
    idx = np.array([3, 1, 10])
    samples = src.read(idx)
    assert all(s.images == [] and s.image_bytes == images[s.index] for s in samples)
    meta = src.metadata(idx)
    decoded = [decode_images(s, patch_size=spec.patch_size, max_patches=spec.max_image_patches) for s in samples]
    assert [s.images[0].shape[0] for s in decoded] == meta["image_patch_counts"].tolist()
    assert all(s.image_bytes is None for s in decoded)


def test_worker_threads_give_identical_samples(tmp_path):
    path, _ = _image_text_file(tmp_path)
    idx = np.array([5, 0, 11, 2, 7])
    outs = []
    for workers in (0, 3):
        with ParquetSource(
            SourceSpec(name="c", format="parquet", paths=[path], image_column="image", num_workers=workers)
        ) as src:
            outs.append(src.read(idx))
    for a, b in zip(*outs, strict=True):
        assert a.index == b.index
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.images[0], b.images[0])


def test_truncation_caps_metadata_and_tokens(tmp_path):
    texts = ["x" * 3, "y" * 30, "z" * 9]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet")
    spec = SourceSpec(name="t", format="parquet", paths=[str(tmp_path)], max_tokens=10, truncate=True)
    src = ParquetSource(spec)
    assert src.metadata()["text_tokens"].tolist() == [4, 10, 10]
    samples = _meta_vs_read(src, np.arange(3))
    np.testing.assert_array_equal(samples[1].tokens, np.append(TOK.encode("y" * 9), TOK.eod_id))


def test_pretokenized_column(tmp_path):
    ids = [[5, 6, 7], [], [9] * 4]
    pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    for append, extra in ((True, 1), (False, 0)):
        spec = SourceSpec(
            name="t", format="parquet", paths=[str(tmp_path)], tokens_column="ids", append_eod=append, eod_token_id=2
        )
        src = ParquetSource(spec)
        assert src.metadata()["text_tokens"].tolist() == [len(x) + extra for x in ids]
        samples = _meta_vs_read(src, np.arange(3))
        assert samples[0].tokens.tolist() == [5, 6, 7] + [2] * extra


def test_hf_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "big": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["hello world", "big big big world foo", ""]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet")
    spec = SourceSpec(
        name="hf", format="parquet", paths=[str(tmp_path / "t.parquet")], tokenizer=str(tmp_path / "tokenizer.json")
    )
    src = ParquetSource(spec)
    assert (src.tokenizer.eod_id, src.tokenizer.pad_id, src.tokenizer.vocab_size) == (1, 2, 6)
    samples = _meta_vs_read(src, np.arange(3))
    assert [s.tokens.tolist() for s in samples] == [[3, 4, 1], [5, 5, 5, 4, 0, 1], [1]]
    assert src.tokenizer.fingerprint().startswith("hf-")


def test_bytes_payload_never_materialized_for_metadata(tmp_path):
    # A 4 MB payload column next to the cost column: metadata must not decode it.
    n = 64
    blob = io.BytesIO(b"\0" * 65536).getvalue()
    schema = pa.schema(
        [("text", pa.string()), ("num_tokens", pa.int32()), ("blob", pa.binary())],
        metadata={KV_TOKENIZER: TOK.fingerprint()},
    )
    pq.write_table(
        pa.table({"text": ["a"] * n, "num_tokens": [2] * n, "blob": [blob] * n}, schema=schema), tmp_path / "b.parquet"
    )
    src = ParquetSource(SourceSpec(name="b", format="parquet", paths=[str(tmp_path / "b.parquet")]))
    assert src.metadata()["text_tokens"].sum() == 2 * n
    assert set(src.columns_read("metadata")) == {"num_tokens"}
    src.read([0, 1])
    assert src.cache_stats()["bytes"] < 65536  # "blob" is not a payload column of this spec


def test_a_window_shuffle_streams_each_row_group_once_and_holds_only_windows(tmp_path):
    """With ``shuffle_window`` the reader decodes W rows at a time: draws in epoch order stream each
    row group once, the cache holds `row_group_cache` windows (not row groups), every row reads as
    it does from whole row groups, and a read behind the stream starts the row group again."""
    from megascale_data_ext.dataplane.epoch_order import epoch_permutation

    texts = _write_text_files(tmp_path, sizes=(40, 24), rg=16)  # row groups of 16, 16, 8, 16, 8 rows
    whole = ParquetSource(SourceSpec(name="t", format="parquet", paths=[str(tmp_path)]))
    spec = SourceSpec(name="t", format="parquet", paths=[str(tmp_path)], shuffle_window=4, row_group_cache=2)
    with ParquetSource(spec) as src:
        perm = epoch_permutation(len(src), seed=1, source_id=0, epoch=0, window=4, blocks=src.blocks())
        got = []
        for step in range(0, len(perm), 3):  # a few draws a step, as a loader serves them
            got += src.read(perm[step:step + 3])
            assert src.cache_stats()["row_groups"] <= 2
        assert [s.index for s in got] == perm.tolist()
        assert [TOK.decode(s.tokens[:-1].tolist()) for s in got] == [texts[i] for i in perm]
        assert sum(n for (p, _, _), n in src.io_counts.items() if p == "read") == src.num_row_groups
        window_bytes = src.cache_stats()["bytes"]
        first = perm[:4]  # the first window drawn: evicted long ago, behind its row group's stream
        again = src.read(first)
        assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in whole.read(first)]
        assert sum(n for (p, _, _), n in src.io_counts.items() if p == "read") == src.num_row_groups + 1
    whole.read(np.arange(16))
    assert window_bytes < whole.cache_stats()["bytes"] / 2
    whole.close()


def test_a_unit_whose_rows_were_all_read_leaves_the_cache(tmp_path):
    """An epoch draws each row once: a window (row group) every row of which was read is dropped
    at once, not kept until the LRU pushes it out; a later read of it reads the file again."""
    texts = _write_text_files(tmp_path, sizes=(40,), rg=16)
    for window in (4, 0):
        spec = SourceSpec(name="t", format="parquet", paths=[str(tmp_path)], shuffle_window=window,
                          row_group_cache=4)
        with ParquetSource(spec) as src:
            unit = window or 16
            src.read(np.arange(unit - 1))  # all but one row of the first unit
            assert src.cache_stats()["row_groups"] == 1
            src.read(np.array([unit - 1, unit - 2]))  # its last row (and one read before): complete
            assert src.cache_stats()["row_groups"] == 0
            reads = sum(n for (p, _, _), n in src.io_counts.items() if p == "read")
            again = src.read(np.array([0]))
            assert TOK.decode(again[0].tokens[:-1].tolist()) == texts[0]
            assert sum(n for (p, _, _), n in src.io_counts.items() if p == "read") == reads + 1


def test_shuffle_window_is_checked_with_the_key_named():
    from megascale_data_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=r"`data.sources.t.shuffle_window` must be 0 .* got -1"):
        SourceSpec(name="t", format="parquet", paths=["x"], shuffle_window=-1)


def test_a_streamed_image_row_group_holds_pages_not_the_row_group(tmp_path):
    """Images as ``prepare`` writes them (no dictionary, pages of a few images) streamed in windows:
    the reader holds a window and a page, not the row group, and keeps nothing of a row group it
    has read (pyarrow's pre-buffering would keep its column chunks in the open file)."""
    import os

    base = synthetic_jpeg(64, 48, seed=3)
    rng = np.random.default_rng(0)
    with PreparedParquetWriter(tmp_path / "im", kind="image-text", tokenizer=TOK, row_group_rows=400) as w:
        for i in range(400):  # unique images of ~20 KB: an 8 MB row group, as real images never repeat
            w.add(f"caption {i}", [base + rng.bytes(20_000)])
    path = os.path.join(tmp_path / "im", os.listdir(tmp_path / "im")[0])
    encodings = pq.ParquetFile(path).metadata.row_group(0).column(2).encodings
    assert not {"RLE_DICTIONARY", "PLAIN_DICTIONARY"} & set(encodings)
    row_group = 400 * 20_000

    # Measured in a process of its own: `total_allocated_bytes` counts every thread of a process, and a
    # background thread an earlier test left behind could allocate during the reads (a slow CI box).
    probe = f"""
import numpy as np, pyarrow as pa
from megascale_data_ext.sources import ParquetSource, SourceSpec
kw = dict(name="im", format="parquet", paths=[{str(tmp_path / "im")!r}], image_column="image",
          decode_images="constructor")
with ParquetSource(SourceSpec(shuffle_window=8, **kw)) as src:
    before = pa.total_allocated_bytes()
    got = src.read(np.arange(8))
    held = pa.total_allocated_bytes() - before  # the cached window, the stream's page and batch
    rows = len(got)
whole = ParquetSource(SourceSpec(row_group_cache=1, **kw))
before = pa.total_allocated_bytes()
del got
whole.read(np.arange(2))
whole._cache.clear()
print(rows, held, pa.total_allocated_bytes() - before)
whole.close()
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    rows, held, left = map(int, out[-3:])
    assert rows == 8 and held < row_group / 2, held
    assert left < row_group / 8, left  # nothing of the row group left in the open file
