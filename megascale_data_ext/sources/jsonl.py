"""JSON Lines sources: one object per line, ``text`` plus optional image file path(s).

Meant for small corpora and quick experiments (``prepare`` turns them into Parquet with cost
columns for real runs): opening scans each file once for line offsets, ``metadata()`` has to
parse every line, ``read()`` seeks straight to the planned lines. Image paths are relative to
the JSONL file's directory.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import BinaryIO

import numpy as np

from megascale_data_ext.errors import SampleError, SourceError
from megascale_data_ext.sources.base import SourceSpec, make_metadata
from megascale_data_ext.sources.rowsource import RowSource, resolve_files
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.transforms import RawSample


def line_offsets(path: str) -> np.ndarray:
    """Byte offsets of the non-blank lines of ``path`` (one scan, no parsing)."""
    offsets = []
    pos = 0
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return np.asarray(offsets, dtype=np.int64)


def image_paths(record: dict, field: str | None, base_dir: str) -> list[str]:
    """The image file paths of one record (a string or a list of strings), made absolute."""
    if field is None or record.get(field) is None:
        return []
    value = record[field]
    items = value if isinstance(value, list) else [value]
    return [p if os.path.isabs(p) else os.path.join(base_dir, p) for p in items]


class JsonlSource(RowSource):
    """Lines of one or more ``.jsonl`` files as samples, in file then line order."""

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(spec, tokenizer=tokenizer)
        self.paths = resolve_files(spec.name, spec.paths, suffixes=(".jsonl", ".json"))
        self._offsets = [line_offsets(p) for p in self.paths]
        self._start = np.concatenate([[0], np.cumsum([len(o) for o in self._offsets], dtype=np.int64)])
        if len(self) == 0:
            raise SourceError(f"source {self.name!r} is empty: no lines in {self.paths[:3]}")

    def __len__(self) -> int:
        return int(self._start[-1])

    def _record(self, fh: BinaryIO, f_i: int, line: int) -> dict:
        fh.seek(int(self._offsets[f_i][line]))
        try:
            record = json.loads(fh.readline())
        except json.JSONDecodeError as exc:
            raise SampleError(f"invalid JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise SampleError(f"line is a JSON {type(record).__name__}, expected an object")
        return record

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
                        texts.append(None)  # read() skips it; counts as EOD only here
                        patches.append([])
                        continue
                    texts.append(record.get(spec.text_column))
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
        with ExitStack() as stack:
            for index, f_i in zip(indices.tolist(), files.tolist(), strict=True):
                path, line = self.paths[f_i], index - int(self._start[f_i])
                if f_i not in handles:
                    handles[f_i] = stack.enter_context(open(path, "rb"))
                raw = RawSample(index=index, path=path, row=line)
                try:
                    record = self._record(handles[f_i], f_i, line)
                    raw.text = record.get(spec.text_column)
                    for p in image_paths(record, spec.image_column, os.path.dirname(path)):
                        with open(p, "rb") as img:
                            raw.images.append(img.read())
                except (SampleError, OSError) as exc:
                    raw.error = f"cannot load line: {exc}"
                out.append(raw)
        return out
