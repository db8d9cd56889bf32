"""Planner: turns buffer summaries into per-step plans with the mixing schedule and strategy.

Plain class; `runtime.actors` wraps it as a Ray actor. Plans are made strictly in step order
(each one advances per-source stream cursors), cached for the few steps the constructors are
ahead of the trainer, and are a pure function of (config, tree, state before the step):
`state_dict(step)` returns the state *before* `step`, so a resume at the trainer's consumed
step recomputes exactly the plans an uninterrupted run would have made.

Replay mode (``config.replay_dir``): the plans `megascale-data plan` wrote are served instead
of planned (`PlanStore`), refused if they were made under another config or layout.

Loss-driven mixing (a feedback schedule with ``delay`` d): the trainer reports each step's
per-source loss (`report_loss`); planning step s first applies the reports of every step up
to s - d, in order, waiting for one that has not arrived yet (a named PlanError after
``report_timeout_s``). Plans therefore depend on the reports, never on prefetch timing.

Token-budget mode (``config.tokens_per_step``): a step draws the documents that fill its
token budget, the strategy balances what fits, the rooms left are filled (splitting documents
with ``split_documents``) and the rest is carried to the next step (`mixing.budget`).

Checkpoint (`StateSchema` "planner", version 4): fingerprint = the config's stream-deciding
fields (`ServiceConfig.fingerprint()`) plus the parallel layout; fields ``step`` (the next
step to plan), ``cursors`` (next stream position per source), ``mixer`` (the Mixer's own
state), ``reports`` (loss reports received but not yet applied, ``[[step, [loss|None per
source]], ...]``) and ``carry`` (token mode: drawn documents or remainders not placed yet,
``[[source, position, index, start, length, [patches]], ...]``). That is all: plans are
recomputed from it.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.dgraph import DGraph
from megascale_data_ext.dataplane.mixing import Mixer
from megascale_data_ext.dataplane.mixing import build_schedule
from megascale_data_ext.dataplane.mixing.budget import (
    OFFER_FRACTION,
    SLACK_MICROBATCHES,
    Pool,
    draw_size,
    fill_rooms,
    offer_prefix,
)
from megascale_data_ext.dataplane.plan import LoaderPlan, StepPlan
from megascale_data_ext.dataplane.plan_store import PlanStore
from megascale_data_ext.dataplane.summary import BufferSummary, SourceSummary
from megascale_data_ext.errors import CapacityError, ConfigError, PlanError, ResumeError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.topology import ServiceTopology, make_strategy
from megascale_data_ext.state import StateSchema

Summarize = Callable[[int, int, int], SourceSummary]
SummaryRequest = tuple[int, int, int]
"""``(source_id, start_position, count)``: metadata of `count` stream positions from `start_position`."""
SummarizeMany = Callable[[Sequence[SummaryRequest]], Sequence[SourceSummary]]
SUMMARY_EXTRA = 4096
"""Samples of metadata fetched beyond the buffer per loader round trip (see `Planner._window`)."""


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
        keep: How many planned steps (and their states) to keep behind the newest one at least: a
            checkpoint of the step the trainer is at (a 4,096-GPU plan is ~30 MiB, see
            `megascale-data simulate`).
        constructors: Data Constructors that report where their slowest consumer is
            (`constructor_floor`): a plan is kept until every one of them is past it, however
            far others ran ahead. None = no constructors (simulation): `keep` alone decides.
        report_timeout_s: Longest wait for a loss report a feedback schedule needs.
        on_planned: Called with each newly planned (or replayed) step and its planning seconds
            (metrics: `runtime.metrics.record_plan`); it must not raise.
    """

    STATE = StateSchema("planner", 4, ("step", "cursors", "mixer", "reports", "carry"),
                        hint="resume with the data config and parallel layout of the saved run")

    def __init__(self, config: ServiceConfig, topology: ServiceTopology, summarize: Summarize | None, *,
                 summarize_many: SummarizeMany | None = None, keep: int = 16, report_timeout_s: float = 600.0,
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
        self.keep = keep
        self.strategy = make_strategy(config)
        names = config.source_names
        self.mixer = Mixer(
            build_schedule(config.mixing_config(), source_names=names), names, seed=config.seed, mode=config.mix_mode
        )
        self.next_step = 0
        self.cursors = np.zeros(len(names), dtype=np.int64)
        self.plans: dict[int, StepPlan] = {}
        self._floors: dict[int, int] | None = None if constructors is None else dict.fromkeys(range(constructors), 0)
        self.report_timeout_s = report_timeout_s
        self.on_planned = on_planned
        self._reports: dict[int, list[float | None]] = {}  # per-source loss by reported step
        self._reports_cv = threading.Condition()  # not self._lock: a report arrives while planning waits
        self.replay = PlanStore(config.replay_dir) if config.replay_dir else None
        if self.replay is not None:
            self.replay.check(self.fingerprint())
        self._states: dict[int, tuple[dict[str, Any], int]] = {}
        self._lock = threading.RLock()
        self.carry: list[list] = []  # token mode: [source, position, index, start, length, [patches]]
        self._drawn: np.ndarray | None = None  # token mode: fresh documents the step being planned drew
        capacity = topology.layout.num_buckets * config.num_microbatches * config.seq_length
        if config.tokens_per_step is not None and config.tokens_per_step > capacity:
            raise ConfigError(f"`tokens_per_step` = {config.tokens_per_step} exceeds what one step holds: "
                              f"{topology.layout.num_buckets} buckets x num_microbatches {config.num_microbatches} "
                              f"x seq_length {config.seq_length} = {capacity}; lower it or raise the batch shape")

    # -- planning ------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must have been planned with: the stream-deciding config and the layout."""
        return {**self.config.fingerprint(), "world": self.tree.layout()}

    def _snapshot(self) -> tuple[dict[str, Any], int]:
        """The state before the next step, without its reports, and the last report step applied."""
        state = {"step": self.next_step, "cursors": self.cursors.tolist(),
                 "mixer": copy.deepcopy(self.mixer.state_dict()), "carry": copy.deepcopy(self.carry)}
        return state, self._applied_through()

    def _stamp(self, snapshot: tuple[dict[str, Any], int]) -> dict[str, Any]:
        """A snapshot with the reports received after what it had applied (and before its step)."""
        state, applied = snapshot
        with self._reports_cv:
            reports = [[k, self._reports[k]] for k in sorted(self._reports) if applied < k < state["step"]]
        return self.STATE.stamp(self.fingerprint(), reports=reports, **state)

    # -- loss-driven mixing --------------------------------------------------------
    @property
    def report_delay(self) -> int | None:
        """d of a feedback schedule (step k's loss shapes step k + d); None for static schedules."""
        schedule = self.mixer.schedule
        return getattr(schedule, "delay", None) if hasattr(schedule, "report_loss") else None

    def _applied_through(self) -> int:
        last = getattr(self.mixer.schedule, "last_step", None)
        return -1 if last is None else int(last)

    def _await_reports(self, step: int) -> None:
        """Wait until every report planning `step` needs (steps up to ``step - delay``) has arrived."""
        delay = self.report_delay
        if delay is None:
            return
        for k in range(self._applied_through() + 1, step - delay + 1):
            with self._reports_cv:
                if not self._reports_cv.wait_for(lambda k=k: k in self._reports, timeout=self.report_timeout_s):
                    raise PlanError(
                        f"planning step {step} needs the per-source loss of step {k} (feedback mixing, delay {delay}) "
                        f"but none arrived within {self.report_timeout_s:g} s: the trainer must report every step "
                        "(hooks: install(client, report_loss=True)), or use a static mixing schedule")

    def _apply_reports(self, step: int) -> None:
        """Fold in the reports of steps up to ``step - delay``, in step order."""
        delay = self.report_delay
        if delay is None:
            return
        self._await_reports(step)  # present already when called from plan(); waits otherwise
        for k in range(self._applied_through() + 1, step - delay + 1):
            with self._reports_cv:
                values = self._reports[k]
            self.mixer.schedule.report_loss(k, {i: v for i, v in enumerate(values) if v is not None})
        with self._reports_cv:
            for old in [k for k in self._reports if k < step - delay - self.keep]:
                del self._reports[old]

    def _plan_next(self) -> StepPlan:
        step = self.next_step
        self._states[step] = self._snapshot()
        t0 = time.perf_counter()
        plan = self._replayed(step) if self.replay is not None else self._planned(step)
        seconds = time.perf_counter() - t0
        if plan.fetch_ranks != tuple(self.topology.fetch_ranks()):
            raise PlanError(f"step {step}: the plan's fetching ranks {list(plan.fetch_ranks)} (broadcast_at "
                            f"{list(plan.broadcast_dims)}) differ from the runtime's {self.topology.fetch_ranks()} "
                            f"(broadcast {list(self.topology.broadcast_dims)}): a strategy's `broadcast` attribute "
                            "must name the dims its broadcast_at() calls use")
        drawn, self._drawn = self._drawn, None
        self.cursors += plan.counts_per_source() if drawn is None else drawn
        self.plans[step] = plan
        self.next_step = step + 1
        if self.on_planned is not None:
            self.on_planned(plan, seconds)
        self._drop_plans()
        return plan

    def _drop_plans(self) -> None:
        """Under the lock: drop plans behind both the `keep` window and every constructor's floor."""
        below = min(self.next_step - 1 - self.keep, self.low_water())
        for old in [s for s in self.plans if s < below]:
            self.plans.pop(old, None)
            self._states.pop(old, None)

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

    def _planned(self, step: int) -> StepPlan:
        """Plan `step` live: buffer summaries -> mix -> strategy (deferring what does not fit)."""
        self._apply_reports(step)
        summaries = self._window(self.config.buffer_size)
        if self.config.tokens_per_step is not None:
            return self._planned_tokens(step, summaries)
        buffer = BufferSummary.of(summaries)
        graph = DGraph.from_summary(buffer, self.tree, step=step)
        graph = graph.mix(self.mixer, batch_size=self.config.samples_per_step)
        try:
            plan = self.strategy(graph).plan()
        except CapacityError:
            if self.config.overflow != "defer":
                raise
            plan = self._fit(buffer, graph, step)
            self.mixer.settle(step, plan.counts_per_source())
        return plan

    def _window(self, count: int) -> list[SourceSummary]:
        """Metadata of the next `count` samples of every source (from its cursor), from cached windows.

        A stream's metadata is a pure function of the position (seed, epoch permutation), so
        the planner asks for ``SUMMARY_EXTRA`` more samples than the buffer and slices steps out
        of them; the sources whose window ran out are asked together (`summarize_many`), so a
        step costs at most one round trip per loader actor, and most steps none.
        """
        def covered(s: int, start: int) -> bool:
            cached = self._summaries.get(s)
            return cached is not None and len(cached) > 0 and cached.positions[0] <= start \
                and start + count <= cached.positions[-1] + 1

        starts = self.cursors.tolist()
        requests = [(s, start, count + SUMMARY_EXTRA) for s, start in enumerate(starts) if not covered(s, start)]
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
        return [self._summaries[s].window(start - int(self._summaries[s].positions[0]), count)
                for s, start in enumerate(starts)]

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

    # -- token-budget steps --------------------------------------------------------
    def _planned_tokens(self, step: int, summaries: list[SourceSummary]) -> StepPlan:
        """Plan `step` to its token budget: carry + fresh draws -> balanced prefix -> filled rooms.

        The fresh documents drawn are left in ``self._drawn`` (they advance the cursors even
        when carried); what is not placed becomes the new carry.
        """
        cfg, m = self.config, self.config.num_microbatches
        target, length = int(cfg.tokens_per_step), cfg.seq_length
        carry = Pool.of(self.carry)
        seq = [s.text_tokens + s.image_patches_total() for s in summaries]
        # Slack beyond the budget gives the room filling documents to choose from.
        need = target + SLACK_MICROBATCHES * length - int(carry.seq_len.sum())
        n = draw_size(lambda b: self.mixer.preview(step, b), seq, need)
        counts = self.mixer.counts(step, n)
        pool = carry.concat(_fresh(summaries, counts, self.mixer.order(step, counts)))
        if cfg.split_documents:
            pool = pool.chop(length)
        plan, k = self._balance_prefix(step, pool, target)
        rest = np.arange(k, len(pool))
        rest = rest[pool.splittable[rest]]  # image samples wait for the balancer (their encoder ranks)
        room = (plan.cap or length) - plan.bin_tokens().reshape(-1)
        fills = fill_rooms(room, pool.length[rest], np.ones(len(rest), bool), split=cfg.split_documents,
                           budget=target - int(plan.tokens.sum()))
        rows = rest[np.asarray([f.row for f in fills], dtype=np.int64)]
        bins = np.asarray([f.bin for f in fills], dtype=np.int64)
        starts = pool.start[rows] + np.asarray([f.start for f in fills], dtype=np.int64)
        lens = np.asarray([f.length for f in fills], dtype=np.int64)
        taken = np.bincount(rows, weights=lens, minlength=len(pool)).astype(np.int64)
        left = np.flatnonzero((np.arange(len(pool)) >= k) & (taken < pool.length))
        carried = pool.rows(left)
        for r, row in zip(left.tolist(), carried, strict=True):  # remainders start after their heads
            row[3], row[4] = int(pool.start[r] + taken[r]), int(pool.length[r] - taken[r])
        self.carry, self._drawn = carried, counts
        cat = np.concatenate
        return dataclasses.replace(
            plan, source=cat([plan.source, pool.source[rows].astype(np.int32)]),
            position=cat([plan.position, pool.position[rows]]), index=cat([plan.index, pool.index[rows]]),
            tokens=cat([plan.tokens, lens]), cost=cat([plan.cost, self._cost_of(lens)]),
            bucket=cat([plan.bucket, bins // m]), microbatch=cat([plan.microbatch, bins % m]),
            span_start=cat([pool.start[:k], starts]), span_stop=cat([pool.start[:k] + pool.length[:k], starts + lens]),
            lineage=plan.lineage + (f"fill-rooms({len(fills)} spans, split={cfg.split_documents}, "
                                    f"carry {len(carried)})",))

    def _balance_prefix(self, step: int, pool: Pool, target: int) -> tuple[StepPlan, int]:
        """The strategy's plan of the longest pool prefix it places under the cap, and its length."""
        budget, seq = OFFER_FRACTION * target, pool.seq_len
        for _ in range(24):
            k = offer_prefix(seq, budget)
            try:
                return self.strategy(self._graph(pool, k, step)).plan(), k
            except CapacityError:
                if k == 0:
                    raise
                budget = min(budget, float(seq[:k].sum())) * 0.95
        raise CapacityError(f"step {step}: the strategy placed none of the first pool documents (lengths "
                            f"{seq[:4].tolist()}) under the cap {self.config.seq_length}")

    def _graph(self, pool: Pool, k: int, step: int) -> DGraph:
        """A DGraph of the first `k` pool rows, selected back in pool order."""
        parts = []
        for s, name in enumerate(self.config.source_names):
            sel = np.flatnonzero(pool.source[:k] == s)
            patches = [pool.patches[i] for i in sel.tolist()]
            parts.append(SourceSummary(
                source=s, name=name, positions=pool.position[sel], indices=pool.index[sel],
                text_tokens=pool.length[sel],
                image_offsets=np.concatenate([[0], np.cumsum([len(p) for p in patches])]).astype(np.int64),
                image_patch_counts=np.asarray([x for p in patches for x in p], dtype=np.int64)))
        by_source = np.argsort(pool.source[:k], kind="stable")  # graph row j is pool row by_source[j]
        rows = np.empty(k, dtype=np.int64)
        rows[by_source] = np.arange(k)
        return DGraph.from_summary(BufferSummary.of(parts), self.tree, step=step).select(rows, note="token-budget")

    def _cost_of(self, seq_len: np.ndarray) -> np.ndarray:
        """Backbone cost of added spans, by the strategy's own cost model when it exposes one."""
        fn = getattr(getattr(self.strategy, "backbone", self.strategy), "_cost", None)
        return np.asarray(fn(seq_len), dtype=np.float64) if fn is not None else seq_len.astype(np.float64)

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
                    raise ResumeError(f"plan for step {step} was dropped (planner is at step {self.next_step}); "
                                      f"keep={self.keep}")
                target = self.next_step
            self._await_reports(target)
            with self._lock:
                if self.next_step == target:
                    self._plan_next()

    def planning(self) -> threading.RLock:
        """The planning lock (re-entrant): held, no other thread plans or loads a state, so a caller
        can load a saved state and plan from it with nothing in between (a rewind)."""
        return self._lock

    def loader_plan(self, step: int, source: int) -> LoaderPlan:
        return self.plan(step).loader_do_plan(source)

    def loader_plans(self, step: int, sources: Sequence[int]) -> dict[int, LoaderPlan]:
        """The LoaderPlans of `step` for `sources` (a loader actor's members) at once; a source left
        out has nothing in the step."""
        return self.plan(step).loader_do_plans(sources)

    def report_loss(self, step: int, losses: Mapping[int | str, float]) -> None:
        """Record the trainer's per-source loss of `step` (by source index or name); a feedback
        schedule applies it when step + delay is planned. No-op for static schedules.

        Raises:
            PlanError: an unknown source, or a second, different report for the same step.
        """
        if self.report_delay is None:
            return
        names = self.config.source_names
        values: list[float | None] = [None] * len(names)
        for key, loss in losses.items():
            i = names.index(key) if isinstance(key, str) and key in names else key
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(names):
                raise PlanError(f"report_loss(step {step}): unknown source {key!r}; use an index in "
                                f"[0, {len(names)}) or one of {names}")
            values[i] = float(loss)
        with self._reports_cv:
            if self._reports.get(step, values) != values:
                raise PlanError(f"step {step}'s loss was reported twice with different values "
                                f"({self._reports[step]} vs {values})")
            self._reports[step] = values
            self._reports_cv.notify_all()

    # -- state ---------------------------------------------------------------------
    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The planner state *before* planning `step` (default: the next unplanned step)."""
        with self._lock:
            if step is None or step == self.next_step:
                return self._stamp(self._snapshot())
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
            with self._reports_cv:
                self._reports = {int(k): list(v) for k, v in fields["reports"]}
            self.carry = copy.deepcopy(list(fields["carry"]))
            self._summaries.clear()
            self.plans.clear()
            self._states.clear()
            if self._floors is not None:  # no constructor builds a step before the one resumed at
                self._floors = {k: max(v, self.next_step) for k, v in self._floors.items()}


def _fresh(summaries: list[SourceSummary], counts: np.ndarray, order: np.ndarray) -> Pool:
    """The step's fresh draws in mixing order: each source's next `counts[s]` buffered samples."""
    src = np.asarray(order, dtype=np.int64)
    cols = {k: np.empty(len(src), dtype=np.int64) for k in ("position", "index", "length")}
    patches: list[tuple[int, ...]] = [()] * len(src)
    for s, c in enumerate(np.asarray(counts).tolist()):
        sel, summ = np.flatnonzero(src == s), summaries[s]
        cols["position"][sel], cols["index"][sel] = summ.positions[:c], summ.indices[:c]
        cols["length"][sel] = summ.text_tokens[:c]
        if len(summ.image_patch_counts):
            off = summ.image_offsets
            for j, i in enumerate(sel.tolist()):
                patches[i] = tuple(summ.image_patch_counts[off[j]:off[j + 1]].tolist())
    return Pool(source=src, start=np.zeros(len(src), dtype=np.int64), patches=patches, **cols)
