"""Seeded synthetic workloads shaped like the paper's datasets (Fig. 2), as columnar arrays.

Benchmarks and tests need the *skew* of real multimodal data, not its bytes: the balancers'
gains come from a few long texts and high-resolution images among many short ones. Each
generator draws from a `numpy.random.Generator` so a (name, size, seed, context) tuple always
gives the same batch.

Workloads:
    * ``coyo`` — 5 sources, one 16×16-patch image per sample. 98.3% of samples have
      ≤ 64 text tokens and the ~1.7% above carry ≈ 9.3% of text tokens (paper: 98.23% /
      1.62% / 9.3%); patches per image are skewed the same way (variable resolution).
    * ``navit`` — 306 sources with Zipf weights and per-source length scales, 14×14
      patches, longer texts, sometimes several (or zero) images per sample.
    * ``long-short`` — pure text, many short documents and ~3% long ones up to the context.
    * ``long-tail`` — pure text where 2% of documents exceed a GPU's cap: ``context`` is the
      longest document, a GPU's cap is ``context / LONG_TAIL_SPAN``; the body is capped there
      and the tail spreads up to the context (the case hybrid context parallelism is for).

Columns: ``source`` int32[n], ``text_tokens`` int64[n], ragged images as
``image_offsets`` int64[n+1] into ``image_patch_counts`` int64[total_images].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from megascale_data_ext.errors import ConfigError

__all__ = ["LONG_TAIL_SPAN", "PAPER_WORKLOADS", "Workload", "WorkloadName", "fill_workload", "generate_workload",
           "megatron_windows", "workload_names"]

WorkloadName = Literal["coyo", "navit", "long-short", "long-tail"]
#: A long-tail workload's longest document over the per-GPU cap it is planned with.
LONG_TAIL_SPAN = 8


@dataclass(slots=True, kw_only=True)
class Workload:
    """A batch of synthetic samples in columnar form (sample i's images are
    ``image_patch_counts[image_offsets[i]:image_offsets[i+1]]``)."""

    name: str
    source: np.ndarray
    text_tokens: np.ndarray
    image_offsets: np.ndarray
    image_patch_counts: np.ndarray
    num_sources: int
    patch_size: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.text_tokens.shape[0])

    @property
    def num_images(self) -> int:
        return int(self.image_patch_counts.shape[0])

    def images_per_sample(self) -> np.ndarray:
        return np.diff(self.image_offsets)

    def image_patches(self) -> np.ndarray:
        """Total patches per sample (int64[n])."""
        csum = np.concatenate(([0], np.cumsum(self.image_patch_counts, dtype=np.int64)))
        return csum[self.image_offsets[1:]] - csum[self.image_offsets[:-1]]

    def seq_lens(self) -> np.ndarray:
        """Backbone sequence length per sample: text tokens + image patch tokens."""
        return self.text_tokens + self.image_patches()

    def image_sample_index(self) -> np.ndarray:
        """For every image, the index of the sample it belongs to."""
        return np.repeat(np.arange(self.num_samples, dtype=np.int64), self.images_per_sample())

    def head(self, n: int) -> Workload:
        """The first `n` samples (a prefix keeps generation deterministic under trimming)."""
        n = min(n, self.num_samples)
        end = int(self.image_offsets[n])
        return Workload(
            name=self.name,
            source=self.source[:n].copy(),
            text_tokens=self.text_tokens[:n].copy(),
            image_offsets=self.image_offsets[: n + 1].copy(),
            image_patch_counts=self.image_patch_counts[:end].copy(),
            num_sources=self.num_sources,
            patch_size=self.patch_size,
        )

    def clip(self, context: int) -> Workload:
        """Fit every sample into `context` tokens, as a pipeline's truncate/resize step would.

        Text of samples with images keeps at most half the context; images of an oversize
        sample are scaled down proportionally, keeping ≥ 1 patch each.
        """
        if context <= 0:
            raise ConfigError(f"`context` must be > 0, got {context!r}")
        n_img = self.images_per_sample()
        if np.any(2 * n_img > context):
            raise ConfigError(f"context {context} is too small for samples with {int(n_img.max())} images")
        text_cap = np.where(n_img > 0, context // 2, context)
        text = np.minimum(self.text_tokens, text_cap)
        patches = self.image_patches()
        room = context - text - n_img  # reserve one patch per image for the max(1, ·) below
        scale = np.where(patches > room, room / np.maximum(patches, 1), 1.0)
        per_image_scale = np.repeat(scale, n_img)
        counts = np.where(
            per_image_scale < 1.0,
            np.maximum(1, np.floor(self.image_patch_counts * per_image_scale)).astype(np.int64),
            self.image_patch_counts,
        )
        return Workload(
            name=self.name,
            source=self.source,
            text_tokens=text.astype(np.int64),
            image_offsets=self.image_offsets,
            image_patch_counts=counts,
            num_sources=self.num_sources,
            patch_size=self.patch_size,
        )


def _ragged_images(rng: np.random.Generator, n_img: np.ndarray, draw: Callable[[int], np.ndarray]) -> tuple:
    offsets = np.zeros(n_img.shape[0] + 1, dtype=np.int64)
    np.cumsum(n_img, out=offsets[1:])
    return offsets, draw(int(offsets[-1])).astype(np.int64)


def _two_part(rng: np.random.Generator, n: int, tail_p: float, body: Callable, tail: Callable) -> np.ndarray:
    is_tail = rng.random(n) < tail_p
    out = body(n)
    k = int(is_tail.sum())
    if k:
        out[is_tail] = tail(k)
    return out


def _coyo(rng: np.random.Generator, n: int, context: int) -> Workload:
    weights = np.array([0.35, 0.25, 0.2, 0.12, 0.08])
    source = rng.choice(5, size=n, p=weights).astype(np.int32)
    # Body ≤ 64 tokens (mean ≈ 16); the tail is 65 + exponential(32): ≈ 9.3% of text tokens.
    text = _two_part(
        rng, n, 0.017,
        lambda k: np.clip(np.rint(rng.lognormal(np.log(13.0), 0.65, k)), 1, 64),
        lambda k: 65 + np.rint(rng.exponential(32.0, k)),
    ).astype(np.int64)

    def patches(k: int) -> np.ndarray:
        # Grid sides in 16-px patches: mostly ~272 px images (≤ 29 patches a side), and a 1.7%
        # tail of 480–960 px ones (30–60 a side).
        tail = rng.random(k) < 0.017
        sides = np.clip(np.rint(rng.lognormal(np.log(17.0), 0.25, (2, k))), 4, 29)
        sides = np.where(tail, rng.integers(30, 61, (2, k)), sides)
        return sides[0] * sides[1]

    offsets, counts = _ragged_images(rng, np.ones(n, dtype=np.int64), patches)
    return Workload(name="coyo", source=source, text_tokens=text, image_offsets=offsets,
                    image_patch_counts=counts, num_sources=5, patch_size=16)


_NAVIT_SOURCES = 306


def _navit(rng: np.random.Generator, n: int, context: int) -> Workload:
    # Source weights and length scales are a property of the dataset, not of the draw: fixed seed.
    src_rng = np.random.default_rng(306)
    weights = 1.0 / np.arange(1, _NAVIT_SOURCES + 1) ** 0.8
    weights = src_rng.permutation(weights / weights.sum())
    text_scale = src_rng.lognormal(0.0, 0.35, _NAVIT_SOURCES)
    image_scale = src_rng.lognormal(0.0, 0.15, _NAVIT_SOURCES)
    source = rng.choice(_NAVIT_SOURCES, size=n, p=weights).astype(np.int32)
    text = np.clip(np.rint(rng.lognormal(np.log(110.0), 0.9, n) * text_scale[source]), 4, context)
    n_img = rng.choice(np.array([0, 1, 2, 3, 4, 6]), size=n, p=[0.05, 0.8, 0.08, 0.04, 0.02, 0.01])
    img_scale = np.repeat(image_scale[source], n_img)

    def patches(k: int) -> np.ndarray:
        # Native resolution in 14-px patches: 56–1022 px sides, heavy right tail.
        sides = rng.lognormal(np.log(22.0), 0.45, (2, k)) * img_scale
        sides = np.clip(np.rint(sides), 4, 73)
        return sides[0] * sides[1]

    offsets, counts = _ragged_images(rng, n_img, patches)
    return Workload(name="navit", source=source, text_tokens=text.astype(np.int64), image_offsets=offsets,
                    image_patch_counts=counts, num_sources=_NAVIT_SOURCES, patch_size=14)


def _long_short(rng: np.random.Generator, n: int, context: int) -> Workload:
    is_long = rng.random(n) < 0.03
    text = np.clip(np.rint(rng.lognormal(np.log(300.0), 1.0, n)), 16, context)
    k = int(is_long.sum())
    text[is_long] = rng.integers(context // 4, context + 1, k)
    return Workload(name="long-short", source=is_long.astype(np.int32), text_tokens=text.astype(np.int64),
                    image_offsets=np.zeros(n + 1, dtype=np.int64), image_patch_counts=np.zeros(0, dtype=np.int64),
                    num_sources=2, patch_size=0)


def _long_tail(rng: np.random.Generator, n: int, context: int) -> Workload:
    cap = max(context // LONG_TAIL_SPAN, 16)
    text = np.clip(np.rint(rng.lognormal(np.log(600.0), 1.0, n)), 16, cap)
    is_long = rng.random(n) < 0.02
    k = int(is_long.sum())
    text[is_long] = rng.integers(cap + 1, max(context, cap + 1) + 1, k)
    return Workload(name="long-tail", source=is_long.astype(np.int32), text_tokens=text.astype(np.int64),
                    image_offsets=np.zeros(n + 1, dtype=np.int64), image_patch_counts=np.zeros(0, dtype=np.int64),
                    num_sources=2, patch_size=0)


_GENERATORS: dict[str, Callable[[np.random.Generator, int, int], Workload]] = {
    "coyo": _coyo,
    "navit": _navit,
    "long-short": _long_short,
    "long-tail": _long_tail,
}


def workload_names() -> list[str]:
    return list(get_args(WorkloadName))


#: The paper's workloads (Fig. 2): every document fits the context; the benches' default grid.
PAPER_WORKLOADS = ("coyo", "navit", "long-short")


def generate_workload(name: WorkloadName | str, num_samples: int, *, seed: int = 0, context: int = 8192) -> Workload:
    """Draw `num_samples` samples of workload `name`, unclipped (use `.clip(context)`).

    `context` only bounds long-short's long documents and navit's texts.
    """
    if name not in _GENERATORS:
        raise ConfigError(f"unknown workload {name!r}; known workloads: {workload_names()}")
    if num_samples < 0:
        raise ConfigError(f"`num_samples` must be >= 0, got {num_samples!r}")
    return _GENERATORS[name](np.random.default_rng(seed), int(num_samples), int(context))


def fill_workload(name: WorkloadName | str, target_tokens: int, *, seed: int = 0, context: int = 8192) -> Workload:
    """The longest prefix of a seeded, context-clipped draw whose sequence lengths sum ≤ target.

    This is how a global batch "fills" DP × m × context tokens of capacity.
    """
    n = max(16, int(target_tokens / 256))
    while True:
        wl = generate_workload(name, n, seed=seed, context=context).clip(context)
        csum = np.cumsum(wl.seq_lens())
        if csum[-1] >= target_tokens:
            return wl.head(int(np.searchsorted(csum, target_tokens, side="right")))
        n *= 2


def megatron_windows(lengths: np.ndarray, seq_length: int, count: int) -> list[list[int]]:
    """What Megatron's GPTDataset trains on: the documents concatenated in order and cut every
    `seq_length` tokens, a document split at a window edge continuing in the next window. The
    first `count` windows, each as the lengths of the document pieces it holds (sum `seq_length`
    while the documents last). The vanilla baseline of a balancing benchmark (issue 26)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_length < 1 or count < 0:
        raise ConfigError(f"megatron_windows: seq_length must be >= 1 and count >= 0, got {seq_length}, {count}")
    ends = np.cumsum(lengths)
    starts = ends - lengths
    windows = []
    for w in range(count):
        lo, hi = w * seq_length, (w + 1) * seq_length
        first, stop = int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(starts, hi, side="left"))
        pieces = np.minimum(ends[first:stop], hi) - np.maximum(starts[first:stop], lo)
        windows.append([int(p) for p in pieces if p > 0])
    return windows
