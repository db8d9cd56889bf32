"""Writing Parquet with precomputed cost columns (what ``prepare`` and the demo data emit).

Cost columns (``num_tokens``: tokens incl. EOD; ``image_patches``: patches per image) sit next
to the payload columns (``text``, ``image`` as a list of encoded images) so a
:class:`~megascale_data_ext.sources.parquet.ParquetSource` can plan from the small cost
columns alone. The tokenizer fingerprint and patch settings go into the file's key-value
metadata; a source with other settings recomputes instead of trusting stale costs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.sources.images import header_patch_count
from megascale_data_ext.sources.parquet import (
    KV_MAX_PATCHES,
    KV_PATCH_SIZE,
    KV_TOKENIZER,
    PATCHES_COLUMN,
    TOKENS_COLUMN,
)
from megascale_data_ext.sources.tokenizer import Tokenizer

PreparedKind = Literal["text", "image-text"]
TEXT_COLUMN = "text"
IMAGE_COLUMN = "image"
_IMAGE_WRITE_BATCH = 16  # values per write batch in image-text files (see _flush)


@dataclass(slots=True, kw_only=True)
class WriteSummary:
    """What a writer produced; printed by ``prepare``."""

    files: list[str] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0
    images: int = 0
    patches: int = 0
    bytes: int = 0


class PreparedParquetWriter:
    """Buffers rows and writes them as ``{prefix}-{k:05d}.parquet`` shards under ``out_dir``.

    Rows are written in row groups of ``row_group_rows`` and files of ``rows_per_file`` rows.
    Image patch counts come from the image header (no decode), with the same grid rule the
    reader's patchifier uses. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        kind: PreparedKind,
        tokenizer: Tokenizer,
        patch_size: int = 16,
        max_image_patches: int = 1024,
        row_group_rows: int = 1024,
        rows_per_file: int = 100_000,
        prefix: str = "part",
    ) -> None:
        if kind not in ("text", "image-text"):
            raise ConfigError(f"`kind` must be one of ['text', 'image-text'], got {kind!r}")
        if row_group_rows < 1 or rows_per_file < 1:
            raise ConfigError(
                f"`row_group_rows` and `rows_per_file` (--row-group-rows, --rows-per-file) must be >= 1, got "
                f"{row_group_rows} and {rows_per_file}"
            )
        self.out_dir = str(out_dir)
        try:
            os.makedirs(self.out_dir, exist_ok=True)
        except OSError as exc:  # a file of that name, no permission
            raise ConfigError(f"cannot write Parquet shards to {self.out_dir!r} ({exc.strerror}): name a directory "
                              "to create or an empty one (--output)") from exc
        self.kind, self.tokenizer, self.prefix = kind, tokenizer, prefix
        self.patch_size, self.max_image_patches = patch_size, max_image_patches
        self.row_group_rows, self.rows_per_file = row_group_rows, rows_per_file
        self.summary = WriteSummary()
        fields = [pa.field(TEXT_COLUMN, pa.string()), pa.field(TOKENS_COLUMN, pa.int32())]
        if kind == "image-text":
            fields += [pa.field(IMAGE_COLUMN, pa.list_(pa.binary())), pa.field(PATCHES_COLUMN, pa.list_(pa.int32()))]
        kv = {
            KV_TOKENIZER: tokenizer.fingerprint(),
            KV_PATCH_SIZE: str(patch_size),
            KV_MAX_PATCHES: str(max_image_patches),
        }
        self.schema = pa.schema(fields, metadata=kv)
        self._buf: dict[str, list] = {f.name: [] for f in fields}
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0

    def add(self, text: str, images: Sequence[bytes] = ()) -> None:
        """Append one row; its costs are computed here.

        Raises:
            SampleError: An image header cannot be read (the caller decides to skip or fail).
        """
        patches = [
            header_patch_count(b, patch_size=self.patch_size, max_patches=self.max_image_patches) for b in images
        ]
        num_tokens = int(self.tokenizer.count([text])[0]) + 1
        self._buf[TEXT_COLUMN].append(text)
        self._buf[TOKENS_COLUMN].append(num_tokens)
        if self.kind == "image-text":
            self._buf[IMAGE_COLUMN].append(list(images))
            self._buf[PATCHES_COLUMN].append(patches)
            self.summary.images += len(images)
            self.summary.patches += sum(patches)
        self.summary.rows += 1
        self.summary.tokens += num_tokens
        if len(self._buf[TEXT_COLUMN]) >= min(self.row_group_rows, self.rows_per_file - self._rows_in_file):
            self._flush()

    def _flush(self) -> None:
        n = len(self._buf[TEXT_COLUMN])
        if n == 0:
            return
        if self._writer is None:
            path = os.path.join(self.out_dir, f"{self.prefix}-{len(self.summary.files):05d}.parquet")
            # Encoded images never repeat in real data: a dictionary over them only makes every
            # reader that streams a row group hold the whole dictionary page beside its rows.
            # And pyarrow closes a page only between write batches (1,024 values by default): with
            # images that is a whole row group in one page, which a streaming reader must hold
            # decompressed. Batches of 16 images keep pages near the 1 MiB target.
            dictionary = [f.name for f in self.schema if f.name != IMAGE_COLUMN]
            self._writer = pq.ParquetWriter(path, self.schema, use_dictionary=dictionary,
                                            write_batch_size=_IMAGE_WRITE_BATCH if self.kind == "image-text" else None)
            self.summary.files.append(path)
        table = pa.Table.from_pydict(self._buf, schema=self.schema)
        self._writer.write_table(table, row_group_size=self.row_group_rows)
        self._buf = {k: [] for k in self._buf}
        self._rows_in_file += n
        if self._rows_in_file >= self.rows_per_file:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self.summary.bytes += os.path.getsize(self.summary.files[-1])
            self._writer = None
            self._rows_in_file = 0

    def close(self) -> WriteSummary:
        """Flush and close the last file; returns the summary."""
        self._flush()
        self._close_file()
        return self.summary

    def __enter__(self) -> PreparedParquetWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
