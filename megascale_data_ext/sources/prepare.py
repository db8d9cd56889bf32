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
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    nbytes: int = 0  # input bytes this row consumed: what the progress bar counts against its total
    text: str | None = None
    image_paths: list[str] = field(default_factory=list)
    error: str | None = None


def _jsonl_rows(path: Path, kind: PreparedKind, keys: Sequence[str] = ("text",),
                image_key: str = "image") -> Iterator[_Row]:
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                yield _Row(where="", nbytes=len(raw), error=None, text=None)  # blank: progress only
                continue
            where, n = f"{path}:{lineno}", len(raw)
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield _Row(where=where, nbytes=n, error=f"invalid JSON: {exc}")
                continue
            if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in keys):
                fields = " and ".join(f'"{k}"' for k in keys) + (" fields" if len(keys) > 1 else " field")
                yield _Row(where=where, nbytes=n, error=f"expected an object with a string {fields} (--json-keys)")
                continue
            images = rec.get(image_key) if kind == "image-text" else None
            items = [] if images is None else images if isinstance(images, list) else [images]
            yield _Row(where=where, nbytes=n, text="\n\n".join(rec[k] for k in keys),
                       image_paths=[str(path.parent / p) for p in items])


def _input_files(inputs: Sequence[str], kind: PreparedKind) -> list[Path]:
    """The files ``inputs`` name, directories expanded as the module docstring says; fails fast."""
    out: list[Path] = []
    for entry in inputs:
        path = Path(entry)
        if not path.exists():
            raise SourceError(f"prepare: input {entry!r} not found; check the --input paths")
        if path.is_dir():
            if kind == "image-text":
                images = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
                if not images:
                    raise SourceError(f"prepare: directory {entry!r} holds no images {IMAGE_SUFFIXES}; "
                                      "use --kind text for text files")
                out.extend(images)
                continue
            files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
            if not files:
                raise SourceError(f"prepare: directory {entry!r} holds no .txt or .jsonl files")
            out.extend(files)
        elif path.suffix in (".jsonl", ".txt"):
            out.append(path)
        else:
            raise SourceError(f"prepare: input {entry!r} is neither .txt, .jsonl nor a directory")
    return out


def _file_rows(path: Path, kind: PreparedKind, split_lines: bool, keys: Sequence[str] = ("text",),
               image_key: str = "image") -> Iterator[_Row]:
    if path.suffix.lower() in IMAGE_SUFFIXES:
        caption = path.with_suffix(".txt")
        text = caption.read_text(encoding="utf-8").strip() if caption.is_file() else ""
        yield _Row(where=str(path), nbytes=path.stat().st_size, text=text, image_paths=[str(path)])
    elif path.suffix == ".jsonl":
        yield from _jsonl_rows(path, kind, keys, image_key)
    elif split_lines:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                yield _Row(where=f"{path}:{lineno}" if line.strip() else "", nbytes=len(raw),
                           text=line if line.strip() else None)
    else:
        data = path.read_bytes()
        yield _Row(where=str(path), nbytes=len(data), text=data.decode("utf-8", errors="replace"))


def prepare(
    inputs: Sequence[str],
    out_dir: str,
    *,
    kind: PreparedKind = "text",
    tokenizer: str | None = None,
    tokenizer_type: str | None = None,
    merge_file: str | None = None,
    patch_size: int = 16,
    max_image_patches: int = 1024,
    row_group_rows: int = 1024,
    rows_per_file: int = 100_000,
    split_lines: bool = False,
    json_keys: Sequence[str] = ("text",),
    image_key: str = "image",
    progress: bool = True,
) -> PrepareResult:
    """Convert ``inputs`` into Parquet shards with cost columns under ``out_dir``.

    ``tokenizer`` / ``tokenizer_type`` / ``merge_file`` are a source's keys of the same names
    (Megatron's ``--tokenizer-model``/``--vocab-file``, ``--tokenizer-type``, ``--merge-file``):
    a source configured with the same values plans from the written cost columns. The progress
    bar counts input bytes against their total, so it shows an ETA. ``json_keys`` name the JSONL
    fields holding the text (Megatron's ``--json-keys``; several are joined by a blank line),
    ``image_key`` the field with image paths. ``manifest.json`` in ``out_dir`` records what was
    written, from what and with which tokenizer (`MANIFEST`).

    Raises:
        ConfigError: Bad options (kind, sizes, tokenizer file or type).
        SourceError: An input is missing or of an unknown type, or no row could be written.
    """
    from tqdm import tqdm

    if not inputs:
        raise ConfigError("prepare: give at least one --input")
    if not json_keys:
        raise ConfigError("prepare: --json-keys needs at least one key")
    tok = load_tokenizer(tokenizer, tokenizer_type=tokenizer_type, merge_file=merge_file, key="--tokenizer")
    writer = PreparedParquetWriter(
        out_dir,
        kind=kind,
        tokenizer=tok,
        patch_size=patch_size,
        max_image_patches=max_image_patches,
        row_group_rows=row_group_rows,
        rows_per_file=rows_per_file,
    )
    files = _input_files(inputs, kind)
    result = PrepareResult(written=writer.summary)
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(desc="prepare", total=total, unit="B", unit_scale=True, file=sys.stderr, disable=not progress,
               mininterval=0.5)
    try:
        for path in files:
            bar.set_postfix_str(f"{writer.summary.rows} rows, {path.name}", refresh=False)
            for row in _file_rows(path, kind, split_lines, json_keys, image_key):
                bar.update(row.nbytes)
                if row.error is not None:
                    result.skipped.append((row.where, row.error))
                    continue
                if row.text is None:  # blank line
                    continue
                try:
                    images = [Path(p).read_bytes() for p in row.image_paths]
                    writer.add(row.text, images)
                except (OSError, SampleError) as exc:
                    result.skipped.append((row.where, str(exc)))
    finally:
        bar.close()
        writer.close()
    if result.written.rows > 0:
        write_manifest(out_dir, result, inputs=files, tokenizer=tok, settings={
            "kind": kind, "tokenizer": tokenizer, "tokenizer_type": tokenizer_type, "merge_file": merge_file,
            "patch_size": patch_size, "max_image_patches": max_image_patches, "json_keys": list(json_keys),
            "image_key": image_key, "split_lines": split_lines})
    if result.written.rows == 0:
        first = "; ".join(f"{where}: {why}" for where, why in result.skipped[:3])
        raise SourceError(f"prepare: no rows written from {list(inputs)} ({len(result.skipped)} rows skipped"
                          + (f", first: {first}" if first else "") + "); give inputs with usable text")
    return result


MANIFEST = "manifest.json"


def write_manifest(out_dir: str, result: PrepareResult, *, inputs: Sequence[Path], tokenizer: Any,
                   settings: dict[str, Any]) -> Path:
    """``manifest.json``: the shards (name, bytes), totals, the inputs, the settings and tokenizer
    fingerprint, the rows skipped, and the source entry that reads the directory."""
    w = result.written
    name = Path(out_dir).resolve().name
    source = {"name": name, "format": "parquet", "paths": [str(Path(out_dir).resolve())]}
    source.update({k: settings[k] for k in ("tokenizer", "tokenizer_type", "merge_file") if settings.get(k)})
    manifest = {
        "format_version": 1,
        "files": [{"name": Path(f).name, "bytes": Path(f).stat().st_size} for f in w.files],
        "totals": {"rows": w.rows, "tokens": w.tokens, "images": w.images, "patches": w.patches, "bytes": w.bytes},
        "inputs": [str(p) for p in inputs],
        "settings": settings,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "skipped_rows": len(result.skipped),
        "source": source,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = Path(out_dir) / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


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
    lines.append(f"manifest: {Path(out_dir) / MANIFEST}")
    lines += [f"  {where}: {reason}" for where, reason in result.skipped[:5]]
    if len(result.skipped) > 5:
        lines.append(f"  ... and {len(result.skipped) - 5} more")
    return os.linesep.join(lines)
