"""Megatron .bin/.idx sources: round trip with Megatron's own reader and writer."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources import SourceSpec, open_source

pytest.importorskip("megatron.core.datasets.indexed_dataset")
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402

from megascale_data_ext.sources.megatron_indexed import MegatronIndexedSource, write_indexed_dataset  # noqa: E402


def _docs(n: int, seed: int, vocab: int = 50_000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)) for k in rng.integers(1, 60, n)]


def test_round_trip_matches_megatron_reader(tmp_path):
    docs = _docs(40, 0)
    prefix = write_indexed_dataset(tmp_path / "corpus" / "text_document", docs, vocab_size=50_000)
    ref = IndexedDataset(prefix)
    assert ref.index.dtype == np.uint16 and len(ref) == 40
    spec = SourceSpec(name="m", format="megatron", paths=[prefix], eod_token_id=50_000)
    src = open_source(spec)
    assert isinstance(src, MegatronIndexedSource) and len(src) == 40
    np.testing.assert_array_equal(src.metadata()["text_tokens"], ref.sequence_lengths.astype(np.int64) + 1)
    assert src.metadata()["num_images"].sum() == 0 and src.metadata()["image_offsets"].tolist() == [0] * 41
    idx = np.array([39, 0, 17, 17, 5])
    samples = src.read(idx)
    assert [s.index for s in samples] == idx.tolist()
    assert [len(s.tokens) for s in samples] == src.metadata(idx)["text_tokens"].tolist()
    for s in samples:
        np.testing.assert_array_equal(s.tokens[:-1], ref[s.index].astype(np.int64))
        np.testing.assert_array_equal(s.tokens[:-1], docs[s.index])
        assert s.tokens[-1] == 50_000 and s.tokens.dtype == np.int64


def test_data_that_already_ends_with_eod(tmp_path):
    eod = 7
    docs = [np.append(d, eod) for d in _docs(5, 1, vocab=7)]
    prefix = write_indexed_dataset(tmp_path / "p", docs, vocab_size=8)
    src = open_source(SourceSpec(name="m", format="megatron", paths=[prefix + ".bin"], append_eod=False))
    assert src.metadata()["text_tokens"].tolist() == [len(d) for d in docs]
    for s in src.read(range(5)):
        np.testing.assert_array_equal(s.tokens, docs[s.index])


def test_multi_sequence_documents_and_several_prefixes(tmp_path):
    # A document made of several sequences (sentence-split preprocessing) is one sample.
    builder = IndexedDatasetBuilder(str(tmp_path / "a.bin"), dtype=np.int32)
    a_docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [9], [10, 11, 12]]]
    for doc in a_docs:
        for seq in doc:
            builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(str(tmp_path / "a.idx"))
    b = write_indexed_dataset(tmp_path / "b", [[20, 21], [22]], vocab_size=100)
    spec = SourceSpec(name="m", format="megatron", paths=[str(tmp_path / "a"), b], max_tokens=5, truncate=True)
    src = open_source(spec)
    eod = src.eod_id
    assert len(src) == 5
    assert src.document_lengths.tolist() == [5, 1, 6, 2, 1]
    assert src.metadata()["text_tokens"].tolist() == [5, 2, 5, 3, 2]  # capped at max_tokens
    tokens = [s.tokens.tolist() for s in src.read(range(5))]
    assert tokens == [[1, 2, 3, 4, eod], [6, eod], [7, 8, 9, 10, eod], [20, 21, eod], [22, eod]]


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(SourceError, match=r"prefix '.*nope' is missing \['.*nope.idx', '.*nope.bin'\]"):
        open_source(SourceSpec(name="m", format="megatron", paths=[str(tmp_path / "nope")]))
    prefix = write_indexed_dataset(tmp_path / "c", _docs(10, 2), vocab_size=50_000)
    bin_bytes = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(bin_bytes[: len(bin_bytes) // 2])
    with pytest.raises(SourceError, match=r"'.*c.bin' has \d+ bytes but its index needs \d+; the .bin is truncated"):
        open_source(SourceSpec(name="m", format="megatron", paths=[prefix]))
    (tmp_path / "c.bin").write_bytes(bin_bytes)
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX" + (tmp_path / "c.idx").read_bytes()[8:])
    with pytest.raises(SourceError, match=r"cannot open Megatron index '.*c.idx'.*corrupt"):
        open_source(SourceSpec(name="m", format="megatron", paths=[prefix]))
    empty = write_indexed_dataset(tmp_path / "e", [], vocab_size=10)
    with pytest.raises(SourceError, match="source 'm' is empty"):
        open_source(SourceSpec(name="m", format="megatron", paths=[empty]))
