"""Held steps: a constructor's built steps, released when their consumers took them, not by a window.

A consumer is a trainer rank that takes data from a Data Constructor: a fetching rank its
microbatches and, under a hybrid (VLM) strategy, every rank its encoder share. Every request
says which step its rank is on (it has taken everything before), so a step is released as soon
as every consumer has taken its part or moved past it; nothing a slow consumer still needs is
dropped. Each step is built once: concurrent requests wait for that one build and get its
result or its own error.

Backpressure: a request for a step ``max_lead`` or more ahead of the constructor's slowest
fetcher waits for it. Only the constructor's own fetchers gate, and a request records its
rank's step before it waits, so the slowest fetcher never waits here and ranks blocked on each
other's constructors cannot form a cycle: every fetcher's first request of a step goes to its
own constructor (microbatches first), or every rank asks every constructor at once (encoder
images first). A rank that never asked this constructor for anything is not waited for: its
encoder shares go once the fetchers are ``silent_after`` steps past them (a loop that never
takes encoder images does not pin them).

Plain Python (no Ray, no numpy); thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from megascale_data_ext.errors import PlanError

T = TypeVar("T")
Takers = dict[int, set[Hashable]]
"""rank -> the keys of a step it has yet to take."""
IMAGES = ("images",)
"""Taker key of a rank's encoder share (microbatch keys are ``(bucket, microbatch)``)."""


@dataclass(slots=True)
class ConsumerPositions:
    """The step each known consumer is on; a consumer not heard of yet holds nobody back.

    Attributes:
        positions: rank -> the step it is on (monotonic: a position never moves back).
        seen_at: rank -> `time.monotonic()` of its last request (names a stalled consumer).
    """

    positions: dict[int, int] = field(default_factory=dict)
    seen_at: dict[int, float] = field(default_factory=dict)

    def advance(self, rank: int, step: int) -> bool:
        """Record that `rank` is on `step`; True when its position moved forward (or is new)."""
        self.seen_at[rank] = time.monotonic()
        old = self.positions.get(rank)
        if old is not None and step <= old:
            return False
        self.positions[rank] = step
        return True

    def add(self, rank: int, step: int) -> None:
        """Know `rank` at `step` unless it is known already."""
        if rank not in self.positions:
            self.positions[rank] = step
            self.seen_at[rank] = time.monotonic()

    def floor(self, among: frozenset[int]) -> int | None:
        """The slowest known step of the ranks `among`; None when none of them is known."""
        return min((p for r, p in self.positions.items() if r in among), default=None)

    def leader(self, among: frozenset[int]) -> int | None:
        """The most advanced known step of the ranks `among`; None when none of them is known."""
        return max((p for r, p in self.positions.items() if r in among), default=None)

    def slowest(self, among: frozenset[int]) -> tuple[int, int, float] | None:
        """``(rank, step, seconds since its last request)`` of the slowest known rank of `among`."""
        known = [r for r in self.positions if r in among]
        if not known:
            return None
        rank = min(known, key=lambda r: (self.positions[r], r))
        return rank, self.positions[rank], time.monotonic() - self.seen_at[rank]

    def passed(self, rank: int, step: int) -> bool:
        """Whether `rank` is known to be past `step` (it will not ask for it again)."""
        pos = self.positions.get(rank)
        return pos is not None and pos > step


class HeldSteps(Generic[T]):
    """Built steps of one constructor with their takers; see the module docstring.

    Args:
        name: Who holds them, for errors ("constructor for buckets [0]").
        fetchers: The ranks whose pace gates building (the constructor's fetching ranks).
        start_step: Where every fetcher starts (a fresh constructor); None for one restarted in
            a running service (a fetcher counts once it asks for something).
        max_lead: Most steps built ahead of the slowest fetcher; None = unbounded (one process
            whose caller paces its consumers).
        silent_after: Steps behind the slowest fetcher after which the encoder shares of ranks
            that never asked this constructor for anything are let go.
        wait_timeout_s: Longest a request waits while the slowest fetcher makes no progress.
        on_floor: Called (outside the lock) with the slowest fetcher's step whenever it rises.
        history: How many released step numbers are remembered (to name a repeated request).
    """

    def __init__(self, name: str, fetchers: list[int], start_step: int | None, *, max_lead: int | None,
                 silent_after: int, wait_timeout_s: float, on_floor: Callable[[int], None] | None = None,
                 history: int = 256) -> None:
        if max_lead is not None and max_lead < 1:
            raise ValueError(f"max_lead must be >= 1 or None, got {max_lead!r}")
        self.name = name
        self.fetchers = frozenset(fetchers)
        self.max_lead = max_lead
        self.silent_after = silent_after
        self.wait_timeout_s = wait_timeout_s
        self.on_floor = on_floor
        self.consumers = ConsumerPositions()
        if start_step is not None:
            for rank in fetchers:
                self.consumers.add(rank, start_step)
        self._held: dict[int, tuple[T, Takers]] = {}
        self._building: dict[int, Future] = {}
        self._released: deque[int] = deque(maxlen=history)
        self._cv = threading.Condition()
        self._floor_reported: int | None = None
        self.released_steps = 0
        self.backpressure_waits = 0

    # -- building ------------------------------------------------------------------
    def within_lead(self, step: int) -> bool:
        with self._cv:
            return self._within_lead(step)

    def _floor(self) -> int | None:
        return self.consumers.floor(self.fetchers)

    def leader(self) -> int | None:
        """The most advanced fetcher's step (None: none heard of yet)."""
        with self._cv:
            return self.consumers.leader(self.fetchers)

    def _within_lead(self, step: int) -> bool:
        floor = self._floor()
        return self.max_lead is None or floor is None or step < floor + self.max_lead

    def _wait_for_lead(self, step: int) -> None:
        """Under the lock: wait until `step` is within `max_lead` of the slowest fetcher. Fails only
        when the slowest fetcher made no progress for `wait_timeout_s` (a slow step is no error)."""
        self.backpressure_waits += 1
        floor, deadline = self._floor(), time.monotonic() + self.wait_timeout_s
        while not self._within_lead(step):
            if self._floor() != floor:  # it moved: wait on
                floor, deadline = self._floor(), time.monotonic() + self.wait_timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                rank, at, idle = self.consumers.slowest(self.fetchers)
                raise PlanError(
                    f"{self.name}: step {step} is {step - at} steps ahead of rank {rank} (on step {at}, silent for "
                    f"{idle:.0f} s) and a constructor builds at most {self.max_lead} ahead of its slowest fetching "
                    "rank (data.fault_tolerance.max_lead_steps): every fetching rank must keep taking its "
                    "microbatches (ranks of one job advance together)")
            self._cv.wait(timeout=min(left, 1.0))

    def get_or_build(self, step: int, build: Callable[[int], tuple[T, Takers]], *,
                     prefetching: bool = False, for_rank: int | None = None) -> T | None:
        """The held step, built once by `build` (``step -> (payload, takers)``).

        Prefetching returns None instead of waiting: for a step held, released, being built or
        beyond the lead. A request waits for the build in flight (and gets its error if it
        fails) and for the slowest fetcher; a step already released raises `PlanError`. A
        request of `for_rank` returns None once that rank is past `step`: a client that moved
        on left it behind (prefetched steps beyond the last one it consumed), and building it
        would take loader data and a thread for nobody.
        """
        with self._cv:
            while True:
                if for_rank is not None and self.consumers.passed(for_rank, step):
                    return None
                held = self._held.get(step)
                if held is not None:
                    return None if prefetching else held[0]
                if step in self._released:  # its samples left the loaders: a rebuild would be silently empty
                    if prefetching:
                        return None
                    raise PlanError(f"step {step} of {self.name} was already taken by every consumer; each "
                                    "microbatch is delivered once (a client asked twice, or after a restart without "
                                    "restoring its data position)")
                future = self._building.get(step)
                owner = future is None
                if not owner:
                    if prefetching:
                        return None
                    break
                if self._within_lead(step):
                    future = self._building[step] = Future()
                    break
                if prefetching:
                    return None
                self._wait_for_lead(step)
        if not owner:  # another request or the prefetch thread builds it: its result, or its own error
            return future.result()
        try:
            payload, takers = build(step)
        except BaseException as exc:
            with self._cv:
                self._building.pop(step, None)
                self._cv.notify_all()
            future.set_exception(exc)
            raise
        with self._cv:
            for rank in [r for r in takers if self.consumers.passed(r, step)]:
                del takers[rank]  # moved past while it was built (a restarted constructor)
            self._building.pop(step, None)
            if takers:
                self._held[step] = (payload, takers)
            else:
                self._release(step)
            self._cv.notify_all()
        future.set_result(payload)
        return payload

    # -- consumption ---------------------------------------------------------------
    def arrive(self, rank: int, position: int) -> None:
        """`rank` is on step `position`: release what it left behind; report a risen floor."""
        with self._cv:
            if not self.consumers.advance(rank, position):
                return
            for step in [s for s in self._held if s < position]:
                self._drop(step, rank, None)
            self._cv.notify_all()
            floor = self._floor()
            if floor is None or (self._floor_reported is not None and floor <= self._floor_reported):
                return
            self._floor_reported = floor
            for step in [s for s in self._held if s < floor - self.silent_after]:
                for silent in [r for r in self._held[step][1] if r not in self.consumers.positions]:
                    self._drop(step, silent, IMAGES)  # never asked here: not an encoder-image consumer
        if self.on_floor is not None:
            self.on_floor(floor)

    def take(self, step: int, rank: int, key: Hashable) -> None:
        """`rank` took `key` of `step`; the step goes once nobody has anything left to take."""
        with self._cv:
            self._drop(step, rank, key)

    def _drop(self, step: int, rank: int, key: Hashable | None) -> None:
        held = self._held.get(step)
        if held is None or rank not in held[1]:
            return
        keys = held[1][rank]
        if key is None:
            keys.clear()
        else:
            keys.discard(key)
        if not keys:
            del held[1][rank]
        if not held[1]:
            del self._held[step]
            self._release(step)
            self._cv.notify_all()

    def _release(self, step: int) -> None:
        self._released.append(step)
        self.released_steps += 1

    # -- introspection -------------------------------------------------------------
    def held(self, step: int) -> T | None:
        with self._cv:
            held = self._held.get(step)
            return None if held is None else held[0]

    def released(self, step: int) -> bool:
        with self._cv:
            return step in self._released

    def holds_for(self, step: int, rank: int) -> bool:
        """Whether `step` is held with something left for `rank` to take."""
        with self._cv:
            held = self._held.get(step)
            return held is not None and rank in held[1]

    def passed(self, rank: int, step: int) -> bool:
        with self._cv:
            return self.consumers.passed(rank, step)

    def position(self, rank: int) -> int | None:
        with self._cv:
            return self.consumers.positions.get(rank)

    def untaken(self, step: int) -> dict[int, list]:
        """What each rank has yet to take of `step` (empty when the step is not held)."""
        with self._cv:
            held = self._held.get(step)
            return {} if held is None else {r: sorted(keys, key=str) for r, keys in held[1].items()}

    def payloads(self) -> list[T]:
        """Every held step's payload (a snapshot: for accounting what the holder keeps)."""
        with self._cv:
            return [payload for payload, _ in self._held.values()]

    def __len__(self) -> int:
        return len(self._held)

    def lead(self) -> int | None:
        """Steps held ahead of the slowest consumer (newest held step + 1 - its step)."""
        with self._cv:
            floor, newest = self._floor(), max(self._held, default=None)
        return None if floor is None or newest is None else max(0, newest + 1 - floor)

    def stats(self) -> dict:
        with self._cv:
            slowest = self.consumers.slowest(self.fetchers)
        return {"buffered_steps": len(self), "released_steps": self.released_steps, "lead": self.lead(),
                "max_lead": self.max_lead, "backpressure_waits": self.backpressure_waits,
                "slowest_consumer": None if slowest is None else {"rank": slowest[0], "step": slowest[1]}}
