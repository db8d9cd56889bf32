"""Parquet sources: many files, opened once, read by row group, cost columns read alone.

Production row groups are 512 MB - 1 GB, so what a loader keeps per open file (footer,
schema, a decoded row-group buffer) dominates its memory (MegaScale-Data Fig. 4). This
reader keeps one :class:`pyarrow.parquet.ParquetFile` per file, maps a global row index to
``(file, row group, offset)`` with one ``searchsorted`` over cumulative row counts, and holds
at most ``spec.row_group_cache`` decoded row groups (LRU), each with the payload columns only,
and drops one as soon as each of its rows has been read (an epoch draws a row once).
With ``spec.shuffle_window`` = W (draws in storage order, `dataplane.epoch_order`) the unit is a
window of W rows of a row group instead: a row group is streamed in small batches (buffered
reads, never the whole column chunk at once, no pre-buffering) and at most ``row_group_cache``
windows are kept, so a source costs the window it is drawing from, not row groups.

``metadata()`` reads only the cost columns ``num_tokens`` / ``image_patches`` that
``prepare`` writes (ahead-of-fetch balancing: plans are made before any payload is read). A
file without them, or prepared with another tokenizer or patch setting (recorded in the
Parquet key-value metadata), has its costs computed by streaming its text/image column.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megascale_data_ext.dataplane.epoch_order import window_of_rows
from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import SourceSpec, metadata_from_counts, text_only_metadata
from megascale_data_ext.sources.file_faults import file_gone
from megascale_data_ext.sources.rowsource import RowSource, empty_source_error, resolve_files
from megascale_data_ext.sources.tokenizer import Tokenizer
from megascale_data_ext.sources.transforms import RawSample

#: Cost columns and the key-value metadata that says how they were computed.
TOKENS_COLUMN = "num_tokens"
PATCHES_COLUMN = "image_patches"
KV_TOKENIZER = "megascale.tokenizer"
KV_PATCH_SIZE = "megascale.patch_size"
KV_MAX_PATCHES = "megascale.max_image_patches"

_STREAM_BATCH_ROWS = 4096
_STREAM_BUFFER_BYTES = 128 << 10  # window reads: column chunks read through a buffer of this size
# Rows decoded per read while streaming windows: between reads pyarrow's column readers keep about
# twice the last batch's bytes, so a window is built from small batches, combined once it is whole.
_WINDOW_BATCH_ROWS = 16


@dataclass(slots=True)
class _RowGroupStream:
    """A row group read forward in windows: the next row offset and any rows read past it."""

    group: int
    batches: Iterator[pa.RecordBatch]
    offset: int = 0
    ahead: list[pa.RecordBatch] = field(default_factory=list)


def image_list(value: object) -> list[bytes]:
    """Normalize one image cell (bytes, list of bytes, ``{"bytes": ...}`` struct, null) to a list."""
    if value is None:
        return []
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [bytes(value)]
    if isinstance(value, dict):
        data = value.get("bytes")
        return [] if data is None else [bytes(data)]
    if isinstance(value, list):
        return [b for v in value for b in image_list(v)]
    raise TypeError(f"unsupported image cell of type {type(value).__name__}")


class ParquetSource(RowSource):
    """A source made of one or more Parquet files (see module docstring).

    ``io_counts`` counts the reads of each ``(purpose, file, columns)``; tests and benchmarks use
    it to check that planning never touches payload columns (counts, not a log: a loader reads
    for weeks).
    """

    def __init__(self, spec: SourceSpec, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(spec, tokenizer=tokenizer)
        self.window = spec.shuffle_window
        self._stream: _RowGroupStream | None = None
        self.paths = resolve_files(spec.name, spec.paths, suffixes=(".parquet", ".pq"))
        self._files: list[pq.ParquetFile] = []
        try:
            for path in self.paths:
                self._files.append(self._open(path))
        except BaseException:
            self.close()
            raise
        self._payload_columns = [spec.tokens_column or spec.text_column] + (
            [spec.image_column] if spec.image_column else []
        )
        self._check_columns()
        rg_rows, rg_file, rg_index, file_rows = [], [], [], []
        for f_i, pf in enumerate(self._files):
            md = pf.metadata
            file_rows.append(md.num_rows)
            for r_i in range(md.num_row_groups):
                rg_rows.append(md.row_group(r_i).num_rows)
                rg_file.append(f_i)
                rg_index.append(r_i)
        self._rg_start = np.concatenate([[0], np.cumsum(rg_rows, dtype=np.int64)]).astype(np.int64)
        self._rg_file = np.asarray(rg_file, dtype=np.int64)
        self._rg_index = np.asarray(rg_index, dtype=np.int64)
        self._file_start = np.concatenate([[0], np.cumsum(file_rows, dtype=np.int64)]).astype(np.int64)
        if self._rg_start[-1] == 0:
            self.close()
            raise empty_source_error(self.name, f"0 rows in {len(self.paths)} file(s) {self.paths[:3]}")
        self._cache: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()  # (row group, window) -> rows
        self._taken: dict[tuple[int, int], tuple[np.ndarray, list[int]]] = {}  # per cached unit: rows read, count
        self.io_counts: Counter[tuple[str, str, tuple[str, ...]]] = Counter()

    def _open(self, path: str) -> pq.ParquetFile:
        try:
            # No pre-buffering: pyarrow (>= 17 by default) keeps the pre-buffered column chunks of
            # the last read row group in the open reader, a compressed row group per open file
            # on top of what the cache holds.
            if self.window:  # streamed window by window: no whole column chunk in memory
                return pq.ParquetFile(path, buffer_size=_STREAM_BUFFER_BYTES, pre_buffer=False)
            return pq.ParquetFile(path, pre_buffer=False)
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(
                f"source {self.name!r}: cannot open Parquet file {path!r} ({exc}); the file is corrupt or "
                "truncated: re-create it (megascale-data prepare) or remove it from `paths`"
            ) from exc

    def _check_columns(self) -> None:
        spec = self.spec
        for path, pf in zip(self.paths, self._files, strict=True):
            names = pf.schema_arrow.names
            missing = [c for c in self._payload_columns if c not in names]
            if missing:
                which = "tokens_column" if spec.tokens_column else "text_column"
                raise SourceError(
                    f"source {self.name!r}: file {path!r} has no column(s) {missing}; it has {names}. "
                    f"Set `{which}`/`image_column` in the source spec to one of those"
                )
            typed = column_problems(spec, pf.schema_arrow)
            if typed:  # found at open, not as a traceback from the first batch that reads it
                key = "tokens_column" if spec.tokens_column else "text_column"
                raise SourceError(f"source {self.name!r}: file {path!r}: {typed[0]}; re-create it with the right "
                                  f"types (megascale-data prepare), or name another column with "
                                  f"data.sources.{self.name}.{key}=COLUMN (images: image_column)")

    def __len__(self) -> int:
        return int(self._rg_start[-1])

    @property
    def num_files(self) -> int:
        return len(self._files)

    @property
    def num_row_groups(self) -> int:
        return len(self._rg_file)

    def blocks(self) -> np.ndarray:
        """Start row of each row group and the row count last: the blocks a window shuffle keeps."""
        return self._rg_start.copy()

    # ---------------------------------------------------------------- metadata
    def _kv(self, pf: pq.ParquetFile) -> dict[str, str]:
        raw = pf.schema_arrow.metadata or {}
        return {k.decode(): v.decode() for k, v in raw.items()}

    def _precomputed(self, pf: pq.ParquetFile) -> tuple[bool, bool]:
        """Whether the file's token / patch cost columns match this source's transforms."""
        names, kv, spec = pf.schema_arrow.names, self._kv(pf), self.spec
        tokens_ok = TOKENS_COLUMN in names and kv.get(KV_TOKENIZER, self.tokenizer.fingerprint()) == (
            self.tokenizer.fingerprint()
        )
        patches_ok = (
            PATCHES_COLUMN in names
            and kv.get(KV_PATCH_SIZE, str(spec.patch_size)) == str(spec.patch_size)
            and kv.get(KV_MAX_PATCHES, str(spec.max_image_patches)) == str(spec.max_image_patches)
        )
        return tokens_ok, patches_ok

    def _compute_metadata(self) -> dict[str, np.ndarray]:
        spec, tf = self.spec, self._transform
        want_images = spec.image_column is not None
        tokens: list[np.ndarray] = []
        num_images: list[np.ndarray] = []
        flat_patches: list[np.ndarray] = []
        for path, pf in zip(self.paths, self._files, strict=True):
            tokens_ok, patches_ok = self._precomputed(pf)
            patches_ok = patches_ok and want_images
            cost_cols = [TOKENS_COLUMN] * tokens_ok + [PATCHES_COLUMN] * patches_ok
            if cost_cols:
                table = self._read(pf, path, "metadata", cost_cols)
                if tokens_ok:
                    # Prepared counts include EOD before truncation; the cap applies here.
                    raw = table.column(TOKENS_COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)
                    tokens.append(tf.final_token_counts(raw, add_eod=False))
                if patches_ok:
                    lists = table.column(PATCHES_COLUMN).combine_chunks()
                    num_images.append(pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False))
                    flat_patches.append(pc.list_flatten(lists).to_numpy(zero_copy_only=False))
            stream_cols = [self._payload_columns[0]] * (not tokens_ok) + [spec.image_column] * (
                want_images and not patches_ok
            )
            if stream_cols:
                self.io_counts[("metadata", path, tuple(stream_cols))] += 1
                for batch in self._iter_batches(pf, path, stream_cols):
                    if not tokens_ok:
                        tokens.append(self._count_tokens(batch.column(0)))
                    if want_images and not patches_ok:
                        counts = [
                            tf.image_patch_counts(image_list(c)) for c in batch.column(spec.image_column).to_pylist()
                        ]
                        num_images.append(np.fromiter(map(len, counts), dtype=np.int64, count=len(counts)))
                        flat_patches.append(np.fromiter((c for cs in counts for c in cs), dtype=np.int64))
        text_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
        if not want_images:
            return text_only_metadata(text_tokens)
        return metadata_from_counts(text_tokens, np.concatenate(num_images), np.concatenate(flat_patches))

    def _count_tokens(self, column: pa.Array) -> np.ndarray:
        if self.spec.tokens_column:
            lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
            return self._transform.final_token_counts(lengths, add_eod=self.spec.append_eod)
        return self._transform.text_token_counts(column.to_pylist())

    def _iter_batches(self, pf: pq.ParquetFile, path: str, columns: list[str]):
        try:
            yield from pf.iter_batches(batch_size=_STREAM_BATCH_ROWS, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"source {self.name!r}: cannot read columns {columns} of {path!r}: {exc}") from exc

    def _read(self, pf: pq.ParquetFile, path: str, purpose: str, columns: list[str], rg: int | None = None) -> pa.Table:
        self.io_counts[(purpose, path, tuple(columns))] += 1
        try:
            return pf.read(columns=columns) if rg is None else pf.read_row_group(rg, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            where = f"row group {rg} of " if rg is not None else ""
            raise SourceError(
                f"source {self.name!r}: cannot read {where}{path!r} (columns {columns}): {exc}; the file is corrupt"
            ) from exc

    # ---------------------------------------------------------------- payloads
    def _unit(self, g: int, w: int) -> pa.Table:
        """Rows of window `w` of row group `g` (the whole row group without ``shuffle_window``)."""
        table = self._cache.get((g, w))
        if table is not None:
            self._cache.move_to_end((g, w))
            return table
        f_i, r_i = int(self._rg_file[g]), int(self._rg_index[g])
        if file_gone(self.paths[f_i]):  # checked on a disk read only, not per cached lookup
            self.file_faults.removed_but_open(self.paths[f_i])
        if not self.window:
            return self._keep((g, w), self._read(self._files[f_i], self.paths[f_i], "read", self._payload_columns,
                                                 rg=r_i))
        return self._read_window(g, w)

    def _keep(self, key: tuple[int, int], table: pa.Table) -> pa.Table:
        self._cache[key] = table
        self._taken[key] = (np.zeros(table.num_rows, dtype=bool), [0])
        while len(self._cache) > self.spec.row_group_cache:
            self._taken.pop(self._cache.popitem(last=False)[0], None)
        return table

    def _mark_taken(self, key: tuple[int, int], rows: np.ndarray) -> None:
        """Rows `rows` of cached unit `key` were read; once every row of it was, it leaves the cache.

        An epoch draws each row once, so a unit whose rows were all read is not asked for again this
        epoch (a re-read, e.g. a retried fetch, reads it from the file again): with a window shuffle
        the cache then holds the windows still being drawn from, not the last `row_group_cache`."""
        entry = self._taken.get(key)
        if entry is None:
            return
        taken, count = entry
        fresh = np.unique(rows[~taken[rows]])  # O(rows read), not O(rows of the unit): a row group has millions
        taken[fresh] = True
        count[0] += len(fresh)
        if count[0] == len(taken):
            self._cache.pop(key, None)
            del self._taken[key]

    def _read_window(self, g: int, w: int) -> pa.Table:
        """Stream row group `g` forward to window `w`, keeping each window it passes: draws in
        storage order ask for the windows of a row group in turn, so each is decoded once."""
        f_i, r_i = int(self._rg_file[g]), int(self._rg_index[g])
        path, lo = self.paths[f_i], w * self.window
        hi = min(lo + self.window, int(self._rg_start[g + 1] - self._rg_start[g]))
        stream = self._stream
        if stream is None or stream.group != g or stream.offset > lo:  # another row group, or back: from its start
            self.io_counts[("read", path, tuple(self._payload_columns))] += 1
            batches = self._files[f_i].iter_batches(batch_size=min(self.window, _WINDOW_BATCH_ROWS), row_groups=[r_i],
                                                    columns=self._payload_columns, use_threads=False)
            stream = self._stream = _RowGroupStream(g, batches)
        table = None
        try:
            while stream.offset < hi:  # each window it passes is kept: the next draws ask for it
                start = stream.offset
                rows = self._take_rows(stream, self.window)
                if not rows.num_rows:
                    break
                stream.offset += rows.num_rows
                table = self._keep((g, start // self.window), rows)
        except (pa.ArrowException, OSError) as exc:
            self._stream = None
            raise SourceError(f"source {self.name!r}: cannot read row group {r_i} of {path!r} "
                              f"(columns {self._payload_columns}): {exc}; the file is corrupt") from exc
        if table is None or stream.offset < hi:
            self._stream = None
            raise SourceError(f"source {self.name!r}: row group {r_i} of {path!r} ended at row {stream.offset} of "
                              f"{hi}; the file is truncated or corrupt")
        return table

    @staticmethod
    def _take_rows(stream: _RowGroupStream, n: int) -> pa.Table:
        """The next `n` rows of `stream` (fewer at its end) as one table."""
        got, pieces = 0, []
        while got < n:
            batch = stream.ahead.pop(0) if stream.ahead else next(stream.batches, None)
            if batch is None:
                break
            if got + batch.num_rows > n:  # batches need not follow the window's edges
                stream.ahead.insert(0, batch.slice(n - got))
                batch = batch.slice(0, n - got)
            pieces.append(batch)
            got += batch.num_rows
        # One contiguous copy per window (none for one batch): `take` on a table of many chunks
        # concatenates them on every read.
        return pa.Table.from_batches(pieces).combine_chunks() if pieces else pa.table({})

    def _raw_rows(self, indices: np.ndarray) -> list[RawSample]:
        spec = self.spec
        groups = np.searchsorted(self._rg_start, indices, side="right") - 1
        offsets = indices - self._rg_start[groups]
        windows = window_of_rows(offsets, self.window)
        out: list[RawSample | None] = [None] * len(indices)
        # Visit each needed row group (window) once, in storage order: k of them cost k reads.
        order = np.lexsort((windows, groups))
        units = groups[order] * (int(windows.max(initial=0)) + 1) + windows[order]
        bounds = np.flatnonzero(np.diff(units)) + 1
        for chunk in np.split(order, bounds):
            g, w = int(groups[chunk[0]]), int(windows[chunk[0]])
            f_i = int(self._rg_file[g])
            try:
                rows = offsets[chunk] - w * self.window
                table = self._unit(g, w).take(pa.array(rows))
                self._mark_taken((g, w), rows)
            except SourceError as exc:  # the file changed under the open handle: truncated or corrupt
                cause = " ".join(str(exc.__cause__ or exc).split())  # Arrow's messages span lines
                why = f"cannot be read at row group {int(self._rg_index[g])} ({cause})"
                for pos in chunk:
                    index = int(indices[pos])
                    out[pos] = RawSample(index=index, path=self.paths[f_i], row=index - int(self._file_start[f_i]),
                                         error=why, file_fault=True)
                continue
            first = table.column(0).to_pylist()
            images = table.column(spec.image_column).to_pylist() if spec.image_column else [None] * len(chunk)
            for j, pos in enumerate(chunk):
                index = int(indices[pos])
                raw = RawSample(index=index, path=self.paths[f_i], row=index - int(self._file_start[f_i]))
                if spec.tokens_column:
                    raw.tokens = None if first[j] is None else np.asarray(first[j], dtype=np.int64)
                else:
                    raw.text = first[j]
                raw.images = image_list(images[j])
                out[pos] = raw
        return out  # type: ignore[return-value]

    def cache_stats(self) -> dict[str, int]:
        """Decoded row groups (windows, with ``shuffle_window``) held and their bytes: the dominant
        per-source loader memory."""
        return {"row_groups": len(self._cache), "bytes": sum(t.nbytes for t in self._cache.values())}

    def columns_read(self, purpose: str) -> Counter[str]:
        """How many times each column was read for ``purpose`` (``"metadata"`` or ``"read"``)."""
        out: Counter[str] = Counter()
        for (p, _, cols), n in self.io_counts.items():
            if p == purpose:
                out.update({c: n for c in cols})
        return out

    def close(self) -> None:
        super().close()
        for pf in self._files:
            pf.close()
        self._files = []
        getattr(self, "_cache", {}).clear()
        getattr(self, "_taken", {}).clear()
        self._stream = None


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _is_image(t: pa.DataType) -> bool:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _is_image(t.value_type)
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and _is_image(t.field("bytes").type)


def column_problems(spec: SourceSpec, schema: pa.Schema) -> list[str]:
    """What is wrong with a Parquet schema's columns for `spec`: a payload column it lacks or whose type the
    reader cannot use (text: a string; tokens: a list of integers; images: binary), a cost column of another type."""
    names = set(schema.names)
    want = [(spec.tokens_column, "tokens_column", _is_int_list, "a list of integers")] if spec.tokens_column else [
        (spec.text_column, "text_column", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "a string")]
    if spec.image_column:
        want.append((spec.image_column, "image_column", _is_image, "binary, a list of binary or a struct with `bytes`"))
    want += [(TOKENS_COLUMN, None, pa.types.is_integer, "an integer"),
             (PATCHES_COLUMN, None, _is_int_list, "a list of integers")]
    out = []
    for column, key, ok, what in want:
        if column not in names:
            if key is not None:
                out.append(f"no column {column!r} (`{key}`); it has {schema.names}")
            continue
        t = schema.field(column).type
        if not ok(t) and not pa.types.is_null(t):  # null: no rows or no values to type (an empty shard)
            out.append(f"column {column!r} is {t}, expected {what}")
    return out
