"""Drop-in replacement for Megatron's ``BlendedMegatronDatasetBuilder`` over this project's sources.

``MegascaleDatasetBuilder(cls, sizes, is_built_on_rank, config).build()`` takes the same
arguments as Megatron's builder (a ``GPTDatasetConfig``: ``blend`` or ``blend_per_split``,
``split``, mock data) and returns ``[train, valid, test]`` map-style datasets whose items have
the keys, dtypes and shapes of Megatron's ``GPTDataset`` (blends add ``dataset_id`` as
Megatron's ``BlendedDataset`` does). What differs, and why:

* No rank-0 index build behind a barrier and no cache files: every index is a pure numpy
  function of (document lengths, seed, sequence length, split, sizes, weights)
  (:mod:`megascale_data_ext.megatron.blend`), so any rank computes it alone in milliseconds to
  seconds and a restarted job recomputes the same data order. ``path_to_cache`` is ignored.
* Each source's sample stream is Megatron's: the same seeded document shuffle and the same
  ``sequence_length + 1``-token windows, so a single-prefix split equals Megatron's
  ``GPTDataset`` sample for sample, and each source of a blend serves Megatron's samples in
  Megatron's order.
* Blends have exactly ``sizes[i]`` samples (Megatron builds ``sum(ceil(N * w))``), with
  per-source counts from the project's Mixer (within one sample of ``N * w``) spread evenly.
* Documents are read through :class:`~megascale_data_ext.sources.megatron_indexed.MegatronIndexedSource`
  (one document = one ``document_indices`` entry, tokens as stored, no EOD appended), so the
  split assigns document ranges; for data preprocessed without ``--split-sentences`` this is
  exactly Megatron's per-sequence split.

This map-style path runs in the trainer process and needs no Ray; the disaggregated service
path (planner, loaders, constructors) is the external data provider in ``runtime``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from megascale_data_ext.errors import ConfigError, SampleError
from megascale_data_ext.megatron.blend import (
    BlendIndex,
    GPTSampleIndex,
    build_blend_index,
    build_gpt_sample_index,
    document_range,
    surplus_sizes,
)

__all__ = ["MegascaleBlendedDataset", "MegascaleDatasetBuilder", "MegascaleGPTDataset", "ltor_masks_and_position_ids"]

_PAD_TOKEN_ID = -1  # Megatron's fallback pad id: never a real token
_NUM_SPLITS = 3


class DocumentStore(Protocol):
    """Random access to one source's documents (token ids as stored)."""

    name: str

    @property
    def document_lengths(self) -> np.ndarray: ...

    def documents(self, ids: np.ndarray) -> list[np.ndarray]: ...


class _IndexedDocuments:
    """A Megatron ``.bin/.idx`` prefix served through :class:`MegatronIndexedSource`."""

    def __init__(self, prefix: str) -> None:
        from megascale_data_ext.sources.base import SourceSpec
        from megascale_data_ext.sources.megatron_indexed import MegatronIndexedSource

        self.name = prefix
        spec = SourceSpec(name=os.path.basename(prefix) or prefix, format="megatron", paths=[prefix], append_eod=False)
        self._source = MegatronIndexedSource(spec)

    @property
    def document_lengths(self) -> np.ndarray:
        return self._source.document_lengths

    def documents(self, ids: np.ndarray) -> list[np.ndarray]:
        report = self._source.read_report(ids)
        if report.skipped:
            bad = report.skipped[0]
            raise SampleError(f"document {bad.index} cannot be read: {bad.reason}", source=self.name, path=bad.path,
                              row=bad.row)
        return [s.tokens for s in report.samples]


class _MockDocuments:
    """Megatron's synthetic documents (``MockGPTLowLevelDataset``): mock data equals Megatron's."""

    def __init__(self, tokenizer: Any) -> None:
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

        self.name = "mock"
        self._ds = MockGPTLowLevelDataset(tokenizer)

    @property
    def document_lengths(self) -> np.ndarray:
        return np.asarray(self._ds.sequence_lengths, dtype=np.int64)

    def documents(self, ids: np.ndarray) -> list[np.ndarray]:
        return [self._ds[int(i)] for i in ids]


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


class MegascaleGPTDataset(torch.utils.data.Dataset):
    """One source's split: sample ``i`` is Megatron ``GPTDataset``'s sample ``i``.

    Stateless and deterministic by index (safe to share with forked DataLoader workers);
    ``__getitem__(None)`` returns Megatron's padding sample (sample 0, loss masked).
    """

    def __init__(self, *, documents: DocumentStore, index: GPTSampleIndex, size: int | None, split: Any,
                 config: Any) -> None:
        self.documents, self.index, self.index_split, self.config = documents, index, split, config
        self.dataset_path = documents.name
        self.num_samples = len(index) if size is None else int(size)
        self._eod = int(config.tokenizer.eod)
        self._pad = _pad_token_id(config.tokenizer, bool(getattr(config, "allow_ambiguous_pad_tokens", False)))
        self._extra = bool(getattr(config, "add_extra_token_to_sequence", True))
        self._create_mask = bool(getattr(config, "create_attention_mask", True))
        self._causal_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.num_samples

    def text(self, idx: int) -> np.ndarray:
        """The ``sequence_length + 1`` int64 token window of sample ``idx``, padded at the stream's end."""
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.dataset_path!r} "
                             f"{self.index_split.name} split of {self.num_samples} samples")
        docs, begin, end = self.index.window(idx % self.num_samples)
        parts = self.documents.documents(np.asarray(docs, dtype=np.int64))
        text = np.concatenate(parts).astype(np.int64, copy=False)[begin:end] if parts else np.zeros(0, np.int64)
        want = self.index.sequence_length + self.index.extra_token
        if text.size < want:
            text = np.concatenate([text, np.full(want - text.size, self._pad, dtype=np.int64)])
        return text

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.text(0 if idx is None else int(idx)))
        if self._extra:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad
        cfg = self.config
        plain = not (cfg.reset_position_ids or cfg.reset_attention_mask)
        attention_mask, loss_mask, position_ids = ltor_masks_and_position_ids(
            tokens, self._eod, reset_position_ids=bool(cfg.reset_position_ids),
            reset_attention_mask=bool(cfg.reset_attention_mask), eod_mask_loss=bool(cfg.eod_mask_loss),
            create_attention_mask=self._create_mask and not (plain and self._causal_mask is not None))
        if self._create_mask and plain:  # the causal mask never changes: build it once, as Megatron caches it
            self._causal_mask = attention_mask if self._causal_mask is None else self._causal_mask
            attention_mask = self._causal_mask
        loss_mask[labels == self._pad] = 0.0
        tokens[tokens == self._pad] = 0
        labels[labels == self._pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        out = {"tokens": tokens, "labels": labels}
        if self._create_mask:
            out["attention_mask"] = attention_mask
        out.update(loss_mask=loss_mask, position_ids=position_ids)
        return out


class MegascaleBlendedDataset(torch.utils.data.Dataset):
    """A blend of per-source datasets; items carry ``dataset_id`` like Megatron's ``BlendedDataset``.

    Attributes mirror Megatron's (``datasets``, ``weights``, ``size``, ``split``,
    ``dataset_index``, ``dataset_sample_index``) for code that inspects them.
    """

    def __init__(self, *, datasets: Sequence[MegascaleGPTDataset], weights: Sequence[float], index: BlendIndex,
                 split: Any) -> None:
        self.datasets, self.weights, self.split = list(datasets), [float(w) for w in weights], split
        self.index_split = split
        self.dataset_index, self.dataset_sample_index = index.dataset_index, index.dataset_sample_index
        self.counts = index.counts
        self.size = len(index)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, Any]:
        source = self.dataset_index[idx]
        return {"dataset_id": source, **self.datasets[source][int(self.dataset_sample_index[idx])]}


class MegascaleDatasetBuilder:
    """``BlendedMegatronDatasetBuilder``'s interface, built from this project's sources.

    Args:
        cls: The dataset class Megatron would build (``GPTDataset`` or ``MockGPTDataset``); a
            mock class, like ``config.mock``, selects Megatron's synthetic documents.
        sizes: Samples per split (train, valid, test); ``None`` = one full epoch of the split.
        is_built_on_rank: Returns False on ranks that get ``None`` for every split.
        config: A ``GPTDatasetConfig``.
    """

    def __init__(self, cls: type, sizes: Sequence[int | None], is_built_on_rank: Callable[[], bool],
                 config: Any) -> None:
        self.cls, self.sizes, self.is_built_on_rank, self.config = cls, list(sizes), is_built_on_rank, config
        self._stores: dict[str, DocumentStore] = {}
        self._validate()

    def _validate(self) -> None:
        from megatron.core.datasets.gpt_dataset import GPTDataset

        cfg, problems = self.config, []
        if isinstance(self.cls, type) and not issubclass(self.cls, GPTDataset):
            problems.append(f"`cls` must be GPTDataset or a subclass, got {self.cls.__name__}")
        if len(self.sizes) != _NUM_SPLITS or not all(s is None or (isinstance(s, int | np.integer) and s >= 0)
                                                     for s in self.sizes):
            problems.append(f"`sizes` must be 3 non-negative ints or None (train, valid, test), got {self.sizes!r}")
        if not isinstance(cfg.sequence_length, int) or cfg.sequence_length < 1:
            problems.append(f"`sequence_length` must be a positive int, got {cfg.sequence_length!r}")
        if getattr(cfg.tokenizer, "eod", None) is None:
            problems.append("`tokenizer` must be set and define `eod` (GPT masks need the EOD id)")
        if not problems and not self._mock:
            blends = [cfg.blend] * _NUM_SPLITS if cfg.blend else list(cfg.blend_per_split or [None] * _NUM_SPLITS)
            for split, (blend, size) in enumerate(zip(blends, self.sizes, strict=True)):
                if blend is None:
                    continue
                prefixes, weights = blend
                if weights is not None and len(weights) != len(prefixes):
                    problems.append(f"split {split}: {len(weights)} weights for {len(prefixes)} prefixes")
                if weights is not None and size is None and len(prefixes) > 1:
                    problems.append(f"split {split}: weighted blends need a size; got sizes[{split}]=None with "
                                    f"weights {list(weights)} (give a size or drop the weights)")
        if problems:
            raise ConfigError("invalid MegascaleDatasetBuilder arguments: " + "; ".join(problems))

    @property
    def _mock(self) -> bool:
        from megatron.core.datasets.gpt_dataset import MockGPTDataset

        return bool(self.config.mock) or (isinstance(self.cls, type) and issubclass(self.cls, MockGPTDataset))

    def build(self) -> list[Any]:
        """``[train, valid, test]`` datasets (or lists of them for multiple validation sets); None where not built."""
        if not self.is_built_on_rank():
            return [None] * _NUM_SPLITS
        cfg = self.config
        if self._mock:
            store = _MockDocuments(cfg.tokenizer)
            return [self._single(store, b, s, i) for i, (b, s) in enumerate(zip(self._matrix, self.sizes, strict=True))]
        if cfg.blend:
            return [None if b is None else self._split(cfg.blend, b, s, i)
                    for i, (b, s) in enumerate(zip(self._matrix, self.sizes, strict=True))]
        return [None if blend is None else self._split(blend, (0.0, 1.0), s, i)
                for i, (blend, s) in enumerate(zip(cfg.blend_per_split, self.sizes, strict=True))]

    @property
    def _matrix(self) -> list[tuple[float, float] | None]:
        return list(self.config.split_matrix)

    def _store(self, prefix: str) -> DocumentStore:
        if prefix not in self._stores:
            self._stores[prefix] = _IndexedDocuments(prefix)
        return self._stores[prefix]

    def _split(self, blend: tuple[list[str], list[float] | None], bookends: tuple[float, float],
               size: int | None, split: int) -> Any:
        prefixes, weights = blend
        if len(prefixes) == 1 and (weights is None or not self.config.blend):
            return self._single(self._store(prefixes[0]), bookends, size, split)
        if split == 1 and getattr(self.config, "multiple_validation_sets", False) and not self.config.blend:
            return [self._single(self._store(p), bookends, size, split) for p in prefixes]
        if weights is None:
            datasets = [self._mid(self._store(p), bookends, None, split, None) for p in prefixes]
            lengths = [len(d) for d in datasets]
            total = sum(lengths)
            counts = lengths if size is None or size >= total else None
            index = build_blend_index(np.asarray(lengths, float) if total else np.ones(len(lengths)),
                                      total if counts is not None else int(size), names=self._names(prefixes),
                                      counts=counts)
            return MegascaleBlendedDataset(datasets=datasets, weights=lengths, index=index, split=self._enum(split))
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum() if np.all(np.isfinite(w)) and w.sum() > 0 else w
        index = build_blend_index(w, int(size), names=self._names(prefixes))  # validates the weights
        per_source = surplus_sizes(w, int(size), float(getattr(self.config, "mid_level_dataset_surplus", 0.005)))
        datasets = [self._mid(self._store(p), bookends, int(n), split, int(n)) for p, n in zip(prefixes, per_source,
                                                                                                 strict=True)]
        return MegascaleBlendedDataset(datasets=datasets, weights=w.tolist(), index=index, split=self._enum(split))

    @staticmethod
    def _names(prefixes: Sequence[str]) -> list[str]:
        return [f"{i}:{p}" for i, p in enumerate(prefixes)]  # prefixes may repeat in a blend

    @staticmethod
    def _enum(split: int) -> Any:
        from megatron.core.datasets.utils import Split

        return Split(split)

    def _single(self, store: DocumentStore, bookends: tuple[float, float] | None, size: int | None,
                split: int) -> MegascaleGPTDataset | None:
        return None if bookends is None else self._mid(store, bookends, size, split, size)

    def _mid(self, store: DocumentStore, bookends: tuple[float, float], num_samples: int | None, split: int,
             size: int | None) -> MegascaleGPTDataset:
        cfg = self.config
        begin, end = document_range(bookends, len(store.document_lengths))
        drop_last = split != 1 or bool(getattr(cfg, "drop_last_partial_validation_sequence", True))
        index = build_gpt_sample_index(
            store.document_lengths, np.arange(begin, end, dtype=np.int64), num_samples=num_samples,
            sequence_length=int(cfg.sequence_length), seed=int(cfg.random_seed),
            add_extra_token=bool(getattr(cfg, "add_extra_token_to_sequence", True)), drop_last_partial=drop_last,
            name=store.name)
        return MegascaleGPTDataset(documents=store, index=index, size=size, split=self._enum(split), config=cfg)
