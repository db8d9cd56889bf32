"""Deterministic demo corpora shaped like the paper's workloads (see ``WORKLOADS.md``).

* coyo-like image-text Parquet sources: real Pillow-made JPEGs of varied size (most small, a
  few large, so patch counts are skewed) and captions where ~98% have <= 64 tokens and the
  ~1.7% long ones carry ~9% of the text tokens (paper Fig. 2a);
* long-short text Parquet sources: many short documents and a few very long ones;
* one Megatron ``.bin/.idx`` text source, so the migration path is exercised too.

Everything is a pure function of ``seed`` and the sizes; a few thousand rows take seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megascale_data_ext.sources.base import SourceSpec
from megascale_data_ext.sources.images import synthetic_jpeg
from megascale_data_ext.sources.tokenizer import ByteTokenizer
from megascale_data_ext.sources.writer import IMAGE_COLUMN, TEXT_COLUMN, PreparedParquetWriter

_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


def _word_pool(rng: np.random.Generator, size: int = 2048) -> np.ndarray:
    lengths = rng.integers(2, 10, size=size)
    return np.array([_LETTERS[rng.integers(0, 26, n)].tobytes().decode() for n in lengths], dtype=object)


def _text(rng: np.random.Generator, words: np.ndarray, num_bytes: int) -> str:
    """Random words, cut to exactly ``num_bytes`` ASCII bytes (one byte-level token each)."""
    n_words = max(1, num_bytes // 5 + 1)
    return " ".join(words[rng.integers(0, len(words), n_words)])[:num_bytes].rstrip() or "a"


def caption_lengths(rng: np.random.Generator, n: int, *, long_fraction: float = 0.017) -> np.ndarray:
    """coyo-like caption lengths in tokens before EOD: short <= 63, a few long (65-260)."""
    short = np.clip(rng.lognormal(np.log(22.0), 0.55, n), 3, 63).astype(np.int64)
    long = rng.integers(65, 260, n)
    return np.where(rng.random(n) < long_fraction, long, short)


def document_lengths(
    rng: np.random.Generator, n: int, *, long_fraction: float = 0.05, max_len: int = 16_000
) -> np.ndarray:
    """long-short document lengths in tokens: lognormal short docs plus a heavy long tail."""
    short = np.clip(rng.lognormal(np.log(200.0), 0.8, n), 8, 2000).astype(np.int64)
    long = rng.integers(2000, max_len, n)
    return np.where(rng.random(n) < long_fraction, long, short)


def image_sizes(rng: np.random.Generator, n: int, *, scale: float = 1.0) -> np.ndarray:
    """``[n, 2]`` (width, height): mostly small images, ~5% large, varied aspect ratios."""
    side = np.clip(rng.lognormal(np.log(120.0 * scale), 0.35, n), 24, 1024)
    side = np.where(rng.random(n) < 0.05, rng.uniform(320, 640, n) * scale, side)
    aspect = np.exp(rng.uniform(np.log(0.5), np.log(2.0), n))
    w = np.clip(side * np.sqrt(aspect), 16, 1024).astype(np.int64)
    h = np.clip(side / np.sqrt(aspect), 16, 1024).astype(np.int64)
    return np.stack([w, h], axis=1)


def make_demo_data(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    text_sources: int = 3,
    image_sources: int = 2,
    rows: int = 1000,
    image_rows: int | None = None,
    megatron_source: bool = True,
    megatron_rows: int | None = None,
    patch_size: int = 16,
    max_image_patches: int = 1024,
    row_group_rows: int = 256,
    rows_per_file: int = 1000,
    validation_rows: int | None = None,
) -> list[SourceSpec]:
    """Write the demo sources under ``out_dir`` and return their specs (byte-level tokenizer).

    Args:
        out_dir: Created if missing; one sub-directory per source.
        seed: Everything written is a deterministic function of it.
        text_sources: Long-short text Parquet sources (``text-<k>``).
        image_sources: coyo-like image-text Parquet sources (``coyo-<k>``).
        rows: Rows per text source.
        image_rows: Rows per image source (default ``rows // 2``: JPEG encoding dominates).
        megatron_source: Also write a Megatron ``.bin/.idx`` source (``megatron-text``).
        megatron_rows: Documents in it (default ``rows``).
        patch_size: Patch edge recorded with the image cost columns.
        max_image_patches: Patch cap recorded with the image cost columns.
        row_group_rows: Rows per Parquet row group.
        rows_per_file: Rows per Parquet file (several files per source by default).
        validation_rows: Rows of the held-out long-short text source `VALIDATION_SOURCE`
            (``conf/sources/demo_text.yaml``'s ``validation.sources``; default ``rows // 4``, 0 =
            none), drawn from its own random stream, so the other sources are the same with or
            without it. It is written beside them but not returned: the returned specs are the
            training sources (`validation_spec` gives it).
    """
    out = Path(out_dir)
    tok = ByteTokenizer()
    specs: list[SourceSpec] = []
    root = np.random.SeedSequence(seed)
    children = root.spawn(text_sources + image_sources + 1)
    for k in range(text_sources):
        rng = np.random.default_rng(children[k])
        words = _word_pool(rng)
        src_dir = out / f"text-{k}"
        with PreparedParquetWriter(
            src_dir, kind="text", tokenizer=tok, row_group_rows=row_group_rows, rows_per_file=rows_per_file
        ) as w:
            for n in document_lengths(rng, rows, long_fraction=0.02 + 0.03 * k):
                w.add(_text(rng, words, int(n)))
        specs.append(SourceSpec(name=f"text-{k}", format="parquet", paths=[str(src_dir)], text_column=TEXT_COLUMN))
    n_img = image_rows if image_rows is not None else max(1, rows // 2)
    for k in range(image_sources):
        rng = np.random.default_rng(children[text_sources + k])
        words = _word_pool(rng)
        src_dir = out / f"coyo-{k}"
        sizes = image_sizes(rng, n_img, scale=1.0 + 0.5 * k)
        with PreparedParquetWriter(
            src_dir,
            kind="image-text",
            tokenizer=tok,
            patch_size=patch_size,
            max_image_patches=max_image_patches,
            row_group_rows=row_group_rows,
            rows_per_file=rows_per_file,
        ) as w:
            for i, n in enumerate(caption_lengths(rng, n_img)):
                jpeg = synthetic_jpeg(int(sizes[i, 0]), int(sizes[i, 1]), seed=int(rng.integers(2**31)))
                w.add(_text(rng, words, int(n)), [jpeg])
        specs.append(
            SourceSpec(
                name=f"coyo-{k}",
                format="parquet",
                paths=[str(src_dir)],
                text_column=TEXT_COLUMN,
                image_column=IMAGE_COLUMN,
                patch_size=patch_size,
                max_image_patches=max_image_patches,
            )
        )
    if megatron_source:
        from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

        rng = np.random.default_rng(children[-1])
        lengths = document_lengths(rng, megatron_rows if megatron_rows is not None else rows)
        docs = (rng.integers(tok.OFFSET, tok.vocab_size, int(n)) for n in lengths)
        prefix = write_indexed_dataset(out / "megatron-text" / "text_document", docs, vocab_size=tok.vocab_size)
        specs.append(SourceSpec(name="megatron-text", format="megatron", paths=[prefix], append_eod=True))
    held_out = rows // 4 if validation_rows is None else validation_rows
    if held_out > 0:
        rng = np.random.default_rng([seed, 0x7A11D])
        words = _word_pool(rng)
        with PreparedParquetWriter(
            out / VALIDATION_SOURCE, kind="text", tokenizer=tok, row_group_rows=row_group_rows,
            rows_per_file=rows_per_file
        ) as w:
            for n in document_lengths(rng, held_out, long_fraction=0.03):
                w.add(_text(rng, words, int(n)))
    return specs


VALIDATION_SOURCE = "valid-text"


def validation_spec(out_dir: str | os.PathLike[str]) -> SourceSpec:
    """The held-out source `make_demo_data` wrote under `out_dir`."""
    return SourceSpec(name=VALIDATION_SOURCE, format="parquet", paths=[str(Path(out_dir) / VALIDATION_SOURCE)],
                      text_column=TEXT_COLUMN)
