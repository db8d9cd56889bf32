"""Files that change under a running source: removed, truncated or corrupted mid-run.

A source checks its files when it opens (`lint` and start-up name every problem then); a file
can still go bad hours later — a storage clean-up deletes it, a copy is cut short, a disk
corrupts a page. Each format reader marks the rows it could not read because of their *file*
(`RawSample.file_fault`, with why); this module applies the source's ``on_bad_rows`` policy
to them before the rows are transformed:

* ``error`` (default): one `SourceError` naming the source, the file, what happened and the
  override that skips such rows — raised in the loader, it reaches every rank as one line;
* ``skip``: the rows are skipped (in the read's ``skipped`` list, so the constructor's
  accounting of planned samples stays exact and the epoch is never silently shorter), not
  counted against ``max_bad_fraction``, and reported in the log once each: one line per file
  the first time, then each newly skipped row range.

A file removed while its handle is open (Parquet, Megatron ``.bin/.idx``) is still readable on
POSIX systems and is served from that handle, with one warning: the loader cannot reopen it
after a restart (it then fails to start, naming the file).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import BadRows
from megascale_data_ext.sources.transforms import RawSample

__all__ = ["FileFaults", "file_gone"]

_log = logging.getLogger(__name__)


def file_gone(path: str) -> bool:
    """Whether ``path`` no longer names a file (removed or renamed since it was opened)."""
    return not os.path.isfile(path)


def _ranges(rows: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"`` (a compact list for a log line)."""
    out: list[str] = []
    rows = sorted(rows)
    start = prev = rows[0]
    for r in rows[1:] + [None]:  # type: ignore[operator]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


class FileFaults:
    """One source's policy for rows whose file went bad mid-run; owned by the source's thread.

    Args:
        source: The source's name (its config key is ``data.sources.<source>``).
        policy: ``"error"`` or ``"skip"`` (the spec's ``on_bad_rows``).
    """

    def __init__(self, source: str, policy: str) -> None:
        self.source = source
        self.policy = policy
        self.files: dict[str, str] = {}  # path -> first reason seen
        self._reported: dict[str, set[int]] = {}  # path -> rows already logged as skipped
        self._removed_warned: set[str] = set()

    def apply(self, raws: Sequence[RawSample]) -> None:
        """Raise (``error``) or log (``skip``) the file faults among ``raws``; the transform skips them."""
        by_file: dict[str, list[RawSample]] = {}
        for raw in raws:
            if raw.file_fault:
                by_file.setdefault(raw.path or "?", []).append(raw)
        for path, bad in by_file.items():
            reason = bad[0].error or "unreadable"
            if self.policy != BadRows.SKIP:
                raise SourceError(
                    f"source {self.source!r}: {path!r} {reason} while the run reads it ({len(bad)} planned "
                    f"row(s) unreadable, first row {bad[0].row}); restore the file and resume from the last "
                    f"checkpoint, or skip its unreadable rows with `data.sources.{self.source}.on_bad_rows=skip`")
            seen = self._reported.setdefault(path, set())
            new = sorted({r.row for r in bad if r.row is not None} - seen)
            if path not in self.files:
                self.files[path] = reason
                _log.warning("source %r: %s %s; its unreadable rows are skipped (on_bad_rows=skip), first: rows %s",
                             self.source, path, reason, _ranges(new) if new else "?")
            elif new:
                _log.warning("source %r: skipped rows %s of %s (%s)", self.source, _ranges(new), path, reason)
            seen.update(new)

    def removed_but_open(self, path: str) -> None:
        """Warn once that ``path`` is gone but still served from its open handle."""
        if path not in self._removed_warned:
            self._removed_warned.add(path)
            _log.warning("source %r: %s was removed while the run reads it; it is served from the open handle, but "
                         "a restarted loader cannot open it: restore the file", self.source, path)
