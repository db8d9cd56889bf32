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

The `PlannerActor` owns the AutoScaler (`runtime.autoscale_plan.AutoscalePlan`: the offline
partition's actors, their placement, the policy): its
``on_planned`` hook feeds the policy the realised per-source counts, loaders pull plans from
it, and constructors ask it where a step of a source is (``route``, then `RoutedFetch`).

Checkpoint (`StateSchema` "autoscaler", version 1): fingerprint = sources; fields
``policy`` (the policy's state), ``layouts`` (per source, ``[from_step, shards]`` still live),
``counts`` (this interval's per-source samples) and ``steps`` (steps observed).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.dataplane.scaling import ScalingDecision, ScalingPolicy
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime.autoscale_plan import LoaderActorSpec
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.failover import raise_unless_recovering
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.loader_group import Spawn
from megascale_data_ext.runtime.placement import home_of
from megascale_data_ext.runtime.retry import Retry
from megascale_data_ext.runtime.shadows import Replica, Suspects, first_answers
from megascale_data_ext.sources.base import SourceSpec
from megascale_data_ext.state import StateSchema

__all__ = ["AutoScaler"]

EVENTS_KEPT = 1024  # scaling events kept for `stats` (a long run scales thousands of times)


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
        # what `release` must look at (it runs every step; at 1,000+ sources a scan of every layout
        # was a good part of the Planner's step): sources with more than one live layout, and
        # whether actors may have fallen out of every layout (start, a restore)
        self._changing: set[int] = set()
        self._recheck = True
        self.counts = np.zeros(len(self.specs), dtype=np.int64)
        self.steps = 0
        self.max_routed = -1
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)  # created / reclaimed: logs, tests
        self._next_id = 0
        self._lock = threading.RLock()
        self.suspects = Suspects(5.0)  # primaries whose shadow answers the Planner's metadata calls first
        self.fleet = uuid.uuid4().hex  # this AutoScaler's actor ids (`route_ids`) mean these actors only

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
        with self._lock:  # re-entrant: ids and handles of one moment
            ids = self.route_ids(step, sources)
            # one Replica object per actor in the answer: its pickle then carries each actor's handles
            # once, not once per source (at 1,000+ sources in one loader group: ~40 copies a step)
            replicas = self.replicas({a for row in ids for a in row})
            return [[replicas[a] for a in row] for row in ids]

    def route_ids(self, step: int, sources: Sequence[int]) -> list[list[int]]:
        """`routes` as actor ids (each with its handles in `replicas`; an id is never reused within
        this fleet): what a constructor's step reply carries (`routing.RouteBook`)."""
        with self._lock:
            self.max_routed = max(self.max_routed, step)
            return [list(self._layout_at(step, s).actors) for s in sources]

    def replicas(self, ids: Iterable[int]) -> dict[int, Replica]:
        """The `Replica` of each actor id (a reclaimed actor's is absent)."""
        with self._lock:
            return {a: self._replica(a) for a in ids if a in self.actors}

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
        retry = Retry(ft.recovery_timeout_s, base_s=0.2, cap_s=0.2)
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
            raise_unless_recovering(failures, names, "answer `summaries`", retry)
            retry.pause()
            todo = failed

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
        self._changing.add(d.source)
        self.events.append({"event": "created", "source": d.source, "from_step": boundary, "old": d.old,
                            "new": d.new, "actors": len(new), "decided_at_step": step})

    def release(self, done_step: int) -> int:
        """Reclaim the loaders of layouts whose steps are all <= `done_step` (delivered); returns how many."""
        with self._lock:
            retired = False
            for s in sorted(self._changing):
                live = self.layouts[s]
                while len(live) > 1 and live[1].from_step <= done_step + 1:
                    old = live.pop(0)
                    retired = True
                    self.events.append({"event": "retired", "source": s, "until_step": live[0].from_step,
                                        "actors": len(old.actors)})
                if len(live) < 2:
                    self._changing.discard(s)
            if not (retired or self._recheck):
                return 0
            used = {a for live in self.layouts for lay in live for a in lay.actors}
            dead = [a for a in self.actors if a not in used]
            for a in dead:
                self.kill(self.actors.pop(a))
                self.homes.pop(a, None)
                if a in self.shadows:
                    self.kill(self.shadows.pop(a))
            if dead:
                self.events.append({"event": "reclaimed", "after_step": done_step, "actors": len(dead)})
            self._recheck = False
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
        """Restore the policy and every live layout of each source, with fresh actors where the
        running ones (the offline partition's) have another shard count. Not only the newest: a
        Planner that dies after deciding to scale down at a later step still serves the steps
        before it at the scaled-up count it had, and constructors rebuilding older steps find
        them routed (the oldest layout starts at step 0)."""
        fields = self.STATE.check(state, {"sources": [s.name for s in self.specs]})
        with self._lock:
            self.policy.load_state_dict(fields["policy"])
            self.counts = np.asarray(fields["counts"], dtype=np.int64)
            self.steps = int(fields["steps"])
            for s, saved in enumerate(fields["layouts"]):
                running = [lay.actors for lay in self.layouts[s]]
                restored = []
                for i, (from_step, n) in enumerate(saved):
                    reuse = next((a for a in running if len(a) == n), None)
                    if reuse is not None:
                        running.remove(reuse)
                    actors = reuse if reuse is not None else self._spawn_shards(s, self.specs[s], n)
                    restored.append(_Layout(0 if i == 0 else int(from_step), actors))
                self.layouts[s] = restored
            self._changing = {s for s, live in enumerate(self.layouts) if len(live) > 1}
            self._recheck = True
            self.release(-1)
            self.events.append({"event": "restored", "layouts": self.layout_table()})
