"""Balance a step with as many micro-batches per bucket as its documents need (not exactly m).

Megatron's own data-side balancer (`BalancedCPScheduler`, ``--hybrid-context-parallel``) gives
every GPU the sequences that even out its cost and runs one forward/backward per sequence, so
ranks run different numbers of them; that is sound where the loss is averaged per token over the
whole step (``--calculate-per-token-loss``). `balance_variable_count` is the same freedom for the
planner: documents are partitioned over the buckets by cost (LPT in vectorized rounds), then each
bucket's documents are packed first-fit-decreasing into micro-batches under the token cap. A
micro-batch's fixed cost (`fixed`: kernel launches, the optimizer-free part of a forward/backward)
is what the freedom can cost, so it is charged per micro-batch while partitioning (spread per
token: a bucket of more tokens needs more micro-batches); then `improve_by_moves` lowers the most
expensive bucket while it can (paired rounds over many buckets at once, re-placing the cheapest
documents, single moves and swaps), and `packed_better` keeps the result only where it is cheaper
once packed. The cost model decides between this and exactly m micro-batches per bucket
(`levels.balance_step`): a caller plans this first, plans exactly m too only where this stays
above `lower_bound`, and keeps the cheaper by `step_cost` (as `bench balance --vs megatron` does:
`commands._vs_megatron.planner_per_token_gpu_costs`).
"""

from __future__ import annotations

import numpy as np

from megascale_data_ext.dataplane.balancers.lpt import greedy, lpt_onto
from megascale_data_ext.dataplane.balancers.microbatches import bucket_cost, members_by_bucket, packed_better
from megascale_data_ext.dataplane.balancers.levels import BalanceResult
from megascale_data_ext.errors import PlanError

__all__ = ["balance_variable_count", "improve_by_moves", "lower_bound", "step_cost"]

#: Documents of the most expensive bucket tried per move (each with a move and two swaps) ...
MOVE_CANDIDATES = 24
#: ... against each of this many of the cheapest buckets.
PARTNERS = 4
#: Partners tried where the cheapest PARTNERS give no move.
BROAD_PARTNERS = 16
#: Moves stop once the most expensive bucket is within this fraction of the mean (no cost
#: model is that exact; the last rounds would only buy digits).
CLOSE_ENOUGH = 1e-6
#: The cheapest documents re-placed when moves are stuck sum to this many times the excess.
REFILL_SPAN = 2.0
#: Only in the endgame: the most expensive bucket within this fraction of the mean (further off,
#: the cheapest documents are too many to re-place one by one, and rarely enough).
REFILL_WITHIN = 1e-3
#: Paired rounds (`_paired_exchanges`) from this many buckets on ...
PAIRED_MIN_BUCKETS = 16
#: ... while a round lowers the most expensive bucket by this fraction of the mean.
PAIRED_PROGRESS = 1e-5
#: A round takes the buckets above the mean by more than this fraction of the most expensive's excess.
PAIRED_TOP = 0.5
#: A round costs at most about this many (bucket, partner, document) tries ...
PAIRED_WORK = 1024
#: ... with this many of the cheapest buckets as partners of each expensive one.
PAIRED_PARTNERS = 4
#: After paired rounds, at most this many rounds one bucket at a time (each lowers one of the
#: buckets near the most expensive by little; paired rounds did the bulk).
FINISHING_ROUNDS = 16


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
    start = greedy(weight, k) if tokens.size else np.zeros(0, dtype=np.int64)
    improved = improve_by_moves(start, costs, tokens, k, cap, fixed)
    bucket, microbatch = packed_better(start, improved, costs, tokens, k, cap, fixed)
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


def _best_exchange(hi: int, tried: np.ndarray, members: list[np.ndarray], cost: np.ndarray, csum: np.ndarray,
                   tsum: np.ndarray, costs: np.ndarray, tokens: np.ndarray, fixed_load: np.ndarray, fixed: float,
                   cap: int, partners: int = 0) -> tuple | None:
    """The move or swap that most lowers the worse of bucket `hi` and one of the cheapest
    buckets: per partner (the `partners` cheapest, default PARTNERS) and tried document a, a
    plain move and swaps with the two documents of the partner whose costs are nearest to
    evening the two. All (partner, document, option) triples are costed at once; the first best
    in that order wins.
    Returns (worst, a, b or None, partner, new cost of hi, new cost of partner), or None."""
    want = min(partners or PARTNERS, cost.size)
    few = np.argpartition(cost, want - 1)[:want] if want < cost.size else np.arange(cost.size)
    cheapest = few[np.argsort(cost[few], kind="stable")].tolist()
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
    new_hi = fixed_load[hi] + bucket_cost(csum[hi] - ca3 + cb, tsum[hi] - ta3 + tb, fixed, cap)
    lo3 = partners[:, None, None]
    new_lo = fixed_load[lo3] + bucket_cost(csum[lo3] + ca3 - cb, tsum[lo3] + ta3 - tb, fixed, cap)
    worst = np.where(ok, np.maximum(new_hi, new_lo), np.inf)
    at = int(np.argmin(worst))
    if not float(worst.flat[at]) < cost[hi] - 1e-12:
        return None
    p, t, col = np.unravel_index(at, shape)
    b = None if col == 0 else int(other[p, t, col])
    return (float(worst.flat[at]), int(tried[t]), b, int(partners[p]), float(new_hi.flat[at]), float(new_lo.flat[at]))


def _paired_exchanges(bucket: np.ndarray, cost: np.ndarray, csum: np.ndarray, tsum: np.ndarray,
                      costs: np.ndarray, rank: np.ndarray, tokens: np.ndarray, fixed_load: np.ndarray, fixed: float,
                      cap: int, k: int, floor: float) -> int:
    """One round of exchanges between many buckets at once: each of the r most expensive buckets
    (those above the mean by more than PAIRED_TOP of the most expensive one's excess, and above
    `floor`, which no bucket can go below) against PAIRED_PARTNERS of the cheapest (the i-th most
    expensive against the i-th to i+PAIRED_PARTNERS-1-th cheapest), every move and swap costed as
    `_best_exchange` costs them, in one numpy pass (fewer documents tried per bucket where many
    buckets take part: PAIRED_WORK); each takes its best exchange that lowers the pair's worse
    bucket, the most expensive first where two want the same partner (the other takes its next
    best free one). Updates `bucket`, `cost`, `csum` and `tsum` in place; returns how many
    exchanges it made.

    A round is a few whole-array passes whatever r is, so the many small gaps the start leaves on
    hundreds of buckets close in a few rounds rather than one round per bucket."""
    n = bucket.size
    by_cost = np.argsort(cost, kind="stable")
    mean, top = float(cost.mean()), float(cost.max())
    limit = max(mean * (1 + CLOSE_ENOUGH), floor, mean + PAIRED_TOP * (top - mean))
    r = min(k // 2, int((cost > limit).sum()))
    if r == 0 or n == 0:
        return 0
    his = by_cost[::-1][:r]
    order = np.argsort(bucket * n + rank, kind="stable")  # documents by bucket, cheapest first within one
    count = np.bincount(bucket, minlength=k)
    start = np.cumsum(count) - count
    his = his[count[his] > 0]
    if not his.size:
        return 0
    p = min(PAIRED_PARTNERS, k - r)
    t = int(np.clip(PAIRED_WORK // (his.size * p), 4, MOVE_CANDIDATES))  # many buckets: fewer tries each
    los = by_cost[:max(r, p)]
    pos = (np.arange(t)[None, :] * (count[his][:, None] - 1)) // max(t - 1, 1)  # spread over hi's documents
    tried = order[start[his][:, None] + pos]  # (H, T)
    partner = los[(np.arange(his.size)[:, None] + np.arange(p)[None, :]) % los.size]  # (H, P)
    # Where a tried document's cost minus half the gap falls among each partner's sorted costs: one
    # searchsorted over all buckets' sorted costs, each bucket's shifted to its own unit interval.
    scale = 4.0 * max(float(costs.max()), 1e-300)
    keyed = bucket[order] + costs[order] / scale
    ca, ta = costs[tried][:, None, :], tokens[tried][:, None, :]  # (H, 1, T)
    half = 0.5 * (cost[his][:, None] - cost[partner])[:, :, None]  # (H, P, 1)
    lo3 = partner[:, :, None]
    want = lo3 + np.clip((ca - half) / scale, 0.0, 0.5)
    j = np.searchsorted(keyed, want, side="left") - start[lo3]  # (H, P, T): partner documents cheaper than that
    nl = count[lo3]
    shape = (his.size, p, t, 3)
    other = np.full(shape, -1, dtype=np.int64)
    cb, tb = np.zeros(shape), np.zeros(shape, dtype=np.int64)
    ok = np.zeros(shape, dtype=bool)
    ok[..., 0] = True
    for c, x in ((1, j - 1), (2, j)):
        x = np.minimum(np.maximum(x, 0), np.maximum(nl - 1, 0))
        ids = order[np.minimum(start[lo3] + x, n - 1)]
        other[..., c] = ids
        cb[..., c] = np.where(nl > 0, costs[ids], 0.0)
        tb[..., c] = np.where(nl > 0, tokens[ids], 0)
        ok[..., c] = (nl > 0) & (cb[..., c] < ca)
    ca4, ta4 = ca[..., None], ta[..., None]
    hi4, lo4 = his[:, None, None, None], partner[:, :, None, None]
    new_hi = fixed_load[hi4] + bucket_cost(csum[hi4] - ca4 + cb, tsum[hi4] - ta4 + tb, fixed, cap)
    new_lo = fixed_load[lo4] + bucket_cost(csum[lo4] + ca4 - cb, tsum[lo4] + ta4 - tb, fixed, cap)
    worst = np.where(ok, np.maximum(new_hi, new_lo), np.inf).reshape(his.size, p, -1)
    choice = np.argmin(worst, axis=2)  # per (hi, partner): its best document and option
    worst = np.take_along_axis(worst, choice[:, :, None], axis=2)[:, :, 0]  # (H, P)
    worst[worst >= cost[his][:, None] - 1e-12] = np.inf  # no gain
    chosen = np.full(his.size, -1)
    taken = np.zeros(k, dtype=bool)
    for _ in range(p):  # most expensive first; who loses a partner takes its next best free one
        waiting = np.flatnonzero(chosen < 0)
        free = np.where(taken[partner[waiting]], np.inf, worst[waiting])
        q = np.argmin(free, axis=1)
        has = np.isfinite(free[np.arange(waiting.size), q])
        waiting, q = waiting[has], q[has]
        if not waiting.size:
            break
        first = np.unique(partner[waiting, q], return_index=True)[1]
        chosen[waiting[first]] = q[first]
        taken[partner[waiting[first], q[first]]] = True
    h = np.flatnonzero(chosen >= 0)
    if not h.size:
        return 0
    q = chosen[h]
    ti, c = np.unravel_index(choice[h, q], (t, 3))
    lo = partner[h, q]
    hi = his[h]
    a = tried[h, ti]
    swap = c > 0
    b = other[h, q, ti, c][swap]
    cost[hi], cost[lo] = new_hi[h, q, ti, c], new_lo[h, q, ti, c]
    bucket[a] = lo
    bucket[b] = hi[swap]
    for ids, src, dst in ((a, hi, lo), (b, lo[swap], hi[swap])):
        np.add.at(csum, src, -costs[ids])
        np.add.at(csum, dst, costs[ids])
        np.add.at(tsum, src, -tokens[ids])
        np.add.at(tsum, dst, tokens[ids])
    return int(h.size)


def _refill_cheapest(bucket: np.ndarray, cost: np.ndarray, costs: np.ndarray, tokens: np.ndarray,
                     fixed_load: np.ndarray, fixed: float, cap: int, k: int) -> np.ndarray | None:
    """Ruin and recreate where single moves and swaps are stuck (the expensive buckets hold only
    large documents): every bucket above the mean gives up its cheapest documents until it is
    not, the cheapest documents of all buckets (summing to REFILL_SPAN × what the buckets stand
    above the mean) join them, and all go back largest first onto the least loaded (LPT with a
    LPT), so the small ones even out the rest to about the size of one. Returns
    the new buckets, or None where that is not cheaper."""
    mean = float(cost.mean())
    if float(cost.max()) > mean * (1 + REFILL_WITHIN):
        return None
    excess = float((cost.max() - cost).sum())
    by_cost = np.argsort(costs, kind="stable")
    take = np.zeros(bucket.size, dtype=bool)
    take[by_cost[: int(np.searchsorted(np.cumsum(costs[by_cost]), REFILL_SPAN * excess)) + 1]] = True
    # Per bucket, its documents cheapest first: those whose running sum stays under its excess, and one more.
    order = np.lexsort((costs, bucket))
    run = np.cumsum(costs[order])
    ends = np.cumsum(np.bincount(bucket, minlength=k))
    before = np.concatenate(([0.0], run[ends[:-1] - 1]))[bucket[order]]  # the sum of earlier buckets
    over = (cost - mean)[bucket[order]]
    take[order[(run - costs[order] - before) < over]] = True
    if take.all() or not take.any():
        return None
    trial = bucket.copy()
    trial[take] = -1
    kept = ~take
    csum = np.bincount(trial[kept], weights=costs[kept], minlength=k)
    tsum = np.bincount(trial[kept], weights=tokens[kept], minlength=k).astype(np.int64)
    pool = np.flatnonzero(take)
    trial[pool] = lpt_onto(costs[pool], fixed_load + bucket_cost(csum, tsum, fixed, cap))
    new = fixed_load + bucket_cost(np.bincount(trial, weights=costs, minlength=k),
                              np.bincount(trial, weights=tokens, minlength=k).astype(np.int64), fixed, cap)
    return trial if new.max() < cost.max() - 1e-12 else None


def improve_by_moves(bucket: np.ndarray, costs: np.ndarray, tokens: np.ndarray, k: int, cap: int, fixed: float,
                     rounds: int | None = None, base: np.ndarray | None = None) -> np.ndarray:
    """Lower the most expensive bucket while possible, until it is within CLOSE_ENOUGH of the mean.

    A bucket's cost while moving: its documents' costs plus `fixed` per micro-batch its tokens
    need at least (first-fit decreasing, run once at the end, rarely needs more with short
    documents); sums per bucket make each try O(1). `base`: what each bucket already carries that
    cannot move (a hybrid-CP plan's shares of long documents). In turn, each only where the one
    before left the most expensive bucket above that:
    1. from PAIRED_MIN_BUCKETS buckets, rounds of `_paired_exchanges` (every expensive bucket with
       a cheap one at once) while they lower the most expensive bucket;
    2. `_refill_cheapest` (the cheapest documents re-placed, where only large ones are left to move);
    3. one bucket at a time: move one of the most expensive bucket's documents to one of the
       cheapest buckets, or swap one for a cheaper document there (the pair whose difference is
       closest to half the gap), trying the BROAD_PARTNERS cheapest and all its documents where
       the PARTNERS cheapest and MOVE_CANDIDATES of its documents give nothing;
    4. `_refill_cheapest` again, where 3 moved anything."""
    bucket = bucket.copy()
    fixed_load = np.zeros(k) if base is None else np.asarray(base, dtype=np.float64)
    floor = float(fixed_load.max())  # the most expensive bucket costs at least this: no need to go lower

    def sums() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        csum = np.bincount(bucket, weights=costs, minlength=k).astype(np.float64)
        tsum = np.bincount(bucket, weights=tokens, minlength=k).astype(np.int64)
        return csum, tsum, fixed_load + bucket_cost(csum, tsum, fixed, cap)

    def above(cost: np.ndarray) -> bool:
        return float(cost.max()) > max(float(cost.mean()) * (1 + CLOSE_ENOUGH), floor)

    def refill(cost: np.ndarray) -> np.ndarray | None:
        return _refill_cheapest(bucket, cost, costs, tokens, fixed_load, fixed, cap, k) if above(cost) else None

    csum, tsum, cost = sums()
    budget = rounds or 8 * k
    if k >= PAIRED_MIN_BUCKETS:
        rank = np.empty(costs.size, dtype=np.int64)
        rank[np.argsort(costs, kind="stable")] = np.arange(costs.size)
        while budget > 0 and above(cost):
            top = float(cost.max())
            changed = _paired_exchanges(bucket, cost, csum, tsum, costs, rank, tokens, fixed_load, fixed, cap, k,
                                        floor)
            budget -= 1
            if not changed or float(cost.max()) > top - PAIRED_PROGRESS * float(cost.mean()):
                break
    if (refilled := refill(cost)) is not None:
        bucket = refilled
        csum, tsum, cost = sums()
    if not above(cost):
        return bucket
    members = members_by_bucket(bucket, k)
    moved = False
    for _ in range(budget if k < PAIRED_MIN_BUCKETS else min(budget, FINISHING_ROUNDS)):
        hi = int(np.argmax(cost))
        if not members[hi].size or not above(cost):
            break
        ranked = members[hi][np.argsort(costs[members[hi]], kind="stable")]
        t = min(len(ranked), MOVE_CANDIDATES)
        tried = ranked[(np.arange(t) * (len(ranked) - 1)) // max(t - 1, 1)]
        best = _best_exchange(hi, tried, members, cost, csum, tsum, costs, tokens, fixed_load, fixed, cap)
        if best is None:  # stuck among the cheapest few: more of them, and every document of hi
            best = _best_exchange(hi, ranked, members, cost, csum, tsum, costs, tokens, fixed_load, fixed, cap,
                                  partners=BROAD_PARTNERS)
        if best is None:
            break
        _, a, b, lo, cost[hi], cost[lo] = best
        for i, src, dst in [(a, hi, lo)] + ([] if b is None else [(b, lo, hi)]):
            bucket[i] = dst
            csum[src] -= costs[i]
            csum[dst] += costs[i]
            tsum[src] -= tokens[i]
            tsum[dst] += tokens[i]
            members[src] = members[src][members[src] != i]
            members[dst] = np.append(members[dst], i)
        moved = True
    refilled = refill(cost) if moved else None
    return bucket if refilled is None else refilled
