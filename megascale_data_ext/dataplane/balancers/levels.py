"""Balance levels: one step's samples to buckets (DP ranks) and their micro-batches.

`balance_step` implements the paper's levels on top of the registered balancers
(`registry.get_balancer`): ``none`` (Megatron's contiguous order), ``inter`` (balanced bucket
membership, in-order micro-batches), ``intra`` (vanilla buckets, balanced micro-batches
inside) and ``interleaved`` (OVERLORD Alg. 1: pack into k·m capped bins, deal the bins m per
bucket, then move single samples out of the heaviest bucket), optionally first over groups of
buckets (`distribute(axis, group_size)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from megascale_data_ext.dataplane.balancers.bins import Bins, cap_array, check_inputs, no_room
from megascale_data_ext.dataplane.balancers.lpt import greedy, greedy_core
from megascale_data_ext.dataplane.balancers.registry import get_balancer
from megascale_data_ext.dataplane.grouping import stable_order
from megascale_data_ext.errors import ConfigError, PlanError

__all__ = ["BalanceResult", "Level", "balance_step"]

Level = Literal["none", "inter", "intra", "interleaved"]

#: Per-(bucket, micro-batch) cost and token sums when a level already has them (else None).
_Cells = tuple[np.ndarray, np.ndarray | None] | None


@dataclass(slots=True, kw_only=True)
class BalanceResult:
    """One step's assignment: sample i goes to `bucket[i]`, micro-batch `microbatch[i]` of it.

    `bin_cost[b, j]` / `bin_tokens[b, j]` sum micro-batch j of bucket b; `bucket_cost` sums
    each bucket (what a pipeline rank's step time follows).
    """

    bucket: np.ndarray
    microbatch: np.ndarray
    bucket_cost: np.ndarray
    bin_cost: np.ndarray
    bin_tokens: np.ndarray | None = None
    keep_order: bool = True
    costs: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))

    def order(self) -> np.ndarray:
        """Sample indices grouped by (bucket, micro-batch); inside a micro-batch in original
        order when `keep_order`, else heaviest first."""
        key = self.bucket * self.bin_cost.shape[1] + self.microbatch
        if self.keep_order:
            return np.argsort(key, kind="stable")
        return np.lexsort((-self.costs, key))

    def members(self, bucket: int, microbatch: int | None = None) -> np.ndarray:
        sel = self.bucket == bucket
        if microbatch is not None:
            sel &= self.microbatch == microbatch
        idx = np.flatnonzero(sel)
        return idx if self.keep_order else idx[np.argsort(-self.costs[idx], kind="stable")]

    def imbalance(self) -> float:
        """max / mean bucket cost (1.0 = perfect)."""
        mean = float(self.bucket_cost.mean()) if self.bucket_cost.size else 0.0
        return float(self.bucket_cost.max()) / mean if mean > 0 else 1.0


def _partition_sums(method: str, costs: np.ndarray, k: int, *, tokens: np.ndarray | None,
                    cap: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`get_balancer(method)`'s bins (inputs already checked) and each bin's cost and token sums.

    The built-in greedy keeps these sums as it places items; for other methods they are
    summed afterwards. Saves two passes over all samples.
    """
    fn = get_balancer(method)
    if fn is greedy:
        bins = Bins(load=np.zeros(k), cap=cap_array(cap, k), tok=None if cap is None else np.zeros(k))
        out = greedy_core(costs, k, tokens=tokens, cap=cap, sizes=None, bins=bins)
        load, tok = bins.load, bins.tok
    else:
        out = np.asarray(fn(costs, k, tokens=tokens, cap=cap, sizes=None), dtype=np.int64)
        load, tok = np.bincount(out, weights=costs, minlength=k), None
    if tok is None and tokens is not None:
        tok = np.bincount(out, weights=tokens, minlength=k)
    return out, load, tok


def _split_positions(pos: np.ndarray, size: np.ndarray | int, parts: int) -> np.ndarray:
    """Part of position `pos` when `size` items are cut into `parts` contiguous equal-count
    slices, the first `size % parts` one longer (numpy.array_split's rule)."""
    q, r = np.divmod(size, parts)
    big = r * (q + 1)
    return np.where(pos < big, pos // (q + 1), r + (pos - big) // np.maximum(q, 1))


def _vanilla(n: int, k: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(n, dtype=np.int64)
    bucket = _split_positions(idx, n, k)
    sizes = np.bincount(bucket, minlength=k)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return bucket, _split_positions(idx - starts[bucket], sizes[bucket], m)


def _first_fit_in_order(tokens: np.ndarray, cap: float, m: int, bucket: int) -> np.ndarray:
    """Microbatch of each sample when a bucket's samples, in order, fill microbatches of <= cap
    tokens one after another; a sample that does not fit opens the next one, which always takes
    it (a first sample over the cap leaves microbatch 0 empty). A loop over the microbatches, each
    cut by one search in the running token sum, not over the samples."""
    out = np.empty(len(tokens), dtype=np.int64)
    csum = np.cumsum(tokens, dtype=np.float64)
    start, j = 0, int(len(tokens) > 0 and tokens[0] > cap)
    while start < len(tokens):
        base = csum[start - 1] if start else 0.0
        end = max(start + 1, int(np.searchsorted(csum, base + cap, side="right")))
        if j >= m:
            raise PlanError(
                f"level='inter': bucket {bucket} holds {int(tokens.sum())} tokens that cannot be cut in order "
                f"into {m} micro-batches of <= {cap:g} tokens; use level='interleaved', add micro-batches "
                "or raise the cap"
            )
        out[start:end] = j
        start, j = end, j + 1
    return out


def _contiguous_microbatches(bucket: np.ndarray, costs: np.ndarray, tokens: np.ndarray | None, k: int, m: int,
                             cap: float | None) -> np.ndarray:
    """Cut each bucket's samples, in original order, into m contiguous slices of ~equal cost;
    a bucket whose cost cut breaks the cap is re-cut first-fit by tokens."""
    order = stable_order(bucket, k)
    b, c = bucket[order], costs[order]
    total = np.bincount(b, weights=c, minlength=k)
    csum = np.cumsum(c)
    start_of = np.concatenate(([0.0], csum))[np.searchsorted(b, np.arange(k))]
    within = csum - c - start_of[b] + 0.5 * c
    frac = np.divide(within, total[b], out=np.zeros_like(within), where=total[b] > 0)
    mb = np.minimum((frac * m).astype(np.int64), m - 1)
    if cap is not None and tokens is not None:
        t = tokens[order]
        over = np.bincount(b * m + mb, weights=t, minlength=k * m).reshape(k, m) > cap
        for bb in np.flatnonzero(over.any(axis=1)).tolist():
            lo, hi = (int(x) for x in np.searchsorted(b, [bb, bb + 1]))
            mb[lo:hi] = _first_fit_in_order(t[lo:hi], cap, m, bb)
    out = np.empty_like(mb)
    out[order] = mb
    return out


def _interleaved(costs: np.ndarray, tokens: np.ndarray | None, k: int, m: int, cap: float | None, method: str,
                 keep_order: bool) -> tuple[np.ndarray, np.ndarray, _Cells]:
    """OVERLORD Alg. 1: pack into k·m capped bins, then deal the bins to buckets, m each.

    Also returns the (k, m) cost / token sums, taken from the bin sums it keeps anyway, so
    `balance_step` need not sum all samples again.
    """
    fn = get_balancer(method)
    n, nbins = costs.shape[0], k * m
    bins, bin_cost, bin_tok = _partition_sums(method, costs, nbins, tokens=tokens, cap=cap)
    bin_bucket = fn(bin_cost, k, tokens=None, cap=None, sizes=np.full(k, m, dtype=np.int64))
    if k > 1 and n:
        _refine(bins, bin_bucket, bin_cost, bin_tok, costs, tokens, cap, k)
    if keep_order:  # micro-batches of a bucket follow the sample stream: ordered by first sample
        key = np.full(nbins, n, dtype=np.int64)
        np.minimum.at(key, bins, np.arange(n, dtype=np.int64))
    else:  # heaviest micro-batch first
        key = -bin_cost
    # bins by (bucket, key): a stable 16-bit radix sort by bucket after a sort by key (≈ lexsort, cheaper)
    by_key = np.argsort(key.astype(np.uint16) if keep_order and n < 65535 else key, kind="stable")
    rank = by_key[np.argsort(bin_bucket[by_key].astype(np.uint16 if k < 65536 else np.int64), kind="stable")]
    mb_of_bin = np.empty(nbins, dtype=np.int64)
    mb_of_bin[rank] = np.arange(nbins, dtype=np.int64) % m
    cell = bin_bucket * m + mb_of_bin  # one bin per (bucket, micro-batch): a permutation
    cell_cost = np.empty(nbins)
    cell_cost[cell] = bin_cost
    cell_tok = None
    if bin_tok is not None:
        cell_tok = np.empty(nbins)
        cell_tok[cell] = bin_tok
    return bin_bucket[bins], mb_of_bin[bins], (cell_cost, cell_tok)


def _refine(bins: np.ndarray, bin_bucket: np.ndarray, bin_cost: np.ndarray, bin_tok: np.ndarray | None,
            costs: np.ndarray, tokens: np.ndarray | None, cap: float | None, k: int, *, tol: float = 1e-3) -> None:
    """Move single samples from the heaviest bucket to the lightest (into a bin with room).

    Dealing whole bins m per bucket cannot split a bin that holds one very long sample, so
    that bucket ends up heavy; moving a few of its small samples out fixes it. Each move
    takes the sample closest to half the gap, so the maximum strictly drops. Updates `bins`,
    `bin_cost` and `bin_tok` in place; bucket sums come from the bin sums, so a balanced deal
    returns after O(k·m) work.
    """
    bucket_cost = np.bincount(bin_bucket, weights=bin_cost, minlength=k)
    mean = float(bucket_cost.mean())
    if cap is None:
        bin_tok = None
    bucket_of = None
    for _ in range(4 * k):
        h, lo = int(np.argmax(bucket_cost)), int(np.argmin(bucket_cost))
        gap = float(bucket_cost[h] - bucket_cost[lo])
        if gap <= tol * mean:
            return
        if bucket_of is None:
            bucket_of = bin_bucket[bins]
        dest_bins = np.flatnonzero(bin_bucket == lo)
        cand = np.flatnonzero((bucket_of == h) & (costs < gap))
        if bin_tok is not None and cand.size:
            cand = cand[tokens[cand] <= cap - bin_tok[dest_bins].min()]
        if cand.size == 0:
            return
        i = int(cand[np.argmin(np.abs(costs[cand] - 0.5 * gap))])
        if bin_tok is None:
            j = int(dest_bins[np.argmin(bin_cost[dest_bins])])
        else:
            fits = dest_bins[bin_tok[dest_bins] + tokens[i] <= cap]
            j = int(fits[np.argmin(bin_cost[fits])])
            bin_tok[bins[i]] -= tokens[i]
            bin_tok[j] += tokens[i]
        bin_cost[bins[i]] -= costs[i]
        bin_cost[j] += costs[i]
        bucket_cost[h] -= costs[i]
        bucket_cost[lo] += costs[i]
        bins[i], bucket_of[i] = j, lo


def _check_groups(groups: Sequence[Sequence[int]], k: int) -> list[np.ndarray]:
    out = [np.asarray(g, dtype=np.int64) for g in groups]
    flat = np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)
    if any(g.size == 0 for g in out) or not np.array_equal(flat, np.arange(k)):
        raise ConfigError(f"`groups` must partition buckets 0..{k - 1} into non-empty groups, got {groups!r}")
    return out


def _solve(costs: np.ndarray, tok: np.ndarray | None, k: int, m: int, cap: float | None, method: str,
           level: str, keep_order: bool) -> tuple[np.ndarray, np.ndarray, _Cells]:
    """(bucket, microbatch, cell sums or None) of every item for one level over k buckets
    (inputs already checked)."""
    n = costs.shape[0]
    if level == "none":
        return (*_vanilla(n, k, m), None)
    if level == "interleaved":
        return _interleaved(costs, tok, k, m, cap, method, keep_order)
    fn = get_balancer(method)
    if level == "inter":
        bucket = fn(costs, k, tokens=tok, cap=None if cap is None else cap * m, sizes=None)
        if m == 1 and (cap is None or tok is None):  # one uncapped microbatch a bucket (the encoder's images
            return bucket, np.zeros(n, dtype=np.int64), None  # each step): nothing to cut; capped, the cut checks
        return bucket, _contiguous_microbatches(bucket, costs, tok, k, m, cap), None
    bucket, _ = _vanilla(n, k, m)  # intra: vanilla membership, balanced micro-batches inside
    microbatch = np.empty(n, dtype=np.int64)
    bounds = np.searchsorted(bucket, np.arange(k + 1))
    for b in range(k):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        microbatch[lo:hi] = fn(costs[lo:hi], m, tokens=None if tok is None else tok[lo:hi], cap=cap, sizes=None)
    return bucket, microbatch, None


def _grouped(costs: np.ndarray, tok: np.ndarray | None, members: list[np.ndarray], m: int, cap: float | None,
             method: str, level: str, keep_order: bool) -> tuple[np.ndarray, np.ndarray]:
    """Balance over groups first (super-buckets weighted by size), then inside each group."""
    n = costs.shape[0]
    gsize = np.array([g.size for g in members], dtype=np.float64)
    gcap = None if cap is None else cap * m * gsize
    if np.all(gsize == gsize[0]):
        group_of = get_balancer(method)(costs, len(members), tokens=tok, cap=None if gcap is None else gcap[0],
                                        sizes=None)
    else:
        group_of = greedy_core(costs, len(members), tokens=tok, cap=gcap, sizes=None, weights=gsize)
    bucket, microbatch = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    order = stable_order(group_of, len(members))
    bounds = np.searchsorted(group_of[order], np.arange(len(members) + 1))
    for g, mem in enumerate(members):
        sub = order[bounds[g] : bounds[g + 1]]
        b, mb, _ = _solve(costs[sub], None if tok is None else tok[sub], mem.size, m, cap, method, level, keep_order)
        bucket[sub], microbatch[sub] = mem[b], mb
    return bucket, microbatch


def balance_step(
    costs: np.ndarray,
    *,
    tokens: np.ndarray | None,
    num_buckets: int,
    num_microbatches: int,
    cap: float | None = None,
    method: str = "kk",
    level: Level | str = "interleaved",
    keep_order: bool = True,
    groups: Sequence[Sequence[int]] | None = None,
) -> BalanceResult:
    """Assign one global batch to buckets (e.g. DP ranks) and their micro-batches.

    Levels: ``none`` — Megatron's order, contiguous equal-count slices (no cap); ``inter`` —
    balanced bucket membership, contiguous in-order micro-batches; ``intra`` — vanilla buckets,
    balanced micro-batches inside each; ``interleaved`` — Alg. 1 over all k·m bins. With more
    than one group, samples are first balanced over groups (weighted by group size), then
    within each group — fewer buckets per solve, as the paper's ``group_size``.
    """
    k, m = int(num_buckets), int(num_microbatches)
    if level not in get_args(Level):
        raise ConfigError(f"unknown balance level {level!r}; known levels: {list(get_args(Level))}")
    if k <= 0 or m <= 0:
        raise ConfigError(f"`num_buckets` and `num_microbatches` must be >= 1, got {k} and {m}")
    get_balancer(method)
    costs, tok, _ = check_inputs(costs, 1, tokens, cap, None)
    if tok is not None and cap is not None and level != "none" and tok.size and tok.max() > cap:
        raise no_room(int(np.argmax(tok > cap)), tok, Bins(load=np.zeros(1), cap=cap_array(cap, 1)))
    capf = None if cap is None else float(cap)
    cells: _Cells = None
    if groups is not None and len(groups) > 1 and level != "none":
        bucket, microbatch = _grouped(costs, tok, _check_groups(groups, k), m, capf, method, level, keep_order)
    else:
        bucket, microbatch, cells = _solve(costs, tok, k, m, capf, method, level, keep_order)
    if cells is None:
        flat = bucket * m + microbatch
        cell_cost = np.bincount(flat, weights=costs, minlength=k * m)
        cell_tok = None if tok is None else np.bincount(flat, weights=tok, minlength=k * m)
    else:
        cell_cost, cell_tok = cells
    bin_cost = cell_cost.reshape(k, m)
    bin_tokens = None if cell_tok is None else np.rint(cell_tok).astype(np.int64).reshape(k, m)
    return BalanceResult(bucket=bucket, microbatch=microbatch, bucket_cost=bin_cost.sum(axis=1), bin_cost=bin_cost,
                         bin_tokens=bin_tokens, keep_order=keep_order, costs=costs)
