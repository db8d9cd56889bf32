"""Online mixture-driven scaling: create, reshard and reclaim loader shards at step boundaries.

`dataplane.scaling.ScalingPolicy` decides how many data-parallel shards each source wants
from the mixture the Planner realised; the `AutoScaler` carries the decisions out:

* A source's **layout** is a history of ``(from_step, shards)``: shard k of n is a loader
  serving the positions ``p % n == k`` of the source's whole-stream plans (see
  `runtime.loader_group`). Steps route by the layout in force at them, so a step is read by
  exactly one set of shards and their positions partition the plan: exact accounting across
  a change needs no hand-over of buffers or cursors, and the samples are the same as a run
  that never rescaled (a position's sample depends only on seed, epoch and position).
* A change takes effect at a **boundary** ``max(step + lead_steps, last routed step + 1)``:
  no constructor has been routed past it yet (routing and rescaling share one lock), and
  ``lead_steps`` lets the new actors start while the old ones serve the steps in between.
* Old shards are **reclaimed** (`release`) once every step they serve has been delivered;
  an actor still named by a live layout (a shared group from the offline partition) is kept.

The `PlannerActor` owns the AutoScaler when the service runs with ``autoscale.enabled``
(`AutoscalePlan`: the offline partition's actors, their placement, the policy): its
``on_planned`` hook feeds the policy the realised per-source counts, loaders pull plans from
it, and constructors ask it where a step of a source is (``route``, then `RoutedFetch`).

Checkpoint (`StateSchema` "autoscaler", version 1): fingerprint = sources; fields
``policy`` (the policy's state), ``layouts`` (per source, ``[from_step, shards]`` still live),
``counts`` (this interval's per-source samples) and ``steps`` (steps observed).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.dataplane.scaling import ScalingConfig, ScalingDecision, ScalingPolicy
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.failover import cannot_restart
from megascale_data_ext.runtime.faults import FaultToleranceConfig, ServiceUnavailableError
from megascale_data_ext.runtime.loader_group import LoaderGroupActor
from megascale_data_ext.runtime.placement import home_of
from megascale_data_ext.runtime.shadows import Replica, Suspects, first_answers
from megascale_data_ext.sources.base import SourceSpec
from megascale_data_ext.state import StateSchema

__all__ = ["AutoScaler", "AutoscalePlan", "LoaderActorSpec", "per_source_plan", "spawn_loader_groups", "spawn_shadows"]

EVENTS_KEPT = 1024  # scaling events kept for `stats` (a long run scales thousands of times)

#: ``(members, workers, ray options) -> actor handle``: a ready loader (group) actor with its plans wired.
Spawn = Callable[[list[tuple[ShardRef, SourceSpec]], int, dict], Any]


@dataclass(slots=True, kw_only=True)
class LoaderActorSpec:
    """One loader actor to start: its (shards of) sources, read-ahead workers and Ray options (placement)."""

    shards: list[ShardRef]
    workers: int = 1
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class AutoscalePlan:
    """What the Planner starts and how it scales (built by `DataService` from the partition).

    Attributes:
        actors: The offline partition's loader actors.
        scaling: The policy's thresholds; its capacities are per source.
        online: Act on the policy (create / reclaim shards); False keeps the partition.
        interval_steps, lead_steps: As `AutoScaler`.
        shard_workers: Workers of a shard the scaler creates.
        shard_options: Ray options of a shard the scaler creates, per source (its node).
        restart_options: Ray restart options of every loader actor (fault tolerance).
        shadows: Start a warm shadow beside every loader actor (``fault_tolerance.shadow_loaders``).
    """

    actors: list[LoaderActorSpec]
    scaling: ScalingConfig
    online: bool = True
    interval_steps: int = 4
    lead_steps: int = 2
    shard_workers: int = 1
    shard_options: list[dict[str, Any]] = field(default_factory=list)
    restart_options: dict[str, Any] = field(default_factory=dict)
    shadows: bool = False

    def initial_shards(self, num_sources: int) -> list[int]:
        """Shards per source in the partition (1 for a source no actor names, which then starts alone)."""
        out = [1] * num_sources
        for a in self.actors:
            for sh in a.shards:
                out[sh.source] = sh.num_shards
        return out


@dataclass(slots=True)
class _Layout:
    from_step: int
    actors: tuple[int, ...]  # actor ids, shard k -> actors[k]


class AutoScaler:
    """Layouts of every source's loader shards and the actors behind them; thread-safe.

    Args:
        specs: The sources, in config order.
        policy: Decides shard counts from the realised mixture.
        spawn: Creates a ready loader actor for members (placement is the spawner's business).
        kill: Ends a loader actor (``ray.kill``).
        interval_steps: Steps per policy interval.
        lead_steps: Steps between a decision and its boundary (>= the constructors' prefetch).
        workers: Worker threads of each spawned shard actor.
        shard_options: Ray options of the shards spawned for each source (None: Ray's choice).
        online: Act on the policy; False counts but never rescales.
        spawn_shadow: Creates the warm shadow of a loader actor's members (`runtime.shadows`);
            None: no shadows.
    """

    STATE = StateSchema("autoscaler", 1, ("policy", "layouts", "counts", "steps"),
                        hint="resume with the same sources and scaling config")

    def __init__(self, specs: Sequence[SourceSpec], policy: ScalingPolicy, *, spawn: Spawn,
                 kill: Callable[[Any], None], interval_steps: int = 4, lead_steps: int = 2, workers: int = 1,
                 shard_options: Sequence[dict] | None = None, online: bool = True,
                 spawn_shadow: Callable[[list[tuple[ShardRef, SourceSpec]]], Any] | None = None) -> None:
        if interval_steps < 1 or lead_steps < 1:
            raise ValueError(f"interval_steps and lead_steps must be >= 1, got {interval_steps}, {lead_steps}")
        self.specs = list(specs)
        self.policy = policy
        self.spawn, self.kill = spawn, kill
        self.interval_steps, self.lead_steps, self.workers = interval_steps, lead_steps, workers
        self.shard_options = list(shard_options) if shard_options else [{} for _ in self.specs]
        self.online = online
        self.actors: dict[int, Any] = {}
        self.homes: dict[int, str | None] = {}  # actor id -> the node its placement prefers (`placement.home_of`)
        self.spawn_shadow = spawn_shadow
        self.shadows: dict[int, Any] = {}  # actor id -> its shadow
        self.layouts: list[list[_Layout]] = [[] for _ in self.specs]
        self.counts = np.zeros(len(self.specs), dtype=np.int64)
        self.steps = 0
        self.max_routed = -1
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)  # created / reclaimed: logs, tests
        self._next_id = 0
        self._lock = threading.RLock()
        self.suspects = Suspects(5.0)  # primaries whose shadow answers the Planner's metadata calls first

    # -- actors --------------------------------------------------------------------
    def _new_actor(self, members: list[tuple[ShardRef, SourceSpec]], workers: int, options: dict) -> int:
        handle = self.spawn(members, workers, options)
        aid, self._next_id = self._next_id, self._next_id + 1
        self.actors[aid] = handle
        self.homes[aid] = home_of(options)
        if self.spawn_shadow is not None:
            self.shadows[aid] = self.spawn_shadow(members)
        return aid

    def _replica(self, aid: int) -> Replica:
        return Replica(self.actors[aid], self.shadows.get(aid))

    def start(self, actors: Sequence[LoaderActorSpec] = ()) -> None:
        """Spawn `actors` (the offline partition: groups and shards), then the policy's shards of
        every source they do not cover. A source's shards must all be among `actors` or none."""
        with self._lock:
            shards: dict[int, dict[int, int]] = {}
            for a in actors:
                aid = self._new_actor([(sh, self.specs[sh.source]) for sh in a.shards], a.workers, dict(a.options))
                for sh in a.shards:
                    shards.setdefault(sh.source, {})[sh.shard] = aid
            for s, by_shard in shards.items():
                n = next(sh.num_shards for a in actors for sh in a.shards if sh.source == s)
                if sorted(by_shard) != list(range(n)):
                    raise PlanError(f"source {self.specs[s].name!r}: the partition gives shards {sorted(by_shard)} "
                                    f"of {n}; every shard must have exactly one actor")
                self.layouts[s].append(_Layout(0, tuple(by_shard[k] for k in range(n))))
            for s, spec in enumerate(self.specs):
                if not self.layouts[s]:
                    self.layouts[s].append(_Layout(0, self._spawn_shards(s, spec, self.policy.shards[s])))

    def _spawn_shards(self, source: int, spec: SourceSpec, n: int) -> tuple[int, ...]:
        return tuple(self._new_actor([(ShardRef(source=source, shard=k, num_shards=n), spec)], self.workers,
                                     dict(self.shard_options[source])) for k in range(n))

    # -- routing -------------------------------------------------------------------
    def _layout_at(self, step: int, source: int) -> _Layout:
        live = self.layouts[source]
        for lay in reversed(live):
            if lay.from_step <= step:
                return lay
        raise PlanError(f"step {step} of source {self.specs[source].name!r} is before the oldest live loader layout "
                        f"(from step {live[0].from_step if live else '?'}): it was delivered and its loaders reclaimed")

    def routes(self, step: int, sources: Sequence[int]) -> list[list[Replica]]:
        """Per source of `sources`, the loader actors (with their shadows) holding its samples of
        `step`, shard k at index k: a constructor's whole step in one call."""
        with self._lock:
            self.max_routed = max(self.max_routed, step)
            return [[self._replica(a) for a in self._layout_at(step, s).actors] for s in sources]

    def metadata_replica(self, source: int) -> Replica:
        """An actor of `source`'s newest layout, for metadata (`summary_buffer`); every shard has it all."""
        with self._lock:
            return self._replica(self.layouts[source][-1].actors[0])

    def newest(self, source: int) -> list[Any]:
        """The actors of `source`'s newest layout (fault injection, stats)."""
        with self._lock:
            return [self.actors[a] for a in self.layouts[source][-1].actors]

    def live(self) -> list[Any]:
        """Every live loader actor, once (shadows apart: `live_shadows`)."""
        with self._lock:
            return list(self.actors.values())

    def live_homes(self) -> list[tuple[Any, str | None]]:
        """Every live loader actor with its home node (None: no labelled home), in `live` order."""
        with self._lock:
            return [(h, self.homes.get(a)) for a, h in self.actors.items()]

    def live_shadows(self) -> list[Any]:
        """The shadow of every live loader actor, in `live` order (empty without shadows)."""
        with self._lock:
            return [self.shadows[a] for a in self.actors if a in self.shadows]

    def summaries(self, requests: Sequence[tuple[int, int, int]], ft: FaultToleranceConfig,
                  calls: CallCounter | None = None) -> list[Any]:
        """`summary_buffer` of every ``(source, start, count)``, in request order: one call per loader
        actor (each asked for all of its sources at once, the actors concurrently; a shadow answers
        for a primary that is down), waiting out restarts up to ``recovery_timeout_s``."""
        out: list[Any] = [None] * len(requests)
        todo = list(range(len(requests)))
        deadline = time.monotonic() + ft.recovery_timeout_s
        while True:
            by_actor: dict[Replica, list[int]] = {}
            for i in todo:
                by_actor.setdefault(self.metadata_replica(requests[i][0]), []).append(i)
            asks = {rep: (rep, lambda h, _idx=idx: h.summaries.remote([requests[i] for i in _idx]))
                    for rep, idx in by_actor.items()}
            answers, failures = first_answers(
                asks, hedge_s=ft.hedge_s, timeout_s=ft.rpc_timeout_s, suspects=self.suspects,
                on_call=None if calls is None else lambda: calls.add("planner>loader summaries"))
            for rep, got in answers.items():
                for i, summ in zip(by_actor[rep], got, strict=True):
                    out[i] = summ
            if not failures:
                return out
            failed = [i for rep in failures for i in by_actor[rep]]
            names = sorted({self.specs[requests[i][0]].name for i in failed})
            last = next(iter(failures.values()))
            dead = next(filter(None, map(cannot_restart, failures.values())), None)
            if dead is not None:
                raise ServiceUnavailableError(f"the loader of sources {names[:8]} cannot start again after a "
                                              f"restart: {dead}") from last
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"the loaders of sources {names[:8]}{' ...' if len(names) > 8 else ''} did not answer "
                    f"`summaries` within {ft.recovery_timeout_s:g} s (fault_tolerance.recovery_timeout_s): "
                    f"{last!r}") from last
            todo = failed
            time.sleep(0.2)

    def shards(self, step: int, source: int) -> int:
        with self._lock:
            return len(self._layout_at(step, source).actors)

    # -- scaling -------------------------------------------------------------------
    def observe(self, step: int, counts: Sequence[int]) -> list[ScalingDecision]:
        """Count the samples `step`'s plan takes per source; at each interval's end, act on the policy."""
        with self._lock:
            self.counts += np.asarray(counts, dtype=np.int64)
            self.steps += 1
            if self.steps % self.interval_steps or not self.online:
                return []
            decisions = self.policy.observe(self.counts.tolist())
            self.counts[:] = 0
            for d in decisions:
                self._reshard(d, step)
            return decisions

    def _reshard(self, d: ScalingDecision, step: int) -> None:
        live = self.layouts[d.source]
        boundary = max(step + self.lead_steps, self.max_routed + 1, live[-1].from_step + 1)
        new = self._spawn_shards(d.source, self.specs[d.source], d.new)
        live.append(_Layout(boundary, new))
        self.events.append({"event": "created", "source": d.source, "from_step": boundary, "old": d.old,
                            "new": d.new, "actors": len(new), "decided_at_step": step})

    def release(self, done_step: int) -> int:
        """Reclaim the loaders of layouts whose steps are all <= `done_step` (delivered); returns how many."""
        with self._lock:
            for s, live in enumerate(self.layouts):
                while len(live) > 1 and live[1].from_step <= done_step + 1:
                    old = live.pop(0)
                    self.events.append({"event": "retired", "source": s, "until_step": live[0].from_step,
                                        "actors": len(old.actors)})
            used = {a for live in self.layouts for lay in live for a in lay.actors}
            dead = [a for a in self.actors if a not in used]
            for a in dead:
                self.kill(self.actors.pop(a))
                self.homes.pop(a, None)
                if a in self.shadows:
                    self.kill(self.shadows.pop(a))
            if dead:
                self.events.append({"event": "reclaimed", "after_step": done_step, "actors": len(dead)})
            return len(dead)

    # -- state ---------------------------------------------------------------------
    def layout_table(self) -> list[list[list[int]]]:
        """Per source, ``[from_step, shards]`` of each live layout."""
        with self._lock:
            return [[[lay.from_step, len(lay.actors)] for lay in live] for live in self.layouts]

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return self.STATE.stamp({"sources": [s.name for s in self.specs]}, policy=self.policy.state_dict(),
                                    layouts=self.layout_table(), counts=self.counts.tolist(), steps=self.steps)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the policy and the newest layout of each source (fresh actors where the shape differs)."""
        fields = self.STATE.check(state, {"sources": [s.name for s in self.specs]})
        with self._lock:
            self.policy.load_state_dict(fields["policy"])
            self.counts = np.asarray(fields["counts"], dtype=np.int64)
            self.steps = int(fields["steps"])
            for s, saved in enumerate(fields["layouts"]):
                from_step, n = saved[-1]
                cur = self.layouts[s][-1] if self.layouts[s] else None
                if cur is None or len(cur.actors) != n:
                    self.layouts[s] = [_Layout(0, self._spawn_shards(s, self.specs[s], n))]
                else:
                    self.layouts[s] = [_Layout(0, cur.actors)]
            self.release(-1)
            self.events.append({"event": "restored", "shards": [len(live[-1].actors) for live in self.layouts]})


def spawn_loader_groups(config: Any, planner: Any, restart_options: dict[str, Any]) -> Spawn:
    """The `Spawn` of a Planner actor: restartable `LoaderGroupActor`s with its plans.

    Returns at once (the actor starts in the background): the partition's actors start side by
    side, and a shard created by scaling opens its sources during the ``lead_steps`` before its
    boundary instead of holding up planning. A call that reaches it first waits for its start.
    """

    def spawn(members: list[tuple[ShardRef, SourceSpec]], workers: int, options: dict) -> Any:
        return LoaderGroupActor.options(**restart_options, **options).remote(
            members, config.seed, config.shuffle, workers, planner)

    return spawn


def spawn_shadows(config: Any, planner: Any, restart_options: dict[str, Any]) -> Callable[[list], Any]:
    """The shadow spawner of a Planner actor (``fault_tolerance.shadow_loaders``): a direct-reading
    `LoaderGroupActor` of the same members, spread by Ray away from its primary where it can."""

    def spawn(members: list[tuple[ShardRef, SourceSpec]]) -> Any:
        return LoaderGroupActor.options(**restart_options, scheduling_strategy="SPREAD").remote(
            members, config.seed, config.shuffle, 1, planner, True)

    return spawn


def per_source_plan(config: Any, restart_options: dict | None = None) -> AutoscalePlan:
    """``autoscale.enabled=false``: one loader actor per source, one shard each, never rescaled
    (no profiling, no partition): the per-source layout of the paper's Fig. 3."""
    n = len(config.sources)
    return AutoscalePlan(actors=[LoaderActorSpec(shards=[ShardRef(source=s, shard=0, num_shards=1)])
                                 for s in range(n)],
                         scaling=ScalingConfig(capacity=tuple(float("inf") for _ in range(n))), online=False,
                         restart_options=dict(restart_options or {}))


def partition_for(config: Any, profiles: Sequence[Any], nodes: Sequence[Any]) -> Any:
    """The offline partition of ``config``'s sources (pure): their profiles, the mixture's weights at
    step 0 and the ``autoscale.*`` caps, on `nodes` (`NodeResources`).

    Raises ConfigError with the partitioner's message and the ``autoscale.*`` keys to change.
    """
    from megascale_data_ext.dataplane.mixing import build_schedule
    from megascale_data_ext.dataplane.partitioner import MiB, PartitionLimits, partition
    from megascale_data_ext.errors import ConfigError

    auto = config.autoscale
    weights = build_schedule(config.mixing_config(), source_names=config.source_names).weights(0)
    limits = PartitionLimits(samples_per_step=config.samples_per_step, step_seconds=auto.step_seconds,
                             actor_memory_bytes=int(auto.actor_memory_mib * MiB),
                             actor_base_bytes=int(auto.actor_base_mib * MiB), buffer_steps=config.prefetch + 1,
                             max_workers_per_actor=auto.max_workers_per_actor,
                             max_workers_per_source=auto.max_workers_per_source, cpus_per_worker=0.0)
    try:
        return partition(profiles, [float(w) for w in weights], list(nodes), limits)
    except ConfigError as exc:
        raise ConfigError(f"autoscale: the loaders cannot be partitioned: {exc}\n(config keys: "
                          "autoscale.actor_memory_mib, autoscale.max_workers_per_actor, "
                          "autoscale.max_workers_per_source, autoscale.node_memory_fraction, "
                          "placement.trainer_nodes)") from exc


def build_autoscale_plan(config: Any, *, nodes: Any, placement: Any = None, restart_options: dict | None = None,
                         progress: Callable[[str], None] | None = None) -> tuple[AutoscalePlan, Any]:
    """The service's `AutoscalePlan` from ``config.autoscale``: profiles (journal, the rest measured
    now), the offline partition (`partition_for`) on `nodes` (`placement.ClusterNodes`; the trainer
    nodes only when ``placement.trainer_nodes`` names them), node affinity per actor and the
    policy's capacities. Returns ``(plan, partition)``.
    """
    from megascale_data_ext.dataplane.scaling import shard_capacity
    from megascale_data_ext.sources.profiling import profile_sources

    auto = config.autoscale
    profiles, measured, stale = profile_sources(config.sources, auto.profiles, samples=auto.profile_samples,
                                                measure_per_kind=auto.profile_per_kind, progress=progress)
    if progress is not None:
        now = set(measured)
        extended = sum(1 for p in profiles if p.name in now and p.samples_profiled == 0)
        progress(f"profiles: {len(config.sources) - len(measured)} from the journal, {len(measured) - extended} "
                 f"measured now, {extended} from their metadata and measured sources of their kind"
                 + (f" (stale: {', '.join(stale)})" if stale else "")
                 + (f", saved to {auto.profiles}" if auto.profiles and measured else ""))
    trainer_nodes = set(config.placement.trainer_nodes)
    offered = [n for n in nodes.resources if not trainer_nodes or n.name in trainer_nodes]
    parts = partition_for(config, profiles, offered)

    def on_node(name: str) -> dict[str, Any]:
        return placement.on_node(name) if placement is not None else nodes.on_node(name, soft=True)

    actors = [LoaderActorSpec(shards=list(a.shards), workers=a.workers, options=on_node(a.node))
              for a in parts.assignments]
    node_of = {sh.source: a.node for a in parts.assignments for sh in a.shards}
    capacity = tuple(shard_capacity(p.cost_s, config.samples_per_step, auto.step_seconds, auto.max_workers_per_actor)
                     for p in profiles)
    scaling = ScalingConfig(capacity=capacity, window=auto.window, patience=auto.patience,
                            hysteresis=auto.hysteresis, max_shards=auto.max_shards)
    plan = AutoscalePlan(actors=actors, scaling=scaling, online=auto.scaling, interval_steps=auto.interval_steps,
                         lead_steps=auto.lead_steps, shard_workers=1,
                         shard_options=[on_node(node_of[s]) for s in range(len(config.sources))],
                         restart_options=dict(restart_options or {}))
    return plan, parts

