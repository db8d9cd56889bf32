"""Data Constructor: assembles planned microbatches and cuts them per client.

One constructor serves a group of DP buckets (by default one). For a step it asks the
Planner for its part of the plan, pulls the planned samples from the Source Loaders that hold
them, packs each microbatch (THD with `cu_seqlens`, labels, loss mask, reset position ids,
optional attention mask), and answers each fetching client with its parallelism transform:
CP slice of its cp rank, fields of its PP stage.

Thread contract: `get` is called concurrently by clients while a prefetch thread builds the
next steps; built steps live in `_built` until every fetching client has taken every
microbatch, which bounds memory to `prefetch` steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.cp_slicing import slice_for_cp
from megascale_data_ext.dataplane.microbatch import fields_for_stage
from megascale_data_ext.dataplane.packing import pack_microbatch
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.plan import ConstructorPlan
from megascale_data_ext.runtime.config import ServiceConfig

FetchFn = Callable[[int, int, list[int]], dict[str, list]]
"""(source_id, step, buckets) -> a loader's `fetch` result."""


@dataclass(slots=True)
class _BuiltStep:
    batches: dict[tuple[int, int], dict[str, np.ndarray]]
    info: dict[tuple[int, int], dict[str, Any]]
    remaining: set[tuple[int, int, int]] = field(default_factory=set)  # (bucket, microbatch, rank)


class DataConstructor:
    """Builds the microbatches of its buckets.

    Args:
        buckets: DP buckets this constructor serves.
        config: Service config (seq length, microbatches, prefetch, attention mask).
        tree: The trainer mesh (who fetches, CP/PP coordinates of clients).
        get_plan: ``(step, bucket) -> ConstructorPlan`` (the Planner).
        fetch: ``(source_id, step, buckets) -> samples`` (a Source Loader).
        pad_id: Padding / masked-label token.
        image_token_id: Image placeholder token (VLM); None for text-only.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        config: ServiceConfig,
        tree: ClientPlaceTree,
        *,
        get_plan: Callable[[int, int], ConstructorPlan],
        fetch: FetchFn,
        pad_id: int,
        image_token_id: int | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.config = config
        self.tree = tree
        self.get_plan = get_plan
        self.fetch = fetch
        self.pad_id = pad_id
        self.image_token_id = image_token_id
        self.decode = decode
        axis = config.strategy_args.get("axis", "DP")
        self.layout = tree.buckets(axis)
        fetchers = set(tree.with_broadcast(("tp",)).fetch_ranks(axis))
        self.fetchers = {b: sorted(set(self.layout.bucket_ranks[b]) & fetchers) for b in self.buckets}
        self._built: dict[int, _BuiltStep] = {}
        self._building: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._next_prefetch = 0
        self.build_seconds: list[float] = []
        self.skipped: list[tuple[int, int, int, str]] = []  # (step, source, position, reason)

    # -- assembly ------------------------------------------------------------------
    def _build(self, step: int) -> _BuiltStep:
        t0 = time.perf_counter()
        plans = {b: self.get_plan(step, b) for b in self.buckets}
        sources = sorted({ref.source for p in plans.values() for mb in p.microbatches for ref in mb})
        pool: dict[tuple[int, int], Any] = {}
        for s in sources:
            got = self.fetch(s, step, self.buckets)
            for _b, pos, sample in got["samples"]:
                pool[(s, pos)] = sample
            for _b, pos, bad in got["skipped"]:
                self.skipped.append((step, s, pos, bad.reason))
        mult = self.config.pad_to_multiple_of * 2 * self.tree.cp
        built = _BuiltStep(batches={}, info={})
        for b, plan in plans.items():
            for j, refs in enumerate(plan.microbatches):
                samples = [pool[(r.source, r.position)] for r in refs if (r.source, r.position) in pool]
                if self.decode is not None:
                    samples = [self.decode(x) for x in samples]
                batch = pack_microbatch(
                    samples,
                    seq_length=self.config.seq_length,
                    pad_id=self.pad_id,
                    image_token_id=self.image_token_id,
                    with_attention_mask=self.config.with_attention_mask,
                    pad_to_multiple_of=mult,
                    variable_length=True,
                )
                built.batches[(b, j)] = batch
                delivered = [(r.source, r.position, r.index) for r in refs if (r.source, r.position) in pool]
                built.info[(b, j)] = {
                    "step": step,
                    "bucket": b,
                    "microbatch": j,
                    "samples": np.asarray(delivered, dtype=np.int64).reshape(-1, 3),
                    "tokens": int(batch["num_tokens"][0]),
                }
                for rank in self.fetchers[b]:
                    built.remaining.add((b, j, rank))
        self.build_seconds.append(time.perf_counter() - t0)
        return built

    def _ensure(self, step: int) -> _BuiltStep:
        with self._lock:
            built = self._built.get(step)
            if built is not None:
                return built
            event = self._building.get(step)
            owner = event is None
            if owner:
                event = self._building[step] = threading.Event()
        if owner:
            try:
                built = self._build(step)
                with self._lock:
                    self._built[step] = built
            finally:
                with self._lock:
                    self._building.pop(step, None)
                event.set()
            return built
        event.wait()
        with self._lock:
            if step not in self._built:
                raise RuntimeError(f"constructor for buckets {self.buckets}: building step {step} failed")
            return self._built[step]

    def prefetch(self, upto: int) -> None:
        """Build every step up to `upto` that is not built yet (called from a background thread)."""
        while self._next_prefetch <= upto:
            self._ensure(self._next_prefetch)
            self._next_prefetch += 1

    # -- client interface ----------------------------------------------------------
    def get(self, step: int, microbatch: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The microbatch `microbatch` of `step` as client `rank` needs it (CP slice, PP fields)."""
        bucket = self.layout.bucket_of_rank(rank)
        if bucket not in self.fetchers:
            raise ValueError(f"rank {rank} belongs to bucket {bucket}, not served here ({self.buckets})")
        self._next_prefetch = max(self._next_prefetch, step)
        built = self._ensure(step)
        batch, info = built.batches[(bucket, microbatch)], built.info[(bucket, microbatch)]
        coords = self.tree.coords(rank)
        if self.tree.cp > 1:
            batch = slice_for_cp(batch, cp_size=self.tree.cp, cp_rank=coords["cp"])
        batch = fields_for_stage(batch, pp_rank=coords["pp"], pp_size=self.tree.pp)
        with self._lock:
            built.remaining.discard((bucket, microbatch, rank))
            if not built.remaining:
                self._built.pop(step, None)
        return batch, info
