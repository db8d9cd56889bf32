"""Loader failover: calls to a Source Loader that survive its death (shadows, retries, replay).

A Source Loader's output for (step, buckets) is a pure function of the step's `LoaderPlan`
(positions -> sample indices through the seeded permutation), so *any* loader of the same
source can serve any step: a warm shadow, or the primary after Ray restarted it. Two ways of
serving a fetch keep that exactly-once:

* ``fetch`` (the primary): pops the step's staged samples (read ahead); a bucket already
  popped by a dead instance or by a constructor that died before building is read again
  from the plan (`read_buckets`), since a constructor asks for a (step, bucket) once per build.
* ``fetch_direct`` (shadows, and anyone while the primary is suspect): reads exactly the
  requested buckets from the plan, staging nothing, so a shadow never holds samples nobody takes.

`LoaderFailover` is what constructors and the Planner call: the primary, hedged by the shadow
when it died, is unavailable or has not answered within ``hedge_s`` (a primary Ray is
restarting queues calls silently: the hedge is what detects it); the first answer wins (both
are the same samples). The shadow is asked first for ``suspect_s`` after a primary failure;
without a shadow it retries the restarting primary until
``recovery_timeout_s`` and then raises `ServiceUnavailableError` naming the source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError

from megascale_data_ext.dataplane.plan import LoaderPlan
from megascale_data_ext.errors import SourceError
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.faults import FaultToleranceConfig, ServiceUnavailableError
from megascale_data_ext.runtime.loader import SourceLoader

__all__ = ["ACTOR_FAILURES", "LoaderFailover", "read_buckets"]

ACTOR_FAILURES = (RayActorError, ActorUnavailableError, GetTimeoutError, ObjectLostError)
"""What counts as a failed call: the actor died, is restarting or unreachable, or timed out, or
its reply was lost with the node holding it (ObjectLostError and its kinds: reconstruction
failed, owner died); each is answered by asking again."""
_log = logging.getLogger(__name__)


def read_buckets(loader: SourceLoader, plan: LoaderPlan, buckets: Sequence[int]) -> dict[str, list]:
    """Read `buckets`' samples of `plan` straight from the source (nothing staged), in the
    shape of `SourceLoader.fetch`: ``{"samples": [(bucket, position, Sample)], "skipped": [...]}``."""
    sel = np.isin(plan.bucket, np.asarray(list(buckets), dtype=np.int64))
    positions, indices, bucket = plan.positions[sel], plan.indices[sel], plan.bucket[sel]
    if not np.array_equal(loader.indices_at(positions), indices):
        raise SourceError(f"source {loader.spec.name!r}: plan for step {plan.step} disagrees with this loader's "
                          "stream (seed/shuffle/source size changed?)")
    out: dict[str, list] = {"samples": [], "skipped": []}
    if not len(indices):
        return out
    result = loader.source.read_report(indices.tolist())
    good = {s.index: s for s in result.samples}
    bad = {s.index: s for s in result.skipped}
    for pos, idx, b in zip(positions.tolist(), indices.tolist(), bucket.tolist(), strict=True):
        if idx in good:
            out["samples"].append((b, pos, good[idx]))
        else:
            out["skipped"].append((b, pos, bad[idx]))
    return out


def missing_buckets(plan: LoaderPlan, buckets: Sequence[int], got: dict[str, list]) -> list[int]:
    """Buckets the plan gives samples of this source but `got` (a pop) returned none for."""
    have = {b for b, _, _ in got["samples"]} | {b for b, _, _ in got["skipped"]}
    planned = set(np.unique(plan.bucket).tolist())
    return [b for b in buckets if b in planned and b not in have]


class LoaderFailover:
    """Calls one source's loader, failing over to its shadow or waiting out its restart.

    Args:
        primaries: One loader actor handle per source.
        shadows: A shadow handle per source, or None without shadows.
        ft: Timeouts and budgets.
        calls: Counts each call submitted, as ``"<caller>>loader <method>"``.
        caller: Who calls (``"planner"``, ``"constructor"``), for `calls`.
    """

    def __init__(self, primaries: Sequence[Any], shadows: Sequence[Any] | None, ft: FaultToleranceConfig, *,
                 calls: CallCounter | None = None, caller: str = "constructor") -> None:
        self.primaries = list(primaries)
        self.calls = calls
        self.caller = caller
        self.shadows = list(shadows) if shadows else None
        self.ft = ft
        self._suspect_until = [0.0] * len(self.primaries)
        self.failovers = 0  # calls a primary failed (each served elsewhere or retried)

    def fetch(self, source: int, step: int, buckets: list[int]) -> dict[str, list]:
        return self._call(source, "fetch", step, buckets)

    def fetch_many(self, step: int, sources: list[int], buckets: list[int]) -> dict[int, dict[str, list]]:
        """A constructor's fetch of `sources` (one actor per source: one call each)."""
        return {s: self.fetch(s, step, buckets) for s in sources}

    def summary(self, source: int, start: int, count: int) -> Any:
        return self._call(source, "summary_buffer", start, count)

    def _targets(self, source: int, method: str) -> list[tuple[str, Any, str]]:
        primary = ("primary", self.primaries[source], method)
        if self.shadows is None:
            return [primary]
        shadow = ("shadow", self.shadows[source], "fetch_direct" if method == "fetch" else method)
        if time.monotonic() < self._suspect_until[source]:
            return [shadow, primary]
        return [primary, shadow]

    def _failed(self, source: int, role: str, name: str, exc: BaseException) -> None:
        if role == "primary":
            self.failovers += 1
            self._suspect_until[source] = time.monotonic() + self.ft.suspect_s
        _log.warning("loader/%d (%s) failed on %s: %s", source, role, name, type(exc).__name__)

    def _attempt(self, source: int, method: str, args: tuple) -> tuple[bool, Any]:
        """One round: the first target, hedged by the second after ``hedge_s`` without an answer
        (or at once when the first fails); ``(True, result)`` from whichever answers first."""
        targets = self._targets(source, method)
        pending: dict[Any, tuple[str, str]] = {}

        def submit() -> None:
            role, handle, name = targets.pop(0)
            if self.calls is not None:
                self.calls.add(f"{self.caller}>loader {method}")
            pending[getattr(handle, name).remote(*args)] = (role, name)

        submit()
        end = time.monotonic() + self.ft.rpc_timeout_s
        last: BaseException | None = None
        while pending:
            wait = end - time.monotonic()
            if targets:
                wait = min(wait, self.ft.hedge_s)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wait))
            for ref in ready:
                role, name = pending.pop(ref)
                try:
                    return True, ray.get(ref)
                except ACTOR_FAILURES as exc:
                    last = exc
                    self._failed(source, role, name, exc)
            if targets and (not ready or not pending):  # slow or failed: hedge with the next loader
                submit()
            elif not ready and time.monotonic() >= end:
                for role, name in pending.values():
                    self._failed(source, role, name, GetTimeoutError(f"no answer within {self.ft.rpc_timeout_s:g} s"))
                return False, GetTimeoutError(f"{method} timed out")
        return False, last

    def _call(self, source: int, method: str, *args: Any) -> Any:
        deadline = time.monotonic() + self.ft.recovery_timeout_s
        attempt = 0
        while True:
            ok, out = self._attempt(source, method, args)
            if ok:
                return out
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"source loader/{source} (and its shadow, if any) did not answer `{method}` within "
                    f"{self.ft.recovery_timeout_s:g} s (fault_tolerance.recovery_timeout_s): last error {out!r}. "
                    "Check the actor's log in the Ray dashboard / `ray logs`, raise the timeout, or enable "
                    "fault_tolerance.shadow_loaders") from out
            time.sleep(min(0.05 * 2 ** attempt, 1.0))
            attempt += 1
