"""One retry budget for every wait on something that may come back: a deadline and capped
exponential backoff.

Calls to actors that Ray is restarting, a Ray address that is not up yet, a prefetch that failed:
each waits out the same shape of budget (``fault_tolerance.recovery_timeout_s`` or its own),
sleeping ``base_s * 2**attempt`` (at most ``cap_s``, never past the deadline) between tries.
Plain Python: no Ray.
"""

from __future__ import annotations

import time

__all__ = ["Retry", "backoff_s"]


def backoff_s(attempt: int, *, base_s: float = 0.05, cap_s: float = 1.0) -> float:
    """The pause before try ``attempt + 1`` (0-based `attempt` failures so far)."""
    return min(base_s * 2 ** attempt, cap_s)


class Retry:
    """A deadline `timeout_s` from now and the tries made against it.

    Use: ``while True: try ...; except ...: if retry.expired(): raise ...; retry.pause()``.
    """

    def __init__(self, timeout_s: float, *, base_s: float = 0.05, cap_s: float = 1.0) -> None:
        self.timeout_s, self.base_s, self.cap_s = timeout_s, base_s, cap_s
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.attempts = 0

    def left(self) -> float:
        """Seconds to the deadline (0 past it)."""
        return max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def pause(self) -> None:
        """Sleep the backoff of this attempt (never past the deadline) and count it."""
        time.sleep(min(backoff_s(self.attempts, base_s=self.base_s, cap_s=self.cap_s), self.left()))
        self.attempts += 1
