"""Drop-in replacement for Megatron's ``BlendedMegatronDatasetBuilder`` (core_v0.16.1).

``MegascaleDatasetBuilder(cls, sizes, is_built_on_rank, config).build()`` takes Megatron's
arguments and returns what Megatron's builder returns for ``GPTDataset`` and
``MockGPTDataset``: ``GPTDataset`` / ``BlendedDataset`` instances (subclasses) with Megatron's
lengths, per-source counts, ``document_index`` / ``sample_index`` / ``shuffle_index`` /
``dataset_index`` arrays and samples, and Megatron's refusals (as ``AssertionError`` /
``IndexError`` subclasses, so ``except AssertionError`` code behaves the same). What differs:

* No rank-0 index build behind a barrier and no cache files: every index is a pure function
  of (sequence lengths, seed, sequence length, split, sizes, weights)
  (:mod:`megascale_data_ext.megatron.blend`), so each rank computes it alone and a restarted
  job recomputes the same data order. ``path_to_cache`` and the cache-loading flags
  (``fast_cache_load``, ``defer_npy_index_mmap``) are ignored.
* Refusals come at construction, before any index is built, naming the split and the fix.
* ``.bin/.idx`` files are opened and checked by the project's reader
  (:class:`~megascale_data_ext.sources.megatron_indexed.MegatronIndexedSource`: named
  ``SourceError`` for missing, corrupt or truncated files).

Other dataset classes (``BERTMaskedWordPieceDataset``, ``T5``, ``MultimodalDataset``, user
subclasses of ``GPTDataset``, ...) are not reimplemented: the builder delegates them to
Megatron's own ``BlendedMegatronDatasetBuilder``, logs that it does, and sets ``delegate``.
This map-style path runs in the trainer process and needs no Ray; the disaggregated service
path (planner, loaders, constructors) is the external data provider in ``runtime``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.utils import Split
from megatron.core.utils import log_single_rank

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.megatron.blend import (
    BlendingKernels,
    GPTSampleIndex,
    blend_sizes,
    build_blend_index,
    build_gpt_sample_index,
    document_range,
    normalize,
)

__all__ = [
    "BlendOversampledError",
    "BuilderArgumentError",
    "MegascaleBlendedDataset",
    "MegascaleDatasetBuilder",
    "MegascaleGPTDataset",
    "MegascaleMockGPTDataset",
    "ltor_masks_and_position_ids",
]

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1  # Megatron's fallback pad id: never a real token
_NUM_SPLITS = 3


class BuilderArgumentError(ConfigError, AssertionError):
    """Arguments Megatron's builder refuses with ``assert``: an AssertionError too, so code
    written against Megatron (``except AssertionError``) sees the same refusal."""


class BlendOversampledError(ConfigError, IndexError):
    """A blend asks a source for more samples than it built (Megatron's ``IndexError``)."""


def _megatron_kernels() -> BlendingKernels | None:
    """Megatron's compiled blending helpers; None falls back to the exact Python port."""
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        return None
    return helpers_cpp  # type: ignore[return-value]


class DocumentStore(Protocol):
    """Random access to one prefix's sequences, GPTDataset's splitting unit (token ids as stored)."""

    name: str
    path: str | None
    low_level: Any  # what Megatron's ``GPTDataset.dataset`` would hold

    @property
    def document_lengths(self) -> np.ndarray: ...

    def documents(self, ids: np.ndarray) -> list[np.ndarray]: ...


class _IndexedSequences:
    """A Megatron ``.bin/.idx`` prefix, opened and checked by :class:`MegatronIndexedSource`.

    Units are sequences, as ``GPTDataset.numel_low_level_dataset`` counts them (one per
    document unless the data was preprocessed with ``--split-sentences``).
    """

    def __init__(self, prefix: str) -> None:
        from megascale_data_ext.sources.base import SourceSpec
        from megascale_data_ext.sources.megatron_indexed import MegatronIndexedSource

        self.name = self.path = prefix
        spec = SourceSpec(name=os.path.basename(prefix) or prefix, format="megatron", paths=[prefix], append_eod=False)
        # The reader has no public accessor for its memory-mapped prefix: see docs/dropin_builder.md.
        self.low_level = MegatronIndexedSource(spec).prefix_data(0)

    @property
    def document_lengths(self) -> np.ndarray:
        return self.low_level.sequence_lengths

    def documents(self, ids: np.ndarray) -> list[np.ndarray]:
        return [self.low_level.sequence(int(i)) for i in ids]


class _MockDocuments:
    """Megatron's synthetic documents (``MockGPTLowLevelDataset``): mock data equals Megatron's."""

    def __init__(self, tokenizer: Any) -> None:
        self.name, self.path = "mock", None
        self.low_level = MockGPTLowLevelDataset(tokenizer)

    @property
    def document_lengths(self) -> np.ndarray:
        return self.low_level.sequence_lengths

    def documents(self, ids: np.ndarray) -> list[np.ndarray]:
        return [self.low_level[int(i)] for i in ids]


def ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod: int,
    *,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Megatron's left-to-right masks, vectorised (no Python loop over EODs).

    Returns:
        ``(attention_mask, loss_mask, position_ids)``: bool ``[1, L, L]`` (True = masked) or
        None, float32 ``[L]``, int64 ``[L]`` -- the values of Megatron's
        ``_get_ltor_masks_and_position_ids``.
    """
    n = tokens.numel()
    is_eod = tokens == eod
    loss_mask = torch.ones(n, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = torch.arange(n, dtype=torch.long)
    if reset_position_ids:
        # Each position restarts counting after the last EOD strictly before it.
        after_eod = torch.where(is_eod, position_ids + 1, torch.zeros_like(position_ids))
        start = torch.cummax(torch.cat([after_eod.new_zeros(1), after_eod[:-1]]), 0).values
        position_ids = position_ids - start
    attention_mask = None
    if create_attention_mask:
        allowed = torch.ones((n, n), dtype=torch.bool).tril_()
        if reset_attention_mask:
            segment = torch.cumsum(is_eod.long(), 0) - is_eod.long()  # EODs strictly before each position
            allowed &= segment[:, None] == segment[None, :]
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


def _pad_token_id(tokenizer: Any, allow_ambiguous: bool) -> int:
    """The pad id Megatron's ``MegatronDataset`` picks: the tokenizer's, unless it collides."""
    try:
        pad = int(tokenizer.pad)
    except Exception:  # noqa: BLE001 - tokenizers raise anything from AttributeError to NotImplementedError
        return _PAD_TOKEN_ID
    special: list[int] = []
    with contextlib.suppress(AttributeError, IndexError, ValueError):  # tokenizers differ in what they expose
        special = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    for attr in () if special else ("eos", "eod"):
        with contextlib.suppress(AttributeError, NotImplementedError):
            special.append(getattr(tokenizer, attr))
    return pad if allow_ambiguous or pad not in special else _PAD_TOKEN_ID


def _describe(identifiers: OrderedDict) -> tuple[str, str]:
    text = json.dumps(identifiers, indent=4, default=lambda obj: getattr(obj, "unique_identifiers", repr(obj)))
    return text, hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


class MegascaleGPTDataset(GPTDataset):
    """One prefix's split: a ``GPTDataset`` whose sample ``i`` is Megatron ``GPTDataset``'s sample ``i``.

    ``GPTDataset.__init__`` is not called (it builds and caches the indices on rank 0); the
    attributes Megatron code reads are set from :class:`GPTSampleIndex` instead, and
    ``sample_index`` is derived on first access. Stateless and deterministic by index (safe
    to share with forked DataLoader workers); ``__getitem__(None)`` is Megatron's padding
    sample (sample 0, loss masked).
    """

    def __init__(self, *, documents: DocumentStore, indices: np.ndarray, index: GPTSampleIndex,
                 num_samples: int | None, split: Split, config: Any) -> None:
        self.documents, self.index = documents, index
        self.dataset, self.dataset_path, self.indices = documents.low_level, documents.path, indices
        self.num_samples, self.index_split, self.config = num_samples, split, config
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("dataset_path", self.dataset_path), ("num_samples", num_samples),
             ("index_split", split.name)] + [(a, getattr(config, a)) for a in self._key_config_attributes()])
        self.unique_description, self.unique_description_hash = _describe(self.unique_identifiers)
        self.document_index, self.shuffle_index = index.document_index, index.shuffle_index
        self._eod = int(config.tokenizer.eod)
        self._pad_token_id = _pad_token_id(config.tokenizer, bool(getattr(config, "allow_ambiguous_pad_tokens", False)))
        self._extra = bool(getattr(config, "add_extra_token_to_sequence", True))
        self._create_mask = bool(getattr(config, "create_attention_mask", True))
        self.masks_and_position_ids_are_cacheable = not (
            config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss)
        self._causal_mask: torch.Tensor | None = None

    @functools.cached_property
    def sample_index(self) -> np.ndarray:
        """Megatron's ``[len + 1, 2]`` sample index (only for code that reads it)."""
        return self.index.megatron_sample_index(self.documents.document_lengths)

    def __len__(self) -> int:
        return len(self.index)

    def text(self, idx: int) -> np.ndarray:
        """The ``sequence_length + 1`` int64 token window of sample ``idx``, padded at the stream's end."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {self.documents.name!r} {self.index_split.name} split "
                             f"of {n} samples")
        docs, begin, end = self.index.window(idx % n)
        parts = self.documents.documents(np.asarray(docs, dtype=np.int64))
        text = np.concatenate(parts).astype(np.int64, copy=False)[begin:end] if parts else np.zeros(0, np.int64)
        want = self.index.sequence_length + self.index.extra_token
        if text.size < want:
            text = np.concatenate([text, np.full(want - text.size, self._pad_token_id, dtype=np.int64)])
        return text

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.text(0 if idx is None else int(idx)))
        pad = self._pad_token_id
        if self._extra:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1, dims=0)
            labels[-1] = pad
        cfg = self.config
        plain = not (cfg.reset_position_ids or cfg.reset_attention_mask)
        attention_mask, loss_mask, position_ids = ltor_masks_and_position_ids(
            tokens, self._eod, reset_position_ids=bool(cfg.reset_position_ids),
            reset_attention_mask=bool(cfg.reset_attention_mask), eod_mask_loss=bool(cfg.eod_mask_loss),
            create_attention_mask=self._create_mask and not (plain and self._causal_mask is not None))
        if self._create_mask and plain:  # the causal mask never changes: build it once, as Megatron caches it
            self._causal_mask = attention_mask if self._causal_mask is None else self._causal_mask
            attention_mask = self._causal_mask
        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        out = {"tokens": tokens, "labels": labels}
        if self._create_mask:
            out["attention_mask"] = attention_mask
        out.update(loss_mask=loss_mask, position_ids=position_ids)
        return out


class MegascaleMockGPTDataset(MegascaleGPTDataset, MockGPTDataset):
    """The mock split: a ``MockGPTDataset`` over Megatron's synthetic documents."""


class MegascaleBlendedDataset(BlendedDataset):
    """A ``BlendedDataset`` whose indices are computed in memory; items carry ``dataset_id``.

    ``weights`` and ``size`` hold what Megatron's hold (normalised weights and the blend size,
    or the source lengths and None for an exhaustive blend); ``counts`` is samples per source.
    """

    def __init__(self, *, datasets: Sequence[MegascaleGPTDataset], weights: list[float] | list[int],
                 size: int | None, index: Any, config: Any) -> None:
        self.datasets, self.weights, self.size, self.config = list(datasets), weights, size, config
        self.split = self.datasets[0].index_split
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("datasets", [d.unique_identifiers for d in self.datasets]),
             ("split", self.split.name), ("weights", weights), ("size", size)])
        self.unique_description, self.unique_description_hash = _describe(self.unique_identifiers)
        self.dataset_index, self.dataset_sample_index = index.dataset_index, index.dataset_sample_index
        self.counts = index.counts

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, Any]:
        source = self.dataset_index[idx]
        return {"dataset_id": source, **self.datasets[source][int(self.dataset_sample_index[idx])]}


_NATIVE = (GPTDataset, MockGPTDataset, MegascaleGPTDataset, MegascaleMockGPTDataset)


class MegascaleDatasetBuilder:
    """``BlendedMegatronDatasetBuilder``'s interface and results, without rank-0 builds or caches.

    Args:
        cls: ``GPTDataset`` or ``MockGPTDataset`` (built here); any other class is delegated
            to Megatron's own builder (logged; ``delegate`` is then that builder).
        sizes: Samples per split (train, valid, test); ``None`` = one full epoch of the split.
        is_built_on_rank: With ``torch.distributed`` initialised, ranks where it returns False
            get None (as with Megatron; without a process group every call builds).
        config: A ``GPTDatasetConfig``.

    Raises:
        BuilderArgumentError: An argument Megatron's builder refuses (every problem listed).
    """

    def __init__(self, cls: type, sizes: Sequence[int | None], is_built_on_rank: Callable[[], bool],
                 config: Any) -> None:
        self.cls, self.sizes, self.is_built_on_rank, self.config = cls, list(sizes), is_built_on_rank, config
        self.delegate: BlendedMegatronDatasetBuilder | None = None
        if cls not in _NATIVE:
            log_single_rank(logger, logging.WARNING,
                            f"MegascaleDatasetBuilder builds GPTDataset and MockGPTDataset; {cls.__name__} is "
                            "delegated to Megatron's BlendedMegatronDatasetBuilder (rank-0 index build and cache "
                            "files as in Megatron)")
            self.delegate = BlendedMegatronDatasetBuilder(cls, list(sizes), is_built_on_rank, config)
            return
        self._kernels = _megatron_kernels()
        self._stores: dict[str, DocumentStore] = {}
        self._validate()

    @property
    def _mock_cls(self) -> bool:
        return issubclass(self.cls, MockGPTDataset)

    def _blends(self) -> list[tuple[list[str], list[float] | None] | None]:
        cfg = self.config
        return [cfg.blend] * _NUM_SPLITS if cfg.blend else list(cfg.blend_per_split or [None] * _NUM_SPLITS)

    def _blended(self, split: int, prefixes: Sequence[str], weights: Sequence[float] | None) -> bool:
        """Whether Megatron builds a BlendedDataset (which refuses weights <= 0) for this split."""
        if self.config.blend:
            return not (len(prefixes) == 1 and weights is None)
        return len(prefixes) > 1 and not (split == 1 and getattr(self.config, "multiple_validation_sets", False))

    def _validate(self) -> None:
        cfg, problems = self.config, []
        if len(self.sizes) != _NUM_SPLITS or not all(s is None or (isinstance(s, int | np.integer) and s >= 0)
                                                     for s in self.sizes):
            raise BuilderArgumentError(f"`sizes` must be 3 non-negative ints or None (train, valid, test), "
                                       f"got {self.sizes!r}")
        if not isinstance(cfg.sequence_length, int) or cfg.sequence_length < 1:
            problems.append(f"`sequence_length` must be a positive int, got {cfg.sequence_length!r}")
        if getattr(cfg.tokenizer, "eod", None) is None:
            problems.append("`tokenizer` must be set and define `eod` (GPT masks need the EOD id)")
        if cfg.mock and not self._mock_cls:
            problems.append(f"config.mock (no `blend`, no `blend_per_split`) needs cls=MockGPTDataset, got "
                            f"{self.cls.__name__} (Megatron fails to build it as a mock data generator)")
        if self._mock_cls and not cfg.mock:
            problems.append("cls=MockGPTDataset needs config.mock: leave `blend` and `blend_per_split` unset")
        for split, (blend, size) in enumerate(zip([None] * 3 if cfg.mock else self._blends(), self.sizes,
                                                  strict=True)):
            if blend is None:
                continue
            prefixes, weights = blend
            name = Split(split).name
            if weights is not None and size is None:
                problems.append(f"{name} split: weighted blends need a size; got sizes[{split}]=None with weights "
                                f"{list(weights)} (give a size or drop the weights)")
            if weights is not None and self._blended(split, prefixes, weights):
                bad = [w for w in weights if not (np.isfinite(w) and w > 0)]
                if bad:
                    problems.append(f"{name} split: blend weights must be positive and finite, got {list(weights)} "
                                    f"for {list(prefixes)} (drop the source instead of giving it weight {bad[0]})")
        if problems:
            raise BuilderArgumentError("invalid MegascaleDatasetBuilder arguments: " + "; ".join(problems))

    def build(self) -> list[Any]:
        """``[train, valid, test]`` datasets (a list for multiple validation sets); None where not built."""
        if self.delegate is not None:
            return self.delegate.build()
        if torch.distributed.is_initialized() and not self.is_built_on_rank():
            return [None] * _NUM_SPLITS
        cfg = self.config
        matrix = list(cfg.split_matrix or [None] * _NUM_SPLITS)  # None with blend_per_split
        if cfg.mock:
            store = _MockDocuments(cfg.tokenizer)
            return [None if b is None else self._gpt(store, b, s, i)
                    for i, (b, s) in enumerate(zip(matrix, self.sizes, strict=True))]
        if cfg.blend:
            prefixes, weights = cfg.blend
            if len(prefixes) == 1 and weights is None:
                return [None if b is None else self._gpt(self._store(prefixes[0]), b, s, i)
                        for i, (b, s) in enumerate(zip(matrix, self.sizes, strict=True))]
            return [None if b is None else self._blend(prefixes, weights, b, s, i)
                    for i, (b, s) in enumerate(zip(matrix, self.sizes, strict=True))]
        out: list[Any] = [None] * _NUM_SPLITS
        for i, (blend, size) in enumerate(zip(cfg.blend_per_split, self.sizes, strict=True)):
            if blend is None:
                continue
            prefixes, weights = blend
            if len(prefixes) == 1:
                out[i] = self._gpt(self._store(prefixes[0]), (0.0, 1.0), size, i)
            elif not self._blended(i, prefixes, weights):  # multiple validation sets
                out[i] = [self._gpt(self._store(p), (0.0, 1.0), size, i) for p in prefixes]
            else:
                out[i] = self._blend(prefixes, weights, (0.0, 1.0), size, i)
        return out

    def _store(self, prefix: str) -> DocumentStore:
        if prefix not in self._stores:
            self._stores[prefix] = _IndexedSequences(prefix)
        return self._stores[prefix]

    def _blend(self, prefixes: Sequence[str], weights: Sequence[float] | None, bookends: tuple[float, float],
               size: int | None, split: int) -> MegascaleBlendedDataset:
        """Megatron's case (3): mid-level datasets sized as Megatron sizes them, then its blend index."""
        if weights is not None:
            w = normalize(weights)
            used, built = blend_sizes(w, int(size or 0), float(self.config.mid_level_dataset_surplus))
            mids = [self._gpt(self._store(p), bookends, n, split) for p, n in zip(prefixes, built, strict=True)]
            blend_weights, blend_size = normalize(w), sum(used)  # BlendedDataset normalises again
        else:
            mids = [self._gpt(self._store(p), bookends, None, split) for p in prefixes]
            lengths = [len(d) for d in mids]
            empty = [p for p, n in zip(prefixes, lengths, strict=True) if n == 0]
            if empty:
                raise BuilderArgumentError(
                    f"{Split(split).name} split: {empty} hold no {self.config.sequence_length}-token sample in this "
                    f"split, so their blend weight (the sample count) is 0, which Megatron's BlendedDataset refuses; "
                    "drop them from the blend or give the split a larger share of `split`")
            blend_size = None if size is None else min(int(size), sum(lengths))
            blend_weights = lengths if size is None else normalize(lengths)
        index = build_blend_index(blend_weights, blend_size, kernels=self._kernels)
        for i, (want, mid) in enumerate(zip(index.counts.tolist(), mids, strict=True)):
            if want > len(mid):
                raise BlendOversampledError(
                    f"the {Split(split).name} blend asks {prefixes[i]!r} (source {i}) for {want} samples but it built "
                    f"{len(mid)}; raise `mid_level_dataset_surplus` (now {self.config.mid_level_dataset_surplus}), "
                    "e.g. two- or ten-fold")
        return MegascaleBlendedDataset(datasets=mids, weights=blend_weights, size=blend_size, index=index,
                                       config=self.config)

    def _gpt(self, store: DocumentStore, bookends: tuple[float, float], num_samples: int | None,
             split: int) -> MegascaleGPTDataset:
        cfg = self.config
        begin, end = document_range(bookends, len(store.document_lengths))
        indices = np.arange(begin, end, dtype=np.int32)
        drop_last = split != 1 or bool(getattr(cfg, "drop_last_partial_validation_sequence", True))
        index = build_gpt_sample_index(
            store.document_lengths, indices, num_samples=num_samples, sequence_length=int(cfg.sequence_length),
            seed=int(cfg.random_seed), add_extra_token=bool(getattr(cfg, "add_extra_token_to_sequence", True)),
            drop_last_partial=drop_last, name=store.name)
        kind = MegascaleMockGPTDataset if cfg.mock else MegascaleGPTDataset
        return kind(documents=store, indices=indices, index=index, num_samples=num_samples, split=Split(split),
                    config=cfg)
