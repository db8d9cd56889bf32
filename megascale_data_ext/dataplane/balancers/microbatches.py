"""A bucket's documents into micro-batches under a token cap, and what it costs.

The variable-count balancer (`variable_count`) moves documents between buckets counting a
bucket's micro-batches as the fewest its tokens need (`bucket_cost`); first-fit decreasing then
packs each bucket (`pack_buckets_under_cap`, every bucket at once), and where it needs one
micro-batch more than counted, `repair_packing` empties one into room other buckets already have
and `packed_better` keeps the cheaper of two assignments once packed. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from megascale_data_ext.dataplane.grouping import grouped_rows

__all__ = ["bucket_cost", "members_by_bucket", "pack_buckets_under_cap", "pack_under_cap", "packed_better",
           "repair_packing"]


def bucket_cost(c: np.ndarray, t: np.ndarray, fixed: float, cap: int) -> np.ndarray:
    """A bucket's cost from its documents' cost sum `c` and token sum `t`: `fixed` per
    micro-batch the tokens need at least; an empty bucket costs nothing."""
    return np.where(t > 0, c + fixed * -(-t // cap), 0.0)


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


def pack_buckets_under_cap(tokens: np.ndarray, bucket: np.ndarray, k: int, cap: int) -> np.ndarray:
    """`pack_under_cap` for every bucket at once: each document's bin within its bucket.

    First-fit decreasing with every bucket's bins opened empty in advance is the same packing
    (the first bin with room is a used one where one fits, else the first empty one, which is
    the bin FFD would open), so one pass per document rank serves all buckets together: the
    loop runs as many times as the fullest bucket has documents, not once per document."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out = np.zeros(tokens.size, dtype=np.int64)
    if not tokens.size:
        return out
    order = np.lexsort((-tokens, bucket))
    count = np.bincount(bucket, minlength=k)
    start = np.cumsum(count) - count
    total = np.bincount(bucket, weights=tokens, minlength=k)
    # FFD leaves no two bins that would fit in one, so a bucket needs fewer than 2·total/cap + 1.
    width = int(2 * np.ceil(total.max() / cap)) + 1
    room = np.full((k, width), cap, dtype=np.int64)
    for p in range(int(count.max())):
        rows = np.flatnonzero(count > p)
        items = order[start[rows] + p]
        t = tokens[items]
        j = np.argmax(room[rows] >= t[:, None], axis=1)
        room[rows, j] -= t
        out[items] = j
    return out


def members_by_bucket(bucket: np.ndarray, k: int) -> list[np.ndarray]:
    """Each bucket's documents (ascending ids), from one sort: ``flatnonzero(bucket == b)`` for
    every b would read all documents k times (65 ms at 4,096 buckets)."""
    order, start = grouped_rows(bucket, k)
    return np.split(order, start[1:-1])


def packed_better(start: np.ndarray, improved: np.ndarray, costs: np.ndarray, tokens: np.ndarray, k: int,
                  cap: int, fixed: float, base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Of two assignments, the one whose most expensive bucket is cheaper once packed (first-fit
    decreasing, then `repair_packing`), with its micro-batch per document. The moves count a
    bucket's micro-batches as the fewest its tokens need; a bucket they filled to just under a
    multiple of the cap can need one more, and this keeps them from making the packed plan worse
    than where they started. The start is not packed where the improved plan already packs to no
    more than the start's own cost at that fewest count (which its packing reaches at best)."""
    base = np.zeros(k) if base is None else np.asarray(base, dtype=np.float64)

    def packed(bucket: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        bucket, slot = repair_packing(bucket, pack_buckets_under_cap(tokens, bucket, k, cap), costs, tokens, k, cap,
                                      fixed, base)
        count = np.zeros(k, dtype=np.int64)
        np.maximum.at(count, bucket, slot + 1)
        return float((base + np.bincount(bucket, weights=costs, minlength=k) + fixed * count).max()), bucket, slot

    after = packed(improved)
    start_model = base + bucket_cost(np.bincount(start, weights=costs, minlength=k),
                                np.bincount(start, weights=tokens, minlength=k).astype(np.int64), fixed, cap)
    if after[0] <= float(start_model.max()):  # the start packs to at least its model's cost: no better
        return after[1:]
    before = packed(start)
    return after[1:] if after[0] <= before[0] else before[1:]


def repair_packing(bucket: np.ndarray, slot: np.ndarray, costs: np.ndarray, tokens: np.ndarray, k: int, cap: int,
                   fixed: float, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where first-fit decreasing gave the most expensive bucket more micro-batches than its tokens
    need, empty its least filled one: each of its documents, largest first, into a micro-batch of
    another bucket with room for it, the cheapest such bucket that stays below this one. Repeated
    while it lowers the most expensive bucket; a bucket whose micro-batch cannot be emptied whole
    is left as it was. Returns new (bucket, slot) arrays."""
    bucket, slot = bucket.copy(), slot.copy()
    width = int(slot.max()) + 1 if slot.size else 1
    fill = np.zeros((k, width), dtype=np.int64)
    np.add.at(fill, (bucket, slot), tokens)
    count = (fill > 0).sum(axis=1)
    step = base + np.bincount(bucket, weights=costs, minlength=k) + fixed * count
    room = np.where(fill > 0, cap - fill, -1)  # what each micro-batch a bucket runs can still take
    best_room = room.max(axis=1)
    members = members_by_bucket(bucket, k)
    for _ in range(k):
        b = int(np.argmax(step))
        if count[b] <= -(-int(fill[b].sum()) // cap):
            break  # the most expensive bucket has no micro-batch more than its tokens need
        used = np.flatnonzero(fill[b] > 0)
        last = int(used[np.argmin(fill[b, used])])
        mine = members[b]
        docs = mine[slot[mine] == last]
        docs = docs[np.argsort(-tokens[docs], kind="stable")]
        top, held = float(step[b]), best_room[b]
        best_room[b] = -1
        moves: list[tuple[int, int, int]] = []
        for i in docs.tolist():
            ok = (best_room >= tokens[i]) & (step + costs[i] < top)
            if not ok.any():
                break
            r = int(np.flatnonzero(ok)[np.argmin(step[ok])])
            m = int(np.flatnonzero(room[r] >= tokens[i])[0])
            room[r, m] -= tokens[i]
            best_room[r] = room[r].max()
            step[r] += costs[i]
            moves.append((i, r, m))
        if len(moves) < docs.size:  # not emptied whole: undo, and stop
            for i, r, m in moves:
                room[r, m] += tokens[i]
                best_room[r] = room[r].max()
                step[r] -= costs[i]
            best_room[b] = held
            break
        for i, r, m in moves:
            bucket[i], slot[i] = r, m
            fill[r, m] += tokens[i]
            members[r] = np.append(members[r], i)
        members[b] = mine = mine[bucket[mine] == b]  # the moved ones are in their new buckets now
        count[b] -= 1
        step[b] -= fixed + float(costs[docs].sum())
        slot[mine[slot[mine] > last]] -= 1  # keep a bucket's micro-batches numbered 0..count-1
        for arr, empty in ((fill, 0), (room, -1)):
            arr[b, last:-1] = arr[b, last + 1:].copy()
            arr[b, -1] = empty
        best_room[b] = room[b].max()
    return bucket, slot
