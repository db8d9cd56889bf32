"""Shared machinery of the concrete sources: path resolution, metadata caching, read path.

A format only says how many rows it has, how to compute its cost columns, and how to extract
:class:`RawSample` rows for planned indices; :class:`RowSource` adds the rest of the
:class:`~megascale_data_ext.sources.base.Source` contract (index checks, transforms,
skip-and-count, cached metadata, context manager) identically for every format.
"""

from __future__ import annotations

import glob
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import (
    ReadResult,
    Sample,
    SkippedSample,
    SourceSpec,
    check_indices,
    take_metadata,
)
from megascale_data_ext.sources.file_faults import FileFaults
from megascale_data_ext.sources.tokenizer import Tokenizer, load_tokenizer
from megascale_data_ext.sources.transforms import RawSample, SampleTransform

_GLOB_CHARS = frozenset("*?[")


def resolve_files(source: str, paths: Sequence[str], *, suffixes: tuple[str, ...]) -> list[str]:
    """Expand files, globs and directories into a sorted, de-duplicated file list.

    Directories contribute their files ending in ``suffixes`` (recursively), globs their
    matches; an entry that matches nothing is an error, so a typo never silently drops data.
    """
    out: list[str] = []
    for entry in paths:
        if _GLOB_CHARS & set(entry):
            matches = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not matches:
                raise SourceError(f"source {source!r}: glob {entry!r} matches no files; check the path")
            out.extend(matches)
        elif os.path.isdir(entry):
            matches = sorted(str(p) for p in Path(entry).rglob("*") if p.is_file() and p.name.endswith(suffixes))
            if not matches:
                raise SourceError(f"source {source!r}: directory {entry!r} holds no {'/'.join(suffixes)} files")
            out.extend(matches)
        elif os.path.isfile(entry):
            out.append(entry)
        else:
            raise SourceError(f"source {source!r}: file {entry!r} not found; check `paths` in the source spec")
    return list(dict.fromkeys(out))


def empty_source_error(source: str, detail: str) -> SourceError:
    """The one wording of "this source has no samples": what was found, and the two fixes."""
    return SourceError(f"source {source!r} is empty: {detail}; point `data.sources.{source}.paths` at data, or "
                       f"remove the source from `data.sources`")


class RowSource(ABC):
    """Base of the concrete sources; owned by one thread (a Source Loader actor).

    Subclasses implement :meth:`__len__`, :meth:`_compute_metadata` and :meth:`_raw_rows`.
    Metadata for all samples is computed once on first use and kept (a few int64 per sample).
    """

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        # The spec's whole tokenizer setting (type, merges), named by its config key on error.
        self._transform = SampleTransform(spec, tokenizer if tokenizer is not None else load_tokenizer(spec))
        self._meta: dict[str, np.ndarray] | None = None
        self.file_faults = FileFaults(spec.name, spec.on_bad_rows)  # files gone bad mid-run

    @property
    def tokenizer(self) -> Tokenizer:
        return self._transform.tokenizer

    @property
    def eod_id(self) -> int:
        return self._transform.eod_id

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _compute_metadata(self) -> dict[str, np.ndarray]:
        """Cost columns of every sample, in index order."""

    @abstractmethod
    def _raw_rows(self, indices: np.ndarray) -> list[RawSample]:
        """Untransformed rows for valid ``indices``, in the same order; a row whose file went bad
        since opening is marked ``file_fault`` (`sources.file_faults`), never raised."""

    def where(self, index: int) -> str | None:
        """Where sample ``index`` lives (file and row) for messages; ``None`` when the format cannot say."""
        return None

    def metadata(self, indices: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Cost columns (``text_tokens``, ``num_images``, ragged image patches); never payloads.

        Raises:
            SourceError: Samples longer than ``max_tokens`` without ``truncate``, more than
                ``max_bad_fraction`` allows (see :meth:`_check_lengths`).
        """
        if self._meta is None:
            self._meta = self._check_lengths(self._compute_metadata())
        if indices is not None:
            indices = check_indices(self.name, indices, len(self))
        return take_metadata(self._meta, indices)

    def _check_lengths(self, meta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Refuse over-long samples now, from the cost columns, rather than in the balancer mid-run.

        A sample longer than ``max_tokens`` (the context, ``data.seq_length``, unless set lower)
        fits no microbatch. Without ``truncate`` ``read()`` skips it as bad; within the
        ``max_bad_fraction`` budget its cost is capped at ``max_tokens`` so the Planner can still
        place it (and ``read()`` reports it skipped), beyond it the source refuses to start.
        """
        spec, tokens = self.spec, meta["text_tokens"]
        if spec.max_tokens is None or spec.truncate:
            return meta
        over = np.flatnonzero(tokens > spec.max_tokens)
        if over.size == 0:
            return meta
        if over.size > spec.max_bad_fraction * len(tokens):
            longest = int(over[np.argmax(tokens[over])])
            where = self.where(longest)
            key, most = f"data.sources.{self.name}", int(tokens[longest])
            room = math.ceil(most / 128) * 128  # a seq_length that divides by 2 * pad_to_multiple_of * cp
            raise SourceError(
                f"source {self.name!r}: {over.size} of {len(tokens)} samples are longer than the "
                f"{spec.max_tokens}-token limit (`{key}.max_tokens`, which defaults to `data.seq_length`); the "
                f"longest has {most} tokens (sample {longest}{', ' + where if where else ''}). "
                f"Cut them to the limit with `{key}.truncate=true`, make room with "
                f"`data.seq_length={room} {key}.max_tokens={room}`, or skip them with "
                f"`{key}.max_bad_fraction={math.ceil(over.size / len(tokens) * 1000) / 1000:g}`"
            )
        return {**meta, "text_tokens": np.minimum(tokens, spec.max_tokens)}

    def read_report(self, indices: Sequence[int] | np.ndarray) -> ReadResult:
        """Transformed samples for ``indices`` plus the ones skipped as bad (exact accounting).

        Raises:
            SourceError: A file went bad mid-run under ``on_bad_rows: error``, or bad samples
                exceed ``max_bad_fraction``.
        """
        idx = check_indices(self.name, indices, len(self))
        if idx.size == 0:
            return ReadResult(samples=[], skipped=[])
        raws = self._raw_rows(idx)
        self.file_faults.apply(raws)
        return self._transform.run(raws)

    def read(self, indices: Sequence[int] | np.ndarray) -> list[Sample]:
        """Transformed samples for ``indices`` in request order, bad ones skipped (see ``read_report``)."""
        return self.read_report(indices).samples

    @property
    def bad_samples(self) -> list[SkippedSample]:
        """Every sample skipped so far, with reason, file and row."""
        return list(self._transform.tracker.skipped)

    @property
    def samples_read(self) -> int:
        """Samples requested from ``read()`` so far (good and bad)."""
        return self._transform.tracker.samples_read

    def bad_sample_reasons(self) -> dict[str, int]:
        """Skipped-sample counts grouped by reason."""
        return self._transform.tracker.reasons()

    def close(self) -> None:
        self._transform.close()

    def __enter__(self) -> RowSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, samples={len(self)})"
