"""Prefetcher: builds steps ahead of the clients on a background thread.

A Data Constructor builds step N when a client first asks for it; the prefetcher builds ahead
up to ``depth`` steps past the newest step asked for, so a client's request usually finds its
step built. A failure is logged and retried with backoff, never latched: a client's own request
builds (or fails with the cause) its step. A constructor Ray restarted has no target until the
first request says where the clients are.

Plain class with its own daemon thread (no Ray): `runtime.constructor_actor` wires it to a
`DataConstructor`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from megascale_data_ext.runtime.retry import backoff_s

__all__ = ["Prefetcher"]

_log = logging.getLogger(__name__)


class Prefetcher:
    """Calls ``build(target)`` whenever the target moves or `wake` is called (the lead may allow more).

    Args:
        build: Builds every step up to and including its argument (`DataConstructor.prefetch`).
        depth: Steps to build past the newest requested one.
        first_target: The step to build up to before any request; None (a restarted
            constructor): wait for the first request.
        name: Names the builder in log lines.
    """

    def __init__(self, build: Callable[[int], None], *, depth: int, first_target: int | None, name: str) -> None:
        self.build, self.depth, self.name = build, depth, name
        self.target = first_target
        self.errors = 0
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="prefetch")

    def start(self) -> Prefetcher:
        """Start building (a `wake` or `requested` before this is kept for then)."""
        self._thread.start()
        self._wake.set()
        return self

    def requested(self, step: int) -> None:
        """A client asked for `step`: build up to `depth` past it."""
        if self.target is None or step + self.depth > self.target:
            self.target = step + self.depth
            self._wake.set()

    def wake(self) -> None:
        """Try again now (the slowest consumer moved, so the lead allows more)."""
        self._wake.set()

    def close(self) -> None:
        """Stop the thread (after the build in progress, if any). An actor never needs it: the
        thread ends with its process."""
        self._closed = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        failures = 0
        while True:
            self._wake.wait(timeout=backoff_s(failures, base_s=0.1, cap_s=5.0) if failures else None)
            self._wake.clear()
            target = self.target
            if self._closed:
                return
            if target is None:  # restarted: wait for the first client request
                continue
            try:
                self.build(target)
                failures = 0
            except Exception as exc:  # retried; the client's own request reports a lasting failure
                failures += 1
                self.errors += 1
                log = _log.warning if failures > 1 else _log.debug  # one is routine in a recovery; two are news
                log("%s: prefetch up to step %d failed (attempt %d): %s", self.name, target, failures,
                    getattr(exc, "cause", None) or exc)
