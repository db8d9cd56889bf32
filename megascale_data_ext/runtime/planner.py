"""Planner: turns buffer summaries into per-step plans with the mixing schedule and strategy.

Plain class; `runtime.actors` wraps it as a Ray actor. Plans are made strictly in step order
(each one advances per-source stream cursors), cached for the few steps the constructors are
ahead of the trainer, and are a pure function of (config, tree, state before the step):
`state_dict(step)` returns the state *before* `step`, so a resume at the trainer's consumed
step recomputes exactly the plans an uninterrupted run would have made.

Replay mode (``config.replay_dir``): the plans `megascale-data plan` wrote are served instead
of planned (`PlanStore`), refused if they were made under another config or layout.

Checkpoint (`StateSchema` "planner", version 2): fingerprint = the config's stream-deciding
fields (`ServiceConfig.fingerprint()`) plus the parallel layout; fields ``step`` (the next
step to plan), ``cursors`` (next stream position per source) and ``mixer`` (the Mixer's own
state). That is all: plans are recomputed from it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.dgraph import DGraph
from megascale_data_ext.dataplane.mixing import Mixer
from megascale_data_ext.dataplane.mixing import build_schedule
from megascale_data_ext.dataplane.plan import LoaderPlan, StepPlan
from megascale_data_ext.dataplane.plan_store import PlanStore
from megascale_data_ext.dataplane.summary import BufferSummary, SourceSummary
from megascale_data_ext.errors import CapacityError, PlanError, ResumeError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.topology import ServiceTopology, make_strategy
from megascale_data_ext.state import StateSchema

Summarize = Callable[[int, int, int], SourceSummary]


class Planner:
    """Makes and caches step plans; thread-safe (one lock around planning).

    Args:
        config: The service config (sources, batch shape, strategy, mixing).
        topology: The service topology (its tree is the mesh plans are made for).
        summarize: ``(source_id, start_position, count) -> SourceSummary`` — asks a loader.
        keep: How many planned steps to keep cached behind the newest one.
    """

    STATE = StateSchema("planner", 2, ("step", "cursors", "mixer"),
                        hint="resume with the data config and parallel layout of the saved run")

    def __init__(self, config: ServiceConfig, topology: ServiceTopology, summarize: Summarize, *, keep: int = 64):
        self.config = config
        self.topology = topology
        self.tree = topology.tree
        self.summarize = summarize
        self.keep = keep
        self.strategy = make_strategy(config)
        names = config.source_names
        self.mixer = Mixer(
            build_schedule(config.mixing_config(), source_names=names), names, seed=config.seed, mode=config.mix_mode
        )
        self.next_step = 0
        self.cursors = np.zeros(len(names), dtype=np.int64)
        self.plans: dict[int, StepPlan] = {}
        self.replay = PlanStore(config.replay_dir) if config.replay_dir else None
        if self.replay is not None:
            self.replay.check(self.fingerprint())
        self._states: dict[int, dict[str, Any]] = {}
        self._lock = threading.RLock()

    # -- planning ------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must have been planned with: the stream-deciding config and the layout."""
        return {**self.config.fingerprint(), "world": self.tree.layout()}

    def _snapshot(self) -> dict[str, Any]:
        return self.STATE.stamp(self.fingerprint(), step=self.next_step, cursors=self.cursors.tolist(),
                                mixer=copy.deepcopy(self.mixer.state_dict()))

    def _plan_next(self) -> StepPlan:
        step = self.next_step
        self._states[step] = self._snapshot()
        plan = self._replayed(step) if self.replay is not None else self._planned(step)
        if plan.fetch_ranks != tuple(self.topology.fetch_ranks()):
            raise PlanError(f"step {step}: the plan's fetching ranks {list(plan.fetch_ranks)} (broadcast_at "
                            f"{list(plan.broadcast_dims)}) differ from the runtime's {self.topology.fetch_ranks()} "
                            f"(broadcast {list(self.topology.broadcast_dims)}): a strategy's `broadcast` attribute "
                            "must name the dims its broadcast_at() calls use")
        self.cursors += plan.counts_per_source()
        self.plans[step] = plan
        self.next_step = step + 1
        for old in [s for s in self.plans if s < step - self.keep]:
            self.plans.pop(old, None)
            self._states.pop(old, None)
        return plan

    def _planned(self, step: int) -> StepPlan:
        """Plan `step` live: buffer summaries -> mix -> strategy (deferring what does not fit)."""
        window = self.config.buffer_size
        summaries = [self.summarize(s, int(self.cursors[s]), window) for s in range(len(self.cursors))]
        buffer = BufferSummary.of(summaries)
        graph = DGraph.from_summary(buffer, self.tree, step=step).mix(self.mixer, batch_size=self.config.samples_per_step)
        try:
            plan = self.strategy(graph).plan()
        except CapacityError:
            if self.config.overflow != "defer":
                raise
            plan = self._fit(buffer, graph, step)
            self.mixer.settle(step, plan.counts_per_source())
        return plan

    def _replayed(self, step: int) -> StepPlan:
        """The plan `megascale-data plan` wrote for `step`; it must continue the streams where they are."""
        plan = self.replay.read(step)
        for s in range(len(self.cursors)):
            pos = np.sort(plan.position[plan.source == s])
            if len(pos) and not np.array_equal(pos, np.arange(self.cursors[s], self.cursors[s] + len(pos))):
                raise PlanError(f"replayed step {step} takes source {s} at positions {pos[:3].tolist()}..., "
                                f"but its stream is at {int(self.cursors[s])}: the plan directory is inconsistent")
        return plan

    def _fit(self, buffer: BufferSummary, mixed: DGraph, step: int) -> StepPlan:
        """Plan the longest prefix of the step's mixed order that fits its microbatches.

        A prefix of the mix order is, for every source, a prefix of its stream, so the
        deferred samples are exactly the next ones each source serves: none lost or repeated.
        """
        rows, tokens = mixed.selected, mixed.cols["seq_len"]
        capacity = self.topology.layout.num_buckets * self.config.num_microbatches * self.config.seq_length
        n = int(np.searchsorted(np.cumsum(tokens), capacity, side="right"))
        while n > 0:
            graph = DGraph.from_summary(buffer, self.tree, step=step).select(rows[:n], note="mix-fit")
            try:
                return self.strategy(graph).plan()
            except CapacityError:
                n = min(n - 1, int(n * 0.9))
        raise CapacityError(f"step {step}: not even one sample fits {capacity} tokens of microbatches")

    def plan(self, step: int) -> StepPlan:
        with self._lock:
            if step in self.plans:
                return self.plans[step]
            if step < self.next_step:
                raise ResumeError(f"plan for step {step} was dropped (planner is at step {self.next_step}); keep={self.keep}")
            while self.next_step <= step:
                self._plan_next()
            return self.plans[step]

    def loader_plan(self, step: int, source: int) -> LoaderPlan:
        return self.plan(step).loader_do_plan(source)

    def report_loss(self, step: int, losses: Mapping[int | str, float]) -> None:
        """Feed per-source loss to a feedback mixing schedule (no-op for static schedules)."""
        report = getattr(self.mixer.schedule, "report_loss", None)
        if report is not None:
            with self._lock:
                report(step, losses)

    # -- state ---------------------------------------------------------------------
    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The planner state *before* planning `step` (default: the next unplanned step)."""
        with self._lock:
            if step is None or step == self.next_step:
                return self._snapshot()
            if step in self._states:
                return copy.deepcopy(self._states[step])
            if step > self.next_step:
                self.plan(step - 1)
                return self._snapshot()
            raise ResumeError(f"state for step {step} is no longer kept (planner at {self.next_step}, keep={self.keep})")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue planning at the saved step; refuses another config, layout or version (ResumeError)."""
        fields = self.STATE.check(state, self.fingerprint())
        if len(fields["cursors"]) != len(self.cursors):
            raise ResumeError(f"planner state has {len(fields['cursors'])} source cursors, the config has "
                              f"{len(self.cursors)} sources")
        with self._lock:
            self.next_step = int(fields["step"])
            self.cursors = np.asarray(fields["cursors"], dtype=np.int64)
            self.mixer.load_state_dict(fields["mixer"])
            self.plans.clear()
            self._states.clear()
