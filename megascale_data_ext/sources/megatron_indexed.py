"""Megatron ``.bin/.idx`` sources: existing Megatron-LM data served unchanged.

Reading goes through Megatron's own :class:`megatron.core.datasets.indexed_dataset.IndexedDataset`
(memory-mapped), so any file ``tools/preprocess_data.py`` wrote is read exactly as Megatron
reads it. One sample is one document (``document_indices[d]:document_indices[d+1]`` of the
index's sequences). Metadata comes from the index's ``sequence_lengths`` alone: planning a
whole epoch never touches the ``.bin`` payload.

Megatron is imported lazily (it pulls in torch), keeping ``import megascale_data_ext.sources``
cheap for processes that only plan.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import SourceSpec, text_only_metadata
from megascale_data_ext.sources.rowsource import RowSource
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.transforms import RawSample


def _prefix(path: str) -> str:
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


class MegatronIndexedSource(RowSource):
    """One or more Megatron ``.bin/.idx`` prefixes concatenated into one source.

    Token ids are used as stored (no tokenizer runs); ``spec.append_eod`` appends the EOD id
    (``spec.eod_token_id``, else the tokenizer's) to every document: turn it off for data
    preprocessed with ``--append-eod``.
    """

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(spec, tokenizer=tokenizer)
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefixes = [_prefix(p) for p in spec.paths]
        self._datasets: list[IndexedDataset] = []
        doc_lengths, doc_starts = [], []
        for prefix in self.prefixes:
            missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
            if missing:
                raise SourceError(
                    f"source {self.name!r}: Megatron prefix {prefix!r} is missing {missing}; "
                    "`paths` must name the prefix shared by the .bin and .idx files"
                )
            if os.path.getsize(prefix + ".bin") == 0:
                raise SourceError(f"source {self.name!r} is empty: {prefix + '.bin'!r} holds no tokens")
            try:
                ds = IndexedDataset(prefix, mmap=True)
            except (AssertionError, ValueError, struct.error, OSError, IndexError) as exc:
                raise SourceError(
                    f"source {self.name!r}: cannot open Megatron index {prefix + '.idx'!r} "
                    f"({type(exc).__name__}: {exc}); the file is corrupt or not a Megatron MMIDIDX index"
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
            raise SourceError(f"source {self.name!r} is empty: 0 documents in {self.prefixes}")

    def __len__(self) -> int:
        return int(self._ds_start[-1])

    def _check_bin_size(self, prefix: str, ds: object) -> None:
        """Fail at open, not mid-training, when the .bin is shorter than its index says."""
        index = ds.index  # type: ignore[attr-defined]
        if len(index.sequence_lengths) == 0:
            return
        end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * int(index.dtype_size)
        size = os.path.getsize(prefix + ".bin")
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
        out = []
        for index, d_i in zip(indices.tolist(), which.tolist(), strict=True):
            doc = index - int(self._ds_start[d_i])
            docs = self._doc_indices[d_i]
            start, stop = int(docs[doc]), int(docs[doc + 1])
            ds = self._datasets[d_i]
            if stop - start == 1:
                tokens = np.asarray(ds[start], dtype=np.int64)
            elif stop == start:
                tokens = np.zeros(0, dtype=np.int64)
            else:
                tokens = np.concatenate(ds[start:stop]).astype(np.int64)
            out.append(RawSample(index=index, tokens=tokens, path=self.prefixes[d_i] + ".bin", row=doc))
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
    65,500, else int32). Returns the prefix.
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
