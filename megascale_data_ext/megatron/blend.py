"""Index math behind :class:`~megascale_data_ext.megatron.builder.MegascaleDatasetBuilder`.

Pure functions of (sequence lengths, seed, sequence length, split, sizes, weights), each
reproducing Megatron-LM core_v0.16.1's arithmetic so the drop-in builder returns Megatron's
lengths, per-source counts and sample order:

* :func:`build_gpt_sample_index` -- ``GPTDataset``'s indices: the seeded document shuffle over
  as many epochs as the requested samples need, the cut of the shuffled token stream into
  ``sequence_length + 1``-token windows (``helpers.build_sample_idx``, vectorised here) and
  the seeded sample shuffle. :meth:`GPTSampleIndex.megatron_sample_index` gives Megatron's
  2-D ``sample_index`` for code that reads it.
* :func:`blend_sizes` -- the builder's sizing of a weighted blend (``normalize``, then
  ``ceil(N * w)`` samples used and ``ceil(ceil(N * w) * (1 + surplus))`` built per source), so
  a blend of ``N`` has ``sum(ceil(N * w))`` samples, as Megatron's has.
* :func:`build_blend_index` -- ``BlendedDataset``'s index: the greedy largest-error rule of
  ``helpers.build_blending_indices`` (or the exhaustive variant), through Megatron's compiled
  kernel when the caller passes it and an exact Python port otherwise.

Everything is computed on whichever rank asks, in memory: no rank-0 build behind a barrier,
no cache files. Pure numpy: no torch, no Ray, no Megatron import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megascale_data_ext.errors import ConfigError, SourceError

__all__ = [
    "BlendIndex",
    "BlendingKernels",
    "GPTSampleIndex",
    "blend_sizes",
    "build_blend_index",
    "build_gpt_sample_index",
    "document_range",
    "normalize",
]

#: Fraction of the epoch the final epoch must reach to be shuffled with the others (Megatron's value).
_FINAL_EPOCH_THRESHOLD = 0.80


def document_range(bookends: tuple[float, float], num_documents: int) -> tuple[int, int]:
    """Documents ``[begin, end)`` of one split, rounded exactly like Megatron's builder."""
    return int(round(bookends[0] * float(num_documents))), int(round(bookends[1] * float(num_documents)))


def normalize(weights: Sequence[float] | np.ndarray) -> list[float]:
    """Megatron's ``datasets.utils.normalize``: float64 division by the float64 sum (bit for bit)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blend_sizes(normalized_weights: Sequence[float], size: int, surplus: float) -> tuple[list[int], list[int]]:
    """Per-source samples of a weighted blend of ``size``: ``(used, built)``.

    ``used[i] = ceil(size * w[i])`` (the blend has ``sum(used)`` samples, so up to one per
    source more than ``size``) and ``built[i] = ceil(used[i] * (1 + surplus))``: the size each
    source's index is built for, which also decides how many epochs are shuffled together, so
    it must equal Megatron's for the source's sample stream to be Megatron's.
    """
    used = [int(math.ceil(size * w)) for w in normalized_weights]
    return used, [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in normalized_weights]


@dataclass(slots=True, kw_only=True)
class GPTSampleIndex:
    """Where each sample of one source's split lies in its shuffled token stream.

    The stream is the concatenation of the documents in ``document_index`` order; sample
    ``i`` is the window ``[s * L, s * L + L + extra)`` with ``s = shuffle_index[i]``, cut short
    at the end of the stream (then padded by the dataset).

    Attributes:
        document_index: int32 document ids, shuffled epoch after epoch.
        token_offsets: int64 start of each ``document_index`` entry in the stream (+ the total).
        shuffle_index: Sample order (uint32, or int64 for huge indices).
        sequence_length: ``L``, the stride between windows.
        extra_token: 1 when windows carry one extra token for the labels, else 0.
    """

    document_index: np.ndarray
    token_offsets: np.ndarray
    shuffle_index: np.ndarray
    sequence_length: int
    extra_token: int

    def __len__(self) -> int:
        return int(self.shuffle_index.size)

    @property
    def num_tokens(self) -> int:
        return int(self.token_offsets[-1])

    def megatron_sample_index(self, sequence_lengths: np.ndarray) -> np.ndarray:
        """Megatron's ``sample_index``: ``[len + 1, 2]`` rows of (``document_index`` position, offset).

        Row ``j`` marks where sample ``j`` starts (token ``j * L`` of the stream), recorded the
        way ``helpers.build_sample_idx`` records it: in the document holding the previous
        sample's last token, and, for a final partial sample, the last document's length minus
        the extra token. Same dtype rule as Megatron (int32 unless an entry needs int64).
        """
        n, extra, offsets = len(self), self.extra_token, self.token_offsets
        starts = np.arange(1, n + 1, dtype=np.int64) * self.sequence_length
        pos = np.searchsorted(offsets, starts + extra, side="left") - 1
        off = starts - offsets[np.maximum(pos, 0)]
        past = starts + extra > self.num_tokens  # the stream ran out: Megatron's break branch
        if past.any():
            pos[past] = self.document_index.size - 1
            off[past] = int(sequence_lengths[self.document_index[-1]]) - extra
        big = max(self.document_index.size, int(np.max(sequence_lengths, initial=0))) > np.iinfo(np.int32).max
        out = np.zeros((n + 1, 2), dtype=np.int64 if big else np.int32)
        out[1:, 0], out[1:, 1] = pos, off
        return out

    def window(self, i: int) -> tuple[np.ndarray, int, int]:
        """Documents covering sample ``i`` and the window's token range relative to the first.

        Returns:
            ``(document ids, begin, end)``: concatenate the documents, then slice ``[begin, end)``.
        """
        start = int(self.shuffle_index[i]) * self.sequence_length
        stop = min(start + self.sequence_length + self.extra_token, self.num_tokens)
        first = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.token_offsets, stop, side="left"))
        base = int(self.token_offsets[first])
        return self.document_index[first:last], start - base, stop - base


def _num_epochs(tokens_per_epoch: int, num_samples: int | None, sequence_length: int, extra: int) -> int:
    if num_samples is None:
        return 1
    return max(1, -(-(num_samples * sequence_length + extra) // tokens_per_epoch))


def _document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate: bool) -> np.ndarray:
    """Megatron's ``_build_document_index``: same RNG calls in the same order, same result."""
    if not separate or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = _document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate((first, _document_index(documents, 1, rng, False)))


def _shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's ``_build_shuffle_index``: shuffle ``[0, num_first)`` and ``[num_first, total)`` apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    rest = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate((first, rest))


def build_gpt_sample_index(
    document_lengths: np.ndarray,
    documents: np.ndarray,
    *,
    num_samples: int | None,
    sequence_length: int,
    seed: int,
    add_extra_token: bool = True,
    drop_last_partial: bool = True,
    name: str = "source",
) -> GPTSampleIndex:
    """The sample index of Megatron's ``GPTDataset`` over ``documents``, in numpy.

    Args:
        document_lengths: Tokens of every document of the source.
        documents: Ids of the documents of this split.
        num_samples: Samples needed; enough epochs are shuffled in to cover them (``None``: one epoch).
        sequence_length: Tokens per sample (plus one extra when ``add_extra_token``).
        seed: Seed of the document and sample shuffles (``config.random_seed``).
        add_extra_token: Draw ``sequence_length + 1`` tokens so inputs and labels both have ``L``.
        drop_last_partial: Drop the last, incomplete window instead of padding it.
        name: Source name for error messages.

    Raises:
        SourceError: Samples are requested from a split that holds no tokens.
    """
    extra = int(add_extra_token)
    documents = np.asarray(documents, dtype=np.int64)
    lengths = np.asarray(document_lengths, dtype=np.int64)
    tokens_per_epoch = int(lengths[documents].sum()) if documents.size else 0
    if tokens_per_epoch <= extra and num_samples:
        raise SourceError(
            f"source {name!r}: its split holds {documents.size} documents with {tokens_per_epoch} tokens, "
            f"too few for one {sequence_length}-token sample; give the split a larger share of `split` "
            "or use more data"
        )
    rng = np.random.RandomState(seed)
    epochs = _num_epochs(tokens_per_epoch, num_samples, sequence_length, extra) if tokens_per_epoch > extra else 1
    separate, sans_final = False, 0
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens_per_epoch - extra) // sequence_length
        per_epoch = (tokens_per_epoch - extra) // sequence_length
        separate = (int(num_samples or 0) - sans_final) < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
    document_index = _document_index(documents, epochs, rng, separate)
    offsets = np.zeros(document_index.size + 1, dtype=np.int64)
    np.cumsum(lengths[document_index], out=offsets[1:])
    total = epochs * tokens_per_epoch - extra
    if drop_last_partial:
        count = max(0, total // sequence_length)
    else:  # helpers.cpp rounds in single precision: ceil(float(total) / L)
        count = max(0, int(np.ceil(np.float32(total) / np.float32(sequence_length))))
    shuffle = _shuffle_index(sans_final if separate else count, count, rng)
    return GPTSampleIndex(document_index=document_index, token_offsets=offsets, shuffle_index=shuffle,
                          sequence_length=int(sequence_length), extra_token=extra)


class BlendingKernels(Protocol):
    """Megatron's compiled ``helpers_cpp`` (the two blending functions this module ports)."""

    def build_blending_indices(self, dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                               weights: np.ndarray, num_datasets: int, size: int, verbose: bool) -> None: ...

    def build_exhaustive_blending_indices(self, dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                                          sizes: np.ndarray, num_datasets: int) -> None: ...


@dataclass(slots=True, kw_only=True)
class BlendIndex:
    """Which source serves each sample of a blend, and which of that source's samples.

    Attributes:
        dataset_index: int16 source of each blend sample (Megatron's ``dataset_index``).
        dataset_sample_index: int64 sample of that source; each source's samples are taken
            in order ``0, 1, 2, ...`` (Megatron's ``dataset_sample_index``).
        counts: Samples each source contributes.
    """

    dataset_index: np.ndarray
    dataset_sample_index: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return int(self.dataset_index.size)


def _greedy(weights: np.ndarray, size: int, budget: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Python port of ``build_blending_indices`` (``budget=None``) and
    ``build_exhaustive_blending_indices`` (``budget`` = samples per source): each step serves
    the first source of largest ``w * max(step, 1) - served``, in float64 as the C++ does."""
    k = weights.size
    served = np.zeros(k, dtype=np.int64)
    index = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    open_ = budget > 0 if budget is not None else None
    for step in range(size):
        error = weights * max(float(step), 1.0) - served
        if open_ is not None:
            error = np.where(open_, error, -np.inf)
        j = int(np.argmax(error))  # first maximum, as the C++ strict '>' keeps
        index[step], sample[step] = j, served[j]
        served[j] += 1
        if open_ is not None and served[j] == budget[j]:
            open_[j] = False
    return index, sample


def build_blend_index(
    weights: Sequence[float] | np.ndarray,
    size: int | None,
    *,
    kernels: BlendingKernels | None = None,
) -> BlendIndex:
    """``BlendedDataset``'s index: ``size`` samples by the largest-error rule, or, when ``size``
    is None, every sample of every source once (``weights`` are then the integer source lengths).

    ``weights`` must already be normalised as ``BlendedDataset`` normalises them (it calls
    :func:`normalize` whenever ``size`` is given). ``kernels`` is Megatron's compiled
    ``helpers_cpp``; without it the Python port gives the same arrays, about 100x slower.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.size >= np.iinfo(np.int16).max:
        raise ConfigError(f"a blend holds at most {np.iinfo(np.int16).max - 1} sources, got {w.size}")
    budget = np.asarray(weights, dtype=np.int64) if size is None else None
    n = int(budget.sum()) if budget is not None else int(size or 0)
    index, sample = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    if kernels is None:
        index, sample = _greedy(w / float(n) if budget is not None else w, n, budget)
    elif budget is not None:
        kernels.build_exhaustive_blending_indices(index, sample, budget, int(w.size))
    else:
        kernels.build_blending_indices(index, sample, w, int(w.size), n, False)
    return BlendIndex(dataset_index=index, dataset_sample_index=sample,
                      counts=np.bincount(index, minlength=w.size).astype(np.int64))
