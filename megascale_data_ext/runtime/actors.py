"""The Planner actor, and the pull-model wiring between the actors (the loader actor is
`runtime.loader_group.LoaderGroupActor`, the Data Constructor's `runtime.constructor_actor`).

Pull model (paper Sec. 3): a Client asks its Data Constructor, the constructor asks Source
Loaders, a loader asks the Planner for its plan, the Planner asks loaders for metadata — each
of these once per loader actor for all the sources it holds (`runtime.calls`).
The Planner -> loader call happens while a loader may be waiting on the Planner, so loaders
and constructors are threaded actors (``max_concurrency`` = `ACTOR_CONCURRENCY`), and a loader's
`summaries` run on threads of their own (a Ray concurrency group) that its waiting fetches cannot
take. The Planner is threaded too: with loss-driven mixing, planning a step waits for a trainer's
`report_loss`, which runs on the Planner's own control threads for the same reason (the Planner's
lock serialises planning itself), and the trainer's own calls about steps it has reached run on
threads of theirs: the trainer, which the reports come from, never waits behind calls that wait for
it. The Planner never waits on a constructor.

Failures (`runtime.fault_tolerance`, paper Sec. 6): every actor may be restarted by Ray. The Planner
writes its state after each planned step and a restarted one restores it (re-planning older
steps from their saved states on demand); its calls are idempotent, so Ray re-runs calls in
flight. Loaders and constructors are called through `RoutedFetch` (with shadows,
`runtime.shadows`) / the client's retries instead, which know which calls can be re-issued. Each actor's ``crash`` is a SIGKILL it
sends itself (fault injection).
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from megascale_data_ext.dataplane.plan import ConstructorPlan
from megascale_data_ext.dataplane.scaling import ScalingPolicy
from megascale_data_ext.runtime.autoscale_plan import AutoscalePlan
from megascale_data_ext.runtime.autoscaler import AutoScaler
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.checkpoints import PlannerCheckpoints
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import EncoderRows, encoder_rows
from megascale_data_ext.runtime.fault_injection import crash_self
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.loader_group import spawn_loader_groups, spawn_shadows
from megascale_data_ext.runtime.metrics import service_metrics
from megascale_data_ext.runtime.placement import constructor_homes
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.runtime.planner_recovery import PlannerRecovery
from megascale_data_ext.runtime.ray_actor import Held, resolve
from megascale_data_ext.runtime.thread_stacks import ThreadStacks
from megascale_data_ext.runtime.routing import RouteBook
from megascale_data_ext.runtime.shadows import Replica
from megascale_data_ext.runtime.topology import ServiceTopology

ACTOR_CONCURRENCY = 16
CONTROL_GROUP = "control"  # the Planner's calls that never wait: threads of their own (`PlannerActor`)
TRAINER_GROUP = "trainer"  # the trainer's calls about steps it has reached (`PlannerActor`)
PLANNED_GROUP = "planned"  # calls about steps a constructor has the plans of: never wait (`PlannerActor`)
NO_FAULT_TOLERANCE = FaultToleranceConfig(restart=False)


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


@dataclass(frozen=True, slots=True)
class ConstructorStep:
    """All a constructor needs from the Planner to build a step, in one reply
    (`PlannerActor.constructor_step`)."""

    plans: list[ConstructorPlan]  # one per bucket asked for, in that order
    sources: list[int]  # every source those plans read
    routes: list[list[int]]  # per source of `sources`: its shards' loader actor ids (shard k at k)
    encoder: EncoderRows | None  # the buckets' images per encoder rank; None: no images this step
    fleet: str = ""  # whose actor ids these are (`AutoScaler.fleet`)
    replicas: dict[int, Replica] = field(default_factory=dict)  # handles of the ids the caller lacks


class PlannerActor(ThreadStacks):
    """The Planner in its own process; holds handles to the loaders for `summary_buffer`.

    With a checkpoint directory, `PlannerRecovery` writes the state after every planned step; a
    restarted actor loads the newest, and a request for an older step (a constructor rebuilding)
    rewinds to that step's saved state and re-plans.

    The Planner owns the loaders (`AutoscalePlan`: the partition's loader groups and shards with
    ``autoscale.enabled``, else one actor per source; with their shadows): it starts them, scales
    them with the mixture it plans (`runtime.autoscaler`) and tells constructors where a step of a
    source is (`routes`). Owned actors die with it; a restarted Planner starts them again at the
    shard counts it had saved (any layout serves any step: a shard's samples are a pure function
    of the plan).
    """

    # With feedback mixing, constructors' and loaders' calls for steps ahead wait for the trainer's
    # loss reports, each holding a thread of the default pool; 2 x constructors + loader actors of
    # them can be waiting. What the trainer needs to go on must not queue behind them: its reports
    # (`CONTROL_GROUP`, with the other calls that never wait) and its calls about steps it has reached
    # (`TRAINER_GROUP`: rank 0's per-step plan summary, checkpoints, the cost model), nor what a
    # constructor building a planned step needs (`PLANNED_GROUP`: its loaders' plans, its routes after
    # a loader failure, its encoder rows; loaders' read-ahead asks without waiting). In one pool the
    # waiting calls held every thread until the report timeout, step after step.
    RAY_OPTIONS = {"num_cpus": 0, "max_concurrency": ACTOR_CONCURRENCY}  # `runtime.ray_actor.actor` adds the rest
    CONCURRENCY_GROUPS = {CONTROL_GROUP: 2, TRAINER_GROUP: 4, PLANNED_GROUP: 4}

    def __init__(self, config: ServiceConfig | Held, topology: ServiceTopology, loaders: AutoscalePlan | Held,
                 ft: FaultToleranceConfig | None = None, checkpoint_dir: str | None = None):
        config, loaders = resolve(config), resolve(loaders)  # by reference for a large blend (`Held`)
        self._topology = topology
        pc = config.placement
        self._constructor_homes = constructor_homes(pc.trainer_nodes, pc.ranks_per_node, topology)
        self.ft = ft or NO_FAULT_TOLERANCE
        checkpoints = PlannerCheckpoints(checkpoint_dir, self.ft.checkpoint_keep) if checkpoint_dir else None
        self.calls, self.metrics = CallCounter(), service_metrics()  # this actor process's registry
        restarted = reconstructed()
        self.scaler = self._start_loaders(config, loaders, checkpoints if restarted else None)
        self._route_book = RouteBook()  # which constructors hold which loader actors' handles
        self._horizon = delivery_horizon(config, self.ft)
        summarize_many = functools.partial(self.scaler.summaries, ft=self.ft, calls=self.calls)
        self.planner = Planner(config, topology, None, summarize_many=summarize_many,
                               on_planned=self._on_planned, constructors=topology.num_constructors,
                               report_timeout_s=self.ft.report_timeout_s)
        self.recovery = PlannerRecovery(self.planner, checkpoints, restarted=restarted,
                                        reports_kept=4 * self.ft.checkpoint_keep)

    def _start_loaders(self, config: ServiceConfig, plan: AutoscalePlan,
                       restored_from: PlannerCheckpoints | None) -> AutoScaler:
        me = ray.get_runtime_context().current_actor
        n = len(config.sources)
        scaler = AutoScaler(config.sources, ScalingPolicy(plan.scaling, plan.initial_shards(n)),
                            spawn=spawn_loader_groups(config, me, plan.restart_options, self._topology.job),
                            kill=lambda h: ray.kill(h, no_restart=True), interval_steps=plan.interval_steps,
                            lead_steps=plan.lead_steps, workers=plan.shard_workers,
                            shard_options=plan.shard_options or None, online=plan.online,
                            spawn_shadow=(spawn_shadows(config, me, plan.restart_options, self._topology.job)
                                          if plan.shadows else None))
        scaler.start(plan.actors)
        self._loaders_ready = False
        if restored_from is not None:  # restarted: its loaders open (or fail, named) before anything else
            self._wait_loaders_ready(scaler)
            saved = restored_from.autoscaler()
            if saved is not None:  # back to the shard counts it had scaled to (the old actors died with it)
                scaler.load_state_dict(saved)
        return scaler

    def _wait_loaders_ready(self, scaler: AutoScaler) -> None:
        """Until every loader actor opened its sources; a source that cannot open raises here, named.
        A fresh Planner returns from ``__init__`` with its loaders only asked for, so that the
        service's constructors start while they open (`DataService` asks `loader_actors` next)."""
        if self._loaders_ready:
            return
        # a loader that Ray is restarting (its node lost while this Planner restarts) is waited for,
        # up to the recovery timeout; one that cannot start (a source that cannot open) raises now
        pending, deadline = scaler.live() + scaler.live_shadows(), time.monotonic() + self.ft.recovery_timeout_s
        while pending:
            refs = [(h, h.ready.remote()) for h in pending]
            pending = []
            for h, ref in refs:
                try:
                    ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    pending.append(h)
            if pending:
                time.sleep(0.2)
        self._loaders_ready = True

    def _on_planned(self, plan: Any, seconds: float) -> None:
        self.metrics.record_plan(plan, seconds)
        # under the planner's lock, so routing sees the decision in order
        decided = self.scaler.observe(plan.step, np.bincount(plan.source, minlength=len(self.scaler.specs)))
        if decided or self.scaler.steps % self.scaler.interval_steps == 0:
            self.recovery.save_autoscaler(self.scaler.state_dict())
        # loaders that served only steps no constructor fetches again go: steps whose plan the
        # Planner dropped, or behind the delivery horizon of the newest step routed
        done = max(plan.step - self.planner.keep - 1, self.scaler.max_routed - self._horizon)
        self.scaler.release(min(done, self.planner.low_water() - 1))  # never what a constructor still builds
        self.recovery.planned()  # under the planner's lock: the state right after this step

    def _plan(self, step: int):
        return self.recovery.plan(step)

    @ray.method(concurrency_group=TRAINER_GROUP)
    def adopt_cost_model(self, fit: dict) -> int:
        """`Planner.adopt_cost_model`, saved at once: a restarted Planner keeps balancing with it."""
        return self.planner.adopt_cost_model(fit, then=self.recovery.planned)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def topology(self) -> ServiceTopology:
        """The service's topology, for clients that join by namespace alone."""
        return self._topology

    @ray.method(concurrency_group=CONTROL_GROUP)
    def fault_tolerance(self) -> FaultToleranceConfig:
        """The service's fault-tolerance settings, for clients (retries, prefetch)."""
        return self.ft

    @ray.method(concurrency_group=TRAINER_GROUP)
    def plan(self, step: int):
        return self._plan(step)

    def loader_plan(self, step: int, source: int):
        return self._plan(step).loader_do_plan(source)

    @ray.method(concurrency_group=PLANNED_GROUP)
    def loader_plans_ahead(self, step: int, sources: list[int], count: int, wait: bool = True) -> dict[int, dict]:
        """`step`'s LoaderPlans of `sources` (a loader group's members; a source absent has nothing
        in the step) and those of up to ``count - 1`` steps after it that can be planned without
        waiting (`Planner.planned_ahead`), ``{step: {source: LoaderPlan}}``: a loader group asks
        once per `count` steps instead of once per step. ``wait=False`` (read-ahead): `step` too
        only if it can be planned without waiting, else ``{}``; a fetch's step is planned already."""
        if not wait and not self.planner.ready(step):
            return {}
        out = {step: self._plan(step).loader_do_plans(sources)}
        for plan in self.planner.planned_ahead(step + 1, count - 1):
            out[plan.step] = plan.loader_do_plans(sources)
        return out

    def constructor_plan(self, step: int, bucket: int):
        return self._plan(step).constructor_do_plan(bucket)

    def constructor_plans(self, step: int, buckets: list[int]) -> list[ConstructorPlan]:
        """The ConstructorPlans of `buckets` at `step`, in that order."""
        plan = self._plan(step)
        return [plan.constructor_do_plan(b) for b in buckets]

    def constructor_step(self, step: int, buckets: list[int], constructor: int,
                         floor: int | None = None, handles: str | None = None) -> ConstructorStep:
        """A constructor's one call per step: its buckets' plans, the routes of every source they
        read and the encoder rows, instead of a call per bucket plus ``routes`` and ``encoder_plan``;
        `floor` (its slowest consumer's step, when it rose since the last call) rides along
        instead of a ``constructor_floor`` call. Floors only free plans and loaders, so one that
        arrives a step late keeps them a step longer. Routes are actor ids; the handles of those
        the constructor's cache `handles` (its token) was not sent yet come along (`RouteBook`)."""
        if floor is not None:
            self.planner.constructor_floor(constructor, floor)
        plan = self._plan(step)  # plans (and observes) up to `step` first, so its layout is decided
        plans = [plan.constructor_do_plan(b) for b in buckets]
        sources = np.unique(np.concatenate([p.rows[:, 1] for p in plans])).tolist() if plans else []
        ids = self.scaler.route_ids(step, sources)
        used = {a for row in ids for a in row}
        send = used if handles is None else self._route_book.unsent(constructor, handles, used)
        return ConstructorStep(plans, sources, ids, encoder_rows(plan, buckets), fleet=self.scaler.fleet,
                               replicas=self.scaler.replicas(send))

    @ray.method(concurrency_group=PLANNED_GROUP)
    def encoder_plan(self, step: int, buckets: list[int]) -> EncoderRows | None:
        """The EncoderPlan rows (images, their (source, position), encoder rank) of `buckets`' samples."""
        return encoder_rows(self._plan(step), buckets)

    def constructor_floor(self, constructor: int, step: int) -> None:
        """Constructor `constructor`'s slowest consumer is on `step` (plans before it may go)."""
        self.planner.constructor_floor(constructor, step)

    @ray.method(concurrency_group=TRAINER_GROUP)
    def plan_summary(self, step: int) -> dict:
        return self._plan(step).summary()

    @ray.method(concurrency_group=TRAINER_GROUP)
    def state_dict(self, step: int | None = None) -> dict:
        return self.recovery.state_dict(step)

    @ray.method(concurrency_group=TRAINER_GROUP)
    def load_state_dict(self, state: dict, reshard: bool = False) -> None:
        """Continue at the saved step; `reshard` accepts a state saved under another parallel layout."""
        self.recovery.load_state_dict(state, reshard=reshard)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def report_loss(self, step: int, losses: dict) -> None:
        self.recovery.report_loss(step, losses)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def missing_report(self, step: int) -> int | None:
        """The step whose loss report planning `step` still waits for (feedback mixing), or None."""
        return self.planner.reports.missing(step)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stats(self) -> dict:
        return {"next_step": self.planner.next_step, "restored_from": self.recovery.restored_from,
                "rewinds": self.recovery.rewinds,
                "report_waiters_most": self.planner.reports.most_waiting,  # calls that waited for a loss report at once
                "failovers": self.scaler.suspects.failovers, "ray_calls": self.calls.snapshot(),
                "autoscale": {"layouts": self.scaler.layout_table(), "live_actors": len(self.scaler.actors),
                              "events": list(self.scaler.events)}}

    # -- the loaders it owns -----------------------------------------------------------
    @ray.method(concurrency_group=PLANNED_GROUP)
    def routes(self, step: int, sources: list[int]) -> list[list[Replica]]:
        """Per source of `sources`, the loader actors (with shadows) holding its samples of `step`
        (shard k at index k): a constructor's whole step in one call."""
        self._plan(step)  # plan (and observe) up to `step` first, so its layout is decided
        return self.scaler.routes(step, sources)

    @ray.method(concurrency_group=TRAINER_GROUP)
    def loaders_of(self, source: int) -> list[Any]:
        """The actors serving `source` now (newest layout)."""
        return self.scaler.newest(source)

    @ray.method(concurrency_group=TRAINER_GROUP)
    def loader_actors(self) -> list[Any]:
        """Every live loader actor, once (the first call waits until they opened their sources)."""
        self._wait_loaders_ready(self.scaler)
        return self.scaler.live()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def shadow_actors(self) -> list[Any]:
        """The shadow of every live loader actor (empty without ``fault_tolerance.shadow_loaders``)."""
        return self.scaler.live_shadows()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def homes(self) -> dict[str, list]:
        """Where the service's actors belong (`runtime.placement`): ``loaders``, each live loader actor
        with its home node, and ``constructors``, each constructor's home (None: no home)."""
        return {"loaders": self.scaler.live_homes(), "constructors": list(self._constructor_homes)}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def scaling_events(self) -> list[dict[str, Any]]:
        return list(self.scaler.events)

    @ray.method(max_task_retries=0)  # never re-run on the restarted actor
    def crash(self) -> None:
        crash_self()
