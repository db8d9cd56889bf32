"""Balancers: split a step's samples into buckets and microbatch bins of near-equal cost.

Two layers:

* `partition(costs, k, method=...)` — number partitioning of items into k bins, with an
  optional per-bin token cap and optional exact bin sizes. Methods are registered by name
  (`register_balancer`); built in are ``greedy`` (LPT) and ``kk`` (Karmarkar–Karp largest
  differencing).
* `balance_step(costs, tokens=..., num_buckets=k, num_microbatches=m, level=...)` — the
  paper's levels (none / inter / intra / interleaved = OVERLORD Alg. 1), optionally first over
  groups of buckets (`distribute(axis, group_size)`).

Why not a textbook heap: the planner runs every step on ~20k samples and ~20k images, and a
Python heap pays a microsecond per item. Here LPT works in *rounds*: the next r largest items
go, largest first, to the r least-loaded bins (one sort of the bin loads per round), which
keeps the LPT guarantee that the spread of bin loads never exceeds the largest spread inside
a round. Items below 1% of the mean bin load form a tail that is *water-filled* in bulk
(cumsum + searchsorted against each bin's deficit to a common level), overshooting a bin by at
most one tail item. A token cap is enforced after each vectorized pass; the few items that
broke it are re-placed one by one into the least-loaded bin that still has room.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import numpy as np

from megascale_data_ext.errors import ConfigError, PlanError

__all__ = [
    "BalanceResult",
    "Balancer",
    "Level",
    "balance_step",
    "balancer_names",
    "get_balancer",
    "partition",
    "register_balancer",
]

Level = Literal["none", "inter", "intra", "interleaved"]

#: Items cheaper than this fraction of the mean bin load are water-filled instead of sorted.
TAIL_FRACTION = 0.01
#: Exact KK runs on at most this many of the largest items (× bins); the rest is greedy.
KK_HEAD_PER_BIN = 2
KK_HEAD_MAX = 4096


class Balancer(Protocol):
    """A partitioning method: returns the bin index (0..k-1) of every item."""

    def __call__(
        self,
        costs: np.ndarray,
        k: int,
        *,
        tokens: np.ndarray | None,
        cap: float | None,
        sizes: np.ndarray | None,
    ) -> np.ndarray: ...


# --------------------------------------------------------------------------- bin state


@dataclass(slots=True, kw_only=True)
class _Bins:
    """Running loads of k bins; `tok`/`left` exist only when a cap / sizes constrain them."""

    load: np.ndarray
    weight: np.ndarray | None = None
    tok: np.ndarray | None = None
    cap: float | None = None
    left: np.ndarray | None = None

    def level(self) -> np.ndarray:
        return self.load if self.weight is None else self.load / self.weight

    def place_one(self, i: int, cost: float, tokens: np.ndarray | None) -> int:
        """Least-loaded bin that still has room for item i (sequential fallback)."""
        ok = np.ones(self.load.shape[0], dtype=bool)
        if self.tok is not None and tokens is not None:
            ok &= self.tok + tokens[i] <= self.cap
        if self.left is not None:
            ok &= self.left > 0
        if not ok.any():
            raise _no_room(i, tokens, self)
        j = int(np.argmin(np.where(ok, self.level(), np.inf)))
        self.load[j] += cost
        if self.tok is not None and tokens is not None:
            self.tok[j] += tokens[i]
        if self.left is not None:
            self.left[j] -= 1
        return j


def _no_room(i: int, tokens: np.ndarray | None, bins: _Bins) -> PlanError:
    if tokens is not None and bins.cap is not None and tokens[i] > bins.cap:
        return PlanError(
            f"item {i} has {int(tokens[i])} tokens but the per-bin token cap is {bins.cap:g}: raise the cap "
            f"(context length / micro-batch token budget), or truncate or split that sample before balancing"
        )
    used = "" if bins.tok is None else f" (bins hold {int(bins.tok.sum())} tokens, cap {bins.cap:g} each)"
    return PlanError(
        f"item {i}" + ("" if tokens is None else f" ({int(tokens[i])} tokens)") + f" fits no bin{used}: "
        "the step has more tokens than its bins can hold; add micro-batches, raise the cap or sample fewer tokens"
    )


# --------------------------------------------------------------------------- greedy (LPT)


def _rounds(order: np.ndarray, costs: np.ndarray, tokens: np.ndarray | None, bins: _Bins, out: np.ndarray,
            *, target: float | None) -> None:
    """LPT in rounds over `order` (descending cost): r items to the r least-loaded eligible bins.

    A bin is eligible while it has count left and (if `target` is set) its level is below the
    target mean level — a bin already there would not be picked by LPT either.
    """
    pos, n = 0, order.shape[0]
    while pos < n:
        level = bins.level()
        eligible = np.ones(level.shape[0], dtype=bool) if bins.left is None else bins.left > 0
        if target is not None:
            below = eligible & (level < target)
            if below.any():
                eligible = below
        cand = np.flatnonzero(eligible)
        if cand.shape[0] == 0:
            raise _no_room(int(order[pos]), tokens, bins)
        cand = cand[np.argsort(level[cand], kind="stable")]
        r = min(cand.shape[0], n - pos)
        items, dest = order[pos : pos + r], cand[:r]
        pos += r
        if bins.tok is not None and tokens is not None:
            fits = bins.tok[dest] + tokens[items] <= bins.cap
            late = items[~fits]
            items, dest = items[fits], dest[fits]
        else:
            late = items[:0]
        out[items] = dest  # each bin gets at most one item per round: no duplicate indices
        bins.load[dest] += costs[items]
        if bins.tok is not None and tokens is not None:
            bins.tok[dest] += tokens[items]
        if bins.left is not None:
            bins.left[dest] -= 1
        for i in late.tolist():
            out[i] = bins.place_one(i, float(costs[i]), tokens)


def _water_fill(items: np.ndarray, costs: np.ndarray, tokens: np.ndarray | None, bins: _Bins,
                out: np.ndarray) -> None:
    """Give small items (in their given order) to bins so all reach one level, in bulk."""
    if items.shape[0] == 0:
        return
    c = costs[items]
    total = float(c.sum())
    k = bins.load.shape[0]
    w = np.ones(k) if bins.weight is None else bins.weight
    if total <= 0.0:
        dest = np.argsort(bins.level(), kind="stable")[np.arange(items.shape[0]) % k]
    else:
        # Level λ with Σ_j max(0, λ·w_j − L_j) = total: scan bins by ascending level.
        lvl = bins.level()
        by = np.argsort(lvl, kind="stable")
        ls, ws = lvl[by], w[by]
        cw, cl = np.cumsum(ws), np.cumsum(ls * ws)
        lam = (total + cl) / cw  # level if the j+1 lowest bins absorb everything
        nxt = np.append(ls[1:], np.inf)
        j = int(np.argmax(lam <= nxt))
        deficit = np.maximum(0.0, lam[j] * w - bins.load)
        mid = np.cumsum(c) - 0.5 * c
        dest = np.minimum(np.searchsorted(np.cumsum(deficit), mid, side="right"), k - 1)
    out[items] = dest
    bins.load += np.bincount(dest, weights=c, minlength=k)
    if bins.tok is None or tokens is None:
        return
    bins.tok += np.bincount(dest, weights=tokens[items], minlength=k)
    _repair_caps(items, costs, tokens, bins, out)


def _repair_caps(items: np.ndarray, costs: np.ndarray, tokens: np.ndarray, bins: _Bins, out: np.ndarray) -> None:
    """Evict `items` from over-cap bins (keeping each bin's earliest ones) and re-place them."""
    over = bins.tok > bins.cap
    if not over.any():
        return
    sub = items[over[out[items]]]
    sub = sub[np.argsort(out[sub], kind="stable")]
    b = out[sub]
    t = tokens[sub].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    csum = np.cumsum(t)
    before = np.repeat(csum[starts] - t[starts], np.diff(np.r_[starts, b.shape[0]]))
    kept_tok = bins.tok[b] - np.bincount(b, weights=t, minlength=bins.tok.shape[0])[b]
    evict = sub[kept_tok + (csum - before) > bins.cap]
    np.subtract.at(bins.load, out[evict], costs[evict])
    np.subtract.at(bins.tok, out[evict], tokens[evict])
    if bins.left is not None:
        np.add.at(bins.left, out[evict], 1)
    for i in evict[np.argsort(-tokens[evict], kind="stable")].tolist():
        out[i] = bins.place_one(i, float(costs[i]), tokens)


def _tree_merge(costs: np.ndarray, k: int) -> np.ndarray:
    """Equal sizes, no cap: sorted chunks of k items merged pairwise (largest with smallest).

    Merging two k-tuples never widens their spread beyond the larger one, so the result
    is within one first-chunk spread, like LPT — but log2(n/k) vectorized passes.
    """
    n = costs.shape[0]
    order = np.argsort(-costs, kind="stable")
    rows = n // k
    loads = costs[order].reshape(rows, k).copy()
    pos = np.broadcast_to(np.arange(k), (rows, k)).copy()  # column of each original cell
    owner = np.arange(rows)  # current tuple of each original row
    while loads.shape[0] > 1:
        t = loads.shape[0]
        pairs = t // 2
        a, b = loads[0 : 2 * pairs : 2], loads[1 : 2 * pairs : 2]
        merged = a + b[:, ::-1]
        srt = np.argsort(-merged, axis=1, kind="stable")
        inv = np.empty_like(srt)
        np.put_along_axis(inv, srt, np.arange(k)[None, :].repeat(pairs, 0), axis=1)
        remap = np.empty((t, k), dtype=np.int64)
        remap[0 : 2 * pairs : 2] = inv
        remap[1 : 2 * pairs : 2] = inv[:, ::-1]
        if t % 2:
            remap[-1] = np.arange(k)
        pos = np.take_along_axis(remap[owner], pos, axis=1)
        new = np.take_along_axis(merged, srt, axis=1)
        loads = np.concatenate([new, loads[-1:]]) if t % 2 else new
        owner = owner // 2
    out = np.empty(n, dtype=np.int64)
    out[order] = pos.reshape(-1)
    return out


def _greedy_core(costs: np.ndarray, k: int, *, tokens: np.ndarray | None, cap: float | None,
                 sizes: np.ndarray | None, weights: np.ndarray | None = None,
                 bins: _Bins | None = None, out: np.ndarray | None = None,
                 items: np.ndarray | None = None) -> np.ndarray:
    n = costs.shape[0]
    if out is None:
        out = np.full(n, -1, dtype=np.int64)
    if bins is None:
        bins = _Bins(load=np.zeros(k), weight=weights, cap=cap,
                     tok=None if cap is None else np.zeros(k), left=None if sizes is None else sizes.copy())
    todo = np.arange(n) if items is None else items
    if sizes is not None:  # exact counts: no tail, every item takes a slot
        _rounds(todo[np.argsort(-costs[todo], kind="stable")], costs, tokens, bins, out, target=None)
        return out
    wsum = float(k if weights is None else weights.sum())
    total = float(bins.load.sum() + costs[todo].sum())
    target = total / wsum
    small = costs[todo] < TAIL_FRACTION * target * (1.0 if weights is None else float(weights.min()))
    head = todo[~small]
    _rounds(head[np.argsort(-costs[head], kind="stable")], costs, tokens, bins, out, target=target)
    _water_fill(todo[small], costs, tokens, bins, out)
    return out


def greedy(costs: np.ndarray, k: int, *, tokens: np.ndarray | None = None, cap: float | None = None,
           sizes: np.ndarray | None = None) -> np.ndarray:
    """LPT (largest item to the least-loaded bin), in vectorized rounds plus a water-filled tail."""
    if sizes is not None and cap is None and np.all(sizes == sizes[0]) and costs.shape[0] == k * int(sizes[0]):
        return _tree_merge(costs, k) if costs.shape[0] else np.zeros(0, dtype=np.int64)
    return _greedy_core(costs, k, tokens=tokens, cap=cap, sizes=sizes)


# --------------------------------------------------------------------------- Karmarkar–Karp


def _kk_merge_all(tuples: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest differencing: repeatedly merge the two k-tuples of largest spread.

    Each tuple is (loads sorted descending and shifted so min = 0, item ids, slot ids); merging
    pairs the heaviest slot of one with the lightest of the other.
    """
    heap = [(-float(t[0][0]), i, t) for i, t in enumerate(tuples)]
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, (la, ia, sa) = heapq.heappop(heap)
        _, _, (lb, ib, sb) = heapq.heappop(heap)
        merged = la + lb[::-1]
        srt = np.argsort(-merged, kind="stable")
        inv = np.empty(k, dtype=np.int64)
        inv[srt] = np.arange(k)
        loads = merged[srt]
        loads -= loads[-1]
        item = np.concatenate([ia, ib])
        slot = np.concatenate([inv[sa], inv[k - 1 - sb]])
        heapq.heappush(heap, (-float(loads[0]), seq, (loads, item, slot)))
        seq += 1
    _, _, (_, item, slot) = heap[0]
    return item, slot


def kk(costs: np.ndarray, k: int, *, tokens: np.ndarray | None = None, cap: float | None = None,
       sizes: np.ndarray | None = None) -> np.ndarray:
    """Karmarkar–Karp multi-way largest differencing.

    Without sizes: exact KK on the largest max(2k, …) ≤ 4096 items, then the greedy rounds /
    water-fill for the rest, and cap repair. With equal sizes: the balanced variant (BLDM):
    tuples are sorted chunks of k items, so every bin keeps exactly one item per chunk.
    Unequal sizes with a cap fall back to greedy (KK cannot keep counts while moving items).
    """
    n = costs.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if sizes is not None:
        if cap is not None or not np.all(sizes == sizes[0]) or n != k * int(sizes[0]):
            return greedy(costs, k, tokens=tokens, cap=cap, sizes=sizes)
        order = np.argsort(-costs, kind="stable")
        chunks = order.reshape(-1, k)
        tuples = [(costs[c] - costs[c[-1]], c, np.arange(k)) for c in chunks]
        item, slot = _kk_merge_all(tuples, k)
        out = np.empty(n, dtype=np.int64)
        out[item] = slot
        return out
    h = min(n, max(KK_HEAD_PER_BIN * k, min(KK_HEAD_MAX, n)))
    order = np.argsort(-costs, kind="stable")
    head, rest = order[:h], order[h:]
    tuples = []
    zeros = np.zeros(k - 1)
    for i in head.tolist():
        tuples.append((np.concatenate(([costs[i]], zeros)), np.array([i]), np.zeros(1, dtype=np.int64)))
    item, slot = _kk_merge_all(tuples, k)
    out = np.full(n, -1, dtype=np.int64)
    out[item] = slot
    bins = _Bins(load=np.bincount(slot, weights=costs[item], minlength=k), cap=cap,
                 tok=None if cap is None else np.bincount(slot, weights=tokens[item], minlength=k))
    if cap is not None:
        _repair_caps(item, costs, tokens, bins, out)
    if rest.shape[0]:
        _greedy_core(costs, k, tokens=tokens, cap=cap, sizes=None, bins=bins, out=out, items=np.sort(rest))
    return out


# --------------------------------------------------------------------------- registry + partition

_BALANCERS: dict[str, Balancer] = {"greedy": greedy, "kk": kk}


def register_balancer(name: str, fn: Balancer) -> None:
    """Make `fn(costs, k, *, tokens, cap, sizes) -> bins` available as `method=name`."""
    if not callable(fn):
        raise ConfigError(f"balancer {name!r} must be callable, got {type(fn).__name__}")
    _BALANCERS[name] = fn


def get_balancer(name: str) -> Balancer:
    if name not in _BALANCERS:
        raise ConfigError(f"unknown balancing method {name!r}; known methods: {balancer_names()}")
    return _BALANCERS[name]


def balancer_names() -> list[str]:
    return sorted(_BALANCERS)


def _check_inputs(costs: np.ndarray, k: int, tokens: np.ndarray | None, cap: float | None,
                  sizes: Sequence[int] | np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    problems = []
    if costs.ndim != 1:
        problems.append(f"`costs` must be 1-D, got shape {costs.shape}")
    elif costs.size and (not np.all(np.isfinite(costs)) or costs.min() < 0):
        problems.append("`costs` must be finite and >= 0 (check the cost model)")
    if int(k) != k or k <= 0:
        problems.append(f"`k` (number of bins) must be a positive integer, got {k!r}")
    tok = None
    if tokens is not None:
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.shape != costs.shape:
            problems.append(f"`tokens` has shape {tok.shape}, `costs` has {costs.shape}")
        elif tok.size and tok.min() < 0:
            problems.append("`tokens` must be >= 0")
    if cap is not None and tokens is None:
        problems.append("`cap` needs `tokens` (per-item token counts)")
    if cap is not None and not cap > 0:
        problems.append(f"`cap` must be > 0, got {cap!r}")
    sz = None
    if sizes is not None:
        sz = np.asarray(sizes, dtype=np.int64)
        if sz.shape != (k,) or (sz.size and sz.min() < 0) or int(sz.sum()) != costs.shape[0]:
            problems.append(f"`sizes` must be {k} non-negative counts summing to {costs.shape[0]} items, got {sizes!r}")
    if problems:
        raise ConfigError("partition(): " + "; ".join(problems))
    return costs, tok, sz


def partition(costs: np.ndarray, k: int, *, method: str = "greedy", tokens: np.ndarray | None = None,
              cap: float | None = None, sizes: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Bin index (int64, 0..k-1) of every item, balancing the bins' summed costs.

    Args:
        costs: Per-item cost (>= 0).
        k: Number of bins.
        method: A registered balancer name ("greedy", "kk", or one added by `register_balancer`).
        tokens: Per-item token counts, needed with `cap`.
        cap: Maximum tokens per bin; an item that fits no bin raises `PlanError`.
        sizes: Exact number of items per bin (e.g. m micro-batches for every bucket).
    """
    fn = get_balancer(method)
    costs, tok, sz = _check_inputs(costs, k, tokens, cap, sizes)
    if tok is not None and cap is not None and tok.size and tok.max() > cap:
        i = int(np.argmax(tok > cap))
        raise _no_room(i, tok, _Bins(load=np.zeros(1), cap=float(cap)))
    out = np.asarray(fn(costs, int(k), tokens=tok, cap=None if cap is None else float(cap), sizes=sz), dtype=np.int64)
    if out.shape != costs.shape or (out.size and (out.min() < 0 or out.max() >= k)):
        raise PlanError(f"balancer {method!r} returned an invalid assignment (shape {out.shape}, k={k})")
    return out


from megascale_data_ext.dataplane._balance_levels import BalanceResult, balance_step  # noqa: E402
