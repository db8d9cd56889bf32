"""Loss-driven mixing: the trainer's per-source loss reports, fed to the schedule in step order.

With a feedback schedule of delay d, planning step s first applies the reports of every step up
to s - d, in order, waiting for one that has not arrived (a named `ReportTimeoutError` after
``report_timeout_s``). Plans therefore depend on the reports, never on prefetch timing. Reports
arrive on trainer threads while planning waits for them: they have their own condition, apart
from the planning lock. Plain Python: no Ray or torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from megascale_data_ext.errors import PlanError, ReportTimeoutError

__all__ = ["REPORT_EVERY_STEP", "LossReports"]

#: What to do about a loss report that never came (the Planner's wait and the client's deadline say it).
REPORT_EVERY_STEP = ("the trainer must report every step (hooks: install(client, report_loss=True)), or use a "
                     "static mixing schedule")


class LossReports:
    """Per-source losses by reported step, applied to `mixer`'s schedule when it is time.

    Args:
        mixer: The Planner's `Mixer` (its schedule takes ``report_loss(step, {source: loss})``).
        source_names: The sources, in config order (a report may name them).
        timeout_s: Longest wait for a report a step needs.
        keep: Steps of applied reports kept behind the newest applied one.
    """

    def __init__(self, mixer: Any, source_names: Sequence[str], *, timeout_s: float, keep: int) -> None:
        self.mixer, self.names = mixer, list(source_names)
        self.timeout_s, self.keep = timeout_s, keep
        self._reports: dict[int, list[float | None]] = {}
        self._cv = threading.Condition()
        self.waiting = self.most_waiting = 0  # calls waiting for a report now, and at most at once

    @property
    def delay(self) -> int | None:
        """d of a feedback schedule (step k's loss shapes step k + d); None for static schedules."""
        schedule = self.mixer.schedule
        return getattr(schedule, "delay", None) if hasattr(schedule, "report_loss") else None

    def applied_through(self) -> int:
        """The last reported step the schedule has applied (-1: none)."""
        last = getattr(self.mixer.schedule, "last_step", None)
        return -1 if last is None else int(last)

    def wait_for(self, step: int) -> None:
        """Wait until every report planning `step` needs (steps up to ``step - delay``) has arrived."""
        delay = self.delay
        if delay is None:
            return
        deadline = time.monotonic() + self.timeout_s  # one budget for the call, however many reports it needs
        for k in range(self.applied_through() + 1, step - delay + 1):
            with self._cv:
                if k in self._reports:
                    continue
                self.waiting += 1
                self.most_waiting = max(self.most_waiting, self.waiting)
                try:
                    arrived = self._cv.wait_for(lambda k=k: k in self._reports,
                                                timeout=max(0.0, deadline - time.monotonic()))
                finally:
                    self.waiting -= 1
                if not arrived:
                    raise ReportTimeoutError(
                        f"planning step {step} needs the per-source loss of step {k} (feedback mixing, delay {delay}) "
                        f"but none arrived within {self.timeout_s:g} s: {REPORT_EVERY_STEP}")

    def missing(self, step: int) -> int | None:
        """The first step whose report planning `step` needs and has not arrived (None: none)."""
        delay = self.delay
        if delay is None:
            return None
        with self._cv:
            needed = range(self.applied_through() + 1, step - delay + 1)
            return next((k for k in needed if k not in self._reports), None)

    def ready(self, step: int) -> bool:
        """Whether planning `step` would find every report it needs (`wait_for` would not wait)."""
        delay = self.delay
        if delay is None:
            return True
        with self._cv:
            return all(k in self._reports for k in range(self.applied_through() + 1, step - delay + 1))

    def apply(self, step: int) -> None:
        """Fold the reports of steps up to ``step - delay`` into the schedule, in step order."""
        delay = self.delay
        if delay is None:
            return
        self.wait_for(step)
        for k in range(self.applied_through() + 1, step - delay + 1):
            with self._cv:
                values = self._reports[k]
            self.mixer.schedule.report_loss(k, {i: v for i, v in enumerate(values) if v is not None})
        with self._cv:
            for old in [k for k in self._reports if k < step - delay - self.keep]:
                del self._reports[old]

    def record(self, step: int, losses: Mapping[int | str, float]) -> None:
        """The trainer's per-source loss of `step` (by source index or name). No-op for static schedules.

        Raises:
            PlanError: an unknown source, or a second, different report for the same step.
        """
        if self.delay is None:
            return
        values: list[float | None] = [None] * len(self.names)
        for key, loss in losses.items():
            i = self.names.index(key) if isinstance(key, str) and key in self.names else key
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.names):
                raise PlanError(f"report_loss(step {step}): unknown source {key!r}; use an index in "
                                f"[0, {len(self.names)}) or one of {self.names}")
            values[i] = float(loss)
        with self._cv:
            if self._reports.get(step, values) != values:
                raise PlanError(f"step {step}'s loss was reported twice with different values "
                                f"({self._reports[step]} vs {values})")
            self._reports[step] = values
            self._cv.notify_all()

    def between(self, applied: int, step: int) -> list[list]:
        """``[[k, losses], ...]`` of the reports after `applied` and before `step` (a checkpoint's)."""
        with self._cv:
            return [[k, self._reports[k]] for k in sorted(self._reports) if applied < k < step]

    def load(self, reports: Sequence[Sequence[Any]]) -> None:
        """Replace the held reports with a checkpoint's ``[[step, losses], ...]``."""
        with self._cv:
            self._reports = {int(k): list(v) for k, v in reports}
            self._cv.notify_all()
