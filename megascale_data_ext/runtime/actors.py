"""Ray actor façades over the plain runtime classes (Planner, Source Loader; the Data
Constructor's is `runtime.constructor_actor`), and the pull-model wiring between them.

Pull model (paper Sec. 3): a Client asks its Data Constructor, the constructor asks Source
Loaders, a loader asks the Planner for its plan, the Planner asks loaders for metadata —
autoscaled, each of these once per loader actor for all the sources it holds (`runtime.calls`).
The Planner -> loader call happens while a loader may be waiting on the Planner, so loaders
and constructors are threaded actors (``max_concurrency`` = `ACTOR_CONCURRENCY`): a loader's
`summaries` are served on another thread while its `fetch` waits. The Planner is threaded
too: with loss-driven mixing, planning a step waits for a trainer's `report_loss`, which must
be served meanwhile (the Planner's lock serialises planning itself). The Planner never
waits on a constructor, so the call graph has no cycle that can exhaust the thread pools.

Failures (`runtime.faults`, paper Sec. 6): every actor may be restarted by Ray. The Planner
writes its state after each planned step and a restarted one restores it (re-planning older
steps from their saved states on demand); its calls are idempotent, so Ray re-runs calls in
flight. Loaders and constructors are called through `LoaderFailover` / the client's retries
instead, which know which calls can be re-issued. Each actor's ``crash`` is a SIGKILL it
sends itself (fault injection).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import ray

from megascale_data_ext.dataplane.scaling import ScalingPolicy
from megascale_data_ext.errors import PlanError, ResumeError
from megascale_data_ext.runtime.autoscaler import AutoScaler, AutoscalePlan, spawn_loader_groups
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.checkpoints import LoaderSnapshots, PlannerCheckpoints
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import EncoderRows, encoder_rows
from megascale_data_ext.runtime.elastic import reshard_planner_state
from megascale_data_ext.runtime.failover import LoaderFailover, missing_buckets, read_buckets
from megascale_data_ext.runtime.faults import FaultToleranceConfig, crash_self
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.runtime.metrics import record_plan, rss_bytes, samples_in, service_metrics
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.runtime.topology import PLANNER_NAME, ServiceTopology

ACTOR_CONCURRENCY = 16
NO_FAULT_TOLERANCE = FaultToleranceConfig(restart=False)
_log = logging.getLogger(__name__)


def reconstructed() -> bool:
    """Whether Ray restarted this actor after a failure (its __init__ runs again)."""
    with warnings.catch_warnings():  # Ray's own property reads its deprecated `actor_id` ("Use get_actor_id()")
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def delivery_horizon(config: ServiceConfig, ft: FaultToleranceConfig) -> int:
    """Steps behind the newest requested one that no client asks for again: a constructor drops
    what it built for them, and the Planner may reclaim the loaders that served only them.

    Ranks of one job run in lockstep (collectives), each at most ``client_prefetch`` steps ahead
    and its constructor ``prefetch`` more; twice that, plus slack, is never re-asked.
    """
    return 2 * (config.prefetch + ft.client_prefetch) + 4


@ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)
class PlannerActor:
    """The Planner in its own process; holds handles to the loaders for `summary_buffer`.

    With a checkpoint directory, the state before every planned step is written there
    (`PlannerCheckpoints`); a restarted actor loads the newest, and a request for an older
    step (a constructor rebuilding) rewinds to that step's saved state and re-plans.

    With an `AutoscalePlan` (``autoscale.enabled``) the Planner owns the loaders: it starts
    the partition's loader groups and shards, scales them with the mixture it plans
    (`runtime.autoscaler`) and tells constructors where a step of a source is (`route`).
    Owned actors die with it; a restarted Planner starts them again at the shard counts it had
    saved (any layout serves any step: a shard's samples are a pure function of the plan).
    """

    def __init__(self, config: ServiceConfig, topology: ServiceTopology, loader_handles: list[Any],
                 ft: FaultToleranceConfig | None = None, checkpoint_dir: str | None = None,
                 shadow_handles: list[Any] | None = None, autoscale: AutoscalePlan | None = None):
        self._topology = topology
        self.ft = ft or NO_FAULT_TOLERANCE
        self.checkpoints = PlannerCheckpoints(checkpoint_dir, self.ft.checkpoint_keep) if checkpoint_dir else None
        self.scaler: AutoScaler | None = None
        self.calls = CallCounter()
        summarize = summarize_many = None
        if autoscale is None:  # one actor per source: a call per source is a call per actor
            self._loaders: LoaderFailover | None = LoaderFailover(loader_handles, shadow_handles, self.ft,
                                                                  calls=self.calls, caller="planner")
            summarize = self._loaders.summary
        else:  # each loader actor asked once for all of its sources (`AutoScaler.summaries`)
            self._loaders = None
            self.scaler = self._start_autoscaler(config, autoscale)
            self._horizon = delivery_horizon(config, self.ft)
            summarize_many = functools.partial(self.scaler.summaries, ft=self.ft, calls=self.calls)
        self.planner = Planner(config, topology, summarize, summarize_many=summarize_many,
                               on_planned=self._on_planned, constructors=topology.num_constructors)
        self.restored_from: int | None = None
        self.rewinds = 0
        self._reports: dict[int, list] = {}  # loss reports received, re-fed after every restore or rewind
        if self.checkpoints is not None:
            state = self.checkpoints.latest() if reconstructed() else None
            if state is not None:
                self._reports = self.checkpoints.reports()
                self._load(state)
                self.restored_from = int(state["step"])
                _log.warning("planner restarted: restored its state before step %d", self.restored_from)
            else:
                self.checkpoints.save(self.planner.state_dict())

    def _start_autoscaler(self, config: ServiceConfig, plan: AutoscalePlan) -> AutoScaler:
        me = ray.get_runtime_context().current_actor
        n = len(config.sources)
        scaler = AutoScaler(config.sources, ScalingPolicy(plan.scaling, plan.initial_shards(n)),
                            spawn=spawn_loader_groups(config, me, plan.restart_options),
                            kill=lambda h: ray.kill(h, no_restart=True), interval_steps=plan.interval_steps,
                            lead_steps=plan.lead_steps, workers=plan.shard_workers,
                            shard_options=plan.shard_options or None, online=plan.online)
        scaler.start(plan.actors)
        ray.get([h.ready.remote() for h in scaler.live()])  # every source opens (or fails, named) now
        saved = self.checkpoints.autoscaler() if self.checkpoints is not None and reconstructed() else None
        if saved is not None:  # back to the shard counts it had scaled to (the old actors died with it)
            scaler.load_state_dict(saved)
        return scaler

    def _on_planned(self, plan: Any, seconds: float) -> None:
        record_plan(plan, seconds)
        if self.scaler is not None:  # under the planner's lock, so routing sees the decision in order
            decided = self.scaler.observe(plan.step, np.bincount(plan.source, minlength=len(self.scaler.specs)))
            if self.checkpoints is not None and (decided or self.scaler.steps % self.scaler.interval_steps == 0):
                self.checkpoints.save_autoscaler(self.scaler.state_dict())
            # loaders that served only steps no constructor fetches again go: steps whose plan the
            # Planner dropped, or behind the delivery horizon of the newest step routed
            done = max(plan.step - self.planner.keep - 1, self.scaler.max_routed - self._horizon)
            self.scaler.release(min(done, self.planner.low_water() - 1))  # never what a constructor still builds
        if self.checkpoints is not None:  # under the planner's lock: the state right after this step
            self.checkpoints.save(self.planner.state_dict(), keep_from=self.planner.low_water())

    def _plan(self, step: int):
        try:
            return self.planner.plan(step)
        except ResumeError:
            if self.checkpoints is None:
                raise
        # Rewind to the saved state before `step` and re-plan (deterministic: the same plans) under
        # the planning lock: concurrent calls wait, and no other rewind moves the Planner before
        # `step` is planned (two concurrent rewinds used to clear each other's plan).
        with self.planner.planning():
            with contextlib.suppress(ResumeError):  # another rewind may have re-planned it meanwhile
                return self.planner.plan(step)
            state = self.checkpoints.at(step)
            if state is None:
                raise ResumeError(f"plan for step {step} is neither kept nor checkpointed (planner at step "
                                  f"{self.planner.next_step}, checkpoints of steps {self.checkpoints.steps()[:1]}.."
                                  f"{self.checkpoints.steps()[-1:]}); raise data.fault_tolerance.checkpoint_keep")
            self._load(state)
            self.rewinds += 1
            return self.planner.plan(step)

    def _load(self, state: dict) -> None:
        """Load a saved state, then hand back the loss reports it predates (feedback mixing)."""
        self.planner.load_state_dict(state)
        for step, pairs in sorted(self._reports.items()):
            self.planner.report_loss(step, dict(pairs))

    def topology(self) -> ServiceTopology:
        """The service's topology, for clients that join by namespace alone."""
        return self._topology

    def fault_tolerance(self) -> FaultToleranceConfig:
        """The service's fault-tolerance settings, for clients (retries, prefetch)."""
        return self.ft

    def plan(self, step: int):
        return self._plan(step)

    def loader_plan(self, step: int, source: int):
        return self._plan(step).loader_do_plan(source)

    def loader_plans(self, step: int, sources: list[int]):
        """`step`'s LoaderPlans of `sources` (a loader group's members) in one reply; absent: nothing."""
        return self._plan(step).loader_do_plans(sources)

    def constructor_plan(self, step: int, bucket: int):
        return self._plan(step).constructor_do_plan(bucket)

    def encoder_plan(self, step: int, buckets: list[int]) -> EncoderRows | None:
        """The EncoderPlan rows (images, their (source, position), encoder rank) of `buckets`' samples."""
        return encoder_rows(self._plan(step), buckets)

    def constructor_floor(self, constructor: int, step: int) -> None:
        """Constructor `constructor`'s slowest consumer is on `step` (plans before it may go)."""
        self.planner.constructor_floor(constructor, step)

    def plan_summary(self, step: int) -> dict:
        return self._plan(step).summary()

    def state_dict(self, step: int | None = None) -> dict:
        try:
            return self.planner.state_dict(step)
        except ResumeError:
            state = self.checkpoints.at(step) if self.checkpoints is not None and step is not None else None
            if state is None:
                raise
            return state

    def load_state_dict(self, state: dict, reshard: bool = False) -> None:
        """Continue at the saved step; `reshard` accepts a state saved under another parallel layout."""
        if reshard:
            state = reshard_planner_state(state, self.planner.fingerprint())
        self.planner.load_state_dict(state)
        if self.checkpoints is not None:
            self.checkpoints.clear()
            self.checkpoints.save(self.planner.state_dict())

    def report_loss(self, step: int, losses: dict) -> None:
        self.planner.report_loss(step, losses)
        if self.checkpoints is not None and self.planner.report_delay is not None:
            self._reports[step] = [[k, v] for k, v in losses.items()]
            for old in [k for k in self._reports if k < step - 4 * self.ft.checkpoint_keep]:
                del self._reports[old]
            self.checkpoints.save_reports(self._reports)

    def stats(self) -> dict:
        out = {"next_step": self.planner.next_step, "restored_from": self.restored_from, "rewinds": self.rewinds,
               "failovers": self._loaders.failovers if self._loaders is not None else 0,
               "ray_calls": self.calls.snapshot()}
        if self.scaler is not None:
            out["autoscale"] = {"layouts": self.scaler.layout_table(), "live_actors": len(self.scaler.actors),
                                "events": list(self.scaler.events)}
        return out

    # -- autoscaled loaders (``autoscale.enabled``) ------------------------------------
    def _scaler(self) -> AutoScaler:
        if self.scaler is None:
            raise PlanError("this service runs one Source Loader per source (autoscale.enabled=false): "
                            "find loaders by name (`loader/<i>`), not through the Planner")
        return self.scaler

    def routes(self, step: int, sources: list[int]) -> list[list[Any]]:
        """Per source of `sources`, the loader actors holding its samples of `step` (shard k at index
        k): a constructor's whole step in one call."""
        self._plan(step)  # plan (and observe) up to `step` first, so its layout is decided
        return self._scaler().routes(step, sources)

    def loaders_of(self, source: int) -> list[Any]:
        """The actors serving `source` now (newest layout)."""
        return self._scaler().newest(source)

    def loader_actors(self) -> list[Any]:
        """Every live loader actor (autoscaled), once."""
        return self._scaler().live()

    def scaling_events(self) -> list[dict[str, Any]]:
        return list(self._scaler().events)

    @ray.method(max_task_retries=0)  # never re-run on the restarted actor
    def crash(self) -> None:
        crash_self()


@ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)
class SourceLoaderActor:
    """A Source Loader; its plans come from the Planner actor (set after creation, or looked up
    by name in `namespace` after a restart).

    A primary reads ahead and stages steps; a ``shadow`` (warm standby: source open, metadata
    loaded) serves only `fetch_direct`. A primary with `snapshots` writes its state every
    ``every`` steps and a restarted one restores it; steps since then replay from their plans.
    """

    def __init__(self, source_id: int, spec: Any, seed: int, shuffle: bool, read_ahead: int = 1, *,
                 namespace: str | None = None, snapshot_dir: str | None = None, snapshot_every: int = 16,
                 shadow: bool = False):
        self.loader = SourceLoader(source_id, spec, seed=seed, shuffle=shuffle, get_plan=self._get_plan)
        self._namespace = namespace
        self._planner: Any = None
        self._plans: OrderedDict[int, Any] = OrderedDict()  # step -> LoaderPlan (immutable), bounded
        self._plans_lock = threading.Lock()
        self.shadow = shadow
        self.read_ahead = 0 if shadow else read_ahead
        self.rereads = 0
        self.direct_fetches = 0
        self.calls = CallCounter()
        self.snapshots = LoaderSnapshots(snapshot_dir, snapshot_every) if snapshot_dir and not shadow else None
        self._snapshot_step = -snapshot_every
        self.restored_step: int | None = None
        if self.snapshots is not None and reconstructed():
            got = self.snapshots.load(source_id)
            if got is not None:
                self._snapshot_step, state = got
                self.loader.load_state_dict(state)
                self.restored_step = self._snapshot_step
        self._ahead: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ahead_until = -1
        if self.read_ahead:
            threading.Thread(target=self._read_ahead_loop, daemon=True, name="read-ahead").start()

    def _read_ahead_loop(self) -> None:
        """Refill from storage in the background: read the next planned steps before they are asked for."""
        while True:
            step = self._ahead.get()
            try:
                self.loader.read_ahead(step)
            except Exception as exc:  # the constructor's own fetch raises it again, with its context
                _log.warning("read-ahead of step %d for source %r failed: %s", step, self.loader.spec.name, exc)

    def _get_plan(self, step: int, source: int):
        with self._plans_lock:
            plan = self._plans.get(step)
        if plan is None:
            if self._planner is None:
                self._planner = ray.get_actor(PLANNER_NAME, namespace=self._namespace)
            self.calls.add("loader>planner loader_plan")
            plan = ray.get(self._planner.loader_plan.remote(step, source))
            with self._plans_lock:
                self._plans[step] = plan
                while len(self._plans) > 64:
                    self._plans.popitem(last=False)
        return plan

    def set_planner(self, planner: Any) -> None:
        self._planner = planner

    def size(self) -> int:
        return self.loader.size

    def summary_buffer(self, start: int, count: int):
        return self.loader.summary_buffer(start, count)

    def fetch(self, step: int, buckets: list[int]):
        """Pop `buckets`' staged samples of `step`; buckets popped before (by a dead instance, or
        for a constructor that died before building) are read again from the plan."""
        out = self.loader.fetch(step, buckets)
        missing = missing_buckets(self._get_plan(step, self.loader.source_id), buckets, out)
        if missing:
            extra = read_buckets(self.loader, self._get_plan(step, self.loader.source_id), missing)
            out = {k: out[k] + extra[k] for k in out}
            self.rereads += len(missing)
        self._served(out)
        for ahead in range(max(step + 1, self._ahead_until + 1), step + 1 + self.read_ahead):
            self._ahead.put(ahead)
            self._ahead_until = ahead
        if self.snapshots is not None and self.snapshots.due(step, self._snapshot_step):
            self._snapshot_step = step
            self.snapshots.save(self.loader.source_id, step, self.loader.state_dict())
        return out

    def fetch_direct(self, step: int, buckets: list[int]):
        """Read exactly `buckets`' samples of `step` from its plan, staging nothing (shadows, failover)."""
        out = read_buckets(self.loader, self._get_plan(step, self.loader.source_id), buckets)
        self.direct_fetches += 1
        self._served(out)
        return out

    def _served(self, out: dict) -> None:
        samples, tokens, skipped = samples_in(out)
        service_metrics().source_read(self.loader.spec.name, samples=samples, tokens=tokens, skipped=skipped)

    def stats(self) -> dict:
        return {**self.loader.stats(), "rereads": self.rereads, "direct_fetches": self.direct_fetches,
                "restored_step": self.restored_step, "shadow": self.shadow, "ray_calls": self.calls.snapshot()}

    def rss_bytes(self) -> int:
        """This process's resident memory (what a shadow costs)."""
        return rss_bytes()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    @ray.method(max_task_retries=0)  # never re-run on the restarted actor
    def crash(self) -> None:
        crash_self()
