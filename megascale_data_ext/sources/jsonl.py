"""JSON Lines sources: one object per line, ``text`` plus optional image file path(s).

Meant for small corpora and quick experiments (``prepare`` turns them into Parquet with cost
columns for real runs). Opening parses every line once and checks what can be checked
without tokenizing: valid JSON, an object, a string text field, image files that exist. Bad
rows are thus found at start-up, not hours later when first sampled: with ``on_bad_rows:
error`` the source refuses to open, naming each row, unless ``max_bad_fraction`` allows that
many (then they stay samples that ``read()`` skips and counts); with ``on_bad_rows: skip``
they are left out of the source and reported once. ``read()`` seeks straight to the planned lines. Image paths are
relative to the JSONL file's directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from megascale_data_ext.errors import SampleError, SourceError
from megascale_data_ext.sources.base import BadRows, SourceSpec, make_metadata
from megascale_data_ext.sources.rowsource import RowSource, empty_source_error, resolve_files
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.transforms import RawSample

_log = logging.getLogger(__name__)
_SHOWN = 5  # bad rows spelled out in a message; the rest are counted


@dataclass(frozen=True, slots=True, kw_only=True)
class BadRow:
    """A JSONL line the source cannot use: where it is (``line`` is 1-based) and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} line {self.line}: {self.reason}"


def image_paths(record: dict, field: str | None, base_dir: str) -> list[str]:
    """The image file paths of one record (a string or a list of strings), made absolute."""
    if field is None or record.get(field) is None:
        return []
    value = record[field]
    items = value if isinstance(value, list) else [value]
    return [p if os.path.isabs(p) else os.path.join(base_dir, p) for p in items]


def row_problem(record: Any, spec: SourceSpec, base_dir: str) -> str | None:
    """Why a parsed line cannot be a sample of ``spec`` (``None``: it can)."""
    if not isinstance(record, dict):
        return f"the line is a JSON {type(record).__name__}, expected an object"
    text = record.get(spec.text_column)
    if not isinstance(text, str):
        got = "missing" if spec.text_column not in record else f"a {type(text).__name__}"
        return f"field {spec.text_column!r} (`text_column`) is {got}, expected a string"
    if spec.image_column is not None and record.get(spec.image_column) is not None:
        value = record[spec.image_column]
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(p, str) for p in items):
            return f"field {spec.image_column!r} (`image_column`) must be a path or a list of paths, got {value!r}"
        missing = [p for p in image_paths(record, spec.image_column, base_dir) if not os.path.isfile(p)]
        if missing:
            return f"image file {missing[0]!r} not found"
    return None


@dataclass(slots=True, kw_only=True)
class JsonlScan:
    """One file's rows (its non-blank lines), as opening found them."""

    offsets: np.ndarray  # byte offset of each row
    lines: np.ndarray  # 1-based line number of each row
    is_bad: np.ndarray  # which rows are bad
    bad_rows: list[BadRow]


def scan_jsonl(path: str, spec: SourceSpec) -> JsonlScan:
    """Parse and check every line of ``path`` once (blank lines are neither rows nor bad)."""
    offsets, lines, is_bad, bad = [], [], [], []
    base, pos = os.path.dirname(path), 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                try:
                    problem = row_problem(json.loads(raw), spec, base)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    problem = f"invalid JSON ({exc})"
                offsets.append(pos)
                lines.append(lineno)
                is_bad.append(problem is not None)
                if problem is not None:
                    bad.append(BadRow(path=path, line=lineno, reason=problem))
            pos += len(raw)
    return JsonlScan(offsets=np.asarray(offsets, dtype=np.int64), lines=np.asarray(lines, dtype=np.int64),
                     is_bad=np.asarray(is_bad, dtype=bool), bad_rows=bad)


def describe_bad_rows(bad: list[BadRow]) -> str:
    """The first few bad rows spelled out, the rest counted."""
    text = "; ".join(str(b) for b in bad[:_SHOWN])
    return text + (f"; ... and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else "")


class _FileFault(SampleError):
    """A line the file lost since the source opened it (removed, truncated): the file's fault."""


class JsonlSource(RowSource):
    """The usable lines of one or more ``.jsonl`` files as samples, in file then line order.

    Attributes:
        bad_rows: The bad lines found when opening (left out under ``on_bad_rows: skip``).
    """

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(spec, tokenizer=tokenizer)
        self.paths = resolve_files(spec.name, spec.paths, suffixes=(".jsonl", ".json"))
        scans = [scan_jsonl(p, spec) for p in self.paths]
        self.bad_rows: list[BadRow] = [b for s in scans for b in s.bad_rows]
        rows = sum(len(s.offsets) for s in scans)
        key = f"data.sources.{spec.name}"
        skip = spec.on_bad_rows == BadRows.SKIP
        if self.bad_rows and not skip and len(self.bad_rows) > spec.max_bad_fraction * rows:
            raise SourceError(
                f"source {self.name!r}: {len(self.bad_rows)} of {rows} rows are bad, found when opening it "
                f"(`{key}.max_bad_fraction={spec.max_bad_fraction:g}` allows {int(spec.max_bad_fraction * rows)}): "
                f"{describe_bad_rows(self.bad_rows)}. Fix or delete those lines, leave them out of the source with "
                f"`{key}.on_bad_rows=skip`, or skip them when read with "
                f"`{key}.max_bad_fraction={math.ceil(len(self.bad_rows) / rows * 1000) / 1000:g}`"
            )
        # Under "error" the few bad rows max_bad_fraction allows stay samples that read() skips and counts.
        # A sample's ``row`` (in skip reports) is its place among its file's rows, as lint counts them.
        self._rows = [np.flatnonzero(~s.is_bad) if skip else np.arange(len(s.offsets)) for s in scans]
        self._offsets = [s.offsets[r] for s, r in zip(scans, self._rows, strict=True)]
        self._lines = [s.lines[r] for s, r in zip(scans, self._rows, strict=True)]
        self._start = np.concatenate([[0], np.cumsum([len(o) for o in self._offsets], dtype=np.int64)])
        self._sizes = [os.path.getsize(p) for p in self.paths]  # a line cut short later is the file's fault
        if len(self) == 0:
            why = f" (all {len(self.bad_rows)} rows are bad: {describe_bad_rows(self.bad_rows)})" * bool(self.bad_rows)
            raise empty_source_error(self.name, f"no usable lines in {self.paths[:3]}{why}")
        if self.bad_rows:
            _log.warning("source %r: %s %d bad row(s): %s", self.name,
                         f"left out (`{key}.on_bad_rows=skip`)" if skip else "will skip when read", len(self.bad_rows),
                         describe_bad_rows(self.bad_rows))

    def __len__(self) -> int:
        return int(self._start[-1])

    def _record(self, fh: BinaryIO, f_i: int, line: int) -> dict:
        fh.seek(int(self._offsets[f_i][line]))
        text = fh.readline()
        if not text.endswith(b"\n") and fh.tell() < self._sizes[f_i]:
            raise _FileFault(f"was truncated to {fh.tell()} bytes")  # the line ran into the file's new end
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:  # the file changed since it was opened
            raise SampleError(f"invalid JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise SampleError(f"line is a JSON {type(record).__name__}, expected an object")
        return record

    def where(self, index: int) -> str:
        """``file line N`` of sample ``index`` (for messages)."""
        f_i = int(np.searchsorted(self._start, index, side="right") - 1)
        return f"{self.paths[f_i]} line {int(self._lines[f_i][index - int(self._start[f_i])])}"

    def _compute_metadata(self) -> dict[str, np.ndarray]:
        spec, tf = self.spec, self._transform
        texts: list[str | None] = []
        patches: list[list[int]] = []
        for f_i, path in enumerate(self.paths):
            base = os.path.dirname(path)
            with open(path, "rb") as fh:
                for line in range(len(self._offsets[f_i])):
                    try:
                        record = self._record(fh, f_i, line)
                    except SampleError:
                        texts.append(None)  # changed since opening; read() skips it
                        patches.append([])
                        continue
                    text = record.get(spec.text_column)
                    texts.append(text if isinstance(text, str) else None)  # a bad row: read() skips it
                    images = []
                    for p in image_paths(record, spec.image_column, base):
                        try:
                            with open(p, "rb") as img:
                                images.append(img.read())
                        except OSError:
                            images.append(b"")
                    patches.append(tf.image_patch_counts(images))
        return make_metadata(tf.text_token_counts(texts), patches)

    def _raw_rows(self, indices: np.ndarray) -> list[RawSample]:
        spec = self.spec
        files = np.searchsorted(self._start, indices, side="right") - 1
        handles: dict[int, BinaryIO] = {}
        out = []
        gone: dict[int, str] = {}  # file -> why it cannot be read now (removed)
        sizes: dict[int, int] = {}
        with ExitStack() as stack:
            for index, f_i in zip(indices.tolist(), files.tolist(), strict=True):
                path, line = self.paths[f_i], index - int(self._start[f_i])
                if f_i not in handles and f_i not in gone:
                    try:
                        handles[f_i] = stack.enter_context(open(path, "rb"))
                        sizes[f_i] = os.fstat(handles[f_i].fileno()).st_size
                    except OSError as exc:  # opened fine at start: removed (or unreadable) since
                        gone[f_i] = f"cannot be opened any more ({exc.strerror or exc})"
                raw = RawSample(index=index, path=path, row=int(self._rows[f_i][line]))
                try:
                    if f_i in gone:
                        raise _FileFault(gone[f_i])
                    if int(self._offsets[f_i][line]) >= sizes[f_i]:
                        raise _FileFault(f"was truncated to {sizes[f_i]} bytes")
                    record = self._record(handles[f_i], f_i, line)
                    problem = row_problem(record, spec, os.path.dirname(path))
                    if problem is not None:
                        raise SampleError(problem)
                    raw.text = record[spec.text_column]
                    for p in image_paths(record, spec.image_column, os.path.dirname(path)):
                        with open(p, "rb") as img:
                            raw.images.append(img.read())
                except _FileFault as exc:
                    raw.error, raw.file_fault = str(exc), True
                except (SampleError, OSError) as exc:
                    raw.error = f"cannot load line: {exc}"
                out.append(raw)
        return out
