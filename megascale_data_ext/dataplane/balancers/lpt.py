"""Greedy (LPT): the largest item to the least-loaded bin, in vectorized rounds.

Why not a textbook heap: the planner runs every step on ~20k samples and ~25k images, and a
Python heap pays a microsecond per item. Here LPT works in *rounds*: the next r largest items
go, largest first, to the r least-loaded bins (one 16-bit radix sort of the loads per round),
which keeps LPT's guarantee that the spread never exceeds the largest spread inside a round.
Small items are *water-filled* in bulk (prefix sums searched against each bin's deficit to a
common level), overshooting a bin by at most one item; uncapped, the tail goes in up to three
passes of decreasing item size. A token cap is enforced after each vectorized pass; the few
items that broke it are re-placed one by one into the least-loaded bin that still has room.
Equal bin sizes without a cap are merged as sorted k-tuples (`merge.merge_rows`).
"""

from __future__ import annotations

import numpy as np

from megascale_data_ext.dataplane.balancers.bins import Bins, cap_array, no_room
from megascale_data_ext.dataplane.balancers.merge import merge_rows

__all__ = ["evict_over_cap", "greedy", "greedy_core", "lpt_onto"]

#: Items cheaper than this fraction of the mean bin load are water-filled instead of sorted.
TAIL_FRACTION = 0.01
#: At most this many LPT rounds (× bins) of head items before the tail is water-filled.
HEAD_ROUNDS = 16
#: Uncapped greedy: at most this many LPT rounds before the sorted tail is water-filled in passes.
SORTED_HEAD_ROUNDS = 4
#: A water-fill pass stops where the items after it sum to this many times the spread it may leave.
RESERVE_FACTOR = 1.0
#: At most this many water-fill passes over the sorted tail (the last takes what is left).
MAX_FILL_PASSES = 3

_EXACT_SORT_BELOW = 512


def _order_desc(values: np.ndarray) -> np.ndarray:
    """Indices by descending value, ties by index.

    Large arrays are ranked on a 16-bit linear key, which numpy sorts by radix in O(n) (≈10×
    faster than a float sort at 20k items); items closer than 1/65535 of the largest keep index
    order, which moves LPT by at most that much per misordered pair.
    """
    n = values.shape[0]
    if n < _EXACT_SORT_BELOW:
        return np.argsort(-values, kind="stable")
    hi = float(values.max())
    scale = 65535.0 / hi if hi > 0 else 0.0
    key = values * -scale  # values >= 0 (checked by partition)
    key += 65535.0
    return np.argsort(key.astype(np.uint16), kind="stable")


def _order_asc(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Indices by ascending value, given its min and max (16-bit linear key for large arrays,
    see `_order_desc`; equal values need no sort)."""
    n = values.shape[0]
    if hi <= lo:
        return np.arange(n)
    if n < _EXACT_SORT_BELOW:
        return np.argsort(values, kind="stable")
    key = values - lo
    key *= 65535.0 / (hi - lo)
    return np.argsort(key.astype(np.uint16), kind="stable")


def _rounds(order: np.ndarray, costs: np.ndarray, tokens: np.ndarray | None, bins: Bins, out: np.ndarray,
            *, lpt: bool) -> None:
    """LPT in rounds over `order` (descending cost): r items to the r least-loaded eligible bins.

    A bin is eligible while it has count left and (with `lpt`) its level is within the next
    item's cost of the lowest level: LPT would hand every item of the round to such bins,
    never to one that is already ahead by more than the item itself.
    """
    pos, n = 0, order.shape[0]
    wmin = 1.0 if bins.weight is None else float(bins.weight.min())
    capped = bins.tok is not None and tokens is not None
    # Gathered once in round order: each round then takes slices (views), not fancy indexes.
    cs = costs[order]
    ts = tokens[order] if capped else None
    cap = bins.cap
    if capped and np.all(cap == cap[0]):
        cap = float(cap[0])  # one cap for all bins: compare with a scalar, skip a gather per round
    while pos < n:
        level = bins.level()
        if bins.left is None:  # the common case: one sort of all bins, eligible ones are a prefix
            lo, hi = float(level.min()), float(level.max())
            cand = _order_asc(level, lo, hi)
            if lpt and hi > lo + cs[pos] / wmin:
                cand = cand[: int(np.count_nonzero(level <= lo + cs[pos] / wmin))]
        else:
            open_ = bins.left > 0
            if not open_.any():
                raise no_room(int(order[pos]), tokens, bins)
            if lpt:
                open_ &= level <= level[open_].min() + cs[pos] / wmin
            cand = np.flatnonzero(open_)
            sub = level[cand]
            cand = cand[_order_asc(sub, float(sub.min()), float(sub.max()))]
        r = min(cand.shape[0], n - pos)
        items, dest, c = order[pos : pos + r], cand[:r], cs[pos : pos + r]
        t = ts[pos : pos + r] if capped else None
        pos += r
        late = None
        if capped:
            fits = bins.tok[dest] + t <= (cap if isinstance(cap, float) else cap[dest])
            if not fits.all():
                late = items[~fits]
                items, dest, c, t = items[fits], dest[fits], c[fits], t[fits]
        out[items] = dest  # each bin gets at most one item per round: no duplicate indices
        bins.load[dest] += c
        if capped:
            bins.tok[dest] += t
        if bins.left is not None:
            bins.left[dest] -= 1
        if late is not None:
            for i in late.tolist():
                out[i] = bins.place_one(i, float(costs[i]), tokens)


def _deficits(bins: Bins, total: float, room_cost: np.ndarray | None) -> np.ndarray:
    """Cost each bin should receive so all reach one level λ: Σ_j clip(λ·w_j − L_j, 0, room_j) = total.

    Without a cap the level is exact (bins scanned by ascending level); with one, each bin's
    share is also bounded by the cost its remaining tokens can carry (λ from the breakpoints).
    """
    k = bins.load.shape[0]
    if room_cost is None and bins.weight is None:  # the common case, in the fewest numpy calls
        ls = np.sort(bins.load)
        lam = np.cumsum(ls)
        lam += total
        lam /= np.arange(1, k + 1)
        fits = np.append(lam[:-1] <= ls[1:], True)  # the j+1 lowest bins take it all below bin j+1
        return np.maximum(lam[int(np.argmax(fits))] - bins.load, 0.0)
    w = np.ones(k) if bins.weight is None else bins.weight
    lvl = bins.level()
    if room_cost is None:
        by = np.argsort(lvl, kind="stable")
        ls, ws = lvl[by], w[by]
        lam = (total + np.cumsum(ls * ws)) / np.cumsum(ws)  # level if the j+1 lowest bins take it all
        j = int(np.argmax(lam <= np.append(ls[1:], np.inf)))
        return np.maximum(0.0, lam[j] * w - bins.load)
    if room_cost.sum() <= total:  # cannot fit by this estimate: fill by room, repair sorts it out
        return room_cost * (total / max(float(room_cost.sum()), 1e-300))
    # f(λ) is piecewise linear: slope +w_j from L_j/w_j until (L_j + room_j)/w_j. Walk the breakpoints.
    pts = np.concatenate((lvl, (bins.load + room_cost) / w))
    order = np.argsort(pts, kind="stable")
    p = pts[order]
    slope = np.cumsum(np.concatenate((w, -w))[order])
    f = np.concatenate(([0.0], np.cumsum(slope[:-1] * np.diff(p))))
    i = min(int(np.searchsorted(f, total, side="right")) - 1, p.shape[0] - 2)
    lam = p[i] + (total - f[i]) / slope[i] if slope[i] > 0 else p[i + 1]
    return np.minimum(np.maximum(0.0, lam * w - bins.load), room_cost)


def _water_fill(items: np.ndarray, costs: np.ndarray, tokens: np.ndarray | None, bins: Bins,
                out: np.ndarray, *, passes: int = 3) -> None:
    """Give small items (in their given order) to bins so all reach one level, in bulk.

    A bin overshoots its deficit by at most one item. Under a cap the deficits are bounded by
    each bin's token room (at the tail's average cost per token); items that still overflow
    are evicted and water-filled again, and the last few placed one by one.
    """
    k = bins.load.shape[0]
    capped = bins.tok is not None and tokens is not None
    for attempt in range(passes):
        if items.shape[0] == 0:
            return
        c = costs[items]
        total = float(c.sum())
        if total <= 0.0:
            dest = np.argsort(bins.level(), kind="stable")[np.arange(items.shape[0]) % k]
        else:
            deficit = _deficits(bins, total, None)
            if capped:
                rho = total / max(float(tokens[items].sum()), 1.0)
                room = np.maximum(0.0, bins.cap - bins.tok) * rho
                if np.any(deficit > room):  # else the unbounded level already respects every room
                    deficit = _deficits(bins, total, room)
            # item -> bin whose deficit interval holds its midpoint (k searches in the midpoints, not n)
            mid = np.cumsum(c)
            mid -= 0.5 * c
            pos = np.searchsorted(mid, np.cumsum(deficit)[: k - 1], side="left")
            dest = np.repeat(np.arange(k, dtype=np.int64), np.diff(pos, prepend=0, append=c.shape[0]))
        out[items] = dest
        bins.load += np.bincount(dest, weights=c, minlength=k)
        if not capped:
            return
        bins.tok += np.bincount(dest, weights=tokens[items], minlength=k)
        items = evict_over_cap(items, costs, tokens, bins, out)
    for i in items[np.argsort(-tokens[items], kind="stable")].tolist():
        out[i] = bins.place_one(i, float(costs[i]), tokens)


def evict_over_cap(items: np.ndarray, costs: np.ndarray, tokens: np.ndarray, bins: Bins,
                   out: np.ndarray) -> np.ndarray:
    """Take `items` out of over-cap bins (each bin keeps its earliest ones); return them."""
    over = bins.tok > bins.cap
    if not over.any():
        return items[:0]
    sub = items[over[out[items]]]
    sub = sub[np.argsort(out[sub], kind="stable")]
    b = out[sub]
    t = tokens[sub].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    csum = np.cumsum(t)
    before = np.repeat(csum[starts] - t[starts], np.diff(np.r_[starts, b.shape[0]]))
    kept_tok = bins.tok[b] - np.bincount(b, weights=t, minlength=bins.tok.shape[0])[b]
    evict = sub[kept_tok + (csum - before) > bins.cap[b]]
    np.subtract.at(bins.load, out[evict], costs[evict])
    np.subtract.at(bins.tok, out[evict], tokens[evict])
    if bins.left is not None:
        np.add.at(bins.left, out[evict], 1)
    out[evict] = -1
    return np.sort(evict)


def _tree_merge(costs: np.ndarray, k: int) -> np.ndarray:
    """Equal sizes, no cap: sorted chunks of k items, merged by `merge_rows`."""
    order = _order_desc(costs)
    out = np.empty(costs.shape[0], dtype=np.int64)
    out[order] = merge_rows(costs[order].reshape(-1, k)).reshape(-1)
    return out


def _quantile_estimate(values: np.ndarray, q: float) -> float:
    """The q-quantile of a strided sample of ≤ 4096 values: O(n/stride), enough to size a head."""
    sample = values[:: max(1, values.shape[0] // 4096)]
    j = min(sample.shape[0] - 1, int(q * sample.shape[0]))
    return float(np.partition(sample, j)[j])


def greedy_core(costs: np.ndarray, k: int, *, tokens: np.ndarray | None, cap: float | np.ndarray | None,
                sizes: np.ndarray | None, weights: np.ndarray | None = None,
                bins: Bins | None = None, out: np.ndarray | None = None,
                items: np.ndarray | None = None) -> np.ndarray:
    """Greedy for `items` (default all) into `bins` (default k empty ones); bin per item in `out`.

    `out` holds -1 for items not placed; `weights` scale the bins' levels (groups of unequal
    size). The caller may pass `bins` to read the bins' cost and token sums afterwards.
    """
    n = costs.shape[0]
    if out is None:
        out = np.full(n, -1, dtype=np.int64)
    if bins is None:
        bins = Bins(load=np.zeros(k), weight=weights, cap=cap_array(cap, k),
                    tok=None if cap is None else np.zeros(k), left=None if sizes is None else sizes.copy())
    if sizes is None and (cap is None or tokens is None):
        _greedy_sorted(items, costs, k, bins, out)
        return out
    if sizes is not None:  # exact counts: no tail, every item takes a slot
        order = _order_desc(costs) if items is None else items[_order_desc(costs[items])]
        _rounds(order, costs, tokens, bins, out, lpt=False)
        return out
    c = costs if items is None else costs[items]
    wsum = float(k if weights is None else weights.sum())
    target = float(bins.load.sum() + c.sum()) / wsum
    threshold = TAIL_FRACTION * target * (1.0 if weights is None else float(weights.min()))
    if c.shape[0] > HEAD_ROUNDS * k:  # bound the sequential rounds; the tail error stays one item
        threshold = max(threshold, _quantile_estimate(c, 1.0 - HEAD_ROUNDS * k / c.shape[0]))
    # One sort: the head (items >= threshold) is its prefix, the tail its suffix, both descending.
    order = _order_desc(c)
    if items is not None:
        order = items[order]
    n_head = int(np.count_nonzero(c >= threshold))
    _rounds(order[:n_head], costs, tokens, bins, out, lpt=True)
    tail = order[n_head:]
    tail = np.sort(tail)  # the water-fill takes items in sample order
    if tail.shape[0] >= 4 * k:  # fill with the larger half, then even out with the smaller half
        fine = costs[tail] < _quantile_estimate(costs[tail], 0.5)
        _water_fill(tail[~fine], costs, tokens, bins, out)
        tail = tail[fine]
    _water_fill(tail, costs, tokens, bins, out)
    return out


def _greedy_sorted(todo: np.ndarray | None, costs: np.ndarray, k: int, bins: Bins, out: np.ndarray) -> None:
    """Uncapped LPT on one sorted copy: head by LPT, the tail water-filled in passes over slices.

    Sorting and gathering once lets every later step work on slices: one prefix sum serves all
    passes (a pass's per-bin load is a difference of two prefix sums, O(k)), a bin's items are
    a run expanded by `repeat`. The final spread is about the largest item of the last pass.
    """
    order = _order_desc(costs) if todo is None else todo[_order_desc(costs[todo])]
    cs = costs[order]
    n = cs.shape[0]
    weights = bins.weight
    wsum = float(k if weights is None else weights.sum())
    target = float(bins.load.sum() + cs.sum()) / wsum
    threshold = TAIL_FRACTION * target * (1.0 if weights is None else float(weights.min()))
    h = min(int(np.count_nonzero(cs >= threshold)), SORTED_HEAD_ROUNDS * k)
    dest = np.empty(n, dtype=np.int64)
    if h:
        _rounds(order[:h], costs, None, bins, out, lpt=True)
        dest[:h] = out[order[:h]]
    if n > h:
        prefix = np.empty(n + 1)
        prefix[0] = 0.0
        np.cumsum(cs, out=prefix[1:])
        spread_per_item = RESERVE_FACTOR * wsum / (1.0 if weights is None else float(weights.min()))
        a = h
        for _ in range(MAX_FILL_PASSES - 1):
            # A pass leaves bins up to one of its items apart; stop it where the smaller items
            # left behind can still even out that spread (`RESERVE_FACTOR`× over).
            b = int(np.searchsorted(prefix, prefix[n] - spread_per_item * cs[a], side="right")) - 1
            if b <= a or b >= n:
                break
            _fill_run(cs, prefix, a, b, bins, dest)
            a = b
        _fill_run(cs, prefix, a, n, bins, dest)
    out[order] = dest


def _fill_run(cs: np.ndarray, prefix: np.ndarray, a: int, b: int, bins: Bins, dest: np.ndarray) -> None:
    """Water-fill sorted items a..b-1 (uncapped): runs of consecutive items per bin, via prefix sums."""
    k = bins.load.shape[0]
    total = float(prefix[b] - prefix[a])
    if total <= 0.0:
        dest[a:b] = np.argsort(bins.level(), kind="stable")[np.arange(b - a) % k]
        return
    bounds = np.cumsum(_deficits(bins, total, None))[: k - 1] + prefix[a]
    # first item ending past each boundary, stepped over if its midpoint is still short (O(k))
    pos = np.searchsorted(prefix[a + 1 : b + 1], bounds, side="left")
    at = np.minimum(a + pos, b - 1)
    pos += (pos < b - a) & (prefix[at + 1] - 0.5 * cs[at] < bounds)
    edges = np.concatenate(([0], pos, [b - a]))
    dest[a:b] = np.repeat(np.arange(k, dtype=np.int64), np.diff(edges))
    bins.load += np.diff(prefix[a + edges])


def greedy(costs: np.ndarray, k: int, *, tokens: np.ndarray | None = None, cap: float | None = None,
           sizes: np.ndarray | None = None) -> np.ndarray:
    """LPT (largest item to the least-loaded bin), in vectorized rounds plus a water-filled tail."""
    if sizes is not None and cap is None and np.all(sizes == sizes[0]) and costs.shape[0] == k * int(sizes[0]):
        return _tree_merge(costs, k) if costs.shape[0] else np.zeros(0, dtype=np.int64)
    return greedy_core(costs, k, tokens=tokens, cap=cap, sizes=sizes)


def lpt_onto(costs: np.ndarray, base: np.ndarray) -> np.ndarray:
    """LPT for every item, no water-filled tail, onto bins that already carry `base`: the bin per
    item. What LPT's last items do (even out the bins to about the size of one) is the point where
    this is used, so the tail is placed item by item too, in rounds."""
    out = np.full(costs.shape[0], -1, dtype=np.int64)
    if costs.shape[0]:
        _rounds(np.argsort(-costs, kind="stable"), costs, None, Bins(load=np.array(base, dtype=np.float64)), out,
                lpt=True)
    return out
