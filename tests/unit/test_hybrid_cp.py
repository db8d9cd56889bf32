"""Hybrid context parallelism in the planner: each document its own CP group (issue 26)."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.balancers.hybrid_cp import (
    CPCost,
    balance_hybrid_cp,
    group_sizes,
    largest_group,
    plan_gpu_costs,
)
from megascale_data_ext.dataplane.workloads import LONG_TAIL_SPAN, fill_workload
from megascale_data_ext.errors import PlanError


def _run_in_order(plan) -> int:
    """Run every GPU's microbatches in its order, a group's only when all its GPUs have it next
    (a collective): returns how many ran; fewer than all means the order deadlocks."""
    queues = {g: list(plan.for_gpu(g)) for g in range(plan.num_gpus)}
    ran, progress = 0, True
    while progress:
        progress = False
        for g in range(plan.num_gpus):
            if queues[g] and all(queues[o] and queues[o][0] is queues[g][0] for o in queues[g][0].gpus()):
                mb = queues[g][0]
                for o in mb.gpus():
                    queues[o].pop(0)
                ran, progress = ran + 1, True
    return ran


@pytest.mark.parametrize("gpus,cap,seed", [(8, 1024, 0), (32, 2048, 1), (12, 1024, 2)])
def test_every_document_once_in_aligned_groups_under_the_cap_and_no_deadlock(gpus, cap, seed) -> None:
    lens = fill_workload("long-tail", int(0.9 * gpus * 4 * cap), seed=seed,
                         context=min(LONG_TAIL_SPAN, largest_group(gpus)) * cap).seq_lens()
    assert (lens > cap).any()
    cost = CPCost(fixed=5e5, per_document=1e4, linear=100.0, quadratic=1.0, cp_comm=50.0)
    plan = balance_hybrid_cp(lens, gpus, cap, cost)
    placed = np.sort(np.concatenate([mb.docs for mb in plan.microbatches]))
    np.testing.assert_array_equal(placed, np.arange(len(lens)))
    for mb in plan.microbatches:
        assert mb.size & (mb.size - 1) == 0 and mb.first_gpu % mb.size == 0 and mb.first_gpu + mb.size <= gpus
        per_gpu = lens[mb.docs] if mb.size == 1 else -(-lens[mb.docs] // (2 * mb.size)) * 2  # THD-padded slices
        assert per_gpu.sum() <= cap
        assert (plan.group_size[mb.docs] == mb.size).all()
    assert (plan.group_size >= group_sizes(lens, cap)).all()
    np.testing.assert_allclose(plan_gpu_costs(plan, lens, cost), plan.gpu_cost)
    assert _run_in_order(plan) == len(plan.microbatches)


def test_a_short_document_is_split_only_where_the_cost_model_says_it_pays() -> None:
    """One document of 1,000 tokens among a few short ones on 8 GPUs: under s² alone its share
    costs more than the mean GPU and halving it always helps, so it is widened; with a CP
    communication term larger than what the split saves it stays whole."""
    lens = np.array([1000, 50, 60, 70, 40])
    assert balance_hybrid_cp(lens, 8, 1024).group_size[0] > 1
    costly = CPCost(quadratic=1.0, cp_comm=1e6)
    assert (balance_hybrid_cp(lens, 8, 1024, costly).group_size == 1).all()


def test_short_documents_balance_around_the_long_ones() -> None:
    """A document that needs 4 GPUs takes them for one microbatch; the short ones fill the
    other GPUs first, so no GPU ends far above the mean."""
    rng = np.random.default_rng(0)
    lens = np.concatenate([[4000], rng.integers(50, 400, 300)])
    plan = balance_hybrid_cp(lens, 8, 1024, CPCost(linear=1.0, quadratic=0.0))
    assert plan.group_size[0] == 4 and (plan.group_size[1:] == 1).all()
    assert plan.max_over_mean() < 1.02


def test_without_long_documents_it_is_the_variable_count_plan() -> None:
    from megascale_data_ext.dataplane.balancers.variable_count import balance_variable_count, step_cost

    lens = fill_workload("long-short", int(0.9 * 8 * 4 * 1024), seed=4, context=1024).seq_lens()
    cost = CPCost(fixed=1e5, quadratic=1.0, cp_comm=1e9)  # splitting never pays
    plan = balance_hybrid_cp(lens, 8, 1024, cost)
    variable = balance_variable_count(cost.per_gpu(lens, 1), lens, 8, 1024, fixed=cost.fixed)
    np.testing.assert_allclose(plan.gpu_cost, step_cost(variable, cost.fixed))


def test_a_document_no_group_can_hold_is_refused_by_size() -> None:
    with pytest.raises(PlanError, match=r"a document of 9000 tokens needs 16 GPUs of cap 1024, but 12 DP x CP GPUs "
                                        r"form groups of at most 8"):
        balance_hybrid_cp(np.array([100, 9000]), 12, 1024)


def test_a_group_microbatch_is_sliced_for_the_rank_and_says_its_group_size() -> None:
    from megascale_data_ext.dataplane.cp_slicing import reassemble_cp, slice_for_cp, slice_for_group
    from megascale_data_ext.dataplane.packing import pack_microbatch

    docs = [{"tokens": np.arange(n) % 50} for n in (30, 7, 12)]
    pack = pack_microbatch(docs, seq_length=64, pad_id=0, variable_length=True)
    parts = [slice_for_group(pack, group_size=4, rank_in_group=r) for r in range(4)]
    assert all(int(p["local_cp_size"]) == 4 for p in parts)
    for r, part in enumerate(parts):
        np.testing.assert_array_equal(part["tokens"], slice_for_cp(pack, cp_size=4, cp_rank=r)["tokens"])
    whole = reassemble_cp([{k: v for k, v in p.items() if k != "local_cp_size"} for p in parts], 4)
    assert whole["tokens"].shape[1] >= pack["tokens"].shape[1]
    alone = slice_for_group(pack, group_size=1, rank_in_group=0)
    assert int(alone["local_cp_size"]) == 1 and np.array_equal(alone["tokens"], pack["tokens"])
    with pytest.raises(PlanError, match="needs per-document boundaries"):
        slice_for_group({"tokens": np.zeros((1, 8), dtype=np.int64)}, group_size=2, rank_in_group=0)


def test_the_model_config_refuses_hybrid_cp_where_it_cannot_run() -> None:
    from megascale_data_ext.errors import ParallelLayoutError
    from megascale_data_ext.trainer.model import GPTModelConfig

    GPTModelConfig(cp=2, hybrid_cp=True, per_token_loss=True, attention="flex").validate(world_size=4)
    with pytest.raises(ParallelLayoutError) as err:
        GPTModelConfig(pp=2, hybrid_cp=True, attention="dense").validate(world_size=12)
    text = str(err.value)
    assert "needs `per_token_loss`=True" in text and "attention=flex" in text
    assert "power of two of DP x CP ranks (>= 2), got 6" in text
    GPTModelConfig(pp=2, cp=2, hybrid_cp=True, per_token_loss=True, attention="flex").validate(world_size=8)
    with pytest.raises(ParallelLayoutError, match="with vpp=2: the interleaved schedule"):
        GPTModelConfig(pp=2, vpp=2, cp=2, hybrid_cp=True, per_token_loss=True, attention="flex").validate(world_size=8)


def _one_f_one_b(n: int, warmup: int) -> list[tuple[str, int]]:
    """megatron-core's 1F1B order of a rank's ``n`` microbatches (forward_backward_pipelining_without_
    interleaving): ``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    w = min(warmup, n)
    order = [("F", i) for i in range(w)]
    for i in range(n - w):
        order += [("F", w + i), ("B", i)]
    return order + [("B", i) for i in range(n - w, n)]


def _pipeline_deadlocks(plan, positions: dict[int, dict[int, int]], warmup: int) -> bool:
    """Whether the ranks of one stage, each running its list through 1F1B (`positions[gpu]`:
    microbatch -> index, the rest fillers), can wait on each other forever: every group
    microbatch's forward and backward is a collective of its GPUs, so the union of every GPU's
    order over those events must have no cycle."""
    edges: dict[tuple[str, int], set] = {}
    for gpu, index in positions.items():
        by_index = {j: mb for mb, j in index.items()}
        events = [(kind, by_index[j]) for kind, j in _one_f_one_b(max(by_index) + 1, warmup) if j in by_index]
        events = [e for e in events if plan.microbatches[e[1]].size > 1]  # collectives only
        for a, b in zip(events, events[1:]):
            edges.setdefault(a, set()).add(b)
    state: dict = {}

    def cyclic(node) -> bool:  # depth-first search for a back edge
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1 or (nxt not in state and cyclic(nxt)):
                return True
        state[node] = 2
        return False

    return any(node not in state and cyclic(node) for node in list(edges))


def _positions(plan) -> tuple[dict[int, dict[int, int]], dict[int, dict[int, int]]]:
    """Per GPU, microbatch -> index: aligned (`HybridPlan.slots`) and packed (its own list, no fillers)."""
    slots = plan.slots()
    aligned: dict[int, dict[int, int]] = {g: {} for g in range(plan.num_gpus)}
    packed: dict[int, dict[int, int]] = {g: {} for g in range(plan.num_gpus)}
    for i, mb in enumerate(plan.microbatches):
        for g in mb.gpus():
            aligned[g][i] = int(slots[i])
            packed[g][i] = len(packed[g])
    for g in range(plan.num_gpus):  # one microbatch per index, the plan's order kept
        assert sorted(aligned[g].values()) == [aligned[g][i] for i in sorted(aligned[g])]
    return aligned, packed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_pipeline_parallelism_groups_sit_at_one_index_and_1f1b_cannot_deadlock(seed) -> None:
    from megascale_data_ext.dataplane.balancers.hybrid_cp import HybridPlan

    rng = np.random.default_rng(seed)  # documents for groups of 2, 4 and 8 of 16 GPUs at cap 1024, and short ones
    lens = rng.permutation(np.concatenate([rng.integers(1100, 2000, 12), rng.integers(2100, 4000, 6),
                                           rng.integers(4200, 8000, 2), rng.integers(50, 1000, 150)]))
    plan = balance_hybrid_cp(lens, 16, 1024, CPCost(linear=100.0, quadratic=1.0, cp_comm=200.0))
    assert {mb.size for mb in plan.microbatches} == {1, 2, 4, 8}
    # The planner's order (aligned blocks, largest groups first, then whole documents) already puts
    # every group at one index on all its GPUs: no filler, the PP 1 lists as they are.
    aligned, packed = _positions(plan)
    assert aligned == packed
    groups_met = {tuple(i for i in index if plan.microbatches[i].size > 1) for index in aligned.values()}
    assert len(groups_met) > 1  # ranks meet different groups, at their own indices
    for warmup in (1, 2, 3):  # the stages of a PP 4 pipeline
        assert not _pipeline_deadlocks(plan, aligned, warmup)
    # The same microbatches in another order, which PP 1 runs without a deadlock: whole documents
    # between a GPU's groups put a group at different indices on its GPUs. Aligned, fillers take the
    # holes and 1F1B cannot deadlock; packed, it can (the check above can fail).
    shuffled = HybridPlan([plan.microbatches[i] for i in rng.permutation(len(plan.microbatches))], plan.group_size,
                          plan.gpu_cost, plan.num_gpus)
    assert _run_in_order(shuffled) == len(plan.microbatches)
    aligned, packed = _positions(shuffled)
    assert any(max(index.values()) + 1 > len(index) for index in aligned.values())  # fillers occur
    assert not any(_pipeline_deadlocks(shuffled, aligned, w) for w in (1, 2, 3))
    assert any(_pipeline_deadlocks(shuffled, packed, w) for w in (1, 2, 3))


def _placements_by_loop(plan, aligned: bool) -> tuple[np.ndarray, ...]:
    """`HybridPlan.placements` written as the loop it replaces (one microbatch and GPU at a time)."""
    rows: list[list[int]] = [[], [], [], [], []]
    count = np.zeros(plan.num_gpus, dtype=np.int64)
    slots = plan.slots() if aligned else None
    for i, mb in enumerate(plan.microbatches):
        for r, g in enumerate(mb.gpus()):
            at = int(count[g]) if slots is None else int(slots[i])
            for d in mb.docs.tolist():
                for col, v in zip(rows, (d, g, at, mb.size, r), strict=True):
                    col.append(v)
            count[g] = at + 1
    return (*(np.asarray(c, dtype=np.int64) for c in rows), count)


@pytest.mark.parametrize("seed", [0, 1])
def test_placements_are_one_row_per_document_and_gpu_as_the_loop_gives_them(seed) -> None:
    from megascale_data_ext.dataplane.balancers.hybrid_cp import HybridPlan

    rng = np.random.default_rng(seed)
    lens = rng.permutation(np.concatenate([rng.integers(1100, 2000, 12), rng.integers(2100, 4000, 6),
                                           rng.integers(4200, 8000, 2), rng.integers(50, 1000, 150)]))
    plan = balance_hybrid_cp(lens, 16, 1024, CPCost(linear=100.0, quadratic=1.0, cp_comm=200.0))
    shuffled = HybridPlan([plan.microbatches[i] for i in rng.permutation(len(plan.microbatches))], plan.group_size,
                          plan.gpu_cost, plan.num_gpus)
    for p in (plan, shuffled):
        for aligned in (False, True):
            got, want = p.placements(aligned=aligned), _placements_by_loop(p, aligned)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
    docs, gpu, _, size, place, _ = plan.placements()
    assert np.bincount(docs, minlength=len(lens)).tolist() == plan.group_size.tolist()  # a document once per GPU
    assert ((place < size) & (gpu - place >= 0)).all()
