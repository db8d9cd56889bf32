"""``prepare``: raw inputs → Parquet with cost columns, ready for ahead-of-fetch balancing.

Inputs, by file type:

* ``*.txt``: one document per file (or per non-blank line with ``split_lines``);
* ``*.jsonl``: one row per line, ``{"text": ..., "image": path or [paths]}`` with image paths
  relative to the JSONL file (images ignored for ``kind="text"``);
* a directory: with ``kind="image-text"``, every image file in it (sorted) paired with the
  caption in the ``.txt`` file of the same stem; with ``kind="text"``, its ``.txt``/``.jsonl``
  files.

Rows whose image cannot be read or whose JSON is invalid are skipped and counted; the
summary names the first few.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megascale_data_ext.errors import ConfigError, SampleError, SourceError
from megascale_data_ext.sources.tokenizer import load_tokenizer
from megascale_data_ext.sources.writer import PreparedKind, PreparedParquetWriter, WriteSummary

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


@dataclass(slots=True, kw_only=True)
class PrepareResult:
    """Written shards plus the rows skipped as bad (``(where, reason)`` pairs)."""

    written: WriteSummary
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class _Row:
    where: str
    text: str | None = None
    image_paths: list[str] = field(default_factory=list)
    error: str | None = None


def _jsonl_rows(path: Path, kind: PreparedKind) -> Iterator[_Row]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                yield _Row(where=where, error=f"invalid JSON: {exc}")
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                yield _Row(where=where, error='expected an object with a string "text" field')
                continue
            images = rec.get("image") if kind == "image-text" else None
            items = [] if images is None else images if isinstance(images, list) else [images]
            yield _Row(where=where, text=rec["text"], image_paths=[str(path.parent / p) for p in items])


def _input_rows(inputs: Sequence[str], kind: PreparedKind, split_lines: bool) -> Iterator[_Row]:
    for entry in inputs:
        path = Path(entry)
        if not path.exists():
            raise SourceError(f"prepare: input {entry!r} not found")
        if path.is_dir():
            if kind == "image-text":
                images = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
                if not images:
                    raise SourceError(f"prepare: directory {entry!r} holds no images {IMAGE_SUFFIXES}")
                for img in images:
                    caption = img.with_suffix(".txt")
                    text = caption.read_text(encoding="utf-8").strip() if caption.is_file() else ""
                    yield _Row(where=str(img), text=text, image_paths=[str(img)])
                continue
            files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
            if not files:
                raise SourceError(f"prepare: directory {entry!r} holds no .txt or .jsonl files")
            yield from _input_rows([str(f) for f in files], kind, split_lines)
        elif path.suffix == ".jsonl":
            yield from _jsonl_rows(path, kind)
        elif path.suffix == ".txt":
            text = path.read_text(encoding="utf-8", errors="replace")
            if split_lines:
                for lineno, line in enumerate(text.splitlines(), 1):
                    if line.strip():
                        yield _Row(where=f"{path}:{lineno}", text=line)
            else:
                yield _Row(where=str(path), text=text)
        else:
            raise SourceError(f"prepare: input {entry!r} is neither .txt, .jsonl nor a directory")


def prepare(
    inputs: Sequence[str],
    out_dir: str,
    *,
    kind: PreparedKind = "text",
    tokenizer: str | None = None,
    patch_size: int = 16,
    max_image_patches: int = 1024,
    row_group_rows: int = 1024,
    rows_per_file: int = 100_000,
    split_lines: bool = False,
    progress: bool = True,
) -> PrepareResult:
    """Convert ``inputs`` into Parquet shards with cost columns under ``out_dir``.

    Raises:
        ConfigError: Bad options (kind, sizes, tokenizer file).
        SourceError: An input is missing or of an unknown type, or no row could be written.
    """
    from tqdm import tqdm

    if not inputs:
        raise ConfigError("prepare: give at least one --input")
    tok = load_tokenizer(tokenizer)
    writer = PreparedParquetWriter(
        out_dir,
        kind=kind,
        tokenizer=tok,
        patch_size=patch_size,
        max_image_patches=max_image_patches,
        row_group_rows=row_group_rows,
        rows_per_file=rows_per_file,
    )
    result = PrepareResult(written=writer.summary)
    bar = tqdm(desc="prepare", unit="rows", file=sys.stderr, disable=not progress, mininterval=0.5)
    try:
        for row in _input_rows(inputs, kind, split_lines):
            bar.update(1)
            if row.error is not None:
                result.skipped.append((row.where, row.error))
                continue
            try:
                images = [Path(p).read_bytes() for p in row.image_paths]
                writer.add(row.text or "", images)
            except (OSError, SampleError) as exc:
                result.skipped.append((row.where, str(exc)))
    finally:
        bar.close()
        writer.close()
    if result.written.rows == 0:
        raise SourceError(f"prepare: no rows written from {list(inputs)} ({len(result.skipped)} skipped)")
    return result


def format_summary(result: PrepareResult, out_dir: str) -> str:
    """Human-readable end-of-run summary."""
    w = result.written
    lines = [
        f"wrote {w.rows} rows to {len(w.files)} file(s) in {out_dir} ({w.bytes / 1e6:.2f} MB)",
        f"text tokens (incl. EOD): {w.tokens}  mean {w.tokens / max(w.rows, 1):.1f}/row",
    ]
    if w.images:
        lines.append(f"images: {w.images}  patches: {w.patches}  mean {w.patches / w.images:.1f}/image")
    lines.append(f"skipped rows: {len(result.skipped)}")
    lines += [f"  {where}: {reason}" for where, reason in result.skipped[:5]]
    if len(result.skipped) > 5:
        lines.append(f"  ... and {len(result.skipped) - 5} more")
    return os.linesep.join(lines)
