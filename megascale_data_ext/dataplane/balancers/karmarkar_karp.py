"""Karmarkar–Karp multi-way largest differencing (``kk``), greedy for the tail and cap repair."""

from __future__ import annotations

import heapq

import numpy as np

from megascale_data_ext.dataplane.balancers.bins import Bins, cap_array
from megascale_data_ext.dataplane.balancers.lpt import evict_over_cap, greedy, greedy_core

__all__ = ["kk"]

#: Exact KK runs on at most this many of the largest items (× bins); the rest is greedy.
KK_HEAD_PER_BIN = 2
KK_HEAD_MAX = 4096
#: ... and on at most this many head items x bins (each merge sorts k-long tuples).
KK_WORK_MAX = 2_000_000


#: Up to this many bins, tuples are merged as Python lists: numpy's per-call cost dominates
#: k-long arrays this short (a step of 2 x 4 microbatches, 60 documents: 0.58 -> 0.38 ms, the same bins).
SMALL_K = 32


def _kk_merge_all(tuples: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest differencing: repeatedly merge the two k-tuples of largest spread.

    Each tuple is (loads sorted descending and shifted so min = 0, item ids, slot ids); merging
    pairs the heaviest slot of one with the lightest of the other. A merge keeps only its k
    loads and where each slot went (not the items: copying them was most of the time at 38k
    items); every leaf's slots are resolved top-down once the root is known. Items come back in
    the order merging would have concatenated them (left tuple first), so sums over them agree.
    """
    if k <= SMALL_K:
        return _kk_merge_all_lists(tuples, k)
    heap = [(-float(t[0][0]), i, t[0]) for i, t in enumerate(tuples)]
    heapq.heapify(heap)
    seq = len(heap)
    children: list[tuple[int, int, np.ndarray]] = []  # node len(tuples) + j merged (a, b); slot of a -> inv[slot]
    while len(heap) > 1:
        _, a, la = heapq.heappop(heap)
        _, b, lb = heapq.heappop(heap)
        merged = la + lb[::-1]
        srt = np.argsort(-merged, kind="stable")
        inv = np.empty(k, dtype=np.int64)
        inv[srt] = np.arange(k)
        loads = merged[srt]
        loads -= loads[-1]
        children.append((a, b, inv))
        heapq.heappush(heap, (-float(loads[0]), seq, loads))
        seq += 1
    leaves = len(tuples)
    final: dict[int, np.ndarray] = {heap[0][1]: np.arange(k, dtype=np.int64)}  # node -> final slot of its slots
    items, slots, stack = [], [], [heap[0][1]]
    while stack:  # depth first, left before right: the order the items were concatenated in
        node = stack.pop()
        to_final = final.pop(node)
        if node < leaves:
            items.append(tuples[node][1])
            slots.append(to_final[tuples[node][2]])
            continue
        a, b, inv = children[node - leaves]
        final[a], final[b] = to_final[inv], to_final[inv[::-1]]
        stack += (b, a)
    return np.concatenate(items), np.concatenate(slots)


def _kk_merge_all_lists(tuples: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                        k: int) -> tuple[np.ndarray, np.ndarray]:
    """`_kk_merge_all` on Python lists, step for step (the same sums, the same stable order)."""
    heap = [(-float(t[0][0]), i, (t[0].tolist(), t[1].tolist(), t[2].tolist())) for i, t in enumerate(tuples)]
    heapq.heapify(heap)
    seq, last, order = len(heap), k - 1, range(k)
    while len(heap) > 1:
        _, _, (la, ia, sa) = heapq.heappop(heap)
        _, _, (lb, ib, sb) = heapq.heappop(heap)
        merged = [a + b for a, b in zip(la, reversed(lb))]
        srt = sorted(order, key=merged.__getitem__, reverse=True)  # stable among equals, as argsort(-x)
        inv = [0] * k
        for j, s in enumerate(srt):
            inv[s] = j
        floor = merged[srt[-1]]
        loads = [merged[s] - floor for s in srt]
        slot = [inv[s] for s in sa] + [inv[last - s] for s in sb]
        heapq.heappush(heap, (-loads[0], seq, (loads, ia + ib, slot)))
        seq += 1
    _, _, (_, item, slot) = heap[0]
    return np.asarray(item, dtype=np.int64), np.asarray(slot, dtype=np.int64)


def kk(costs: np.ndarray, k: int, *, tokens: np.ndarray | None = None, cap: float | None = None,
       sizes: np.ndarray | None = None) -> np.ndarray:
    """Karmarkar–Karp multi-way largest differencing.

    Without sizes: exact KK on the largest max(2k, …) ≤ 4096 items (and ≤ 2M / k), then the
    greedy rounds / water-fill for the rest, and cap repair; with at least as many bins as those
    items, greedy (what differencing would do there). With equal sizes: the balanced variant (BLDM):
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
    h = min(n, KK_HEAD_MAX, max(KK_HEAD_PER_BIN * k, 256), max(1, KK_WORK_MAX // k))
    if h <= k:
        # No more head items than bins: differencing would put each alone in a bin, as LPT's first
        # round does, only through h merges of k-long tuples (at 4,096 GPUs' interleaved level,
        # 38,272 bins: 1.2 GB and 1.8 s a step).
        return greedy(costs, k, tokens=tokens, cap=cap)
    order = np.argsort(-costs, kind="stable")
    head, rest = order[:h], order[h:]
    zeros, slot0 = np.zeros(k - 1), np.zeros(1, dtype=np.int64)
    tuples = [(np.concatenate(([costs[i]], zeros)), np.array([i]), slot0) for i in head.tolist()]
    item, slot = _kk_merge_all(tuples, k)
    out = np.full(n, -1, dtype=np.int64)
    out[item] = slot
    bins = Bins(load=np.bincount(slot, weights=costs[item], minlength=k), cap=cap_array(cap, k),
                tok=None if cap is None else np.bincount(slot, weights=tokens[item], minlength=k))
    if cap is not None:
        rest = np.concatenate([rest, evict_over_cap(item, costs, tokens, bins, out)])
    if rest.shape[0]:
        greedy_core(costs, k, tokens=tokens, cap=cap, sizes=None, bins=bins, out=out, items=np.sort(rest))
    return out
