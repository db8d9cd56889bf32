"""Hybrid context parallelism: every document gets its own CP group (issue 26).

With one CP size for the whole job every document is split over every CP rank, so a short
document pays CP communication for nothing, and the CP size must fit the longest document.
megatron-core 0.16's ``--hybrid-context-parallel`` (`BalancedCPScheduler`) instead gives each
sequence the smallest power-of-two group of DP×CP GPUs whose per-GPU token cap it fits. This is
the planner's version of that freedom, driven by a cost model with the terms that make
splitting a document cost something (`CPCost`):

1. Each document's group size is the smallest power of two ``g`` with ``len / g <= cap``; a
   document whose share on each GPU would still cost more than the mean GPU's whole step is
   widened (doubled) while that lowers its per-GPU cost under the model, so the CP
   communication and per-document terms decide whether splitting pays.
2. Documents of one group size ``g > 1`` are packed first-fit decreasing into packs of at most
   ``g × cap`` tokens (each document padded to a multiple of ``2g``, as THD slicing needs); each
   pack is one microbatch of an aligned block of ``g`` GPUs (``first_gpu % g == 0``, Megatron's
   hybrid groups), placed on the block whose busiest GPU is least loaded, largest first.
3. Documents of group size 1 run whole on one GPU: balanced over the GPUs on top of the loads
   step 2 left (LPT by cost, then `variable_count.improve_by_moves`, kept where it packs
   cheaper: `microbatches.packed_better`), then packed first-fit decreasing under ``cap`` into
   as many microbatches as each GPU needs (the loss must be per token, Megatron's condition for
   its own scheduler).

A GPU runs the microbatches that cover it in the plan's order: every group microbatch first,
in one global order, then its own. Two groups that share GPUs are met in the same order on
every GPU they share, so the first pending group of the order always has all its members
waiting for it and no barrier is needed between groups (Megatron's schedule puts one after
every group).

Pure numpy: the Planner runs it for every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megascale_data_ext.dataplane.balancers.lpt import lpt_onto
from megascale_data_ext.dataplane.balancers.microbatches import pack_under_cap, packed_better
from megascale_data_ext.dataplane.balancers.variable_count import balance_variable_count, improve_by_moves
from megascale_data_ext.errors import PlanError

__all__ = [
    "CPCost", "HybridMicrobatch", "HybridPlan", "balance_hybrid_cp", "group_sizes", "largest_group", "plan_gpu_costs",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CPCost:
    """What one GPU pays for its share of a document of ``s`` tokens split over ``g`` GPUs:
    ``per_document + (linear·s + quadratic·s²) / g + cp_comm · s · (g - 1) / g`` (the K/V of
    the other ``g - 1`` GPUs' tokens reach it over the ring), plus ``fixed`` per microbatch
    (one forward/backward: launches, the fixed part of a step). With only ``quadratic = 1``
    this is megatron-core's own estimator (s² / g). A per-sample cost `model` (a strategy's
    FLOPs or calibrated model) replaces ``linear·s + quadratic·s²`` where given."""

    fixed: float = 0.0
    per_document: float = 0.0
    linear: float = 0.0
    quadratic: float = 1.0
    cp_comm: float = 0.0
    model: Callable[[np.ndarray], np.ndarray] | None = None

    def per_gpu(self, lens: np.ndarray, group: np.ndarray | int) -> np.ndarray:
        s = np.asarray(lens, dtype=np.float64)
        g = np.asarray(group, dtype=np.float64)
        work = self.linear * s + self.quadratic * s * s if self.model is None else np.asarray(self.model(s), np.float64)
        return self.per_document + work / g + self.cp_comm * s * (g - 1) / g


@dataclass(frozen=True, slots=True)
class HybridMicrobatch:
    """One forward/backward of the aligned block ``first_gpu .. first_gpu + size - 1``, all of
    whose GPUs hold a THD slice of every document in `docs` (``size == 1``: whole documents)."""

    first_gpu: int
    size: int
    docs: np.ndarray

    def gpus(self) -> range:
        return range(self.first_gpu, self.first_gpu + self.size)


@dataclass(slots=True)
class HybridPlan:
    """A step's hybrid-CP plan: `microbatches` in the order every GPU runs the ones covering
    it; `group_size[i]` is document i's CP group; `gpu_cost` each GPU's cost under the model
    it was planned with."""

    microbatches: list[HybridMicrobatch]
    group_size: np.ndarray
    gpu_cost: np.ndarray
    num_gpus: int = field(default=0)

    def for_gpu(self, gpu: int) -> list[HybridMicrobatch]:
        return [mb for mb in self.microbatches if mb.first_gpu <= gpu < mb.first_gpu + mb.size]

    def placements(self, *, aligned: bool = False) -> tuple[np.ndarray, ...]:
        """The plan as one row per document and GPU holding it (its slice, or the whole of it), in
        the plan's order: ``(document, gpu, index of its microbatch on that gpu, group size, place in
        the group)``, and each GPU's count of microbatches. The index is the microbatch's position
        among that GPU's in the plan's order, or with `aligned` its `slots` index (a GPU's count
        then includes its fillers)."""
        k, mbs = max(self.num_gpus, 1), self.microbatches
        empty = np.zeros(0, dtype=np.int64)
        if not mbs:
            return empty, empty, empty, empty, empty, np.zeros(k, dtype=np.int64)
        size = np.fromiter((mb.size for mb in mbs), np.int64, len(mbs))
        first = np.fromiter((mb.first_gpu for mb in mbs), np.int64, len(mbs))
        ndocs = np.fromiter((len(mb.docs) for mb in mbs), np.int64, len(mbs))
        which = np.repeat(np.arange(len(mbs)), size)  # one entry per (microbatch, GPU of its group)
        place = np.arange(which.size) - np.repeat(np.cumsum(size) - size, size)
        gpu = first[which] + place
        if aligned:
            index = self.slots()[which]
        else:
            order = np.argsort(gpu, kind="stable")
            index = np.empty_like(gpu)
            index[order] = np.arange(gpu.size) - np.searchsorted(gpu[order], gpu[order])
        count = np.zeros(k, dtype=np.int64)
        np.maximum.at(count, gpu, index + 1)
        reps = ndocs[which]  # each entry expanded to its microbatch's documents
        entry = np.repeat(np.arange(which.size), reps)
        within = np.arange(entry.size) - np.repeat(np.cumsum(reps) - reps, reps)
        docs = np.concatenate([np.asarray(mb.docs, dtype=np.int64) for mb in mbs])
        docs = docs[(np.cumsum(ndocs) - ndocs)[which][entry] + within]
        return docs, gpu[entry], index[entry], size[which][entry], place[entry], count

    def slots(self) -> np.ndarray:
        """Each microbatch's position in the list of every GPU it covers, when a group must sit at
        the same position on all its GPUs: the earliest position free on all of them, in the plan's
        order; a GPU runs a filler (a pack of padding, no collective) at a position it has nothing.

        Pipeline parallelism needs this: 1F1B runs a rank's forward of position i before its
        backward of position j exactly when ``i <= j + warmup``, and the warm-up is the same for
        every rank of a stage, so groups placed at equal positions meet in the same order on every
        member whatever each rank's count; at unequal positions two groups sharing GPUs could each
        wait for the other."""
        nxt = np.zeros(max(self.num_gpus, 1), dtype=np.int64)
        out = np.empty(len(self.microbatches), dtype=np.int64)
        for i, mb in enumerate(self.microbatches):
            members = slice(mb.first_gpu, mb.first_gpu + mb.size)
            out[i] = slot = int(nxt[members].max())
            nxt[members] = slot + 1
        return out

    def max_over_mean(self) -> float:
        mean = float(self.gpu_cost.mean()) if self.gpu_cost.size else 0.0
        return float(self.gpu_cost.max()) / mean if mean > 0 else 1.0


def largest_group(gpus: int) -> int:
    """The largest power-of-two group `gpus` GPUs can form."""
    return 1 << (max(int(gpus), 1).bit_length() - 1)


def group_sizes(lens: np.ndarray, cap: int) -> np.ndarray:
    """The smallest power of two ``g`` per document with ``len / g <= cap``."""
    need = np.maximum(-(-np.asarray(lens, dtype=np.int64) // int(cap)), 1)
    return (1 << np.ceil(np.log2(need)).astype(np.int64)).astype(np.int64)


def _padded(lens: np.ndarray, g: int) -> np.ndarray:
    """Each document padded to a multiple of ``2g`` (THD slicing over ``g`` GPUs), ``g > 1``."""
    return -(-lens // (2 * g)) * (2 * g)


def _widen(lens: np.ndarray, groups: np.ndarray, gpus: int, cost: CPCost) -> np.ndarray:
    """Double a document's group while its per-GPU share costs more than the mean GPU's step
    and doubling lowers that share under the model."""
    top = largest_group(gpus)
    share = cost.per_gpu(lens, groups)
    mean = float((share * groups).sum()) / gpus
    out = groups.copy()
    for i in np.flatnonzero(share > mean).tolist():
        g, s = int(out[i]), lens[i]
        while 2 * g <= top and mean < float(cost.per_gpu(s, g)) > float(cost.per_gpu(s, 2 * g)):
            g *= 2
        out[i] = g
    return out


def balance_hybrid_cp(lens: np.ndarray, gpus: int, cap: int, cost: CPCost | None = None) -> HybridPlan:
    """Plan one step of `lens` over `gpus` DP×CP GPUs of at most `cap` tokens per microbatch.

    Raises:
        PlanError: A document longer than the largest power-of-two group of GPUs can hold.
    """
    cost = cost or CPCost()
    lens = np.asarray(lens, dtype=np.int64)
    k = int(gpus)
    if k < 1 or cap < 1:
        raise PlanError(f"hybrid CP needs gpus >= 1 and cap >= 1, got gpus={gpus}, cap={cap}")
    groups = group_sizes(lens, cap)
    top = largest_group(k)
    if groups.size and int(groups.max()) > top:
        i = int(np.argmax(lens))
        raise PlanError(f"a document of {int(lens[i])} tokens needs {int(groups[i])} GPUs of cap {cap}, but "
                        f"{k} DP x CP GPUs form groups of at most {top}: raise the cap or drop such documents")
    groups = _widen(lens, groups, k, cost)
    load = np.zeros(k)
    microbatches: list[HybridMicrobatch] = []
    packs: list[tuple[float, int, np.ndarray]] = []
    for g in sorted({int(x) for x in groups.tolist()} - {1}, reverse=True):
        members = np.flatnonzero(groups == g)
        padded = _padded(lens, g)
        slot = pack_under_cap(padded, members, g * cap)
        for b in range(int(slot.max()) + 1):
            docs = members[slot == b]
            packs.append((cost.fixed + float(cost.per_gpu(lens[docs], g).sum()), g, docs))
    packs.sort(key=lambda p: (-p[0], -p[1]))
    for per_gpu_cost, g, docs in packs:
        blocks = load[: k // g * g].reshape(-1, g).max(axis=1)
        first = int(np.argmin(blocks)) * g
        load[first:first + g] += per_gpu_cost
        microbatches.append(HybridMicrobatch(first, g, docs))
    short = np.flatnonzero(groups == 1)
    if short.size:
        costs = cost.per_gpu(lens[short], 1)
        if not microbatches:  # nothing split: the variable-count plan (LPT, moves, first-fit decreasing)
            res = balance_variable_count(costs, lens[short], k, cap, fixed=cost.fixed)
            bucket, slot = res.bucket, res.microbatch
        else:
            start = lpt_onto(costs + cost.fixed * lens[short] / cap, load)
            improved = improve_by_moves(start, costs, lens[short], k, cap, cost.fixed, base=load)
            bucket, slot = packed_better(start, improved, costs, lens[short], k, cap, cost.fixed, base=load)
        order = np.lexsort((slot, bucket))
        cuts = np.flatnonzero(np.diff(bucket[order] * (int(slot.max()) + 1) + slot[order])) + 1
        runs = np.split(order, cuts)
        firsts = bucket[order[np.concatenate(([0], cuts))]].tolist()
        microbatches.extend(HybridMicrobatch(gpu, 1, short[run]) for gpu, run in zip(firsts, runs))
        load += np.bincount(bucket, weights=costs, minlength=k) + cost.fixed * np.bincount(firsts, minlength=k)
    return HybridPlan(microbatches=microbatches, group_size=groups, gpu_cost=load, num_gpus=k)


def plan_gpu_costs(plan: HybridPlan, lens: np.ndarray, cost: CPCost) -> np.ndarray:
    """Each GPU's cost of `plan` under `cost` (which may differ from the one it was planned with)."""
    out = np.zeros(plan.num_gpus)
    lens = np.asarray(lens, dtype=np.int64)
    for mb in plan.microbatches:
        out[mb.first_gpu:mb.first_gpu + mb.size] += cost.fixed + float(cost.per_gpu(lens[mb.docs], mb.size).sum())
    return out
