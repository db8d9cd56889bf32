"""Loading plans: what one training step takes from which source and where each sample goes.

A `StepPlan` is the product of `DGraph.plan()` and the only thing the runtime acts on. It is
plain numpy (picklable, cheap to ship through Ray) and answers the three questions the
actors ask: a Source Loader asks `loader_do_plan(source)` (which stream positions to pop and
to which bucket each goes), a Data Constructor asks `constructor_do_plan(bucket)` (the ordered
microbatches it assembles), and a Client asks `fetch_ranks` (whether it fetches or receives).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from megascale_data_ext.dataplane.grouping import grouped_rows


@dataclass(slots=True, kw_only=True, frozen=True)
class SampleRef:
    """One planned sample: its source, its position in that source's stream, its sample index.

    `start`/`stop` delimit the token span taken (a split document, `split_documents`); the
    default (0, None) is the whole sample.
    """

    source: int
    position: int
    index: int
    start: int = 0
    stop: int | None = None


@dataclass(slots=True, kw_only=True)
class LoaderPlan:
    """What one Source Loader does for a step: pop `positions` (stream order) and route each one."""

    step: int
    source: int
    positions: np.ndarray  # int64, stream positions to pop, ascending
    indices: np.ndarray  # int64, sample index inside the source for each position
    bucket: np.ndarray  # int64, destination bucket for each position


@dataclass(slots=True, kw_only=True)
class ConstructorPlan:
    """What one Data Constructor assembles for a step: `microbatches[j]` in delivery order.

    It travels as one int64 array, a row per sample in plan order (`COLUMNS`; ``stop`` -1 = the
    whole sample), so the Planner's reply to each constructor is a copy of plain memory, not
    hundreds of thousands of Python objects at 4,096 GPUs; the `SampleRef`s are built where the
    plan is used, once.
    """

    COLUMNS = ("microbatch", "source", "position", "index", "start", "stop")

    step: int
    bucket: int
    rows: np.ndarray  # int64 [samples, len(COLUMNS)]
    num_microbatches: int
    ranks: tuple[int, ...]
    cap: int | None = None  # token cap the planner packed under; None = no cap (vanilla)
    encoder: bool = False  # the step has an EncoderPlan (images to hand to encoder ranks)
    cp_groups: np.ndarray | None = None  # hybrid CP: int64 [num_microbatches, 2] = (group size, place in it)
    _refs: list[list[SampleRef]] | None = field(default=None, repr=False, compare=False)

    @property
    def microbatches(self) -> list[list[SampleRef]]:
        """Per microbatch, its samples in delivery order."""
        if self._refs is None:
            mbs: list[list[SampleRef]] = [[] for _ in range(self.num_microbatches)]
            for j, source, position, index, start, stop in self.rows.tolist():
                mbs[j].append(SampleRef(source=source, position=position, index=index, start=start,
                                        stop=None if stop < 0 else stop))
            self._refs = mbs
        return self._refs

    def __getstate__(self) -> dict:  # the rows travel, the references are rebuilt where used
        return {f: getattr(self, f) for f in ("step", "bucket", "rows", "num_microbatches", "ranks", "cap", "encoder",
                                              "cp_groups")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self._refs = None


@dataclass(slots=True, kw_only=True)
class EncoderPlan:
    """Image-level sub-plan of a hybrid (VLM) strategy: which encoder bucket encodes each image.

    Rows are images; `sample` points into the parent plan's sample arrays.
    """

    axis: str
    num_buckets: int
    sample: np.ndarray  # int64, row of the parent plan
    image: np.ndarray  # int64, image number inside its sample
    patches: np.ndarray  # int64
    bucket: np.ndarray  # int64
    cost: np.ndarray  # float64

    def bucket_costs(self) -> np.ndarray:
        return np.bincount(self.bucket, weights=self.cost, minlength=self.num_buckets)


def _index(keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`grouped_rows`, its row numbers as int32 (a cached plan holds a few of these)."""
    order, start = grouped_rows(keys, k)
    return (order.astype(np.int32) if keys.shape[0] < 2**31 else order), start


@dataclass(slots=True, kw_only=True)
class StepPlan:
    """The plan of one global step (arrays are aligned: row i is one planned sample).

    Rows are in global-batch order (the mixer's order); `bucket`/`microbatch` say where each
    sample goes, and the samples of one microbatch are delivered in row order.
    """

    step: int
    axis: str
    num_buckets: int
    num_microbatches: int
    source_names: tuple[str, ...]
    source: np.ndarray  # int32
    position: np.ndarray  # int64 stream position inside the source
    index: np.ndarray  # int64 sample index inside the source
    tokens: np.ndarray  # int64 sequence tokens (text + image placeholders)
    cost: np.ndarray  # float64 backbone cost
    bucket: np.ndarray  # int64
    microbatch: np.ndarray  # int64
    bucket_ranks: tuple[tuple[int, ...], ...]
    fetch_ranks: tuple[int, ...]
    broadcast_dims: tuple[str, ...] = ()
    encoder: EncoderPlan | None = None
    lineage: tuple[str, ...] = field(default=())
    cap: int | None = None
    span_start: np.ndarray | None = None  # int64 first token of the row's span; None = whole samples
    span_stop: np.ndarray | None = None  # int64 one past its last token (span_start + tokens)
    cp_size: np.ndarray | None = None  # int64 hybrid CP: the row's group size (a sample has a row per group member)
    cp_rank: np.ndarray | None = None  # int64 the row's place in its group; None = no hybrid CP
    # Rows and encoder images grouped by bucket (and rows by source), built on the first call and not
    # shipped: the Planner hands every constructor its buckets (every loader its sources) from one plan,
    # which scanning all rows per bucket made O(rows × buckets) a step (at 4,096 GPUs ~0.2 s of the actor's time).
    _by_bucket: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)
    _by_source: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)
    _images_by_bucket: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False,
                                                                    compare=False)

    def __getstate__(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self._by_bucket = self._by_source = self._images_by_bucket = None

    def bucket_rows(self, bucket: int) -> np.ndarray:
        """Rows going to `bucket`, ascending (``flatnonzero(self.bucket == bucket)``), from an index."""
        if self._by_bucket is None:
            self._by_bucket = _index(self.bucket, self.num_buckets)
        order, start = self._by_bucket
        return order[start[bucket] : start[bucket + 1]]

    def source_rows(self, source: int) -> np.ndarray:
        """Rows of `source`, ascending (``flatnonzero(self.source == source)``), from an index."""
        if self._by_source is None:
            self._by_source = _index(self.source, len(self.source_names))
        order, start = self._by_source
        return order[start[source] : start[source + 1]] if 0 <= source < len(start) - 1 else order[:0]

    def encoder_images_of(self, buckets: Iterable[int]) -> np.ndarray:
        """Encoder images whose samples go to `buckets`, ascending, from an index."""
        if self.encoder is None:
            return np.zeros(0, dtype=np.int64)
        if self._images_by_bucket is None:
            self._images_by_bucket = _index(self.bucket[self.encoder.sample], self.num_buckets)
        order, start = self._images_by_bucket
        parts = [order[start[b] : start[b + 1]] for b in dict.fromkeys(buckets)]
        if len(parts) == 1:
            return parts[0].astype(np.int64)
        return np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    @property
    def num_samples(self) -> int:
        return int(self.source.shape[0])

    def heads(self) -> np.ndarray:
        """Rows that start their sample (all rows unless documents were split, or a hybrid-CP
        group's other members hold the same sample)."""
        out = np.ones(self.num_samples, bool) if self.span_start is None else self.span_start == 0
        return out if self.cp_rank is None else out & (self.cp_rank == 0)

    def counts_per_source(self) -> np.ndarray:
        """Samples started per source (a split document's continuations are not counted again)."""
        src = self.source if self.span_start is None and self.cp_rank is None else self.source[self.heads()]
        return np.bincount(src, minlength=len(self.source_names)).astype(np.int64)

    def bucket_costs(self) -> np.ndarray:
        return np.bincount(self.bucket, weights=self.cost, minlength=self.num_buckets)

    def bin_costs(self) -> np.ndarray:
        """Cost per (bucket, microbatch) as a [num_buckets, num_microbatches] array."""
        flat = self.bucket * self.num_microbatches + self.microbatch
        out = np.bincount(flat, weights=self.cost, minlength=self.num_buckets * self.num_microbatches)
        return out.reshape(self.num_buckets, self.num_microbatches)

    def bin_tokens(self) -> np.ndarray:
        flat = self.bucket * self.num_microbatches + self.microbatch
        out = np.bincount(flat, weights=self.tokens, minlength=self.num_buckets * self.num_microbatches)
        return out.reshape(self.num_buckets, self.num_microbatches).astype(np.int64)

    def imbalance(self) -> float:
        """max bucket cost / mean bucket cost (1.0 = perfectly balanced)."""
        costs = self.bucket_costs()
        mean = costs.mean() if costs.size else 0.0
        return float(costs.max() / mean) if mean > 0 else 1.0

    def vanilla_bucket_costs(self) -> np.ndarray:
        """Bucket costs had the same samples been split Megatron-style (contiguous, equal count)."""
        n, k = self.num_samples, self.num_buckets
        return np.bincount(np.arange(n) * k // max(n, 1), weights=self.cost, minlength=k)

    def vanilla_imbalance(self) -> float:
        """max/mean of `vanilla_bucket_costs` (1.0 for an empty step)."""
        if self.num_samples == 0:
            return 1.0
        costs = self.vanilla_bucket_costs()
        return float(costs.max() / costs.mean()) if costs.mean() > 0 else 1.0

    def loader_do_plan(self, source: int) -> LoaderPlan:
        return self._loader_plan_of(source, self.source_rows(source))

    def loader_do_plans(self, sources: Iterable[int]) -> dict[int, LoaderPlan]:
        """`loader_do_plan` of each of `sources` that has samples in the step (a loader actor
        hosting many sources asks once); a source left out has none."""
        out = {}
        for s in np.unique(np.asarray(list(sources), dtype=np.int64)).tolist():
            rows = self.source_rows(s)
            if len(rows):
                out[s] = self._loader_plan_of(s, rows)
        return out

    def _loader_plan_of(self, source: int, rows: np.ndarray) -> LoaderPlan:
        """The LoaderPlan of `source` from its rows of the plan (ascending)."""
        if self.span_start is None:
            rows = rows[np.argsort(self.position[rows], kind="stable")]
        else:  # spans of one sample going to one bucket: read and ship it once
            _, first = np.unique(self.position[rows] * self.num_buckets + self.bucket[rows], return_index=True)
            rows = rows[first]
        return LoaderPlan(
            step=self.step,
            source=source,
            positions=self.position[rows],
            indices=self.index[rows],
            bucket=self.bucket[rows],
        )

    def constructor_do_plan(self, bucket: int) -> ConstructorPlan:
        rows = self.bucket_rows(bucket)
        table = np.empty((len(rows), len(ConstructorPlan.COLUMNS)), dtype=np.int64)
        table[:, 0], table[:, 1] = self.microbatch[rows], self.source[rows]
        table[:, 2], table[:, 3] = self.position[rows], self.index[rows]
        if self.span_start is not None:
            table[:, 4], table[:, 5] = self.span_start[rows], self.span_stop[rows]
        else:
            table[:, 4], table[:, 5] = 0, -1
        if self.cp_size is None:
            return ConstructorPlan(step=self.step, bucket=bucket, rows=table, num_microbatches=self.num_microbatches,
                                   ranks=self.bucket_ranks[bucket], cap=self.cap, encoder=self.encoder is not None)
        count = int(self.microbatch[rows].max()) + 1 if len(rows) else 0  # this bucket's own count
        groups = np.zeros((count, 2), dtype=np.int64)
        groups[:, 0] = 1  # an index without rows (aligned plans, pipeline parallelism): a filler, on its own
        groups[self.microbatch[rows], 0], groups[self.microbatch[rows], 1] = self.cp_size[rows], self.cp_rank[rows]
        return ConstructorPlan(step=self.step, bucket=bucket, rows=table, num_microbatches=count,
                               ranks=self.bucket_ranks[bucket], cap=self.cap, encoder=self.encoder is not None,
                               cp_groups=groups)

    def summary(self) -> dict[str, float | int | list[int]]:
        """Numbers worth printing per step: sizes, balance and per-source counts."""
        costs = self.bucket_costs()
        own = slice(None) if self.cp_rank is None else self.cp_rank == 0  # a hybrid-CP group's sample once
        out: dict[str, float | int | list[int]] = {
            "step": self.step,
            "samples": int(self.source[own].shape[0]),
            "tokens": int(self.tokens[own].sum()),
            "buckets": self.num_buckets,
            "max_over_mean": self.imbalance(),
            "vanilla_max_over_mean": self.vanilla_imbalance(),
            "max_bucket_cost": float(costs.max()) if costs.size else 0.0,
            "per_source": self.counts_per_source().tolist(),
            "fetchers": len(self.fetch_ranks),
        }
        if self.encoder is not None:
            ec = self.encoder.bucket_costs()
            out["encoder_max_over_mean"] = float(ec.max() / ec.mean()) if ec.size and ec.mean() > 0 else 1.0
        return out
