"""``megascale-data lint``: open every file of every source of a data config and find what is bad.

File by file (each opened alone, exactly as a Source Loader opens its source, so one bad file
does not hide the others) it checks

* the schema: Parquet columns the spec names exist with usable types (text: string; tokens:
  list of integers; images: binary, list of binary or a struct with ``bytes``; the prepared cost
  columns ``num_tokens``: integer, ``image_patches``: list of integers); JSONL lines are JSON
  objects whose text field is a string and image field a path or a list of paths;
* every row's cost metadata: rows with no tokens (only the EOD the transform appends), images
  whose header cannot be read (0 patches);
* every row's payload through the source's own read path (``read_report``, tolerance off):
  undecodable JSONL lines, null texts, missing or undecodable images (``--no-decode`` checks
  image headers only), rows longer than ``max_tokens`` without ``truncate`` — and that the
  payload has exactly the tokens and patches the cost columns promised the Planner.

Each bad row is reported with its file and row (JSONL: the file's line number), then a
summary per source. Exit status 0 when clean, 1 when anything is wrong, 2 when the config
itself cannot be loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import add_config_arguments, fail, load_data_config
from megascale_data_ext.errors import MegascaleDataError

NAME = "lint"
HELP = "Check every file and row of a data config's sources (schema, cost columns, bad rows); exit 1 on problems."

SUFFIXES = {"parquet": (".parquet", ".pq"), "jsonl": (".jsonl", ".json"), "webdataset": (".tar",)}


@dataclass(slots=True, kw_only=True)
class Finding:
    """One problem: a whole file (``row`` None) or one row of it (``line``: JSONL line number, 1-based)."""

    source: str
    path: str
    problem: str
    row: int | None = None
    line: int | None = None

    def where(self) -> str:
        if self.line is not None:
            return f"{self.path}:{self.line}"
        return self.path if self.row is None else f"{self.path} row {self.row}"


@dataclass(slots=True)
class SourceReport:
    name: str
    format: str
    files: int = 0
    rows: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def bad_rows(self) -> int:
        return len({(f.path, f.row) for f in self.findings if f.row is not None})

    @property
    def file_problems(self) -> int:
        return sum(f.row is None for f in self.findings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--no-read", action="store_true", help="schema and cost metadata only, no payload read")
    parser.add_argument("--no-decode", action="store_true", help="check image headers only, do not decode pixels")
    parser.add_argument("--chunk", type=int, default=256, help="rows read per call (256)")
    parser.add_argument("--max-print", type=int, default=50, help="bad rows printed per source (50; all in --json)")
    parser.add_argument("--json", type=Path, help="write every finding and the summary here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- schema ----------------------------------------------------------------------
def parquet_schema_problems(spec: Any, path: str) -> list[str]:
    """What is wrong with a Parquet file's columns for `spec` (opening problems included)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megascale_data_ext.sources.parquet import column_problems

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        return [f"cannot open as Parquet ({type(exc).__name__}: {exc})"]
    return column_problems(spec, schema)


def jsonl_lines(spec: Any, path: str) -> tuple[list[int], list[tuple[int, str]]]:
    """Line number (1-based) of each row (non-blank line) of a JSONL file, and the rows' schema problems."""
    lines, problems = [], []
    text_key, image_key = spec.text_column, spec.image_column
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            row = len(lines)
            lines.append(number)
            try:
                record = json.loads(raw.strip())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problems.append((row, f"invalid JSON: {exc}"))
                continue
            if not isinstance(record, dict):
                problems.append((row, f"line is a JSON {type(record).__name__}, expected an object"))
                continue
            text = record.get(text_key)
            if text is None:
                problems.append((row, f"no text: field {text_key!r} is missing or null"))
            elif not isinstance(text, str):
                problems.append((row, f"field {text_key!r} is of type {type(text).__name__}, expected a string"))
            images = record.get(image_key) if image_key else None
            if images is not None and not (isinstance(images, str) or (
                    isinstance(images, list) and all(isinstance(p, str) for p in images))):
                problems.append((row, f"field {image_key!r} must be a path or a list of paths, got {images!r:.60}"))
    return lines, problems


# -- files -----------------------------------------------------------------------
def source_files(spec: Any) -> list[str]:
    """The files (Megatron: prefixes) of a source, as its reader resolves them."""
    from megascale_data_ext.sources.rowsource import resolve_files

    if spec.format == "megatron":
        return [p[:-4] if p.endswith((".bin", ".idx")) else p for p in spec.paths]
    if spec.format in SUFFIXES:
        return resolve_files(spec.name, spec.paths, suffixes=SUFFIXES[spec.format])
    return [",".join(spec.paths)]  # a plugged-in format: the whole source is one unit


@dataclass(slots=True)
class _File:
    spec: Any
    path: str
    source: Any = None
    lines: list[int] | None = None  # JSONL line numbers by row
    flagged: dict[int, str] = field(default_factory=dict)  # row -> first problem


_EMPTY = "no tokens (empty text)"


def _eod(spec: Any) -> int:
    """Tokens the transform appends to every row: the EOD, unless a tokens/Megatron source turns it off."""
    return 1 if (spec.format != "megatron" and not spec.tokens_column) or spec.append_eod else 0


def _short(reason: str) -> str:
    return reason.split(" (source=")[0]


class Linter:
    """Collects the findings of one config's sources; `run()` drives the progress bar."""

    def __init__(self, specs: list[Any], *, read: bool = True, decode: bool = True, chunk: int = 256) -> None:
        self.specs, self.read, self.decode, self.chunk = specs, read, decode, max(1, chunk)
        self.reports = {s.name: SourceReport(s.name, s.format) for s in specs}

    def _add(self, f: _File, problem: str, row: int | None = None) -> None:
        if row is not None:
            if row in f.flagged:
                return
            f.flagged[row] = problem
        line = f.lines[row] if (row is not None and f.lines is not None and row < len(f.lines)) else None
        self.reports[f.spec.name].findings.append(Finding(source=f.spec.name, path=f.path, problem=problem,
                                                          row=row, line=line))

    def open_all(self) -> Iterator[_File]:
        """Every file, schema-checked and opened (files that cannot be opened are findings)."""
        from megascale_data_ext.sources.registry import open_source

        for spec in self.specs:
            report = self.reports[spec.name]
            try:
                paths = source_files(spec)
            except MegascaleDataError as exc:
                self._add(_File(spec, ", ".join(spec.paths)), str(exc))
                continue
            for path in paths:
                report.files += 1
                f = _File(spec, path)
                problems = parquet_schema_problems(spec, path) if spec.format == "parquet" else []
                for p in problems:
                    self._add(f, p)
                if problems:
                    continue
                if spec.format == "jsonl":
                    f.lines, row_problems = jsonl_lines(spec, path)
                    for row, p in row_problems:
                        self._add(f, p, row)
                one = dataclasses.replace(spec, paths=[path] if spec.format in SUFFIXES or spec.format == "megatron"
                                          else spec.paths, max_bad_fraction=1.0,
                                          decode_images="constructor" if not self.decode else spec.decode_images)
                try:
                    f.source = open_source(one)
                except Exception as exc:  # SourceError, or a reader that fails in an unforeseen way
                    self._add(f, _short(str(exc)) if isinstance(exc, MegascaleDataError)
                              else f"cannot open: {type(exc).__name__}: {exc}")
                    continue
                report.rows += len(f.source)
                yield f

    def check(self, f: _File, progress: Any) -> None:
        """Metadata and payload checks of every row of one opened file."""
        src = f.source
        n = len(src)
        try:
            meta = src.metadata(None)
        except Exception as exc:
            self._add(f, f"cannot compute the cost columns: {type(exc).__name__}: {exc}")
            meta = None
        for start in range(0, n, self.chunk):
            idx = np.arange(start, min(n, start + self.chunk), dtype=np.int64)
            if self.read:
                self._read(f, idx, meta)
            progress.update(len(idx))
        if meta is not None:
            self._check_metadata(f, meta)
        src.close()

    def _read(self, f: _File, idx: np.ndarray, meta: dict[str, np.ndarray] | None) -> None:
        try:
            reports = [(idx, f.source.read_report(idx))]
        except Exception:  # pinpoint the row(s) a reader cannot cope with
            reports = []
            for i in idx.tolist():
                try:
                    reports.append((np.array([i]), f.source.read_report([i])))
                except Exception as exc:
                    self._add(f, f"read failed: {type(exc).__name__}: {exc}", i)
        for _, report in reports:
            for s in report.skipped:
                self._add(f, _short(s.reason), s.row if s.row is not None else s.index)
            offsets, counts = (meta["image_offsets"], meta["image_patch_counts"]) if meta is not None else (None, None)
            for s in report.samples:
                if len(s.tokens) <= _eod(f.spec):
                    self._add(f, _EMPTY + (" besides the EOD" if _eod(f.spec) else ""), s.index)
                if meta is None:
                    continue
                want = int(meta["text_tokens"][s.index])
                if len(s.tokens) != want:
                    self._add(f, f"cost metadata says {want} tokens, the payload has {len(s.tokens)} "
                                 "(stale num_tokens column? re-run prepare)", s.index)
                elif self.decode and s.images:
                    planned = counts[offsets[s.index]:offsets[s.index + 1]].tolist()
                    got = [int(np.asarray(im).shape[0]) for im in s.images]
                    if planned != got:
                        self._add(f, f"cost metadata says image patches {planned}, decoding gives {got} "
                                     "(stale image_patches column? re-run prepare)", s.index)

    def _check_metadata(self, f: _File, meta: dict[str, np.ndarray]) -> None:
        spec, eod = f.spec, _eod(f.spec)
        tokens = np.asarray(meta["text_tokens"], dtype=np.int64)
        for row in np.flatnonzero(tokens <= eod).tolist():
            self._add(f, _EMPTY + (" besides the EOD" if eod else ""), row)
        if spec.max_tokens is not None and not spec.truncate and not self.read:
            for row in np.flatnonzero(tokens > spec.max_tokens).tolist():
                self._add(f, f"{tokens[row]} tokens > max_tokens={spec.max_tokens} "
                             f"(data.sources.{spec.name}.truncate=true)", row)
        offsets, counts = meta["image_offsets"], meta["image_patch_counts"]
        for flat in np.flatnonzero(counts <= 0).tolist():
            row = int(np.searchsorted(offsets, flat, side="right") - 1)
            self._add(f, f"image {flat - int(offsets[row])}: header unreadable (0 patches)", row)

    def run(self, progress: bool = True) -> dict[str, SourceReport]:
        from tqdm import tqdm

        files = list(self.open_all())
        total = sum(len(f.source) for f in files)
        with tqdm(total=total, unit="row", desc=f"lint {len(files)} files", file=sys.stderr,
                  disable=not progress) as bar:
            for f in files:
                self.check(f, bar)
        for report in self.reports.values():
            report.findings.sort(key=lambda x: (x.path, -1 if x.row is None else x.row))
        return self.reports


def format_report(reports: dict[str, SourceReport], max_print: int) -> str:
    lines = []
    for r in reports.values():
        for i, f in enumerate(r.findings):
            if i == max_print:
                lines.append(f"{r.name}: ... {len(r.findings) - max_print} more (see --json)")
                break
            lines.append(f"{r.name}: {f.where()}: {f.problem}")
    head = ["source", "format", "files", "rows", "bad rows", "file problems"]
    body = [[r.name, r.format, str(r.files), f"{r.rows:,}", str(r.bad_rows), str(r.file_problems)]
            for r in reports.values()]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    if lines:
        lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    problems = sum(len(r.findings) for r in reports.values())
    bad = [r for r in reports.values() if r.findings]
    rows = sum(r.rows for r in reports.values())
    if problems:
        lines.append(f"lint: {problems} problem(s) ({sum(r.bad_rows for r in bad)} bad rows, "
                     f"{sum(r.file_problems for r in bad)} file problems) in {len(bad)} of {len(reports)} sources, "
                     f"{rows:,} rows checked")
    else:
        lines.append(f"lint: clean, {len(reports)} sources, {rows:,} rows checked")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        specs = load_data_config(args, check_paths=False).to_service_config().sources
    except MegascaleDataError as exc:
        return fail(exc)
    reports = Linter(specs, read=not args.no_read, decode=not args.no_decode, chunk=args.chunk).run(
        progress=not args.no_progress)
    print(format_report(reports, args.max_print))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"sources": [
            {"name": r.name, "format": r.format, "files": r.files, "rows": r.rows, "bad_rows": r.bad_rows,
             "file_problems": r.file_problems, "findings": [dataclasses.asdict(f) for f in r.findings]}
            for r in reports.values()]}, indent=1))
    return 1 if any(r.findings for r in reports.values()) else 0
