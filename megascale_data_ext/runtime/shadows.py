"""Shadow loaders: a warm replica beside a loader actor, and calls that go to whichever answers.

A loader actor's output for (step, sources, buckets) is a pure function of the step's plans (a
position's sample depends only on seed, epoch and position), so its shadow — the same members,
sources open, metadata loaded, reading straight from the plan and staging nothing — returns the
same samples. When a primary dies, Ray restarts it (seconds: its sources reopen) and queues the
calls sent meanwhile without an error; the shadow serves in between:

* a call unanswered after a few typical answer times (at most ``hedge_s``), or whose primary
  failed, is also sent to the shadow; the first answer wins (both are the same samples, so
  exactly-once holds whichever it is);
* a primary that failed is *suspect* for ``suspect_s``: its shadow is asked first meanwhile.

Without shadows the same calls wait out the restart (up to ``recovery_timeout_s``, by the caller).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from megascale_data_ext.runtime.failover import ACTOR_FAILURES

__all__ = ["Replica", "Suspects", "first_answers"]


@dataclass(frozen=True, slots=True)
class Replica:
    """A loader actor and its warm shadow (None without ``fault_tolerance.shadow_loaders``)."""

    primary: Any
    shadow: Any = None


class Suspects:
    """What one caller knows of its loaders: primaries that failed within the last ``suspect_s``
    seconds, and how long a healthy answer takes (for the hedge); thread-safe."""

    HEDGE_FACTOR = 4.0  # hedge a call this many typical answers late (Dean & Barroso's "tail at scale")
    HEDGE_FLOOR_S = 0.1
    WARM_ANSWERS = 8  # answers seen before the typical latency is trusted

    def __init__(self, suspect_s: float) -> None:
        self.suspect_s = suspect_s
        self._until: dict[Any, float] = {}
        self._lock = threading.Lock()
        self.failovers = 0  # primary calls that failed or were hedged (each served elsewhere or retried)
        self._typical_s = 0.0  # moving average of answer latency
        self._answers = 0

    def answered(self, seconds: float) -> None:
        """Record a healthy answer's latency."""
        with self._lock:
            self._answers += 1
            self._typical_s += (seconds - self._typical_s) / min(self._answers, 32)

    def hedge_after(self, hedge_s: float) -> float:
        """When to ask the shadow too: a few typical answers late, at most ``hedge_s`` (a primary Ray
        is restarting answers nothing and raises nothing: waiting out a fixed second stalled the step)."""
        with self._lock:
            if self._answers < self.WARM_ANSWERS:
                return hedge_s
            return min(hedge_s, max(self.HEDGE_FLOOR_S, self.HEDGE_FACTOR * self._typical_s))

    def mark(self, handle: Any) -> None:
        with self._lock:
            self.failovers += 1
            self._until[handle] = time.monotonic() + self.suspect_s

    def __contains__(self, handle: Any) -> bool:
        with self._lock:
            until = self._until.get(handle)
            if until is not None and until < time.monotonic():
                del self._until[handle]
                return False
            return until is not None


def first_answers(requests: Mapping[Hashable, tuple[Replica, Callable[[Any], Any]]], *, hedge_s: float,
                  timeout_s: float, suspects: Suspects,
                  on_call: Callable[[], None] | None = None) -> tuple[dict[Hashable, Any], dict[Hashable, BaseException]]:
    """Each request's answer from its primary or its shadow, whichever comes first.

    Args:
        requests: ``key -> (replica, call)``; ``call(handle)`` submits the request to a handle
            and returns its ObjectRef.
        hedge_s: Longest wait without an answer before the shadow is asked too (sooner once
            `suspects` knows the typical answer time: `Suspects.hedge_after`).
        timeout_s: Longest wait for the round; a request still unanswered fails with GetTimeoutError.
        suspects: Primaries asked after their shadow (and marked when they fail or are hedged).
        on_call: Called once per call submitted (call counting).

    Returns ``(answers, failures)``: every key is in exactly one; a failure is the last actor error.
    """
    pending: dict[Any, tuple[Hashable, Any]] = {}
    untried: dict[Hashable, list[Any]] = {}
    sent_at: dict[Hashable, float] = {}

    def submit(key: Hashable) -> None:
        handle = untried[key].pop(0)
        if on_call is not None:
            on_call()
        pending[requests[key][1](handle)] = (key, handle)
        sent_at[key] = time.monotonic()

    hedge_s = suspects.hedge_after(hedge_s)
    for key, (rep, _call) in requests.items():
        order = [rep.primary] if rep.shadow is None else (
            [rep.shadow, rep.primary] if rep.primary in suspects else [rep.primary, rep.shadow])
        untried[key] = order
        submit(key)
    answers: dict[Hashable, Any] = {}
    failures: dict[Hashable, BaseException] = {}
    end = time.monotonic() + timeout_s
    while pending:
        now = time.monotonic()
        hedges = [sent_at[k] + hedge_s for k in untried if untried[k] and k not in answers]
        wait = min([end - now, *(h - now for h in hedges)])
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wait))
        for ref in ready:
            key, handle = pending.pop(ref)
            if key in answers:
                continue
            primary = requests[key][0].primary
            try:
                answers[key] = ray.get(ref)
                failures.pop(key, None)
                suspects.answered(time.monotonic() - sent_at[key])
                if handle != primary and any(k == key and h == primary for k, h in pending.values()):
                    suspects.mark(primary)  # the shadow beat a primary asked first: Ray may be restarting it
            except ACTOR_FAILURES as exc:
                failures[key] = exc
                if handle == primary:
                    suspects.mark(handle)
                if untried[key]:
                    submit(key)
        now = time.monotonic()
        for key in [k for k in untried if untried[k] and k not in answers and now >= sent_at[k] + hedge_s]:
            submit(key)  # silent for hedge_s: ask the other replica too
        if len(answers) == len(requests):
            break
        if now >= end:
            for key, _handle in pending.values():
                if key not in answers:
                    failures.setdefault(key, GetTimeoutError(f"no answer within {timeout_s:g} s"))
            break
    for key in requests:
        if key not in answers:
            failures.setdefault(key, GetTimeoutError(f"no answer within {timeout_s:g} s"))
    return answers, {k: v for k, v in failures.items() if k not in answers}
