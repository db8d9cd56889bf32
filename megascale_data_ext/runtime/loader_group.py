"""Loader groups: one loader actor serving several sources, or shards of a source.

One actor per source costs one Python process (interpreter, numpy, pyarrow: ~80 MiB) per
source; the partitioner (`dataplane.partitioner`) instead packs many small sources into one
actor (source parallel) and splits heavy ones into data-parallel shards. A `LoaderGroup`
hosts one `SourceLoader` per member and dispatches every call by source id.

Shards: member ``ShardRef(source, k, n)`` serves the stream positions ``p`` with
``p % n == k`` of its source's plans. The Planner plans the whole source as before; each
shard keeps its residue class of the plan, so the n shards of a step are disjoint and
together are the plan: resharding at a step boundary loses and repeats nothing, and a
sample is the same sample (position -> index is a pure function of seed and epoch)
whichever shard reads it.

Workers: ``workers`` threads read ahead the next steps' plans of every member (worker
parallel: worker i starts step s + i while the constructors consume step s), so a costly
transform has ``workers`` steps of time to finish.

Batched calls: whatever crosses a process goes once per group, not once per member — the
Planner's metadata (`summaries`), the plans (``get_plans_ahead(step, members, count)``: every
member's plans of a few steps per call, cached) and a constructor's fetch of every member it needs
(`LoaderGroupActor.fetch_many`, samples as columns: `runtime.fetch_wire`) — so Ray calls per step do
not grow with the sources an actor hosts, and the plans cost a call per `PLANS_AHEAD` steps.

Thread contract: as `SourceLoader`; the Ray façade is threaded (``max_concurrency``) because
a member's `fetch` may wait on the Planner while the Planner asks for `summaries`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.dataplane.plan import LoaderPlan
from megascale_data_ext.errors import SourceError
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.failover import missing_buckets, read_buckets
from megascale_data_ext.runtime.fault_injection import crash_self
from megascale_data_ext.runtime.fetch_wire import encode_fetch
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.runtime.malloc import trim_periodically
from megascale_data_ext.runtime.metrics import rss_bytes, samples_in, service_metrics
from megascale_data_ext.runtime.ray_actor import Held, actor, resolve
from megascale_data_ext.runtime.thread_stacks import ThreadStacks
from megascale_data_ext.sources.base import SourceSpec

#: ``(members, workers, ray options) -> actor handle``: a ready loader (group) actor with its plans wired.
Spawn = Callable[[list[tuple[ShardRef, SourceSpec]], int, dict], Any]

__all__ = ["GROUP_CONCURRENCY", "LoaderGroup", "LoaderGroupActor", "Spawn", "merge_fetches", "shard_of_plan",
           "spawn_loader_groups", "spawn_shadows"]

GROUP_CONCURRENCY = 16
METADATA_GROUP = "metadata"  # the Planner's summaries: threads of their own (`LoaderGroupActor.RAY_OPTIONS`)
_log = logging.getLogger(__name__)
GetPlan = Callable[[int, int], LoaderPlan]
GetPlans = Callable[[int, list[int]], Mapping[int, LoaderPlan]]
"""``(step, sources) -> {source: LoaderPlan}`` of the whole sources; a source left out has nothing in the step."""
GetPlansAhead = Callable[..., Mapping[int, Mapping[int, LoaderPlan]]]
"""``(step, sources, count, wait=True) -> {step: {source: LoaderPlan}}``: `step`'s plans and those of up
to ``count - 1`` steps after it that the Planner can make without waiting; with ``wait=False`` `step`
too only if it can be made without waiting (for a loss report), else nothing."""
PLAN_STEPS = 64
"""Steps of plans a group keeps (read-ahead and re-reads of recent steps find them)."""
PLANS_AHEAD = 4
"""Steps of plans a group asks for in one call (`GetPlansAhead`): a Planner call per 4 steps, not per step."""


class PlanCache:
    """A group's plans of its members, asked for all of them at once, a few steps per call
    (`GetPlansAhead`; `GetPlans`: one step per call); thread-safe.

    Concurrent misses wait for an ask in flight that may bring their step instead of asking again.
    """

    def __init__(self, get_plans: GetPlans | None, sources: Sequence[int], steps: int = PLAN_STEPS, *,
                 get_plans_ahead: GetPlansAhead | None = None, ahead: int = PLANS_AHEAD) -> None:
        self.get_plans = get_plans
        self.get_plans_ahead = get_plans_ahead
        self.ahead = ahead
        self.sources = sorted(sources)
        self.steps = steps
        self._plans: OrderedDict[int, Mapping[int, LoaderPlan]] = OrderedDict()
        self._lock = threading.Lock()
        self._asking: dict[int, threading.Event] = {}  # first step of each ask in flight -> its answer

    def get(self, step: int, source: int) -> LoaderPlan:
        plan = self._step(step).get(source)
        if plan is None:
            empty = np.zeros(0, dtype=np.int64)
            plan = LoaderPlan(step=step, source=source, positions=empty, indices=empty, bucket=empty)
        return plan

    def drawn(self, step: int) -> list[int]:
        """The members with samples in `step` (asks the Planner once, as `get` does)."""
        return _drawn(self._step(step))

    def _keep(self, got: Mapping[int, Mapping[int, LoaderPlan]]) -> dict[int, Mapping[int, LoaderPlan]]:
        """Cache an answer's steps (the newest `steps` are kept); returns it as a dict."""
        got = dict(got)
        with self._lock:
            for s, p in sorted(got.items()):
                self._plans.setdefault(s, p)
            while len(self._plans) > self.steps:
                self._plans.popitem(last=False)
        return got

    def drawn_if_planned(self, step: int) -> list[int] | None:
        """`drawn` for read-ahead, which must not wait: None when the Planner cannot make `step`'s
        plans now (feedback mixing: a loss report not yet in). A Planner call that waited would
        hold one of its threads for a step nobody needs yet."""
        with self._lock:
            plans = self._plans.get(step)
        if plans is None:
            if self.get_plans_ahead is None:
                return self.drawn(step)
            got = self._keep(self.get_plans_ahead(step, self.sources, self.ahead, wait=False))
            plans = got.get(step)
            if plans is None:
                return None
        return _drawn(plans)

    def _step(self, step: int) -> Mapping[int, LoaderPlan]:
        """Every member's plan of `step`: cached, or asked for. A thread whose step an ask in
        flight may bring (it asked for an earlier step, and answers carry up to `ahead` steps)
        waits for that answer instead of sending its own; a thread never waits behind an ask for
        a later step, which may be waiting for this step's loss report (feedback mixing)."""
        while True:
            with self._lock:
                plans = self._plans.get(step)
                if plans is not None:
                    return plans
                covering = next((done for first, done in self._asking.items() if first <= step < first + self.ahead),
                                None)
                if covering is None:
                    mine = self._asking[step] = threading.Event()
                    break
            covering.wait()  # then look again: the answer may have stopped short of `step`
        try:
            if self.get_plans_ahead is not None:
                got = self._keep(self.get_plans_ahead(step, self.sources, self.ahead))
            else:
                got = self._keep({step: self.get_plans(step, self.sources)})
            return got[step]
        finally:
            with self._lock:
                del self._asking[step]
            mine.set()


def _drawn(plans: Mapping[int, LoaderPlan]) -> list[int]:
    """The sources of one step's plans that have samples in it."""
    return [s for s, plan in plans.items() if len(plan.positions)]


def shard_of_plan(plan: LoaderPlan, shard: int, num_shards: int) -> LoaderPlan:
    """The part of `plan` that shard `shard` of `num_shards` serves: positions p with p % n == shard."""
    if num_shards == 1:
        return plan
    keep = plan.positions % num_shards == shard
    return LoaderPlan(step=plan.step, source=plan.source, positions=plan.positions[keep],
                      indices=plan.indices[keep], bucket=plan.bucket[keep])


class LoaderGroup:
    """Several sources (or shards of sources) behind one loader's interface.

    Args:
        members: ``(ShardRef, SourceSpec)`` per hosted source; a source at most once.
        seed: Seeds the per-epoch shuffles (the same for every shard of a source).
        shuffle: Shuffle sample order per epoch.
        workers: Read-ahead threads (worker parallelism for costly transforms).
        read_ahead: Steps each fetch schedules ahead (default: `workers`).
        get_plan: ``(step, source) -> LoaderPlan`` of the whole source (the Planner).
        get_plans: ``(step, sources) -> {source: LoaderPlan}`` (`GetPlans`): every member's plan of
            a step in one call, cached (`PlanCache`); replaces `get_plan`.
        get_plans_ahead: `GetPlansAhead`: the same for a few steps per call; replaces `get_plans`.
        direct: A shadow (`runtime.shadows`): reads exactly the buckets asked for from the plan,
            staging nothing and reading nothing ahead.

    Checkpoint: ``{"members": {source: SourceLoader state}}`` (each member's own schema).
    """

    def __init__(self, members: Sequence[tuple[ShardRef, SourceSpec]], *, seed: int, shuffle: bool = True,
                 workers: int = 1, read_ahead: int | None = None, get_plan: GetPlan | None = None,
                 get_plans: GetPlans | None = None, get_plans_ahead: GetPlansAhead | None = None,
                 direct: bool = False) -> None:
        seen = [ref.source for ref, _ in members]
        if len(set(seen)) != len(seen):
            raise ValueError(f"a loader group hosts a source at most once, got sources {seen}")
        self.refs: dict[int, ShardRef] = {ref.source: ref for ref, _ in members}
        self.loaders: dict[int, SourceLoader] = {
            ref.source: SourceLoader(ref.source, spec, seed=seed, shuffle=shuffle) for ref, spec in members
        }
        self.workers = max(1, int(workers))
        self.direct = direct
        self.read_ahead = 0 if direct else self.workers if read_ahead is None else read_ahead
        self.rereads = 0  # buckets read again from the plan (popped before by a dead instance or constructor)
        self.direct_fetches = 0  # a shadow's fetches, each read from the plan
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="loader-worker")
        self._ahead_until: dict[int, int] = {s: -1 for s in self.loaders}
        self._ahead_lock = threading.Lock()
        self._group_ahead_until = -1  # with `plans`: read ahead by step, for the members each step draws
        self.plans = (PlanCache(get_plans, list(self.loaders), get_plans_ahead=get_plans_ahead,
                                ahead=max(PLANS_AHEAD, self.read_ahead + 1))
                      if get_plans is not None or get_plans_ahead is not None else None)
        self.set_get_plan(self.plans.get if self.plans is not None else get_plan)

    def set_get_plan(self, get_plan: GetPlan | None) -> None:
        """Give every member the Planner's plans, cut to its shard."""
        for s, loader in self.loaders.items():
            ref = self.refs[s]
            loader.get_plan = None if get_plan is None else (
                lambda step, source, _r=ref: shard_of_plan(get_plan(step, source), _r.shard, _r.num_shards))

    def _member(self, source: int) -> SourceLoader:
        loader = self.loaders.get(source)
        if loader is None:
            raise SourceError(f"this loader group serves sources {sorted(self.loaders)}, not source {source}; "
                              f"route the call by the autoscaler's layout")
        return loader

    def size(self, source: int) -> int:
        return self._member(source).size

    def summary_buffer(self, source: int, start: int, count: int):
        """Metadata of the whole source's stream (every shard has all of it: it is metadata only)."""
        return self._member(source).summary_buffer(start, count)

    def summaries(self, requests: Sequence[tuple[int, int, int]]) -> list:
        """`summary_buffer` of each ``(source, start, count)``, in request order (the Planner's batch)."""
        return [self.summary_buffer(s, start, count) for s, start, count in requests]

    def fetch(self, source: int, step: int, buckets: list[int]) -> dict[str, list]:
        """This member's samples of `step` for `buckets`, each bucket's exactly once per ask.

        A primary pops what it staged and schedules read-ahead on the worker threads; buckets
        popped before (by a dead instance of this actor, or for a constructor that died before
        building) are read again from the plan. A shadow reads the buckets from the plan.
        """
        loader = self._member(source)
        if self.direct:
            self.direct_fetches += 1
            return read_buckets(loader, loader.get_plan(step, source), buckets)
        out = loader.fetch(step, buckets)
        if self.plans is not None:
            self._schedule_read_ahead(step)
        else:
            first = max(step + 1, self._ahead_until[source] + 1)
            for ahead in range(first, step + 1 + self.read_ahead):
                self._pool.submit(self._read_ahead, loader, ahead)
                self._ahead_until[source] = ahead
        plan = loader.get_plan(step, source)  # this member's shard of the plan (cached)
        missing = missing_buckets(plan, buckets, out)
        if missing:
            extra = read_buckets(loader, plan, missing)
            out = {k: out[k] + extra[k] for k in out}
            self.rereads += len(missing)
        return out

    def fetch_many(self, step: int, sources: Sequence[int], buckets: list[int]) -> dict[int, dict[str, list]]:
        """`fetch` of every one of `sources` (members): a constructor's step from this actor."""
        return {s: self.fetch(s, step, buckets) for s in sources}

    def _schedule_read_ahead(self, step: int) -> None:
        """Read the next `read_ahead` steps of the members they draw (from the group's plans). Per
        member instead, a group of 1,000 sources read ahead ~40 sources a step would draw and
        ~40 that the next step does not (their empty plans), and rarely the ones it does."""
        with self._ahead_lock:
            first = max(step + 1, self._group_ahead_until + 1)
            last = step + self.read_ahead
            self._group_ahead_until = max(self._group_ahead_until, last)
        for ahead in range(first, last + 1):
            self._pool.submit(self._read_ahead_step, ahead)

    def _read_ahead_step(self, step: int) -> None:
        try:
            drawn = self.plans.drawn_if_planned(step)
        except Exception as exc:  # the constructor's own fetch asks again, and raises with its context
            _log.warning("read-ahead of step %d: its plans could not be had: %s", step, exc)
            return
        for s in drawn or ():  # None: not plannable yet (a loss report to come): the fetch reads it
            if s not in self.loaders:
                continue
            if self.workers > 1:  # costly transforms: each member on its own worker thread
                self._pool.submit(self._read_ahead, self.loaders[s], step)
            else:
                self._read_ahead(self.loaders[s], step)

    @staticmethod
    def _read_ahead(loader: SourceLoader, step: int) -> None:
        try:
            loader.read_ahead(step)
        except Exception as exc:  # the constructor's own fetch raises it again, with its context
            _log.warning("read-ahead of step %d for source %r failed: %s", step, loader.spec.name, exc)

    def stats(self) -> dict[int, dict[str, int]]:
        return {s: {**ld.stats(), "shard": self.refs[s].shard, "num_shards": self.refs[s].num_shards}
                for s, ld in self.loaders.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"members": {str(s): ld.state_dict() for s, ld in self.loaders.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for s, sub in state["members"].items():
            self._member(int(s)).load_state_dict(sub)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ld in self.loaders.values():
            ld.close()


class LoaderGroupActor(ThreadStacks):
    """A `LoaderGroup` in its own process (the service's one loader actor class); plans come from
    the Planner actor whose handle it is given.

    A one-source, one-shard group is a per-source loader; ``direct`` makes it a shadow. Restarts
    (fault tolerance): Ray re-runs ``__init__`` (members, seed, workers and the Planner's handle are
    its arguments; a restarted Planner keeps its actor id) and the group stages nothing until asked
    (`LoaderGroup.fetch` reads again what the dead instance had handed out).
    """

    # The Planner's metadata calls get threads of their own. Fetches wait on the Planner's plans, and the
    # Planner waits on these calls to plan: in one pool of threads, GROUP_CONCURRENCY fetches waiting for
    # a plan left no thread to answer the summaries that plan needed, until the Planner's timeouts.
    RAY_OPTIONS = {"num_cpus": 0, "max_concurrency": GROUP_CONCURRENCY}  # `runtime.ray_actor.actor` adds the rest
    CONCURRENCY_GROUPS = {METADATA_GROUP: 2}

    def __init__(self, members: list[tuple[ShardRef, SourceSpec]] | Held, seed: int, shuffle: bool, workers: int = 1,
                 planner: Any = None, direct: bool = False):
        members = resolve(members)  # by reference: hundreds of sources' specs (`runtime.ray_actor.Held`)
        trim_periodically()  # windows and pages of every size come and go on pyarrow's malloc (`runtime.malloc`)
        self._planner = planner
        self.calls, self.metrics = CallCounter(), service_metrics()
        self.group = LoaderGroup(members, seed=seed, shuffle=shuffle, workers=workers,
                                 get_plans_ahead=self._get_plans_ahead, direct=direct)

    def _get_plans_ahead(self, step: int, sources: list[int], count: int,
                         wait: bool = True) -> Mapping[int, Mapping[int, LoaderPlan]]:
        """Every member's plans of `step` and of the next steps the Planner has: one call for
        several steps (the group caches the answer)."""
        self.calls.add("loader>planner loader_plans")
        return ray.get(self._planner.loader_plans_ahead.remote(step, sources, count, wait))

    def ready(self) -> dict[str, Any]:
        """Where the actor runs and what it serves (placement checks and readiness)."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "sources": sorted(self.group.loaders), "pid": os.getpid(),
                "shards": {s: [r.shard, r.num_shards] for s, r in self.group.refs.items()},
                "shadow": self.group.direct}

    @ray.method(concurrency_group=METADATA_GROUP)
    def summary_buffer(self, source: int, start: int, count: int):
        return self.group.summary_buffer(source, start, count)

    @ray.method(concurrency_group=METADATA_GROUP)
    def summaries(self, requests: list[tuple[int, int, int]]) -> list:
        """The Planner's metadata requests for any of this actor's sources, answered in one call."""
        return self.group.summaries(requests)

    def fetch_many(self, step: int, sources: list[int], buckets: list[int]) -> dict[int, dict[str, list]]:
        """A constructor's step from this actor: every one of `sources` in one call."""
        out = self.group.fetch_many(step, sources, buckets)
        for s, got in out.items():
            samples, tokens, skipped = samples_in(got)
            self.metrics.source_read(self.group.loaders[s].spec.name, samples=samples, tokens=tokens,
                                     skipped=skipped)
        return {s: encode_fetch(got) for s, got in out.items()}  # text as columns (`runtime.fetch_wire`)

    def stats(self) -> dict:
        return {"members": self.group.stats(), "rereads": self.group.rereads, "workers": self.group.workers,
                "shadow": self.group.direct, "direct_fetches": self.group.direct_fetches,
                "ray_calls": self.calls.snapshot()}

    def rss_bytes(self) -> int:
        """This process's resident memory."""
        return rss_bytes()

    @ray.method(max_task_retries=0)  # never re-run on the restarted actor
    def crash(self) -> None:
        crash_self()


def merge_fetches(parts: Sequence[Mapping[str, list]]) -> dict[str, list]:
    """One source's fetch result from its shards' results (disjoint positions), in position order."""
    samples = sorted((x for p in parts for x in p["samples"]), key=lambda x: (x[0], x[1]))
    skipped = sorted((x for p in parts for x in p["skipped"]), key=lambda x: (x[0], x[1]))
    return {"samples": samples, "skipped": skipped}


def spawn_loader_groups(config: Any, planner: Any, restart_options: dict[str, Any], job: str) -> Spawn:
    """The `Spawn` of a Planner actor: restartable `LoaderGroupActor`s with its plans.

    Returns at once (the actor starts in the background): the partition's actors start side by
    side, and a shard created by scaling opens its sources during the ``lead_steps`` before its
    boundary instead of holding up planning. A call that reaches it first waits for its start.
    """

    def spawn(members: list[tuple[ShardRef, SourceSpec]], workers: int, options: dict) -> Any:
        return actor(LoaderGroupActor, **restart_options, **options).remote(
            Held.put(members, owner=job), config.seed, config.shuffle, workers, planner)

    return spawn


def spawn_shadows(config: Any, planner: Any, restart_options: dict[str, Any], job: str) -> Callable[[list], Any]:
    """The shadow spawner of a Planner actor (``fault_tolerance.shadow_loaders``): a direct-reading
    `LoaderGroupActor` of the same members, spread by Ray away from its primary where it can."""

    def spawn(members: list[tuple[ShardRef, SourceSpec]]) -> Any:
        return actor(LoaderGroupActor, **restart_options, scheduling_strategy="SPREAD").remote(
            Held.put(members, owner=job), config.seed, config.shuffle, 1, planner, True)

    return spawn
