"""DGraph: the per-step, metadata-only graph of sample states (paper Sec. 4.1).

Nodes are samples in a state (buffered -> sampled -> bucket -> microbatch bin -> client);
edges are the primitive that moved them. Internally the graph is columnar (one numpy array
per attribute) so a 4,096-GPU step plans in milliseconds; `lineage`, `__str__` and `to_dot()`
make the state transitions visible.

Primitives chain and return the graph::

    plan = (DGraph.from_summary(summary, tree, step=s)
            .mix(mixer, batch_size=B)
            .distribute("DP")
            .cost(TransformerCost(cfg))
            .balance("kk", level="interleaved", num_microbatches=m, cap=seq_len)
            .broadcast_at("tp")
            .plan())

`images()` derives the image DGraph from the same buffer (one node per image) for hybrid
strategies whose encoder has its own distribution axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.balancers import balance_step
from megascale_data_ext.dataplane.balancers.hybrid_cp import CPCost, balance_hybrid_cp
from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.dataplane.grouping import ranks_within
from megascale_data_ext.dataplane.plan import EncoderPlan, StepPlan
from megascale_data_ext.dataplane.summary import BufferSummary
from megascale_data_ext.errors import PlanError, ShortBufferError

CostFn = Callable[[Any], np.ndarray]


class _Columns(Mapping[str, np.ndarray]):
    """Read-only view of a graph's columns handed to user cost functions."""

    def __init__(self, cols: dict[str, np.ndarray]):
        self._cols = cols

    def __getitem__(self, key: str) -> np.ndarray:
        return self._cols[key]

    def __getattr__(self, key: str) -> np.ndarray:
        try:
            return self._cols[key]
        except KeyError:
            raise AttributeError(key) from None

    def __iter__(self):
        return iter(self._cols)

    def __len__(self) -> int:
        return len(self._cols)


def _apply_cost(fn: CostFn, cols: dict[str, np.ndarray], on: str | None) -> np.ndarray:
    n = len(next(iter(cols.values()))) if cols else 0
    if on is not None:
        if on not in cols:
            raise PlanError(f"cost(on={on!r}): no such column; columns are {sorted(cols)}")
        out = fn(cols[on])
    else:
        out = fn(_Columns(cols))
    out = np.asarray(out, dtype=np.float64)
    if out.shape != (n,):
        raise PlanError(f"cost function {fn!r} returned shape {out.shape}, expected ({n},)")
    if not np.all(np.isfinite(out)) or np.any(out < 0):
        raise PlanError(f"cost function {fn!r} returned negative or non-finite costs")
    return out


class _GraphBase:
    """State shared by the sample graph and the image graph: columns, buckets, bins, lineage."""

    def __init__(self, cols: dict[str, np.ndarray], tree: Any, step: int):
        self.cols = cols
        self.tree = tree
        self.step = step
        self.lineage: list[str] = []
        self.layout: Any = None
        self.costs: np.ndarray | None = None
        self.bucket: np.ndarray | None = None
        self.microbatch: np.ndarray | None = None
        self.num_microbatches = 1
        self.cap: int | None = None
        self.cp_size: np.ndarray | None = None  # hybrid CP: each row's group size and its place in the group
        self.cp_rank: np.ndarray | None = None

    def __len__(self) -> int:
        return int(len(next(iter(self.cols.values())))) if self.cols else 0

    def _record(self, text: str) -> None:
        self.lineage.append(text)

    def distribute(self, axis: str, group_size: int | None = None):
        """Create one bucket per consumer on `axis` of the ClientPlaceTree ("DP", "CP", "WORLD")."""
        self.layout = self.tree.buckets(axis, group_size=group_size)
        self._record(f"distribute(axis={axis!r}, group_size={group_size}) -> {self.layout.num_buckets} buckets")
        return self

    def cost(self, fn: CostFn, *, on: str | None = "seq_len"):
        """Attach a cost per node: `fn(column)` when `on` names a column, else `fn(columns)`."""
        self.costs = _apply_cost(fn, self.cols, on)
        self._record(f"cost({getattr(fn, '__name__', type(fn).__name__)}, on={on!r})")
        return self

    def balance(
        self,
        method: str = "kk",
        *,
        level: str = "interleaved",
        num_microbatches: int = 1,
        cap: int | None = None,
        keep_order: bool = True,
    ):
        """Assign nodes to buckets and microbatch bins with a registered balancer."""
        if self.layout is None:
            raise PlanError("balance() needs distribute(axis) first: it decides how many buckets there are")
        costs = self.costs if self.costs is not None else self.cols["seq_len"].astype(np.float64)
        groups = self.layout.groups if len(self.layout.groups) > 1 else None
        try:
            res = self._balance_step(costs, groups, method, level, num_microbatches, cap, keep_order)
        except PlanError as exc:
            raise type(exc)(f"step {self.step}: {exc} [{self._describe_rows(exc)}]") from exc
        self.bucket, self.microbatch = res.bucket.astype(np.int64), res.microbatch.astype(np.int64)
        self.num_microbatches = num_microbatches
        self.cap = cap
        self.costs = costs
        self._record(f"balance({method!r}, level={level!r}, m={num_microbatches}, cap={cap}, keep_order={keep_order})")
        return self

    def _describe_rows(self, exc: Exception) -> str:
        """Name the source and sample behind an "item N" in a balancer error."""
        import re

        m = re.search(r"item (\d+)", str(exc))
        if m is None or "source" not in self.cols:
            return "no sample named"
        i = int(m.group(1))
        src = int(self.cols["source"][i])
        names = getattr(getattr(self, "summary", None), "names", None)
        name = names[src] if names else str(src)
        return f"item {i} is sample {int(self.cols['index'][i]) if 'index' in self.cols else i} of source {name!r}"

    def _balance_step(self, costs, groups, method, level, num_microbatches, cap, keep_order):
        return balance_step(
            costs,
            tokens=self.cols["seq_len"],
            num_buckets=self.layout.num_buckets,
            num_microbatches=num_microbatches,
            cap=cap,
            method=method,
            level=level,
            keep_order=keep_order,
            groups=groups,
        )


class ImageDGraph(_GraphBase):
    """One node per image of the sampled samples, for encoders with their own axis (Alg. 2)."""

    def to_encoder_plan(self) -> EncoderPlan:
        if self.bucket is None:
            raise PlanError("image graph was never balanced: call distribute() and balance() on it")
        return EncoderPlan(
            axis=self.layout.axis,
            num_buckets=self.layout.num_buckets,
            sample=self.cols["sample"],
            image=self.cols["image"],
            patches=self.cols["seq_len"],
            bucket=self.bucket,
            cost=self.costs if self.costs is not None else self.cols["seq_len"].astype(np.float64),
        )


def _stream_heads(src: np.ndarray, position: np.ndarray, held: np.ndarray, counts: np.ndarray, order: np.ndarray,
                  mixer: str, rank: np.ndarray | None = None) -> np.ndarray:
    """Buffer row of each batch slot: the slots of source s (`order`, ascending) take its `counts[s]`
    lowest-position rows in position order. `rank` (each slot's place among its source's slots, from
    a mixer's `interleave`) spares the sort of the slots by source. Sorts at most twice, not once per
    source (hundreds of sources at 300k samples a step made a scan per source the Planner's largest cost)."""
    k = len(counts)
    if not np.array_equal(np.bincount(order, minlength=k)[:k], counts) or (len(order) and order.max() >= k):
        raise PlanError(f"mixer {mixer}: order() must hold each source as often as counts() says ({counts.tolist()})")
    if rank is None:
        rank = ranks_within(order, k)
    first_row = np.cumsum(held) - held
    picked = first_row[order] + rank
    step_src = np.diff(src)
    if bool(np.all((step_src > 0) | ((step_src == 0) & (np.diff(position) >= 0)))):
        return picked  # summaries arrive by source, in stream order
    return np.lexsort((position, src))[picked]


class DGraph(_GraphBase):
    """Metadata graph of one step's samples; see the module docstring for the primitive chain."""

    def __init__(self, summary: BufferSummary, tree: Any, *, step: int, distribution: Distribution | None = None):
        self.summary = summary
        self.distribution = Distribution() if distribution is None else distribution
        sources = summary.sources
        parts = [p for p in sources if p.positions.shape[0]]  # a step's graph at 1,000+ sources holds rows of few
        # Whole-buffer arrays in a few numpy calls, not a few per source (1,000+ sources a step).
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))

        def cat(arrays: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)

        offsets = cat([p.image_offsets for p in parts])  # each part's len + 1 entries, from 0
        num_images = np.delete(np.diff(offsets), np.cumsum(lengths + 1)[:-1] - 1) if parts else np.zeros(0, np.int64)
        image_offsets = np.concatenate(([0], np.cumsum(num_images)))
        image_patch_counts = cat([p.image_patch_counts for p in parts])
        patches_before = np.concatenate(([0], np.cumsum(image_patch_counts)))
        cols = {
            "source": np.repeat(np.fromiter((p.source for p in parts), np.int32, len(parts)), lengths),
            "position": cat([p.positions for p in parts]),
            "index": cat([p.indices for p in parts]),
            "text_tokens": cat([p.text_tokens for p in parts]),
            "image_patches": patches_before[image_offsets[1:]] - patches_before[image_offsets[:-1]],
            "num_images": num_images,
        }
        for key in sorted({k for p in parts for k in p.extra}):
            cols[key] = np.concatenate([p.extra[key] for p in parts])
        cols["seq_len"] = cols["text_tokens"] + cols["image_patches"]
        super().__init__(cols, tree, step)
        self.image_offsets = image_offsets.astype(np.int64, copy=False)
        self.image_patch_counts = image_patch_counts.astype(np.int64, copy=False)
        self.selected: np.ndarray | None = None
        self.broadcast_dims: tuple[str, ...] = ()
        self.encoder: ImageDGraph | None = None
        self._record(f"buffer({len(self)} samples from {len(sources)} sources)")

    @classmethod
    def from_summary(cls, summary: BufferSummary, tree: Any, *, step: int,
                     distribution: Distribution | None = None) -> DGraph:
        """The step's graph over `summary` on the mesh `tree`; `distribution` (the service's broadcast
        dims and reading stages) decides the plan's fetching ranks unless `broadcast_at` overrides it."""
        return cls(summary, tree, step=step, distribution=distribution)

    # -- primitives -------------------------------------------------------------------
    def mix(self, mixer: Any, *, batch_size: int) -> DGraph:
        """Sample this step's global batch: `mixer.counts` per source, `mixer.order` interleaving.

        Each source contributes its next samples in stream order, so every sample is taken
        exactly once per epoch; only sampled nodes take part in what follows.
        """
        counts = np.asarray(mixer.counts(self.step, batch_size), dtype=np.int64)
        interleave = getattr(mixer, "interleave", None)  # a mixer that knows each slot's rank in its source
        order, rank = (interleave(self.step, counts) if interleave is not None
                       else (mixer.order(self.step, counts), None))
        order = np.asarray(order, dtype=np.int64)
        src = self.cols["source"]
        held = np.bincount(src, minlength=len(counts)) if len(src) else np.zeros(len(counts), np.int64)
        short = {s: int(n) for s, n in enumerate(counts.tolist()) if n > held[s]}
        if short:
            s, n = next(iter(short.items()))
            raise ShortBufferError(
                f"step {self.step}: source {self.summary.sources[s].name!r} has {int(held[s])} buffered samples but "
                f"the mixture needs {n}; raise the loader buffer size (buffer_size) or lower the batch size", short)
        self._select(_stream_heads(src, self.cols["position"], held, counts, order, type(mixer).__name__, rank),
                     source=order)
        self._record(f"mix({type(mixer).__name__}, batch_size={batch_size}) -> counts {counts.tolist()}")
        return self

    def select(self, rows: np.ndarray, *, note: str = "select") -> DGraph:
        """Low-level alternative to `mix`: take exactly these buffer rows in this order."""
        self._select(np.asarray(rows, dtype=np.int64))
        self._record(f"{note}({len(rows)} rows)")
        return self

    def _select(self, rows: np.ndarray, *, source: np.ndarray | None = None) -> None:
        """Keep these rows in this order; `source` is their source column where the caller knows it."""
        starts = np.take(self.image_offsets, rows)  # np.take: a 1-D gather without fancy indexing's overhead
        self.cols = {k: source.astype(v.dtype) if k == "source" and source is not None else np.take(v, rows)
                     for k, v in self.cols.items()}
        lens = self.cols["num_images"]  # the offsets' differences, gathered with the other columns
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        if total:
            idx = np.repeat(starts - offsets[:-1], lens)
            idx += np.arange(total, dtype=np.int64)
            self.image_patch_counts = np.take(self.image_patch_counts, idx)
        else:
            self.image_patch_counts = np.zeros(0, np.int64)
        self.image_offsets = offsets
        self.selected = rows

    def images(self) -> ImageDGraph:
        """The image DGraph over the same sampled samples (`seq_len` = patches of one image)."""
        lens = np.diff(self.image_offsets)
        sample = np.repeat(np.arange(len(self), dtype=np.int64), lens)
        image = np.arange(len(sample), dtype=np.int64) - np.repeat(self.image_offsets[:-1], lens)
        cols = {"sample": sample, "image": image, "seq_len": self.image_patch_counts.copy()}
        cols["source"] = self.cols["source"][sample]
        g = ImageDGraph(cols, self.tree, self.step)
        g._record(f"images({len(sample)} images of {len(self)} samples)")
        self.encoder = g
        return g

    def balance_hybrid_cp(self, *, cap: int, cost: CPCost, aligned: bool = False) -> DGraph:
        """Hybrid context parallelism over the buckets (`balancers.hybrid_cp`): each sample its own
        power-of-two group of consecutive buckets, as many microbatches per bucket as it needs,
        at most `cap` tokens per bucket and microbatch. A sample split over g buckets becomes g
        rows, one per bucket, carrying ``cp_size`` = g and ``cp_rank`` = its place in the group
        (every bucket of a group holds the same samples in the same order in that microbatch);
        a row's cost is its share on one bucket. Needs `distribute` over the DP×CP consumers (axis
        ``"CP"``, bucket ``dp * CP + cp``, megatron-core's hybrid-group order). `aligned` (pipeline
        parallelism) puts each group microbatch at the same index on all its buckets
        (`HybridPlan.slots`); an index a bucket has no rows at is a filler for its constructor."""
        if self.layout is None:
            raise PlanError("balance_hybrid_cp() needs distribute(axis) first: it decides how many buckets there are")
        if int(self.cols["num_images"].sum()) if len(self) else 0:
            raise PlanError(f"step {self.step}: hybrid CP plans text only, and this step has samples with images")
        lens = self.cols["seq_len"].astype(np.int64)
        try:
            plan = balance_hybrid_cp(lens, self.layout.num_buckets, cap, cost)
        except PlanError as exc:
            raise type(exc)(f"step {self.step}: {exc} [{self._describe_rows(exc)}]") from exc
        picked, bucket, mb, size, rank, count = plan.placements(aligned=aligned)
        if len(count) and int(count.min()) == 0:
            raise PlanError(f"step {self.step}: hybrid CP left {int((count == 0).sum())} of {len(count)} consumers "
                            f"without a microbatch ({len(self)} samples); every rank runs at least one: raise "
                            "data.samples_per_step")
        self.cp_size, self.cp_rank = size, rank
        selected = self.selected
        self._select(picked)
        self.selected = selected  # the step's buffer rows, not its replicas
        self.bucket, self.microbatch = bucket, mb
        self.costs = cost.per_gpu(self.cols["seq_len"], self.cp_size)
        self.num_microbatches = int(count.max()) if count.size else 1
        self.cap = int(cap)
        self._record(f"balance_hybrid_cp(cap={cap}) -> groups {np.bincount(plan.group_size).nonzero()[0].tolist()}, "
                     f"microbatches per bucket {int(count.min())}..{int(count.max())}")
        return self

    def broadcast_at(self, dim: str) -> DGraph:
        """Declare a trainer-side broadcast along `dim`: only its rank 0 fetches (e.g. "tp")."""
        self.broadcast_dims = tuple(dict.fromkeys(self.broadcast_dims + (dim,)))
        self._record(f"broadcast_at({dim!r})")
        return self

    def plan_raw(self) -> dict[str, np.ndarray]:
        """The raw per-sample assignment arrays, for users who program the Planner directly."""
        if self.bucket is None:
            raise PlanError("nothing to plan: call distribute() and balance() first")
        return {**self.cols, "bucket": self.bucket, "microbatch": self.microbatch, "cost": self.costs}

    def plan(self) -> StepPlan:
        raw = self.plan_raw()
        layout = self.layout
        own = self.distribution  # the service's, with the axis distributed on and the program's broadcast_at
        fetching = Distribution(layout.axis, self.broadcast_dims or own.broadcast, own.stages)
        fetch = tuple(fetching.fetch_ranks(self.tree))
        return StepPlan(
            step=self.step,
            axis=layout.axis,
            num_buckets=layout.num_buckets,
            num_microbatches=self.num_microbatches,
            source_names=self.summary.names,
            source=raw["source"].astype(np.int32),
            position=raw["position"],
            index=raw["index"],
            tokens=raw["seq_len"].astype(np.int64),
            cost=raw["cost"],
            bucket=raw["bucket"],
            microbatch=raw["microbatch"],
            bucket_ranks=tuple(tuple(r) for r in layout.bucket_ranks),
            fetch_ranks=fetch,
            broadcast_dims=self.broadcast_dims,
            encoder=self.encoder.to_encoder_plan() if self.encoder is not None and self.encoder.bucket is not None else None,
            lineage=tuple(self.lineage + (self.encoder.lineage if self.encoder is not None else [])),
            cap=self.cap,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
        )

    # -- inspection -------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"DGraph(step={self.step}, nodes={len(self)})"]
        lines += [f"  {i}. {t}" for i, t in enumerate(self.lineage)]
        if self.encoder is not None:
            lines += [f"  encoder: {t}" for t in self.encoder.lineage]
        if self.bucket is not None:
            bc = np.bincount(self.bucket, weights=self.costs, minlength=self.layout.num_buckets)
            lines.append(f"  bucket cost max/mean = {bc.max() / max(bc.mean(), 1e-12):.3f}")
        return "\n".join(lines)

    def to_dot(self, *, per_sample: bool = False) -> str:
        """Graphviz DOT of the lineage: sources -> buckets -> microbatch bins -> clients.

        Edges are labelled with sample counts; `per_sample=True` draws one node per sample
        ("id:cost" as in the paper's Fig. 8) for small graphs.
        """
        out = ["digraph DGraph {", "  rankdir=LR;", '  node [shape=box, fontsize=10];']
        names = self.summary.names
        for s, name in enumerate(names):
            out.append(f'  src{s} [label="{name}", shape=cylinder];')
        if self.bucket is None:
            out.append("}")
            return "\n".join(out)
        m = self.num_microbatches
        src, b, mb = self.cols["source"], self.bucket, self.microbatch
        for k in range(self.layout.num_buckets):
            ranks = ",".join(map(str, self.layout.bucket_ranks[k]))
            out.append(f'  b{k} [label="bucket {k}", shape=folder];')
            out.append(f'  c{k} [label="clients {ranks}", shape=component];')
            for j in range(m):
                sel = (b == k) & (mb == j)
                cost = float(self.costs[sel].sum())
                out.append(f'  b{k}m{j} [label="mb {j}\\ncost {cost:.3g}", shape=box, style=rounded];')
                out.append(f"  b{k} -> b{k}m{j};")
                out.append(f"  b{k}m{j} -> c{k};")
        if per_sample:
            for i in range(len(self)):
                out.append(f'  n{i} [label="{int(self.cols["index"][i])}:{self.costs[i]:.3g}", shape=ellipse];')
                out.append(f"  src{int(src[i])} -> n{i};")
                out.append(f"  n{i} -> b{int(b[i])}m{int(mb[i])};")
        else:
            pairs, counts = np.unique(np.stack([src, b]), axis=1, return_counts=True)
            for (s, k), c in zip(pairs.T.tolist(), counts.tolist(), strict=True):
                out.append(f'  src{s} -> b{k} [label="{c}"];')
        out.append("}")
        return "\n".join(out)
