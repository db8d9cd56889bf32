"""Skip-and-count policy for bad samples (Energon's ``SkipSample`` with a budget).

A corrupt image in a billion-sample corpus must not stop a training run, but a source whose
every other row is broken must: bad samples are skipped while their count stays within
``max_bad_fraction`` of all samples read so far, and every skip is recorded with its reason
and location so the runtime can report it and keep its accounting exact.
"""

from __future__ import annotations

import math
from collections import Counter

from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import SkippedSample


class BadSampleTracker:
    """Counts samples read and skipped for one source; raises once the budget is exceeded.

    The check runs after each ``read()`` call (not after each sample), so a batch with one bad
    sample among many passes a small non-zero tolerance even at the very start of an epoch.
    """

    __slots__ = ("source", "max_bad_fraction", "samples_read", "skipped")

    def __init__(self, *, source: str, max_bad_fraction: float) -> None:
        self.source = source
        self.max_bad_fraction = max_bad_fraction
        self.samples_read = 0
        self.skipped: list[SkippedSample] = []

    def record(self, *, num_read: int, skipped: list[SkippedSample]) -> None:
        """Account for one ``read()`` call of ``num_read`` planned samples.

        Raises:
            SourceError: More than ``max_bad_fraction`` of the samples read so far were bad;
                the message shows the first offending sample and the tally of reasons.
        """
        self.samples_read += num_read
        self.skipped.extend(skipped)
        bad = [s for s in skipped if not s.file_fault]  # a file gone bad is skipped by policy, not budget
        if not bad:
            return
        allowed = self.max_bad_fraction * self.samples_read
        total_bad = sum(not s.file_fault for s in self.skipped)
        if total_bad > allowed:
            first = bad[0]
            raise SourceError(
                f"source {self.source!r}: {total_bad} bad samples out of {self.samples_read} read "
                f"exceeds max_bad_fraction={self.max_bad_fraction} (allowed {allowed:.1f}); "
                f"first in this read: {first.reason}. Fix the data (`megascale-data lint` lists the bad rows) "
                f"or allow more with `data.sources.{self.source}.max_bad_fraction="
                f"{min(1.0, math.ceil(total_bad / self.samples_read * 100) / 100):g}`"
            )

    def reasons(self) -> dict[str, int]:
        """How many samples were skipped for each distinct reason (location stripped)."""
        return dict(Counter(s.reason.split(" (source=")[0] for s in self.skipped))
