"""Balance a step with as many micro-batches per bucket as its documents need (not exactly m).

Megatron's own data-side balancer (`BalancedCPScheduler`, ``--hybrid-context-parallel``) gives
every GPU the sequences that even out its cost and runs one forward/backward per sequence, so
ranks run different numbers of them; that is sound where the loss is averaged per token over the
whole step (``--calculate-per-token-loss``). `balance_variable_count` is the same freedom for the
planner: documents are partitioned over the buckets by cost (KK), then each bucket's documents
are packed first-fit-decreasing into micro-batches under the token cap. A micro-batch's fixed
cost (`fixed`: kernel launches, the optimizer-free part of a forward/backward) is what the
freedom can cost, so it is charged per micro-batch while partitioning (spread per token: a
bucket of more tokens needs more micro-batches); then moves and swaps of single documents
lower the most expensive bucket while they can. The cost model decides between this and exactly
m micro-batches per bucket (`levels.balance_step`): a caller plans this first, plans exactly m too
only where this stays above `lower_bound`, and keeps the cheaper by `step_cost` (as `bench balance
--vs megatron` does: `commands._vs_megatron.planner_per_token_gpu_costs`).
"""

from __future__ import annotations

import numpy as np

from megascale_data_ext.dataplane.balancers.karmarkar_karp import kk
from megascale_data_ext.dataplane.balancers.levels import BalanceResult
from megascale_data_ext.errors import PlanError

__all__ = ["balance_variable_count", "improve_by_moves", "lower_bound", "pack_under_cap", "step_cost"]

#: Documents of the most expensive bucket tried per move (each with a move and two swaps) ...
MOVE_CANDIDATES = 24
#: ... against each of this many of the cheapest buckets.
PARTNERS = 4
#: Partners tried where the cheapest PARTNERS give no move.
BROAD_PARTNERS = 16
#: Moves stop once the most expensive bucket is within this fraction of the mean (no cost
#: model is that exact; the last rounds would only buy digits).
CLOSE_ENOUGH = 1e-5


def pack_under_cap(tokens: np.ndarray, members: np.ndarray, cap: int) -> np.ndarray:
    """First-fit decreasing of `members` (by tokens) into bins of at most `cap` tokens: each
    member's bin index."""
    order = members[np.argsort(-tokens[members], kind="stable")]
    room: list[int] = []
    out = np.empty(len(tokens), dtype=np.int64)
    for i in order.tolist():
        t = int(tokens[i])
        j = next((b for b, r in enumerate(room) if r >= t), None)
        if j is None:
            room.append(cap - t)
            j = len(room) - 1
        else:
            room[j] -= t
        out[i] = j
    return out[members]


def step_cost(res: BalanceResult, fixed: float) -> np.ndarray:
    """Per bucket: its documents' cost plus `fixed` per non-empty micro-batch."""
    k, m = res.bin_cost.shape
    used = np.bincount(res.bucket * m + res.microbatch, minlength=k * m).reshape(k, m) > 0
    return res.bucket_cost + fixed * used.sum(axis=1)


def balance_variable_count(costs: np.ndarray, tokens: np.ndarray, num_buckets: int, cap: int, *,
                           fixed: float = 0.0) -> BalanceResult:
    """Documents to buckets by cost, each bucket's packed under `cap` into as many micro-batches
    as it needs; `bin_cost` has as many columns as the fullest bucket (empty ones cost 0).

    Raises:
        PlanError: A document longer than `cap` (it fits no micro-batch).
    """
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    k = int(num_buckets)
    if tokens.size and int(tokens.max()) > cap:
        raise PlanError(f"a document of {int(tokens.max())} tokens exceeds the micro-batch cap {cap}")
    weight = costs + fixed * tokens / max(cap, 1)  # a micro-batch's fixed cost, spread over its tokens
    bucket = kk(weight, k) if tokens.size else np.zeros(0, dtype=np.int64)
    bucket = improve_by_moves(bucket, costs, tokens, k, cap, fixed)
    microbatch = np.zeros(len(tokens), dtype=np.int64)
    for b in range(k):
        members = np.flatnonzero(bucket == b)
        if members.size:
            microbatch[members] = pack_under_cap(tokens, members, cap)
    m = int(microbatch.max()) + 1 if tokens.size else 1
    bin_cost = np.zeros((k, m))
    bin_tokens = np.zeros((k, m))
    np.add.at(bin_cost, (bucket, microbatch), costs)
    np.add.at(bin_tokens, (bucket, microbatch), tokens)
    return BalanceResult(bucket=bucket, microbatch=microbatch, bucket_cost=bin_cost.sum(axis=1), bin_cost=bin_cost,
                         bin_tokens=bin_tokens, keep_order=True, costs=costs)


def lower_bound(costs: np.ndarray, tokens: np.ndarray, num_buckets: int, cap: int, fixed: float) -> float:
    """No plan with any number of micro-batches per bucket has a cheaper most expensive bucket: the
    mean bucket with the fewest micro-batches the tokens need, or the costliest document alone.
    Where exactly m per bucket already reaches it, the variable plan need not be made."""
    if not len(costs):
        return 0.0
    bins = -(-int(np.sum(tokens)) // cap)
    return max((float(np.sum(costs)) + fixed * bins) / num_buckets, float(np.max(costs)) + fixed)


def _total(c: np.ndarray, t: np.ndarray, fixed: float, cap: int) -> np.ndarray:
    """A bucket's cost from its documents' cost sum `c` and token sum `t`: `fixed` per
    micro-batch the tokens need at least; an empty bucket costs nothing."""
    return np.where(t > 0, c + fixed * -(-t // cap), 0.0)


def _best_exchange(hi: int, tried: np.ndarray, members: list[np.ndarray], cost: np.ndarray, csum: np.ndarray,
                   tsum: np.ndarray, costs: np.ndarray, tokens: np.ndarray, fixed_load: np.ndarray, fixed: float,
                   cap: int, partners: int = 0) -> tuple | None:
    """The move or swap that most lowers the worse of bucket `hi` and one of the cheapest
    buckets: per partner (the `partners` cheapest, default PARTNERS) and tried document a, a
    plain move and swaps with the two documents of the partner whose costs are nearest to
    evening the two. All (partner, document, option) triples are costed at once; the first best
    in that order wins.
    Returns (worst, a, b or None, partner, new cost of hi, new cost of partner), or None."""
    cheapest = np.argsort(cost, kind="stable")[:partners or PARTNERS].tolist()
    partners = np.array([lo for lo in cheapest if lo != hi], dtype=np.int64)
    if not partners.size:
        return None
    sizes = np.array([members[lo].size for lo in partners.tolist()])
    width = max(int(sizes.max()), 1)
    low_ids = np.zeros((partners.size, width), dtype=np.int64)
    low_costs = np.full((partners.size, width), np.inf)
    for p, lo in enumerate(partners.tolist()):
        ids = members[lo][np.argsort(costs[members[lo]], kind="stable")]
        low_ids[p, :ids.size], low_costs[p, :ids.size] = ids, costs[ids]
    ca, ta = costs[tried][None, :], tokens[tried][None, :]  # (1, T)
    half = 0.5 * (cost[hi] - cost[partners])[:, None]  # (P, 1)
    j = (low_costs[:, None, :] < (ca - half)[:, :, None]).sum(axis=2)  # searchsorted per partner: (P, T)
    last = np.maximum(sizes - 1, 0)[:, None]
    rows = np.arange(partners.size)[:, None]
    shape = (partners.size, tried.size, 3)
    cb, tb = np.zeros(shape), np.zeros(shape, dtype=np.int64)
    other, ok = np.full(shape, -1, dtype=np.int64), np.zeros(shape, dtype=bool)
    ok[:, :, 0] = True
    for col, x in ((1, np.minimum(np.maximum(j - 1, 0), last)), (2, np.minimum(j, last))):
        other[:, :, col] = low_ids[rows, x]
        cb[:, :, col] = np.where(sizes[:, None] > 0, low_costs[rows, x], 0.0)
        tb[:, :, col] = tokens[other[:, :, col]]
        ok[:, :, col] = (sizes[:, None] > 0) & (cb[:, :, col] < ca)
    ca3, ta3 = ca[:, :, None], ta[:, :, None]
    new_hi = fixed_load[hi] + _total(csum[hi] - ca3 + cb, tsum[hi] - ta3 + tb, fixed, cap)
    lo3 = partners[:, None, None]
    new_lo = fixed_load[lo3] + _total(csum[lo3] + ca3 - cb, tsum[lo3] + ta3 - tb, fixed, cap)
    worst = np.where(ok, np.maximum(new_hi, new_lo), np.inf)
    at = int(np.argmin(worst))
    if not float(worst.flat[at]) < cost[hi] - 1e-12:
        return None
    p, t, col = np.unravel_index(at, shape)
    b = None if col == 0 else int(other[p, t, col])
    return (float(worst.flat[at]), int(tried[t]), b, int(partners[p]), float(new_hi.flat[at]), float(new_lo.flat[at]))


def improve_by_moves(bucket: np.ndarray, costs: np.ndarray, tokens: np.ndarray, k: int, cap: int, fixed: float,
                     rounds: int | None = None, base: np.ndarray | None = None) -> np.ndarray:
    """Lower the most expensive bucket while possible: move one of its documents to one of the
    cheapest buckets, or swap one for a cheaper document there (the pair whose difference is
    closest to half the gap), trying the BROAD_PARTNERS cheapest where the PARTNERS cheapest give
    nothing. A bucket's cost while moving: its documents' costs plus `fixed` per micro-batch its
    tokens need at least (first-fit decreasing, run once at the end, rarely needs more with short
    documents); sums per bucket make each try O(1). `base`: what each bucket already carries that
    cannot move (a hybrid-CP plan's shares of long documents)."""
    bucket = bucket.copy()
    csum = np.bincount(bucket, weights=costs, minlength=k).astype(np.float64)
    tsum = np.bincount(bucket, weights=tokens, minlength=k).astype(np.int64)

    fixed_load = np.zeros(k) if base is None else np.asarray(base, dtype=np.float64)
    cost = fixed_load + _total(csum, tsum, fixed, cap)
    members = [np.flatnonzero(bucket == b) for b in range(k)]
    for _ in range(rounds or 8 * k):
        hi = int(np.argmax(cost))
        if not members[hi].size or cost[hi] <= cost.mean() * (1 + CLOSE_ENOUGH):
            break
        ranked = members[hi][np.argsort(costs[members[hi]], kind="stable")]
        tried = ranked[np.unique(np.linspace(0, len(ranked) - 1, min(len(ranked), MOVE_CANDIDATES)).astype(int))]
        best = _best_exchange(hi, tried, members, cost, csum, tsum, costs, tokens, fixed_load, fixed, cap)
        if best is None:  # stuck among the cheapest few: more of them
            best = _best_exchange(hi, tried, members, cost, csum, tsum, costs, tokens, fixed_load, fixed, cap,
                                  partners=BROAD_PARTNERS)
        if best is None:
            break
        _, a, b, lo, cost[hi], cost[lo] = best
        moved = [(a, hi, lo)] + ([] if b is None else [(b, lo, hi)])
        for i, src, dst in moved:
            bucket[i] = dst
            csum[src] -= costs[i]
            csum[dst] += costs[i]
            tsum[src] -= tokens[i]
            tsum[dst] += tokens[i]
            members[src] = members[src][members[src] != i]
            members[dst] = np.append(members[dst], i)
    return bucket
