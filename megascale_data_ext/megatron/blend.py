"""Index math behind :class:`~megascale_data_ext.megatron.builder.MegascaleDatasetBuilder`.

Two pure functions of (document lengths, seed, sequence length, split, sizes, weights):

* :func:`build_gpt_sample_index` reproduces Megatron's ``GPTDataset`` indices -- the seeded
  document shuffle over as many epochs as the requested samples need, the cut of the
  shuffled token stream into ``sequence_length + 1``-token windows (``helpers.build_sample_idx``,
  here vectorised numpy instead of C++), and the seeded sample shuffle -- so sample ``i`` of a
  source is the same token window Megatron would serve, computed on whichever rank asks, with
  no rank-0 build behind a barrier and no cache files.
* :func:`build_blend_index` decides which source serves each sample of a blend. Counts come
  from the project's :class:`~megascale_data_ext.dataplane.mixing.Mixer` (the error-minimising
  rule of Megatron's ``build_blending_indices``, vectorised), so every source lands within one
  sample of ``N * w``; the order spreads each source evenly over the blend.

Pure numpy: no torch, no Ray, no Megatron import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megascale_data_ext.dataplane.mixing import ConstantSchedule, Mixer
from megascale_data_ext.errors import ConfigError, SourceError

__all__ = [
    "BlendIndex",
    "GPTSampleIndex",
    "build_blend_index",
    "build_gpt_sample_index",
    "document_range",
    "surplus_sizes",
]

#: Fraction of the epoch the final epoch must reach to be shuffled with the others (Megatron's value).
_FINAL_EPOCH_THRESHOLD = 0.80


def document_range(bookends: tuple[float, float], num_documents: int) -> tuple[int, int]:
    """Documents ``[begin, end)`` of one split, rounded exactly like Megatron's builder."""
    return int(round(bookends[0] * float(num_documents))), int(round(bookends[1] * float(num_documents)))


def surplus_sizes(weights: np.ndarray, size: int, surplus: float) -> np.ndarray:
    """Samples built per source for a weighted blend: ``ceil(ceil(size * w) * (1 + surplus))``.

    Megatron sizes each source's index this way, and the size decides how many epochs are
    shuffled together, so using the same number keeps each source's sample stream identical
    to Megatron's.
    """
    return np.array([int(math.ceil(math.ceil(size * float(w)) * (1 + surplus))) for w in weights], dtype=np.int64)


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
    count = max(0, total // sequence_length if drop_last_partial else -(-total // sequence_length))
    shuffle = _shuffle_index(sans_final if separate else count, count, rng)
    return GPTSampleIndex(document_index=document_index, token_offsets=offsets, shuffle_index=shuffle,
                          sequence_length=int(sequence_length), extra_token=extra)


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


def build_blend_index(
    weights: Sequence[float] | np.ndarray,
    size: int,
    *,
    names: Sequence[str] | None = None,
    counts: Sequence[int] | np.ndarray | None = None,
) -> BlendIndex:
    """Blend ``size`` samples from sources in proportion to ``weights``.

    Counts are the Mixer's (closest to ``size * w``, within one sample per source) unless
    ``counts`` are given (exhaustive blends: every sample of every source once); either way
    the Mixer's deterministic order spreads each source evenly, so every prefix of the blend
    is itself within about one sample per source of its share.
    """
    w = np.asarray(weights, dtype=np.float64)
    names = list(names) if names is not None else [f"source{i}" for i in range(w.size)]
    if w.size >= np.iinfo(np.int16).max:
        raise ConfigError(f"a blend holds at most {np.iinfo(np.int16).max - 1} sources, got {w.size}")
    if size < 0:
        raise ConfigError(f"blend size must be >= 0, got {size}")
    if size == 0 or (counts is not None and int(np.sum(counts)) == 0):
        empty = np.zeros(w.size, dtype=np.int64)
        return BlendIndex(dataset_index=np.zeros(0, np.int16), dataset_sample_index=np.zeros(0, np.int64), counts=empty)
    mixer = Mixer(ConstantSchedule(w.tolist(), source_names=names), names, seed=0)
    c = np.asarray(counts, dtype=np.int64) if counts is not None else mixer.counts(0, int(size))
    order = mixer.order(0, c)
    rank = np.empty(order.size, dtype=np.int64)
    rank[np.argsort(order, kind="stable")] = np.arange(order.size) - np.repeat(np.cumsum(c) - c, c)
    return BlendIndex(dataset_index=order.astype(np.int16), dataset_sample_index=rank, counts=c)
