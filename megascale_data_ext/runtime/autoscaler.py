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

`ScalingPlannerActor` wires a `Planner` to an `AutoScaler` in one threaded actor: the
Planner's ``on_planned`` hook feeds the policy the realised per-source counts, loaders pull
plans from it, and constructors ask it where a step of a source is (`route`).

Checkpoint (`StateSchema` "autoscaler", version 1): fingerprint = sources; fields
``policy`` (the policy's state), ``layouts`` (per source, ``[from_step, shards]`` still live),
``counts`` (this interval's per-source samples) and ``steps`` (steps observed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.dataplane.scaling import ScalingConfig, ScalingDecision, ScalingPolicy
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime.loader_group import GROUP_CONCURRENCY, LoaderGroupActor, merge_fetches
from megascale_data_ext.sources.base import SourceSpec
from megascale_data_ext.state import StateSchema

__all__ = ["AutoScaler", "RoutedFetch", "ScalingPlannerActor"]

#: ``(members, workers) -> actor handle``: a ready loader (group) actor with its plans wired.
Spawn = Callable[[list[tuple[ShardRef, SourceSpec]], int], Any]


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
    """

    STATE = StateSchema("autoscaler", 1, ("policy", "layouts", "counts", "steps"),
                        hint="resume with the same sources and scaling config")

    def __init__(self, specs: Sequence[SourceSpec], policy: ScalingPolicy, *, spawn: Spawn,
                 kill: Callable[[Any], None], interval_steps: int = 4, lead_steps: int = 2, workers: int = 1) -> None:
        if interval_steps < 1 or lead_steps < 1:
            raise ValueError(f"interval_steps and lead_steps must be >= 1, got {interval_steps}, {lead_steps}")
        self.specs = list(specs)
        self.policy = policy
        self.spawn, self.kill = spawn, kill
        self.interval_steps, self.lead_steps, self.workers = interval_steps, lead_steps, workers
        self.actors: dict[int, Any] = {}
        self.layouts: list[list[_Layout]] = [[] for _ in self.specs]
        self.counts = np.zeros(len(self.specs), dtype=np.int64)
        self.steps = 0
        self.max_routed = -1
        self.events: list[dict[str, Any]] = []  # created / reclaimed, for logs and tests
        self._next_id = 0
        self._lock = threading.RLock()

    # -- actors --------------------------------------------------------------------
    def _new_actor(self, members: list[tuple[ShardRef, SourceSpec]]) -> int:
        handle = self.spawn(members, self.workers)
        aid, self._next_id = self._next_id, self._next_id + 1
        self.actors[aid] = handle
        return aid

    def adopt(self, source: int, handle: Any, *, from_step: int = 0) -> None:
        """Serve `source` (whole) from an existing actor, e.g. a shared group of the offline partition."""
        with self._lock:
            aid = next((a for a, h in self.actors.items() if h is handle), None)
            if aid is None:
                aid, self._next_id = self._next_id, self._next_id + 1
                self.actors[aid] = handle
            self.layouts[source].append(_Layout(from_step, (aid,)))

    def start(self) -> None:
        """Spawn the policy's initial shards for every source not adopted."""
        with self._lock:
            for s, spec in enumerate(self.specs):
                if not self.layouts[s]:
                    self.layouts[s].append(_Layout(0, self._spawn_shards(s, spec, self.policy.shards[s])))

    def _spawn_shards(self, source: int, spec: SourceSpec, n: int) -> tuple[int, ...]:
        return tuple(self._new_actor([(ShardRef(source=source, shard=k, num_shards=n), spec)]) for k in range(n))

    # -- routing -------------------------------------------------------------------
    def _layout_at(self, step: int, source: int) -> _Layout:
        live = self.layouts[source]
        for lay in reversed(live):
            if lay.from_step <= step:
                return lay
        raise PlanError(f"step {step} of source {self.specs[source].name!r} is before the oldest live loader layout "
                        f"(from step {live[0].from_step if live else '?'}): it was delivered and its loaders reclaimed")

    def route(self, step: int, source: int) -> list[Any]:
        """The loader actors holding `source`'s samples of `step`, shard k at index k."""
        with self._lock:
            self.max_routed = max(self.max_routed, step)
            return [self.actors[a] for a in self._layout_at(step, source).actors]

    def metadata_actor(self, source: int) -> Any:
        """An actor of `source`'s newest layout, for metadata (`summary_buffer`); every shard has it all."""
        with self._lock:
            return self.actors[self.layouts[source][-1].actors[0]]

    def shards(self, step: int, source: int) -> int:
        with self._lock:
            return len(self._layout_at(step, source).actors)

    # -- scaling -------------------------------------------------------------------
    def observe(self, step: int, counts: Sequence[int]) -> list[ScalingDecision]:
        """Count the samples `step`'s plan takes per source; at each interval's end, act on the policy."""
        with self._lock:
            self.counts += np.asarray(counts, dtype=np.int64)
            self.steps += 1
            if self.steps % self.interval_steps:
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


class RoutedFetch:
    """A constructor's ``fetch(source, step, buckets)`` over the shards a step routes to.

    Asks the router once per (step, source) and merges the shards' disjoint results.
    """

    def __init__(self, route: Callable[[int, int], list[Any]]) -> None:
        self.route = route
        self._cache: dict[tuple[int, int], list[Any]] = {}

    def __call__(self, source: int, step: int, buckets: list[int]) -> dict[str, list]:
        handles = self._cache.get((step, source))
        if handles is None:
            handles = self.route(step, source)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[(step, source)] = handles
        return merge_fetches(ray.get([h.fetch.remote(source, step, buckets) for h in handles]))


@ray.remote(num_cpus=0, max_concurrency=GROUP_CONCURRENCY)
class ScalingPlannerActor:
    """A Planner whose loaders are shards the AutoScaler creates and reclaims (see module doc).

    Args:
        config: The service config.
        topology: The service topology.
        scaling: The policy's thresholds.
        interval_steps, lead_steps, workers: As `AutoScaler`.
        loader_options: Ray options of spawned loader actors (`runtime.placement`).
        groups: Sources that start in one shared actor (the offline partition's groups);
            sources in no group start alone.
    """

    def __init__(self, config: Any, topology: Any, scaling: ScalingConfig, interval_steps: int = 4,
                 lead_steps: int = 2, workers: int = 1, loader_options: dict | None = None,
                 groups: list[list[int]] | None = None):
        from megascale_data_ext.runtime.planner import Planner  # the planner process only

        me = ray.get_runtime_context().current_actor
        opts = dict(loader_options or {})

        def spawn(members: list, w: int) -> Any:
            h = LoaderGroupActor.options(**opts).remote(members, config.seed, config.shuffle, w)
            ray.get(h.set_planner.remote(me))
            return h

        n = len(config.sources)
        self.scaler = AutoScaler(config.sources, ScalingPolicy(scaling), spawn=spawn, kill=ray.kill,
                                 interval_steps=interval_steps, lead_steps=lead_steps, workers=workers)
        for group in groups or []:
            handle = spawn([(ShardRef(source=s), config.sources[s]) for s in group], workers)
            for s in group:
                self.scaler.adopt(s, handle)
        self.scaler.start()

        def summarize(source: int, start: int, count: int):
            return ray.get(self.scaler.metadata_actor(source).summary_buffer.remote(source, start, count))

        def on_planned(plan: Any, _seconds: float) -> None:
            self.scaler.observe(plan.step, np.bincount(plan.source, minlength=n))
            # a step whose plan the Planner dropped can no longer be fetched: its loaders may go
            self.scaler.release(plan.step - self.planner.keep - 1)

        self.planner = Planner(config, topology, summarize, on_planned=on_planned)

    def loader_plan(self, step: int, source: int):
        return self.planner.loader_plan(step, source)

    def constructor_plan(self, step: int, bucket: int):
        return self.planner.plan(step).constructor_do_plan(bucket)

    def route(self, step: int, source: int) -> list[Any]:
        self.planner.plan(step)  # plan (and observe) up to `step` first, so its layout is decided
        return self.scaler.route(step, source)

    def release(self, done_step: int) -> int:
        return self.scaler.release(done_step)

    def layouts(self) -> list[list[list[int]]]:
        return self.scaler.layout_table()

    def events(self) -> list[dict[str, Any]]:
        return list(self.scaler.events)

    def live_actors(self) -> int:
        return len(self.scaler.actors)

    def state_dict(self, step: int | None = None) -> dict:
        return {"planner": self.planner.state_dict(step), "autoscaler": self.scaler.state_dict()}
