"""Token-budget steps (``config.tokens_per_step``): what a step draws, balances, fills and carries.

A step draws the documents that fill its token budget (plus slack), the strategy balances the
longest prefix it places under the cap, the rooms left are filled (splitting documents with
``split_documents``) and the rest is carried to the next step (`mixing.budget`). The carry is
part of the Planner's checkpoint. Plain numpy: no Ray or torch.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.dgraph import DGraph
from megascale_data_ext.dataplane.grouping import stable_order
from megascale_data_ext.dataplane.mixing.budget import (
    OFFER_FRACTION,
    SLACK_MICROBATCHES,
    Pool,
    draw_size,
    fill_rooms,
    offer_prefix,
)
from megascale_data_ext.dataplane.plan import StepPlan
from megascale_data_ext.dataplane.summary import BufferSummary, SourceSummary
from megascale_data_ext.errors import CapacityError, ConfigError

__all__ = ["TokenBudget"]


class TokenBudget:
    """Plans steps to a token budget; holds the carry between steps.

    Args:
        config: The service config (``tokens_per_step``, ``seq_length``, ``num_microbatches``,
            ``split_documents``, source names).
        strategy: The balancing strategy's factory (``strategy(graph).plan()``).
        topology: The `ServiceTopology` plans are made for (its buckets must hold the budget).
        mixer: The Planner's `Mixer` (previews, counts and orders the draws).
    """

    def __init__(self, config: Any, strategy: Any, topology: Any, mixer: Any) -> None:
        num_buckets = topology.layout.num_buckets
        capacity = num_buckets * config.num_microbatches * config.seq_length
        if config.tokens_per_step > capacity:
            raise ConfigError(f"`tokens_per_step` = {config.tokens_per_step} exceeds what one step holds: "
                              f"{num_buckets} buckets x num_microbatches {config.num_microbatches} "
                              f"x seq_length {config.seq_length} = {capacity}; lower it or raise the batch shape")
        self.config, self.strategy, self.topology, self.mixer = config, strategy, topology, mixer
        self.carry: list[list] = []  # [source, position, index, start, length, [patches]] not placed yet
        self.recent_draws: deque[int] = deque(maxlen=8)  # fresh documents of the last steps (sizes metadata)
        self._empties = [SourceSummary.empty(s, name) for s, name in enumerate(config.source_names)]

    def plan(self, step: int, summaries: list[SourceSummary]) -> tuple[StepPlan, np.ndarray]:
        """Plan `step` to its token budget: carry + fresh draws -> balanced prefix -> filled rooms.

        Returns the plan and the fresh documents drawn per source (they advance the cursors even
        when carried); what is not placed becomes the new carry.
        """
        cfg, m = self.config, self.config.num_microbatches
        target, length = int(cfg.tokens_per_step), cfg.seq_length
        carry = Pool.of(self.carry)
        seq = [s.seq_lengths() if s.positions.shape[0] else _NO_ROWS for s in summaries]  # most: not drawn
        # Slack beyond the budget gives the room filling documents to choose from.
        need = target + SLACK_MICROBATCHES * length - int(carry.seq_len.sum())
        n = draw_size(lambda b: self.mixer.preview(step, b), seq, need)
        self.recent_draws.append(n)
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
        self.carry = carried
        cat = np.concatenate
        planned = dataclasses.replace(
            plan, source=cat([plan.source, pool.source[rows].astype(np.int32)]),
            position=cat([plan.position, pool.position[rows]]), index=cat([plan.index, pool.index[rows]]),
            tokens=cat([plan.tokens, lens]), cost=cat([plan.cost, self._cost_of(lens)]),
            bucket=cat([plan.bucket, bins // m]), microbatch=cat([plan.microbatch, bins % m]),
            span_start=cat([pool.start[:k], starts]), span_stop=cat([pool.start[:k] + pool.length[:k], starts + lens]),
            lineage=plan.lineage + (f"fill-rooms({len(fills)} spans, split={cfg.split_documents}, "
                                    f"carry {len(carried)})",))
        return planned, counts

    def draw_estimate(self) -> int:
        """About how many fresh documents the next step draws: the most of the last steps, with room;
        before any, as if documents were 256 tokens (metadata windows grow when a step needs more,
        `Planner._planned`)."""
        if not self.recent_draws:
            return max(1, -(-int(self.config.tokens_per_step) // 256))
        most = max(self.recent_draws)
        return most + most // 2 + 4

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
        src = pool.source[:k]
        by_source = np.argsort(src, kind="stable")  # graph row j is pool row by_source[j]
        parts = list(self._empties)  # a source without rows in the prefix: most of 1,000+ in a step
        drawn, firsts, counts = np.unique(src[by_source], return_index=True, return_counts=True)
        for s, first, n in zip(drawn.tolist(), firsts.tolist(), counts.tolist(), strict=True):
            sel = by_source[first:first + n]  # source s's rows, in pool order (one sort, not a scan per source)
            patches = [pool.patches[i] for i in sel.tolist()]
            parts[s] = SourceSummary(
                source=s, name=self._empties[s].name, positions=pool.position[sel], indices=pool.index[sel],
                text_tokens=pool.length[sel],
                image_offsets=np.concatenate([[0], np.cumsum([len(p) for p in patches])]).astype(np.int64),
                image_patch_counts=np.asarray([x for p in patches for x in p], dtype=np.int64))
        rows = np.empty(k, dtype=np.int64)
        rows[by_source] = np.arange(k)
        return DGraph.from_summary(BufferSummary.of(parts), self.topology.tree, step=step,
                                   distribution=self.topology.distribution).select(rows, note="token-budget")

    def _cost_of(self, seq_len: np.ndarray) -> np.ndarray:
        """Backbone cost of added spans, by the strategy's own cost model when it exposes one."""
        fn = getattr(getattr(self.strategy, "backbone", self.strategy), "_cost", None)
        return np.asarray(fn(seq_len), dtype=np.float64) if fn is not None else seq_len.astype(np.float64)


_NO_ROWS = np.zeros(0, dtype=np.int64)


def _fresh(summaries: list[SourceSummary], counts: np.ndarray, order: np.ndarray) -> Pool:
    """The step's fresh draws in mixing order: each source's next `counts[s]` buffered samples."""
    src, counts = np.asarray(order, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    cols = {k: np.empty(len(src), dtype=np.int64) for k in ("position", "index", "length")}
    patches: list[tuple[int, ...]] = [()] * len(src)
    # each source's slots, ascending: one stable sort, not a scan of the batch per source (1,000+ sources)
    slots = stable_order(src, len(counts))
    first = np.cumsum(counts) - counts
    for s in np.flatnonzero(counts).tolist():
        c = int(counts[s])
        sel, summ = slots[first[s]:first[s] + c], summaries[s]
        cols["position"][sel], cols["index"][sel] = summ.positions[:c], summ.indices[:c]
        cols["length"][sel] = summ.text_tokens[:c]
        if len(summ.image_patch_counts):
            off = summ.image_offsets
            for j, i in enumerate(sel.tolist()):
                patches[i] = tuple(summ.image_patch_counts[off[j]:off[j + 1]].tolist())
    return Pool(source=src, start=np.zeros(len(src), dtype=np.int64), patches=patches, **cols)
