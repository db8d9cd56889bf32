"""Megatron ``.bin/.idx`` sources: existing Megatron-LM data served unchanged.

Files are read by a small numpy-only reader of Megatron's ``MMIDIDX`` format (:class:`_MMapIndex`
for the ``.idx``, :class:`_MMapIndexedData` for the ``.bin`` memory map), written from the format
as megatron-core 0.16.1 writes it (``megatron/core/datasets/indexed_dataset.py``:
``_IndexWriter``/``_IndexReader``): any file ``tools/preprocess_data.py`` wrote is read token for
token as Megatron's ``IndexedDataset`` reads it, but a Source Loader actor never imports torch or
megatron-core. One sample is one document (``document_indices[d]:document_indices[d+1]`` of the
index's sequences). Metadata comes from the index's ``sequence_lengths`` alone: planning a whole
epoch never touches the ``.bin`` payload.

Only :func:`write_indexed_dataset` (demo data, tests; run in the driver) uses Megatron's
``IndexedDatasetBuilder``, imported lazily inside the function.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import SourceSpec, text_only_metadata
from megascale_data_ext.sources.rowsource import RowSource, empty_source_error
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.transforms import RawSample

# The .idx layout (all little-endian), as megatron-core's ``_IndexWriter`` writes it:
#   9 bytes  magic ``MMIDIDX\x00\x00``
#   u64      version (always 1)
#   u8       token dtype code (``DType``)
#   u64      sequence count S
#   u64      document count D (entries of document_indices: number of documents + 1)
#   S x i32  sequence_lengths (tokens per sequence)
#   S x i64  sequence_pointers (byte offset of each sequence in the .bin)
#   D x i64  document_indices (sequence index where each document starts; last == S)
#   S x i8   sequence_modes (multimodal indexes only)
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
# megatron.core.datasets.indexed_dataset.DType: code -> token dtype.
_DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}


def _libc() -> Any:
    """libc's ``mmap``/``munmap`` through ctypes (None where there is none: not Linux/macOS)."""
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):  # pragma: no cover - other platforms
        return None


_LIBC = _libc() if hasattr(mmap, "MAP_SHARED") else None


def map_file(path: str) -> np.ndarray:
    """A read-only uint8 memory map of `path` that holds no file descriptor.

    ``np.memmap`` (Python's ``mmap``) keeps a duplicate descriptor open per map for as long as
    the map lives: a loader of 10,000 prefixes held 20,000 of them, past ``ulimit -n`` (users hit
    the limit near 600 prefixes with per-rank loaders). A mapping needs no descriptor once made,
    so this maps with libc's ``mmap``, closes the file at once, and unmaps when the last array
    viewing the map is gone. Falls back to ``np.memmap`` where libc is not reachable.
    """
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    if _LIBC is None:  # pragma: no cover - other platforms
        return np.memmap(path, mode="r", dtype=np.uint8, order="C")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {path!r} ({size} bytes) failed: {os.strerror(err)}")
    raw = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(raw, _LIBC.munmap, addr, size)
    arr = np.frombuffer(raw, dtype=np.uint8)
    arr.flags.writeable = False
    return arr


class _CorruptIndex(ValueError):
    """The .idx bytes do not describe a Megatron MMIDIDX index (reason in the message)."""


class _OutOfRange(ValueError):
    """The index points past the end of the .bin (reason in the message)."""


class _MMapIndex:
    """A memory-mapped Megatron ``.idx`` (what ``_IndexReader`` reads), numpy only.

    ``sequence_lengths`` (int32), ``sequence_pointers`` (int64, bytes into the .bin),
    ``document_indices`` (int64) and, for ``multimodal`` indexes, ``sequence_modes`` (int8) are
    read-only views of the file. The header and the counts are checked against the file size, so a
    damaged index fails here with :class:`_CorruptIndex` instead of at some later read.
    """

    def __init__(self, idx_path: str, *, multimodal: bool = False) -> None:
        self.path = idx_path
        self.multimodal = multimodal
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise _CorruptIndex(f"{size} bytes, shorter than the {_HEADER.size}-byte MMIDIDX header")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if magic != _INDEX_HEADER:
            raise _CorruptIndex(f"bad magic {magic!r}, expected {_INDEX_HEADER!r}")
        if version != _INDEX_VERSION:
            raise _CorruptIndex(f"unknown version {version}, expected {_INDEX_VERSION}")
        if code not in _DTYPE_CODES:
            raise _CorruptIndex(f"unknown dtype code {code}, expected one of {sorted(_DTYPE_CODES)}")
        self.dtype = _DTYPE_CODES[code]
        self.dtype_size = self.dtype.itemsize
        if n_doc < 1:
            raise _CorruptIndex("document count 0 (document_indices always holds at least [0])")
        need = _HEADER.size + n_seq * (4 + 8 + (1 if multimodal else 0)) + n_doc * 8
        if need > size:
            raise _CorruptIndex(
                f"header counts {n_seq} sequences and {n_doc} document indices, which need {need} bytes; "
                f"the file has {size}"
            )
        self.sequence_count, self.document_count = int(n_seq), int(n_doc)
        self._mmap = map_file(idx_path)
        buf = memoryview(self._mmap)
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=off)
        off += 8 * n_doc
        self.sequence_modes = np.frombuffer(buf, dtype=np.int8, count=n_seq, offset=off) if multimodal else None
        docs = self.document_indices
        if int(docs[-1]) != n_seq:  # Megatron's own IndexedDataset check
            raise _CorruptIndex(f"document_indices end at sequence {int(docs[-1])}, but the index has {n_seq}")
        if int(docs[0]) < 0 or (n_doc > 1 and bool(np.any(docs[1:] < docs[:-1]))):
            raise _CorruptIndex("document_indices are not non-decreasing sequence indices")
        if n_seq and int(self.sequence_lengths.min()) < 0:
            raise _CorruptIndex("negative sequence length")

    def __len__(self) -> int:
        return self.sequence_count

    def __reduce__(self) -> tuple[object, tuple[str, bool]]:
        """Pickles as its path: the receiver maps the file again instead of copying the arrays."""
        return _open_index, (self.path, self.multimodal)


def _open_index(path: str, multimodal: bool) -> _MMapIndex:
    return _MMapIndex(path, multimodal=multimodal)


class _MMapIndexedData:
    """One Megatron prefix: the :class:`_MMapIndex` plus a read-only memory map of the ``.bin``.

    Reads return views of the map (``dtype`` as stored); ``document_tokens`` copies to int64.
    """

    def __init__(self, prefix: str, *, multimodal: bool = False, index: _MMapIndex | None = None) -> None:
        self.prefix = prefix
        self.bin_path = prefix + ".bin"
        self.index = index if index is not None else _MMapIndex(prefix + ".idx", multimodal=multimodal)
        self._bin = map_file(self.bin_path)
        self._bin_buffer = memoryview(self._bin)
        self.bin_size = int(self._bin.size)
        self.readable = self.bin_size  # bytes a read may touch: less once the .bin was truncated (`refresh`)

    def __len__(self) -> int:
        return len(self.index)

    def __reduce__(self) -> tuple[object, tuple[str, bool]]:
        return _open_data, (self.prefix, self.index.multimodal)

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    def refresh(self) -> bool:
        """Re-read the ``.bin``'s size before reading (a map past a truncated file's end would SIGBUS the
        process); returns False when the file is gone (its map stays readable)."""
        try:
            self.readable = min(self.bin_size, os.stat(self.bin_path).st_size)
        except FileNotFoundError:
            return False
        return True

    def _read(self, count: int, offset: int) -> np.ndarray:
        end = offset + count * self.index.dtype_size
        if offset < 0 or end > self.readable:
            raise _OutOfRange(
                f"{self.bin_path!r} has {self.readable} bytes but its index points at bytes {offset}:{end}; "
                "the .bin is truncated or belongs to another .idx: re-run preprocessing"
            )
        return np.frombuffer(self._bin_buffer, dtype=self.index.dtype, count=count, offset=offset)

    def sequence(self, i: int) -> np.ndarray:
        """Tokens of sequence ``i`` (``IndexedDataset[i]``)."""
        return self._read(int(self.index.sequence_lengths[i]), int(self.index.sequence_pointers[i]))

    def sequences(self, start: int, stop: int) -> np.ndarray:
        """Tokens of sequences ``start:stop`` concatenated, read as ``IndexedDataset[start:stop]`` reads
        them: one contiguous run from ``sequence_pointers[start]``."""
        if stop <= start:
            return np.zeros(0, dtype=self.index.dtype)
        count = int(self.index.sequence_lengths[start:stop].sum(dtype=np.int64))
        return self._read(count, int(self.index.sequence_pointers[start]))

    def document_tokens(self, doc: int) -> np.ndarray:
        """Tokens of document ``doc`` (all its sequences), as int64."""
        docs = self.index.document_indices
        return self.sequences(int(docs[doc]), int(docs[doc + 1])).astype(np.int64)


def _open_data(prefix: str, multimodal: bool) -> _MMapIndexedData:
    return _MMapIndexedData(prefix, multimodal=multimodal)


def _prefix(path: str) -> str:
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def peek_document_lengths(paths: list[str]) -> np.ndarray | None:
    """Tokens per document of the prefixes `paths`, read from the ``.idx`` headers and arrays
    alone (no ``.bin`` mapped, no index mapped): what start-up profiling needs of a source it
    does not measure (issue 25: opening 1,024 prefixes for this took 0.4 s). None where anything
    is off (a missing file, an empty .bin, a bad header, counts past the file's end): opening the
    source then says what, by name."""
    out = []
    for prefix in (_prefix(p) for p in paths):
        idx = prefix + ".idx"
        try:
            if not os.path.getsize(prefix + ".bin"):  # a missing or empty .bin: opening names it, now
                return None
            size = os.path.getsize(idx)
            with open(idx, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    return None
                magic, version, code, n_seq, n_doc = _HEADER.unpack(head)
                if magic != _INDEX_HEADER or version != _INDEX_VERSION or code not in _DTYPE_CODES or n_doc < 1:
                    return None
                if _HEADER.size + n_seq * 12 + n_doc * 8 > size:
                    return None
                seq = np.fromfile(f, dtype="<i4", count=n_seq)
                f.seek(_HEADER.size + 12 * n_seq)
                docs = np.fromfile(f, dtype="<i8", count=n_doc)
        except OSError:
            return None
        if seq.size != n_seq or docs.size != n_doc or int(docs[-1]) != n_seq or int(docs[0]) < 0:
            return None
        csum = np.concatenate([[0], np.cumsum(seq, dtype=np.int64)])
        out.append(csum[docs[1:]] - csum[docs[:-1]])
    return np.concatenate(out) if out else None


class MegatronIndexedSource(RowSource):
    """One or more Megatron ``.bin/.idx`` prefixes concatenated into one source.

    Token ids are used as stored (no tokenizer runs); ``spec.append_eod`` appends the EOD id
    (``spec.eod_token_id``, else the tokenizer's) to every document: turn it off for data
    preprocessed with ``--append-eod``.
    """

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(spec, tokenizer=tokenizer)
        self.prefixes = [_prefix(p) for p in spec.paths]
        self._datasets: list[_MMapIndexedData] = []
        doc_lengths, doc_starts = [], []
        for prefix in self.prefixes:
            missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
            if missing:
                raise SourceError(
                    f"source {self.name!r}: Megatron prefix {prefix!r} is missing {missing}; "
                    "`paths` must name the prefix shared by the .bin and .idx files"
                )
            if os.path.getsize(prefix + ".bin") == 0:
                raise empty_source_error(self.name, f"{prefix + '.bin'!r} holds no tokens")
            try:
                index = _MMapIndex(prefix + ".idx")
            except (ValueError, struct.error, OSError, IndexError) as exc:
                raise SourceError(
                    f"source {self.name!r}: cannot open Megatron index {prefix + '.idx'!r} "
                    f"({type(exc).__name__}: {exc}); the file is corrupt or not a Megatron MMIDIDX index: "
                    "re-run preprocessing (tools/preprocess_data.py) to rewrite the .bin/.idx pair"
                ) from exc
            try:
                ds = _MMapIndexedData(prefix, index=index)
            except (ValueError, OSError) as exc:
                raise SourceError(
                    f"source {self.name!r}: cannot map Megatron data {prefix + '.bin'!r} "
                    f"({type(exc).__name__}: {exc}); check the file is readable"
                ) from exc
            self._check_bin_size(prefix, ds)
            self._datasets.append(ds)
            seq = np.asarray(ds.sequence_lengths, dtype=np.int64)
            docs = np.asarray(ds.document_indices, dtype=np.int64)
            csum = np.concatenate([[0], np.cumsum(seq)])
            doc_lengths.append(csum[docs[1:]] - csum[docs[:-1]])
            doc_starts.append(docs)
        self._doc_lengths = np.concatenate(doc_lengths) if doc_lengths else np.zeros(0, np.int64)
        self._doc_indices = doc_starts
        counts = [len(d) - 1 for d in doc_starts]
        self._ds_start = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        if len(self) == 0:
            raise empty_source_error(self.name, f"0 documents in {self.prefixes}")

    def __len__(self) -> int:
        return int(self._ds_start[-1])

    def prefix_data(self, i: int = 0) -> _MMapIndexedData:
        """The memory-mapped data of the ``i``-th prefix (the drop-in builder reads its index arrays)."""
        return self._datasets[i]

    def _check_bin_size(self, prefix: str, ds: _MMapIndexedData) -> None:
        """Fail at open, not mid-training, when the .bin is shorter than its index says."""
        index = ds.index
        if len(index.sequence_lengths) == 0:
            return
        end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * int(index.dtype_size)
        size = ds.bin_size
        if size < end:
            raise SourceError(
                f"source {self.name!r}: {prefix + '.bin'!r} has {size} bytes but its index needs {end}; "
                "the .bin is truncated or belongs to another .idx: re-run preprocessing"
            )

    @property
    def document_lengths(self) -> np.ndarray:
        """Tokens per document as stored (no EOD added, no truncation)."""
        return self._doc_lengths

    def _compute_metadata(self) -> dict[str, np.ndarray]:
        return text_only_metadata(self._transform.final_token_counts(self._doc_lengths, add_eod=self.spec.append_eod))

    def _raw_rows(self, indices: np.ndarray) -> list[RawSample]:
        which = np.searchsorted(self._ds_start, indices, side="right") - 1
        for d_i in dict.fromkeys(which.tolist()):  # the files read, once each
            if not self._datasets[d_i].refresh():
                self.file_faults.removed_but_open(self._datasets[d_i].bin_path)
        out = []
        for index, d_i in zip(indices.tolist(), which.tolist(), strict=True):
            doc = index - int(self._ds_start[d_i])
            ds = self._datasets[d_i]
            raw = RawSample(index=index, path=ds.bin_path, row=doc)
            try:
                raw.tokens = ds.document_tokens(doc)
            except _OutOfRange as exc:
                if ds.readable == ds.bin_size:  # the index itself points past the .bin
                    raise SourceError(f"source {self.name!r}: document {doc}: {exc}") from exc
                raw.error, raw.file_fault = f"was truncated to {ds.readable} bytes (document {doc} lies past it)", True
            out.append(raw)
        return out

    def close(self) -> None:
        super().close()
        self._datasets = []


def write_indexed_dataset(
    prefix: str | os.PathLike[str],
    documents: Iterable[Sequence[int] | np.ndarray],
    *,
    vocab_size: int | None = None,
) -> str:
    """Write documents to ``prefix.bin`` / ``prefix.idx`` with Megatron's ``IndexedDatasetBuilder``.

    Each document is stored as one sequence, as ``tools/preprocess_data.py`` does without
    sentence splitting. The dtype is Megatron's optimal one for ``vocab_size`` (uint16 below
    65,500, else int32). Returns the prefix. Megatron (and so torch) is imported here, in the
    process that writes, never by the readers above.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = str(prefix)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64)
        builder.add_document(arr, [len(arr)])
    builder.finalize(prefix + ".idx")
    return prefix
