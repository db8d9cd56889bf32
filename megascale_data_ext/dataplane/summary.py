"""Buffer summaries: the metadata a Source Loader reports to the Planner (`summary_buffer`).

A summary never carries payloads: stream positions, sample indices and cost columns
(text tokens, image patches per image, any user column). The Planner builds a DGraph from
the summaries of all sources.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from megascale_data_ext.errors import PlanError


@dataclass(slots=True, kw_only=True)
class SourceSummary:
    """Metadata of the samples a source holds (or will hold) at stream positions `positions`.

    Positions count samples in the source's stream across epochs (position p is sample
    `index[p]` of epoch p // len(source)); they are what makes "each sample once per epoch"
    checkable. `image_offsets` has len(positions)+1 entries into `image_patch_counts`.
    """

    source: int
    name: str
    positions: np.ndarray
    indices: np.ndarray
    text_tokens: np.ndarray
    image_offsets: np.ndarray | None = None
    image_patch_counts: np.ndarray | None = None
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.positions)
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self.indices = np.asarray(self.indices, dtype=np.int64)
        self.text_tokens = np.asarray(self.text_tokens, dtype=np.int64)
        if self.image_offsets is None:
            self.image_offsets = np.zeros(n + 1, dtype=np.int64)
            self.image_patch_counts = np.zeros(0, dtype=np.int64)
        self.image_offsets = np.asarray(self.image_offsets, dtype=np.int64)
        self.image_patch_counts = np.asarray(self.image_patch_counts, dtype=np.int64)
        bad = [k for k, v in (("indices", self.indices), ("text_tokens", self.text_tokens)) if len(v) != n]
        bad += [k for k, v in self.extra.items() if len(v) != n]
        if len(self.image_offsets) != n + 1:
            bad.append("image_offsets")
        if bad:
            raise PlanError(f"summary of source {self.name!r}: columns {bad} do not have one entry per sample ({n})")

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def empty(cls, source: int, name: str) -> SourceSummary:
        """No samples of `source`: its part of a step that draws nothing of it."""
        z = np.zeros(0, dtype=np.int64)
        return cls(source=source, name=name, positions=z, indices=z, text_tokens=z)

    def image_patches_total(self) -> np.ndarray:
        """Patches per sample (all its images together)."""
        if not len(self.image_patch_counts):
            return np.zeros(len(self), dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(self.image_patch_counts)])
        return csum[self.image_offsets[1:]] - csum[self.image_offsets[:-1]]

    def seq_lengths(self) -> np.ndarray:
        """Sequence length per sample: text tokens plus image patches (the text column itself
        when the source has no images: no copy)."""
        return self.text_tokens + self.image_patches_total() if len(self.image_patch_counts) else self.text_tokens

    def head(self, n: int) -> SourceSummary:
        """The first `n` samples (stream order): what a FIFO buffer serves next."""
        return self.window(0, n)

    def window(self, start: int, n: int) -> SourceSummary:
        """Samples ``[start, start + n)`` of this summary (rows, not stream positions)."""
        stop = min(start + n, len(self))
        off = self.image_offsets[start: stop + 1]
        base = int(off[0]) if len(off) else 0
        # Slices of a checked summary are consistent: skip the checks (the Planner slices every drawn
        # source each step, 1,000+ at a time).
        window = object.__new__(SourceSummary)
        window.source, window.name = self.source, self.name
        window.positions, window.indices = self.positions[start:stop], self.indices[start:stop]
        window.text_tokens = self.text_tokens[start:stop]
        window.image_offsets = off - base if base else off
        window.image_patch_counts = (self.image_patch_counts[base: off[-1]] if len(off)
                                     else self.image_patch_counts[:0])
        window.extra = {k: v[start:stop] for k, v in self.extra.items()} if self.extra else {}
        return window


_SOURCE, _NAME = operator.attrgetter("source"), operator.attrgetter("name")


@dataclass(slots=True, kw_only=True)
class BufferSummary:
    """Summaries of every source, indexed by source id (`sources[i].source == i`)."""

    sources: list[SourceSummary]

    @classmethod
    def of(cls, summaries: Sequence[SourceSummary] | Mapping[int, SourceSummary]) -> BufferSummary:
        items = list(summaries.values()) if isinstance(summaries, Mapping) else list(summaries)
        order = list(map(_SOURCE, items))  # C-level passes: a step's buffer at 1,000+ sources is mostly empties
        if order != list(range(len(items))):
            items.sort(key=_SOURCE)
            order = list(map(_SOURCE, items))
            if order != list(range(len(items))):
                raise PlanError(f"buffer summaries must cover sources 0..{len(items) - 1}, got {order}")
        return cls(sources=items)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(map(_NAME, self.sources))
