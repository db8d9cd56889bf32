"""Planner: turns buffer summaries into per-step plans with the mixing schedule and strategy.

Plain class; `runtime.actors` wraps it as a Ray actor. Plans are made strictly in step order
(each one advances per-source stream cursors), cached for the few steps the constructors are
ahead of the trainer, and are a pure function of (config, tree, state before the step):
`state_dict(step)` returns the state *before* `step`, so a resume at the trainer's consumed
step recomputes exactly the plans an uninterrupted run would have made.

This module holds count mode (``samples_per_step`` samples a step, the longest fitting prefix
deferred on overflow) and the order of planning; the other modes are their own modules:
token-budget steps (``config.tokens_per_step``) in `runtime.token_budget`, loss-driven mixing
(a feedback schedule's reports) in `runtime.loss_feedback`, replay mode (``config.replay_dir``:
the plans `megascale-data plan` wrote, refused under another config or layout) in
`dataplane.plan_store`.

Checkpoint (`StateSchema` "planner", version 5): fingerprint = the config's stream-deciding
fields (`ServiceConfig.fingerprint()`) plus the parallel layout; fields ``step`` (the next
step to plan), ``cursors`` (next stream position per source), ``mixer`` (the Mixer's own
state), ``reports`` (loss reports received but not yet applied, ``[[step, [loss|None per
source]], ...]``) and ``carry`` (token mode: drawn documents or remainders not placed yet,
``[[source, position, index, start, length, [patches]], ...]``) and ``cost_model`` (a fit the
running Planner adopted, `adopt_cost_model`, as its ``to_dict()``; None: the configured model).
That is all: plans are recomputed from it.
"""

from __future__ import annotations

import copy
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.dgraph import DGraph
from megascale_data_ext.dataplane.mixing import Mixer, build_schedule
from megascale_data_ext.dataplane.plan import LoaderPlan, StepPlan
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.plan_store import PlanStore
from megascale_data_ext.dataplane.summary import BufferSummary, SourceSummary
from megascale_data_ext.dataplane.traffic import plan_nbytes
from megascale_data_ext.errors import CapacityError, ConfigError, PlanError, ResumeError, ShortBufferError
from megascale_data_ext.runtime.config import Overflow, ServiceConfig
from megascale_data_ext.runtime.loss_feedback import LossReports
from megascale_data_ext.runtime.token_budget import TokenBudget
from megascale_data_ext.runtime.topology import ServiceTopology, make_strategy
from megascale_data_ext.state import Fingerprint, StateSchema

Summarize = Callable[[int, int, int], SourceSummary]
SummaryRequest = tuple[int, int, int]
"""``(source_id, start_position, count)``: metadata of `count` stream positions from `start_position`."""
SummarizeMany = Callable[[Sequence[SummaryRequest]], Sequence[SourceSummary]]
PLAN_CACHE_BYTES = 256 * 2**20
"""Default byte budget of the plans kept behind what constructors still need (issue 21's bound at 4,096 GPUs)."""
SUMMARY_AHEAD_STEPS = 32
"""A source's metadata is fetched for its draws of the step and about this many more (`Planner._window`)."""
SUMMARY_MIN_ROWS = 64
"""...and at least this many samples, so a rarely drawn source is not asked again every time."""


def plan_fingerprint(config: ServiceConfig, tree: ClientPlaceTree) -> Fingerprint:
    """What a saved state or replayed plan must have been planned with: the stream-deciding config
    and the layout (checked by the Planner, and by `DataService` before it starts anything)."""
    return Fingerprint.of({**config.fingerprint(), "world": tree.layout()})


class Planner:
    """Makes and caches step plans; thread-safe (one lock around planning).

    Args:
        config: The service config (sources, batch shape, strategy, mixing).
        topology: The service topology (its tree is the mesh plans are made for).
        summarize: ``(source_id, start_position, count) -> SourceSummary`` — asks a loader; None
            when `summarize_many` is given.
        summarize_many: ``[SummaryRequest, ...] -> [SourceSummary, ...]`` in request order: every
            source the step needs metadata of in one call, which a Ray façade turns into one
            call per loader actor (default: `summarize` per request).
        keep: How many planned steps' states to keep behind the newest one at least (a checkpoint
            of the step the trainer is at), and their plans within `plan_cache_bytes`.
        plan_cache_bytes: What the kept plans may hold beyond those a constructor still needs and
            the newest (a 4,096-GPU plan is ~28 MiB, see `megascale-data simulate`): older plans go
            first; their states stay, so a checkpoint of such a step still works.
        constructors: Data Constructors that report where their slowest consumer is
            (`constructor_floor`): a plan is kept until every one of them is past it, however
            far others ran ahead. None = no constructors (simulation): `keep` alone decides.
        report_timeout_s: Longest wait for a loss report a feedback schedule needs.
        on_planned: Called with each newly planned (or replayed) step and its planning seconds
            (metrics: `ServiceMetrics.record_plan`); it must not raise.
    """

    STATE = StateSchema("planner", 5, ("step", "cursors", "mixer", "reports", "carry", "cost_model"),
                        hint="resume with the data config and parallel layout of the saved run")

    def __init__(self, config: ServiceConfig, topology: ServiceTopology, summarize: Summarize | None, *,
                 summarize_many: SummarizeMany | None = None, keep: int = 16,
                 plan_cache_bytes: int = PLAN_CACHE_BYTES, report_timeout_s: float = 600.0,
                 on_planned: Callable[[StepPlan, float], None] | None = None, constructors: int | None = None):
        if summarize_many is None:
            if summarize is None:
                raise ValueError("Planner needs `summarize` or `summarize_many` (the loaders' metadata)")
            summarize_many = lambda requests: [summarize(*r) for r in requests]  # noqa: E731
        self.config = config
        self.topology = topology
        self.tree = topology.tree
        self.summarize_many = summarize_many
        self._summaries: dict[int, SourceSummary] = {}  # per source, a window of its (pure) stream metadata
        self._windows: dict[int, tuple] = {}  # per source, ((start, count), summary, its window) last sliced
        self.keep = keep
        self.plan_cache_bytes = plan_cache_bytes
        self._plan_bytes: dict[int, int] = {}  # per kept plan, its arrays' bytes
        self.strategy = make_strategy(config)
        self.cost_model: dict[str, Any] | None = None  # an adopted fit (`adopt_cost_model`), as saved
        names = config.source_names
        self._empty = [SourceSummary.empty(s, name) for s, name in enumerate(names)]  # a source not drawn
        self._out, self._out_drawn = list(self._empty), []  # `_window`'s last answer and its drawn sources
        self.mixer = Mixer(
            build_schedule(config.mixing_config(), source_names=names), names, seed=config.seed, mode=config.mix_mode
        )
        self.next_step = 0
        self.cursors = np.zeros(len(names), dtype=np.int64)
        self.plans: dict[int, StepPlan] = {}
        self._floors: dict[int, int] | None = None if constructors is None else dict.fromkeys(range(constructors), 0)
        self.on_planned = on_planned
        self.reports = LossReports(self.mixer, names, timeout_s=report_timeout_s, keep=keep)
        self._fingerprint = plan_fingerprint(config, self.tree)
        self.replay = PlanStore(config.replay_dir) if config.replay_dir else None
        if self.replay is not None:
            self.replay.check(self.fingerprint())
        self._states: dict[int, tuple[dict[str, Any], int]] = {}
        self._lock = threading.RLock()
        self.budget = None if config.tokens_per_step is None else TokenBudget(
            config, self.strategy, topology, self.mixer)

    @property
    def carry(self) -> list[list]:
        """Token mode: ``[source, position, index, start, length, [patches]]`` not placed yet."""
        return self.budget.carry if self.budget is not None else []

    @property
    def report_timeout_s(self) -> float:
        """Longest wait for a loss report a feedback schedule needs (`LossReports.timeout_s`)."""
        return self.reports.timeout_s

    @report_timeout_s.setter
    def report_timeout_s(self, seconds: float) -> None:
        self.reports.timeout_s = seconds

    @property
    def report_delay(self) -> int | None:
        """d of a feedback schedule (step k's loss shapes step k + d); None for static schedules."""
        return self.reports.delay

    # -- planning ------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must have been planned with: the stream-deciding config and the layout."""
        return self._fingerprint  # shared by every state (`Fingerprint`): read-only

    def _snapshot(self) -> tuple[dict[str, Any], int]:
        """The state before the next step, without its reports, and the last report step applied."""
        # the mixer's state is a fresh stamped copy (its fingerprint shared, read-only); the carry is
        # plain data, copied by a pickle round trip (~10x faster than deepcopy)
        state = {"step": self.next_step, "cursors": self.cursors.tolist(),
                 "mixer": self.mixer.state_dict(), "carry": _copied(self.carry),
                 "cost_model": _copied(self.cost_model)}
        return state, self.reports.applied_through()

    def _stamp(self, snapshot: tuple[dict[str, Any], int]) -> dict[str, Any]:
        """A snapshot with the reports received after what it had applied (and before its step)."""
        state, applied = snapshot
        return self.STATE.stamp(self.fingerprint(), reports=self.reports.between(applied, state["step"]), **state)

    def _plan_next(self) -> StepPlan:
        step = self.next_step
        if step not in self._states:  # taken already when the state after the last step was saved
            self._states[step] = self._snapshot()
        t0 = time.perf_counter()
        drawn = None
        if self.replay is not None:
            plan = self.replay.read_continuing(step, self.cursors)
        else:
            plan, drawn = self._planned(step)
        seconds = time.perf_counter() - t0
        if plan.fetch_ranks != tuple(self.topology.fetch_ranks()):
            raise PlanError(f"step {step}: the plan's fetching ranks {list(plan.fetch_ranks)} (broadcast_at "
                            f"{list(plan.broadcast_dims)}) differ from the runtime's {self.topology.fetch_ranks()} "
                            f"(broadcast {list(self.topology.broadcast_dims)}): a strategy's `broadcast` attribute "
                            "must name the dims its broadcast_at() calls use")
        self.cursors += plan.counts_per_source() if drawn is None else drawn
        self.plans[step] = plan
        self._plan_bytes[step] = plan_nbytes(plan)
        self.next_step = step + 1
        if self.on_planned is not None:
            self.on_planned(plan, seconds)
        self._drop_plans()
        return plan

    def _drop_plans(self) -> None:
        """Under the lock: drop states behind both the `keep` window and every constructor's floor,
        and plans there too, or beyond `plan_cache_bytes` once every constructor is past them."""
        low = self.low_water()
        below = min(self.next_step - 1 - self.keep, low)
        for old in [s for s in self._states if s < below]:
            self._states.pop(old, None)
        needed = min(low, self.next_step - 1)  # a constructor's, and the newest plan, always stay
        total = sum(self._plan_bytes.values())
        for old in sorted(self.plans):
            if old >= needed or (old >= below and total <= self.plan_cache_bytes):
                break
            self.plans.pop(old, None)
            total -= self._plan_bytes.pop(old, 0)

    def low_water(self) -> int:
        """The oldest step some constructor may still build (no constructors: the next step)."""
        return min(self._floors.values(), default=self.next_step) if self._floors is not None else self.next_step

    def constructor_floor(self, constructor: int, step: int) -> None:
        """Constructor `constructor`'s slowest consumer is on `step`: older plans are no longer
        needed by it (a consumer-driven release, not a window)."""
        if self._floors is None:
            return
        with self._lock:
            if step > self._floors.get(constructor, -1):
                self._floors[constructor] = step
                self._drop_plans()

    def _planned(self, step: int) -> tuple[StepPlan, np.ndarray | None]:
        """Plan `step` live: buffer summaries -> mix -> strategy (deferring what does not fit).
        Returns the plan and, in token mode, the documents drawn per source (else None: the plan's)."""
        self.reports.apply(step)
        want = self._wanted(step)
        while True:
            try:
                return self._planned_from(step, self._window(want))
            except ShortBufferError as short:  # a step drew more of some sources than their windows hold
                if max(short.needs.values()) > self.config.buffer_size:
                    raise
                for s, n in short.needs.items():
                    want[s] = min(self.config.buffer_size, max(n, 2 * int(want[s])))

    def _wanted(self, step: int) -> np.ndarray:
        """Samples of each source `step` draws, as far as known before its metadata: the mixer's
        counts (token-budget steps: for about as many documents as the last step drew)."""
        n = self.config.samples_per_step if self.budget is None else self.budget.draw_estimate()
        return np.minimum(self.mixer.preview(step, n), self.config.buffer_size).astype(np.int64)

    def _planned_from(self, step: int, summaries: list[SourceSummary]) -> tuple[StepPlan, np.ndarray | None]:
        if self.budget is not None:
            return self.budget.plan(step, summaries)
        buffer = BufferSummary.of(summaries)
        graph = self._graph(buffer, step)
        graph = graph.mix(self.mixer, batch_size=self.config.samples_per_step)
        try:
            plan = self.strategy(graph).plan()
        except CapacityError:
            if self.config.overflow != Overflow.DEFER:
                raise
            plan = self._fit(buffer, graph, step)
            self.mixer.settle(step, plan.counts_per_source())
        return plan, None

    def _graph(self, buffer: BufferSummary, step: int) -> DGraph:
        """The step's DGraph on the trainer mesh, fetching as this service distributes."""
        return DGraph.from_summary(buffer, self.tree, step=step, distribution=self.topology.distribution)

    def _window(self, want: np.ndarray) -> list[SourceSummary]:
        """Metadata of the next `want[s]` samples of every source `s` (from its cursor), from cached windows.

        A stream's metadata is a pure function of the position (seed, epoch permutation), so the
        planner asks for about ``SUMMARY_AHEAD_STEPS`` steps of a source's draws at once and slices
        steps out of them; the sources whose window ran out are asked together (`summarize_many`),
        so a step costs at most one round trip per loader actor, and most steps none. What is asked
        follows what the mixture draws, not the buffer size: a blend of 1,000+ sources draws few
        samples of each per step, and a start-up that asked every source for thousands of rows
        shipped millions of them before the first plan.
        """
        drawn = np.flatnonzero(want).tolist()  # a step at 1,000+ sources draws a few dozen: touch only those
        counts, starts = want.tolist(), self.cursors.tolist()
        requests = []
        for s in drawn:
            start, cached = starts[s], self._summaries.get(s)
            if cached is None or not len(cached) or not (
                    cached.positions[0] <= start and start + counts[s] <= cached.positions[-1] + 1):
                requests.append((s, start, counts[s] * (1 + SUMMARY_AHEAD_STEPS) + SUMMARY_MIN_ROWS))
        if requests:
            got = list(self.summarize_many(requests))
            if len(got) != len(requests):
                raise PlanError(f"summarize_many answered {len(got)} summaries for {len(requests)} requests")
            for (s, start, n), summ in zip(requests, got, strict=True):
                if len(summ) != n or (len(summ) and summ.positions[0] != start):
                    raise PlanError(f"source {s}: summary_buffer({start}, {n}) returned {len(summ)} samples from "
                                    f"position {int(summ.positions[0]) if len(summ) else None}; a loader must "
                                    "return exactly the positions asked for")
                self._summaries[s] = summ
        out = self._out  # per source, its window of the last step; a source not drawn: empty
        for s in self._out_drawn:
            out[s] = self._empty[s]
        for s in drawn:  # a source whose cursor did not move keeps its window
            start, n = starts[s], counts[s]
            summ, known = self._summaries[s], self._windows.get(s)
            if known is None or known[0] != (start, n) or known[1] is not summ:
                known = self._windows[s] = ((start, n), summ, summ.window(start - int(summ.positions[0]), n))
            out[s] = known[2]
        self._out_drawn = drawn
        return list(out)

    def _fit(self, buffer: BufferSummary, mixed: DGraph, step: int) -> StepPlan:
        """Plan the longest prefix of the step's mixed order that fits its microbatches.

        A prefix of the mix order is, for every source, a prefix of its stream, so the
        deferred samples are exactly the next ones each source serves: none lost or repeated.
        """
        rows, tokens = mixed.selected, mixed.cols["seq_len"]
        capacity = self.topology.layout.num_buckets * self.config.num_microbatches * self.config.seq_length
        n = int(np.searchsorted(np.cumsum(tokens), capacity, side="right"))
        while n > 0:
            graph = self._graph(buffer, step).select(rows[:n], note="mix-fit")
            try:
                return self.strategy(graph).plan()
            except CapacityError:
                n = min(n - 1, int(n * 0.9))
        raise CapacityError(f"step {step}: not even one sample fits {capacity} tokens of microbatches")

    # -- token-budget steps --------------------------------------------------------
    def plan(self, step: int) -> StepPlan:
        """The plan of `step`, planning the steps before it first (in order).

        A feedback schedule's missing loss reports are awaited *outside* the planning lock, so
        planned steps stay available to every constructor while a later step waits.
        """
        while True:
            with self._lock:
                if step in self.plans:
                    return self.plans[step]
                if step < self.next_step:
                    raise ResumeError(f"plan for step {step} was dropped (planner is at step {self.next_step}; "
                                      f"keep={self.keep}, plan_cache_bytes={self.plan_cache_bytes})")
                target = self.next_step
            self.reports.wait_for(target)
            with self._lock:
                if self.next_step == target:
                    self._plan_next()

    def ready(self, step: int) -> bool:
        """Whether `step` can be planned without waiting: its loss reports are in (feedback
        mixing), and in replay mode the saved plans reach it (past them it is an error, asked for
        only by a trainer that runs longer, never by a read-ahead)."""
        if self.replay is not None and step >= self.replay.num_steps:
            return False
        return self.reports.ready(step)

    def planned_ahead(self, step: int, count: int) -> list[StepPlan]:
        """The plans of up to `count` steps from `step` that exist or can be made now without
        waiting: planning stops at a step whose loss reports have not arrived (feedback mixing),
        once the kept plans hold `plan_cache_bytes`, or at a step that fails (its own request
        raises it). A plan is the same whenever it is made: this only moves work earlier, so
        a loader asks for a few steps' plans in one call (`LoaderGroup`'s read-ahead)."""
        out: list[StepPlan] = []
        for s in range(step, step + count):
            with self._lock:
                plan = self.plans.get(s)
                if plan is None:
                    if (s != self.next_step or not self.ready(s)
                            or sum(self._plan_bytes.values()) > self.plan_cache_bytes):
                        break
                    try:
                        plan = self._plan_next()
                    except Exception:  # noqa: BLE001 -- raised again, with its context, when the step is asked for
                        break
            out.append(plan)
        return out

    def planning(self) -> threading.RLock:
        """The planning lock (re-entrant): held, no other thread plans or loads a state, so a caller
        can load a saved state and plan from it with nothing in between (a rewind)."""
        return self._lock

    def loader_plan(self, step: int, source: int) -> LoaderPlan:
        return self.plan(step).loader_do_plan(source)

    def report_loss(self, step: int, losses: Mapping[int | str, float]) -> None:
        """Record the trainer's per-source loss of `step` (by source index or name); a feedback
        schedule applies it when step + delay is planned (`LossReports.record`)."""
        self.reports.record(step, losses)

    # -- state ---------------------------------------------------------------------
    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The planner state *before* planning `step` (default: the next unplanned step)."""
        with self._lock:
            if step is None or step == self.next_step:  # kept: planning the step takes the same snapshot
                snapshot = self._states.get(self.next_step)
                if snapshot is None:
                    snapshot = self._states[self.next_step] = self._snapshot()
                return self._stamp(snapshot)
            if step in self._states:
                return self._stamp(copy.deepcopy(self._states[step]))
            if step < self.next_step:
                raise ResumeError(f"state for step {step} is no longer kept (planner at {self.next_step}, "
                                  f"keep={self.keep})")
        self.plan(step - 1)  # a future step: plan up to it first (without holding the lock)
        return self.state_dict(step)

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
            self.reports.load(fields["reports"])
            if self.budget is not None:
                self.budget.carry = copy.deepcopy(list(fields["carry"]))
            self._use_cost_model(fields["cost_model"])
            self._summaries.clear()
            self._windows.clear()
            self.plans.clear()
            self._plan_bytes.clear()
            self._states.clear()
            if self._floors is not None:  # no constructor builds a step before the one resumed at
                self._floors = {k: max(v, self.next_step) for k, v in self._floors.items()}


    def adopt_cost_model(self, fit: Mapping[str, Any], *, then: Callable[[], None] | None = None) -> int:
        """Balance every step not planned yet with the fitted `CalibratedCost` `fit` (its
        ``to_dict()``), e.g. the trainer's online fit of its own step times; steps already
        planned keep theirs. The states of later steps carry it, so a resume plans them alike;
        `then` runs under the planning lock right after (a checkpoint of the new state).
        Returns the first step planned with it.

        Raises:
            ConfigError: The fit is invalid, or the strategy takes no ``model`` (or plans replay).
        """
        if self.replay is not None:
            raise ConfigError("the Planner replays saved plans (`replay_dir`): there is no balancing to re-cost")
        with self._lock:
            self._use_cost_model(fit)
            if then is not None:
                then()
            return self.next_step

    def _use_cost_model(self, fit: Mapping[str, Any] | None) -> None:
        """Under the lock: the strategy with `fit` as its ``model`` (None: the configured one)."""
        from megascale_data_ext.dataplane.calibration import CalibratedCost

        args = dict(self.config.strategy_args)
        if fit is not None:
            args["model"] = CalibratedCost.from_dict(fit, where="the adopted cost model")
        try:
            strategy = make_strategy(replace(self.config, strategy_args=args))
        except TypeError as e:  # a user strategy without a `model` argument
            raise ConfigError(f"strategy {self.config.strategy!r} cannot be re-costed with a fitted model: {e}") from e
        self.strategy, self.cost_model = strategy, None if fit is None else _copied(dict(fit))
        self._states.pop(self.next_step, None)  # a snapshot taken before holds the old cost model
        if self.budget is not None:
            self.budget.strategy = strategy


def _copied(plain: Any) -> Any:
    """A deep copy of plain data (what a state holds)."""
    return pickle.loads(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL))
