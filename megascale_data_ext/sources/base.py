"""The Source contract between file formats and the runtime's Source Loader actors.

A source is a random-access collection of samples (one epoch = ``len(source)`` samples).
The Planner only ever sees :meth:`Source.metadata` (cost columns, never payloads), so the
balancing decisions can be made before a single payload byte is read ("ahead-of-fetch
balancing"); the Source Loader then calls :meth:`Source.read` for exactly the planned
indices. Everything here is plain Python/numpy so unit tests can build a source without Ray.
"""

from __future__ import annotations

import enum
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.sources.formats import SourceFormat, source_formats
from megascale_data_ext.sources.tokenizer import TokenizerType, tokenizer_types

class DecodeImages(enum.StrEnum):
    """Where a source's images are decoded: in its loader, or in the Data Constructor (the paper's
    transformation reordering: raw bytes travel, decoding runs beside the trainer)."""

    LOADER = "loader"
    CONSTRUCTOR = "constructor"


DecodeMode = Literal["loader", "constructor"]  # `DecodeImages` as the config schema types it
#: What opening a JSONL source does with rows it cannot use (invalid JSON, text not a string,
#: a missing image file): refuse at start-up, or leave them out of the source and report them once.
class BadRows(enum.StrEnum):
    ERROR = "error"
    SKIP = "skip"


BadRowPolicy = Literal["error", "skip"]  # `BadRows` as the config schema types it
#: One thing wrong with a config value: ``(field name, message)``; a config re-addresses the field.
FieldProblem = tuple[str, str]

#: Keys of the dict returned by :meth:`Source.metadata`; image patches are ragged
#: (``image_offsets[i]:image_offsets[i+1]`` slices ``image_patch_counts`` for sample ``i``).
METADATA_KEYS: tuple[str, ...] = ("text_tokens", "num_images", "image_offsets", "image_patch_counts")


@dataclass(slots=True, kw_only=True)
class Sample:
    """One transformed sample, as a Source Loader hands it to a Data Constructor.

    Attributes:
        source: Name of the source the sample came from.
        index: Index of the sample inside its source (the id the Planner planned).
        tokens: int64 text token ids, ending with the EOD id.
        images: One float32 ``[num_patches, patch_size * patch_size * 3]`` array per image
            (NaViT-style variable resolution). Empty when decoding is deferred.
        image_bytes: Raw encoded images when decoding is deferred to the Data Constructor
            (``decode_images="constructor"``); ``None`` otherwise.
        extra: Free-form per-sample fields (e.g. ``image_grids``: ``(rows, cols)`` per image).
    """

    source: str
    index: int
    tokens: np.ndarray
    images: list[np.ndarray] = field(default_factory=list)
    image_bytes: list[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class SkippedSample:
    """A sample that ``read()`` skipped under the tolerance policy, with why and where."""

    index: int
    reason: str
    path: str | None = None
    row: int | None = None
    file_fault: bool = False
    """Skipped because its file was removed, truncated or corrupted while the run read it
    (``on_bad_rows: skip``; not counted against ``max_bad_fraction``)."""


@dataclass(slots=True, kw_only=True)
class ReadResult:
    """What one ``read_report()`` call produced: samples in request order, minus the skipped.

    ``len(samples) + len(skipped) == len(indices)`` always holds, so the runtime's accounting
    of planned samples stays exact.
    """

    samples: list[Sample]
    skipped: list[SkippedSample]


@dataclass(slots=True, kw_only=True)
class SourceSpec:
    """Where a source's data is and how its samples are transformed.

    Attributes:
        name: Unique source name (used in plans, errors and metrics).
        format: File format; see :data:`SourceFormat`.
        paths: Files, globs or directories (Parquet/JSONL), or Megatron ``.bin/.idx`` prefixes.
        weight: Mixing weight, consumed by the mixing schedule (not by the source).
        text_column: Column/field holding raw text.
        tokens_column: Column holding pre-tokenized ids (used instead of ``text_column``).
        image_column: Column holding encoded image bytes (binary, list of binary, or struct
            with a ``bytes`` field); ``None`` for text-only sources.
        tokenizer: Tokenizer file as Megatron's ``--tokenizer-model`` / ``--vocab-file`` give it: a
            Hugging Face ``tokenizer.json``, a SentencePiece ``.model``, GPT-2's ``vocab.json``, or a
            directory holding one; ``None`` = the byte tokenizer (demos).
        tokenizer_type: Megatron's ``--tokenizer-type`` (``HuggingFaceTokenizer``,
            ``SentencePieceTokenizer``, ``GPT2BPETokenizer``, ``ByteTokenizer``); ``None`` = from
            the ``tokenizer`` path.
        merge_file: GPT-2 BPE ``merges.txt`` (Megatron's ``--merge-file``); ``None`` = beside the
            vocab file (``gpt2-vocab.json`` → ``gpt2-merges.txt``); relative to the vocab's directory.
        on_bad_rows: JSONL rows that cannot be used (invalid JSON, text not a string, missing image
            file) are found when the source opens: ``"error"`` refuses to start and names them
            (unless ``max_bad_fraction`` allows that many: then ``read()`` skips and counts them),
            ``"skip"`` leaves them out of the source and reports them once. The same policy
            applies, in every format, to rows whose file is truncated, corrupted or removed
            while the run reads it (`sources.file_faults`).
        patch_size: ViT patch edge in pixels.
        max_image_patches: Cap on patches per image; larger images are downscaled.
        decode_images: ``"loader"`` decodes/patchifies in ``read()``; ``"constructor"`` returns
            raw bytes and leaves :func:`~megascale_data_ext.sources.transforms.decode_images`
            to the Data Constructor.
        max_tokens: Longest allowed token sequence (incl. EOD); ``None`` = unlimited.
        truncate: Truncate longer samples to ``max_tokens`` instead of treating them as bad.
        max_bad_fraction: Fraction of samples read so far that may be skipped as bad before
            the source fails with ``SourceError``.
        append_eod: Megatron sources: append EOD to each document (set False when the data
            was preprocessed with ``--append-eod``).
        eod_token_id: EOD id override (Megatron sources whose tokenizer is not given).
        num_workers: Threads used by ``read()`` for tokenization and image decoding.
        row_group_cache: Decoded Parquet row groups kept in the LRU cache (windows of
            ``shuffle_window`` rows when that is set).
        shuffle_window: 0 = each epoch draws the source's samples in a global shuffle; W > 0 =
            in storage order (`dataplane.epoch_order`): row groups in a seeded order, rows
            shuffled within consecutive windows of W rows, as Megatron-Energon streams shards
            through a shuffle buffer. A Parquet reader then decodes W rows at a time and keeps
            ``row_group_cache`` windows instead of whole row groups.
    """

    name: str
    format: SourceFormat
    paths: list[str]
    weight: float = 1.0
    text_column: str = "text"
    tokens_column: str | None = None
    image_column: str | None = None
    tokenizer: str | None = None
    tokenizer_type: TokenizerType | None = None
    merge_file: str | None = None
    on_bad_rows: BadRowPolicy = "error"
    patch_size: int = 16
    max_image_patches: int = 1024
    decode_images: DecodeMode = "loader"
    max_tokens: int | None = None
    truncate: bool = False
    max_bad_fraction: float = 0.0
    append_eod: bool = True
    eod_token_id: int | None = None
    num_workers: int = 0
    row_group_cache: int = 4
    shuffle_window: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        self.paths = [str(p) for p in self.paths]
        problems = self.field_problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problems:
            lines = "\n  - ".join(f"`data.sources.{self.name}.{key}` {msg}" for key, msg in problems)
            raise ConfigError(f"invalid source spec {self.name!r}:\n  - {lines}")

    @classmethod
    def field_problems(cls, values: Mapping[str, Any]) -> list[FieldProblem]:
        """What is wrong with would-be field ``values``, as ``(field, message)``; empty = valid.

        A config checks its sources with this before building any spec, naming each field by
        its own config path.
        """
        v, out = values, list[FieldProblem]()
        if not v["name"] or not isinstance(v["name"], str):
            out.append(("name", f"must be a non-empty string, got {v['name']!r}"))
        if v["format"] not in source_formats():
            out.append(("format", f"must be one of {source_formats()}, got {v['format']!r}"))
        if not v["paths"]:
            out.append(("paths", "is empty: give files, globs, directories or Megatron prefixes"))
        if not (v["weight"] >= 0):
            out.append(("weight", f"must be >= 0, got {v['weight']!r}"))
        out += [(key, f"must be >= 1, got {v[key]!r}") for key in ("patch_size", "max_image_patches") if v[key] < 1]
        if v["tokenizer_type"] is not None and v["tokenizer_type"] not in tokenizer_types():
            out.append(("tokenizer_type", f"must be one of {tokenizer_types()} (Megatron's --tokenizer-type names) "
                                          f"or null, got {v['tokenizer_type']!r}"))
        for key, choices in (("on_bad_rows", BadRows), ("decode_images", DecodeImages)):
            if v[key] not in list(choices):
                out.append((key, f"must be one of {[c.value for c in choices]}, got {v[key]!r}"))
        if v["max_tokens"] is not None and v["max_tokens"] < 2:
            out.append(("max_tokens", f"must be >= 2 (one token plus EOD) or null, got {v['max_tokens']!r}"))
        if not 0.0 <= v["max_bad_fraction"] <= 1.0:
            out.append(("max_bad_fraction", f"must be in [0, 1], got {v['max_bad_fraction']!r}"))
        if v["num_workers"] < 0:
            out.append(("num_workers", f"must be >= 0, got {v['num_workers']!r}"))
        if v["row_group_cache"] < 1:
            out.append(("row_group_cache", f"must be >= 1, got {v['row_group_cache']!r}"))
        if not isinstance(v["shuffle_window"], int) or v["shuffle_window"] < 0:
            out.append(("shuffle_window", f"must be 0 (a global shuffle) or a number of rows >= 1, "
                                          f"got {v['shuffle_window']!r}"))
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SourceSpec:
        """Build a spec from a YAML/Hydra mapping, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"source spec {data.get('name', '?')!r} has unknown keys {unknown}; allowed: {sorted(known)}"
            )
        return cls(**dict(data))


@runtime_checkable
class Source(Protocol):
    """A random-access sample collection; implementations are not thread-safe.

    A Source Loader actor owns one instance and calls it from one thread; ``read()`` may use
    its own worker threads internally.
    """

    name: str

    def __len__(self) -> int:
        """Samples in one epoch."""
        ...

    def metadata(self, indices: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Cost columns for ``indices`` (all samples when ``None``); see :data:`METADATA_KEYS`."""
        ...

    def read(self, indices: Sequence[int]) -> list[Sample]:
        """Transformed payloads of the planned samples, bad ones skipped under the tolerance."""
        ...

    def close(self) -> None:
        """Release file handles and caches."""
        ...


def make_metadata(text_tokens: np.ndarray, patch_counts: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Pack per-sample token counts and per-image patch counts into the metadata layout."""
    num_images = np.fromiter((len(p) for p in patch_counts), dtype=np.int64, count=len(patch_counts))
    flat = np.fromiter((c for p in patch_counts for c in p), dtype=np.int64, count=int(num_images.sum()))
    return metadata_from_counts(text_tokens, num_images, flat)


def metadata_from_counts(
    text_tokens: np.ndarray, num_images: np.ndarray, flat_patch_counts: np.ndarray
) -> dict[str, np.ndarray]:
    """Metadata from per-sample image counts and the flattened per-image patch counts."""
    offsets = np.zeros(len(num_images) + 1, dtype=np.int64)
    np.cumsum(num_images, out=offsets[1:])
    if offsets[-1] != len(flat_patch_counts) or len(text_tokens) != len(num_images):
        raise ValueError(
            f"inconsistent metadata: {len(text_tokens)} samples, {len(num_images)} image counts summing to "
            f"{offsets[-1]}, {len(flat_patch_counts)} patch counts"
        )
    return {
        "text_tokens": np.asarray(text_tokens, dtype=np.int64),
        "num_images": np.asarray(num_images, dtype=np.int64),
        "image_offsets": offsets,
        "image_patch_counts": np.asarray(flat_patch_counts, dtype=np.int64),
    }


def text_only_metadata(text_tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Metadata of a source without images (every sample has zero images)."""
    n = len(text_tokens)
    return {
        "text_tokens": np.asarray(text_tokens, dtype=np.int64),
        "num_images": np.zeros(n, dtype=np.int64),
        "image_offsets": np.zeros(n + 1, dtype=np.int64),
        "image_patch_counts": np.zeros(0, dtype=np.int64),
    }


def take_metadata(meta: Mapping[str, np.ndarray], indices: np.ndarray | None) -> dict[str, np.ndarray]:
    """Gather the metadata rows ``indices`` (vectorized ragged take; ``None`` = copy all)."""
    if indices is None:
        return {k: np.array(meta[k], dtype=np.int64) for k in METADATA_KEYS}
    idx = np.asarray(indices, dtype=np.int64)
    counts = meta["num_images"][idx]
    starts = meta["image_offsets"][idx]
    offsets = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat_idx = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1], dtype=np.int64)
    return {
        "text_tokens": meta["text_tokens"][idx].astype(np.int64, copy=False),
        "num_images": counts.astype(np.int64, copy=False),
        "image_offsets": offsets,
        "image_patch_counts": meta["image_patch_counts"][flat_idx].astype(np.int64, copy=False),
    }


def check_indices(name: str, indices: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
    """Validate planned indices against the source length, naming the source on error."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= length):
        bad = idx[(idx < 0) | (idx >= length)][:5].tolist()
        raise IndexError(f"source {name!r}: indices {bad} out of range [0, {length})")
    return idx
