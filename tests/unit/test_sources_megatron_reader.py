"""The numpy-only MMIDIDX reader: same tokens as Megatron's IndexedDataset, no torch in loaders."""

from __future__ import annotations

import pickle
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources import SourceSpec, open_source
from megascale_data_ext.sources.megatron_indexed import _MMapIndexedData, write_indexed_dataset

pytest.importorskip("megatron.core.datasets.indexed_dataset")
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def test_loader_process_imports_neither_torch_nor_megatron(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "d", [[1, 2, 3], [4], [5, 6]] * 10, vocab_size=100)
    script = textwrap.dedent(
        f"""
        import sys
        from megascale_data_ext.sources import registry
        from megascale_data_ext.sources.base import SourceSpec
        src = registry.open_source(SourceSpec(name="m", format="megatron", paths=[{prefix!r}]))
        samples = src.read([0, 1, 2, 29])
        assert [s.tokens[:-1].tolist() for s in samples] == [[1, 2, 3], [4], [5, 6], [5, 6]], samples
        assert src.metadata()["text_tokens"].sum() == 60 + 30
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
        assert not loaded, loaded
        print("OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr


def _reference_document(ref: IndexedDataset, start: int, stop: int) -> np.ndarray:
    if stop == start:
        return np.zeros(0, dtype=np.int64)
    sequences = ref[start:stop][0] if ref.multimodal else ref[start:stop]  # multimodal: (sequences, modes)
    return np.concatenate(sequences).astype(np.int64)


def _assert_same_as_megatron(prefix: str, *, multimodal: bool = False) -> int:
    ref = IndexedDataset(prefix, multimodal=multimodal, mmap=True)
    ours = _MMapIndexedData(prefix, multimodal=multimodal)
    assert ours.index.dtype == np.dtype(ref.index.dtype) and ours.index.dtype_size == ref.index.dtype_size
    np.testing.assert_array_equal(ours.sequence_lengths, ref.sequence_lengths)
    np.testing.assert_array_equal(ours.index.sequence_pointers, ref.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, ref.document_indices)
    if multimodal:
        np.testing.assert_array_equal(ours.index.sequence_modes, ref.index.sequence_modes)
    for i in range(len(ref)):
        seq = ref[i][0] if multimodal else ref[i]
        assert ours.sequence(i).dtype == seq.dtype
        np.testing.assert_array_equal(ours.sequence(i), seq)
    docs = ref.document_indices
    for d in range(len(docs) - 1):
        got = ours.document_tokens(d)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, _reference_document(ref, int(docs[d]), int(docs[d + 1])))
    again = pickle.loads(pickle.dumps(ours))  # re-maps the files, does not copy them
    np.testing.assert_array_equal(again.document_tokens(len(docs) - 2), ours.document_tokens(len(docs) - 2))
    return len(docs) - 1


def _random_docs(rng, n, vocab, max_len=80):
    return [rng.integers(0, vocab, int(k)) for k in rng.integers(0, max_len, n)]


@pytest.mark.parametrize(("vocab", "dtype"), [(50_000, np.uint16), (65_499, np.uint16), (200_000, np.int32)])
def test_single_sequence_documents_match_megatron(tmp_path, vocab, dtype):
    rng = np.random.default_rng(vocab)
    docs = _random_docs(rng, 200, vocab)
    docs[3] = np.array([vocab - 1, 0, vocab - 1])  # extremes of the id range survive the dtype
    prefix = write_indexed_dataset(tmp_path / "p", docs, vocab_size=vocab)
    assert IndexedDataset(prefix).index.dtype == dtype
    assert _assert_same_as_megatron(prefix) == 200
    src = open_source(SourceSpec(name="m", format="megatron", paths=[prefix], append_eod=False))
    for s in src.read(range(200)):
        np.testing.assert_array_equal(s.tokens, docs[s.index])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64])
def test_multi_sequence_documents_match_megatron(tmp_path, dtype):
    """Sentence-split data: documents of several (sometimes empty) sequences, some empty documents."""
    rng = np.random.default_rng(7)
    high = min(np.iinfo(dtype).max, 300_000)
    builder = IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=dtype)
    expected = []
    for d in range(60):
        n_seq = int(rng.integers(0, 5)) if d % 10 else 0
        seqs = [rng.integers(0, high, int(rng.integers(0, 12))) for _ in range(n_seq)]
        if d % 2:
            for seq in seqs:
                builder.add_item(torch.from_numpy(seq))
            builder.end_document()
        else:
            flat = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
            builder.add_document(flat, [len(s) for s in seqs])
        expected.append(np.concatenate(seqs).astype(np.int64) if seqs else np.zeros(0, np.int64))
    builder.finalize(str(tmp_path / "s.idx"))
    assert _assert_same_as_megatron(str(tmp_path / "s")) == 60
    src = open_source(SourceSpec(name="m", format="megatron", paths=[str(tmp_path / "s")], append_eod=False))
    np.testing.assert_array_equal(src.document_lengths, [len(e) for e in expected])
    for s in src.read(range(60)):
        np.testing.assert_array_equal(s.tokens, expected[s.index])


def test_multimodal_index_sequence_modes_match_megatron(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.int32, multimodal=True)
    for d in range(12):
        for j in range(d % 3 + 1):
            builder.add_item(torch.arange(d + j + 1, dtype=torch.int32), mode=(d + j) % 2)
        builder.end_document()
    builder.finalize(str(tmp_path / "mm.idx"))
    assert _assert_same_as_megatron(str(tmp_path / "mm"), multimodal=True) == 12
    # A text source reads the same file (the trailing modes are ignored).
    src = open_source(SourceSpec(name="m", format="megatron", paths=[str(tmp_path / "mm")], append_eod=False))
    assert len(src) == 12 and src.read([4])[0].tokens.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]


def _header(magic=b"MMIDIDX\x00\x00", version=1, code=8, n_seq=None, n_doc=None, *, idx: bytes):
    old_seq, old_doc = struct.unpack("<QQ", idx[18:34])
    n_seq = old_seq if n_seq is None else n_seq
    n_doc = old_doc if n_doc is None else n_doc
    return struct.pack("<9sQBQQ", magic, version, code, n_seq, n_doc) + idx[34:]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: _header(magic=b"MMIDIDX\x00\x01", idx=b), "bad magic"),
        (lambda b: b"\x00" * len(b), "bad magic"),
        (lambda b: _header(version=2, idx=b), "unknown version 2"),
        (lambda b: _header(code=0, idx=b), "unknown dtype code 0"),
        (lambda b: _header(code=9, idx=b), "unknown dtype code 9"),
        (lambda b: _header(n_seq=10**6, idx=b), "which need"),
        (lambda b: _header(n_doc=10**12, idx=b), "which need"),
        (lambda b: _header(n_seq=2**63, idx=b), "which need"),
        (lambda b: _header(n_doc=0, idx=b), "document count 0"),
        (lambda b: _header(n_seq=5, idx=b), "document_indices"),
        (lambda b: b[:-8], "which need"),
        (lambda b: b[:20], "shorter than the 34-byte MMIDIDX header"),
        (lambda b: b"", "shorter than the 34-byte MMIDIDX header"),
    ],
)
def test_corrupt_index_names_the_idx_file(tmp_path, damage, reason):
    prefix = write_indexed_dataset(tmp_path / "c", [[1, 2, 3], [4, 5], [6]] * 4, vocab_size=100)
    idx = tmp_path / "c.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(SourceError) as info:
        open_source(SourceSpec(name="m", format="megatron", paths=[prefix]))
    msg = str(info.value)
    assert f"cannot open Megatron index {str(idx)!r}" in msg, msg
    assert reason in msg and "corrupt or not a Megatron MMIDIDX index" in msg and "re-run preprocessing" in msg, msg


def test_document_indices_out_of_order_is_corrupt(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "c", [[1, 2, 3], [4, 5], [6]], vocab_size=100)
    idx = tmp_path / "c.idx"
    raw = bytearray(idx.read_bytes())
    n_seq = 3
    docs_at = 34 + n_seq * 12
    raw[docs_at + 8 : docs_at + 16] = struct.pack("<q", 3)  # [0, 3, 2, 3]
    idx.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=re.escape(repr(str(idx))) + r".*not non-decreasing"):
        open_source(SourceSpec(name="m", format="megatron", paths=[prefix]))


def test_pointer_past_the_bin_end_is_a_source_error_at_read(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "c", [[1, 2, 3], [4, 5], [6]], vocab_size=100)
    idx = tmp_path / "c.idx"
    raw = bytearray(idx.read_bytes())
    raw[34 + 3 * 4 : 34 + 3 * 4 + 8] = struct.pack("<q", 1000)  # first sequence's pointer
    idx.write_bytes(bytes(raw))
    src = open_source(SourceSpec(name="m", format="megatron", paths=[prefix]))  # only the last one is checked at open
    assert src.read([1])[0].tokens[:-1].tolist() == [4, 5]
    with pytest.raises(SourceError, match=r"source 'm': document 0: '.*c.bin' has 12 bytes but its index points at"):
        src.read([0])


def test_open_prefixes_hold_no_file_descriptors(tmp_path) -> None:
    """np.memmap kept a duplicate descriptor per map (two per prefix): 10,000 prefixes ran past ulimit -n."""
    import gc
    import os

    from megascale_data_ext.sources.megatron_indexed import map_file

    prefixes = [write_indexed_dataset(tmp_path / f"p{i}", [np.arange(3, 10 + i)] * 4, vocab_size=259)
                for i in range(20)]
    fds = len(os.listdir("/proc/self/fd"))
    srcs = [open_source(SourceSpec(name=f"s{i}", format="megatron", paths=[p], append_eod=False, eod_token_id=1))
            for i, p in enumerate(prefixes)]
    assert len(os.listdir("/proc/self/fd")) <= fds + 1
    assert srcs[7].read([2])[0].tokens.tolist() == list(range(3, 17))
    arr = map_file(prefixes[0] + ".bin")
    assert not arr.flags.writeable and arr.size == os.path.getsize(prefixes[0] + ".bin")
    view = arr[4:]
    del arr, srcs
    gc.collect()
    assert view.size > 0 and int(view[0]) >= 0  # a view keeps the map alive
