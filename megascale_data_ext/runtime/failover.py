"""Loader failover: what counts as a failed call, and why any replica of a loader can answer it.

A loader's output for (step, buckets) is a pure function of the step's `LoaderPlan` (positions ->
sample indices through the seeded permutation), so *any* loader of the same source (shard) can
serve any step: the primary after Ray restarted it, or its warm shadow (`runtime.shadows`). Two
ways of serving a fetch keep that exactly-once (`runtime.loader_group.LoaderGroup.fetch`):

* a primary pops the step's staged samples (read ahead); a bucket already popped by a dead
  instance, or by a constructor that died before building, is read again from the plan
  (`missing_buckets`, `read_buckets`), since a constructor asks for a (step, bucket) once per build;
* a shadow reads exactly the requested buckets from the plan and stages nothing, so it never
  holds samples nobody takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from ray.exceptions import ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError

from megascale_data_ext.dataplane.plan import LoaderPlan
from megascale_data_ext.errors import ServiceUnavailableError, SourceError
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.runtime.retry import Retry
from megascale_data_ext.runtime.thread_stacks import note_thread_stacks

__all__ = ["ACTOR_FAILURES", "cannot_restart", "missing_buckets", "raise_unless_recovering", "read_buckets"]

ACTOR_FAILURES = (RayActorError, ActorUnavailableError, GetTimeoutError, ObjectLostError)
"""What counts as a failed call: the actor died, is restarting or unreachable, or timed out, or
its reply was lost with the node holding it (ObjectLostError and its kinds: reconstruction
failed, owner died); each is answered by asking again."""


def cannot_restart(exc: BaseException) -> str | None:
    """Why an actor Ray restarted died in its ``__init__`` (e.g. a source file removed mid-run
    cannot be opened again), as its error's last line; None for a failure that asking again answers.

    No retry helps such an actor, so a caller raises at once instead of waiting out
    ``recovery_timeout_s``.
    """
    if not (isinstance(exc, RayActorError) and exc.actor_init_failed):
        return None
    lines = [ln.strip() for ln in str(exc).splitlines() if "Error:" in ln]
    return lines[-1] if lines else str(exc).splitlines()[0]


def raise_unless_recovering(failures: Mapping[Any, BaseException], sources: Sequence[Any], doing: str,
                            retry: Retry) -> None:
    """Raise `ServiceUnavailableError` when waiting for the loaders of `sources` cannot help:
    one of them died in its restart (`cannot_restart`), or `retry`'s deadline passed. `doing`
    says what they were asked (``"deliver step 7"``)."""
    last = next(iter(failures.values()))
    names = list(sources)[:8]
    more = " ..." if len(sources) > 8 else ""
    dead = next(filter(None, map(cannot_restart, failures.values())), None)
    if dead is not None:
        raise ServiceUnavailableError(f"the loader of sources {names}{more} cannot start again after a restart: "
                                      f"{dead}") from last
    if retry.expired():
        error = ServiceUnavailableError(
            f"the loaders of sources {names}{more} did not {doing} within {retry.timeout_s:g} s "
            f"(fault_tolerance.recovery_timeout_s): {last!r}. Check the actors' logs (`ray logs`), raise the "
            "timeout, or enable fault_tolerance.shadow_loaders")
        silent = [key for key, exc in failures.items() if isinstance(exc, GetTimeoutError)]
        for key in silent[:2]:  # alive but silent: where its threads wait (a deadlock names itself)
            handle = getattr(key, "primary", key)  # a `shadows.Replica`, or a handle
            note_thread_stacks(error, handle, f"the loader of sources {names}{more}")
        raise error from last


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
    result = loader.read(indices.tolist())
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
    planned = set(plan.bucket.tolist())  # a few dozen rows: a set beats np.unique's sort
    return [b for b in buckets if b in planned and b not in have]
