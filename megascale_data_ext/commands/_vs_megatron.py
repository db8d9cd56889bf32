"""`bench balance --vs megatron`: the planner's balancing against megatron-core's own (issue 26).

megatron-core 0.16 balances data for ``--hybrid-context-parallel`` with `BalancedCPScheduler`
(`pipeline_parallel/hybrid_cp_schedule.py`): every sequence gets its own CP size (the next
power of two of its length over ``max_seqlen_per_dp_cp_rank``) and sub-samples are grouped so
every DP×CP GPU carries about the same s² work; each GPU runs one forward/backward per
sub-sample. Here it runs planning only, on a stand-in process group of `gpus` ranks, against
the planner's hybrid CP (`balancers.hybrid_cp`: each document its own power-of-two group of
GPUs, short ones whole on one GPU, as many microbatches per GPU as its documents need, which a
per-token loss allows — Megatron's condition for its own scheduler). Where no document was split
and the hybrid plan stays above what any count could reach, exactly m microbatches per GPU are
planned too (KK interleaved, as `LLMBalance`) and the cost model keeps the cheaper
(`planner_max`, timed as `planner_ms`). Beside them: the planner at one CP size for the whole
job, the smallest that fits the longest document (what the project did before hybrid CP;
`planner_fixed_cp_max`), and vanilla, Megatron's fixed windows of cap tokens cut from the same
documents, attention over the whole window, window w to GPU w mod `gpus`.

Per GPU the cost of the step is summed under one of two cost models (`cost_terms`; the
slowest GPU is `*_max`); `megatron_step` adds what Megatron's schedule also does, a barrier over
all DP×CP ranks after every group, so its step is the sum over groups of each group's slowest GPU:

* ``s2``: Megatron's own estimator, s² per sequence (s²/g per GPU for a sequence over g GPUs);
* ``calibrated``: seconds ``fixed + per_document + (linear·s + quadratic·s²)/g + cp_comm·s·(g-1)/g``:
  fixed, linear and quadratic fitted on an H100 (the profile step of
  `docs/results/gpu_balance.json`), per_document fitted on the same GPU run's profile packs
  (0.11 ms), cp_comm *estimated*, not measured (`CP_COMM_S_PER_TOKEN`); the fixed term is paid
  once per forward/backward: per microbatch for the planner and vanilla, per sub-sample for
  Megatron, which runs each sequence separately. Vanilla's windows pay no per-document term
  (one attention over the window).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.balancers import balance_step
from megascale_data_ext.dataplane.balancers.hybrid_cp import CPCost, balance_hybrid_cp, group_sizes
from megascale_data_ext.dataplane.balancers.variable_count import balance_variable_count, lower_bound, step_cost
from megascale_data_ext.dataplane.workloads import LONG_TAIL_SPAN, fill_workload, megatron_windows

#: The H100 profile-step fit (hidden 2048, 8 layers, bf16, flash varlen; docs/results/gpu_balance.json).
H100_FIT = {"fixed_s": 0.0398, "linear_s_per_token": 4.125e-6, "quadratic_s_per_token2": 2.564e-10}
#: Per document and GPU, fitted on the same H100 run's profile packs (docs/benchmarks.md, issue 18).
PER_DOCUMENT_S = 1.1e-4
#: CP's ring exchange per token of the other GPUs' K/V, an estimate from bandwidth, not measured:
#: hidden 2048 × 8 layers × K and V in bf16 = 64 KiB a token forward, ~3× with the backward's
#: K/V and dK/dV, over ~450 GB/s of NVLink a direction. Ring attention overlaps much of it with
#: compute, so as a cost it is an upper bound.
CP_COMM_S_PER_TOKEN = 3 * 64 * 1024 / 450e9
COST_MODELS = ("s2", "calibrated")
#: A variable-count plan within this factor of the lower bound is kept without planning exactly m.
BOUND_SLACK = 1.001


@dataclass(slots=True, kw_only=True)
class VsRow:
    workload: str
    gpus: int
    cap: int
    cost_model: str
    batches: int
    planner_max: float
    planner_exact_max: float | None
    planner_variable_max: float
    variable_chosen: float
    planner_fixed_cp_max: float
    fixed_cp_size: int
    documents_split: float
    megatron_max: float
    megatron_step: float
    vanilla_max: float
    planner_max_over_mean: float
    megatron_max_over_mean: float
    planner_ms: float
    megatron_ms: float

    def public(self) -> dict[str, Any]:
        return asdict(self)


class _Group:
    """The DP×CP process group `BalancedCPScheduler` reads only the size of (planning only)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def cost_terms(model: str) -> CPCost:
    """The cost model `model` names (``s2`` or ``calibrated``), as every side is charged."""
    if model == "s2":
        return CPCost()
    return CPCost(fixed=H100_FIT["fixed_s"], per_document=PER_DOCUMENT_S, linear=H100_FIT["linear_s_per_token"],
                  quadratic=H100_FIT["quadratic_s_per_token2"], cp_comm=CP_COMM_S_PER_TOKEN)


def megatron_gpu_costs(lens: np.ndarray, gpus: int, cap: int, model: str) -> tuple[np.ndarray, float, float]:
    """Per-GPU cost of megatron-core's hybrid-CP grouping of `lens`, the step's cost with the
    barrier its schedule puts after every group (Σ over groups of the group's slowest GPU), and
    its planning ms."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    cost = cost_terms(model)
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=_Group(gpus))
    t0 = time.perf_counter()
    _, sample_id_groups = scheduler.get_groups_and_subsamples([(i, int(s)) for i, s in enumerate(lens)], None)
    ms = (time.perf_counter() - t0) * 1e3
    total, step = np.zeros(gpus), 0.0
    for per_gpu in sample_id_groups:
        share: dict[int, int] = {}
        for ids in per_gpu:
            for i in ids:
                share[i] = share.get(i, 0) + 1  # how many GPUs of the group split sample i
        group = np.zeros(gpus)
        for g, ids in enumerate(per_gpu):
            for i in ids:
                group[g] += cost.fixed + float(cost.per_gpu(lens[i], share[i]))
        total += group
        step += float(group.max())
    return total, step, ms


def planner_gpu_costs(lens: np.ndarray, gpus: int, m: int, cap: int, model: str) -> tuple[np.ndarray, float]:
    """Per-GPU cost of the planner's split at CP 1 (KK interleaved, exactly m microbatches, cap),
    and its ms."""
    cost = cost_terms(model)
    t0 = time.perf_counter()
    res = balance_step(cost.per_gpu(lens, 1), tokens=lens, num_buckets=gpus, num_microbatches=m, cap=cap,
                       method="kk", level="interleaved")
    ms = (time.perf_counter() - t0) * 1e3
    return step_cost(res, cost.fixed), ms


def planner_per_token_gpu_costs(lens: np.ndarray, gpus: int, m: int, cap: int, model: str
                                ) -> tuple[np.ndarray, str, float, np.ndarray, int]:
    """What the planner does where the loss is per token: hybrid CP with as many microbatches
    per GPU as its documents need; where no document was split and that plan stays above the
    bound any count can reach (`lower_bound`, within 0.1 %), exactly m is planned too and the
    cheaper kept (not planned where the hybrid plan is within 0.1 % of exactly m's floor).
    Returns the chosen per-GPU costs, which it was (``"variable"`` / ``"exact"``),
    the planning ms of this decision, the hybrid plan's costs and how many documents it split."""
    cost = cost_terms(model)
    t0 = time.perf_counter()
    plan = balance_hybrid_cp(lens, gpus, cap, cost)
    hybrid, split = plan.gpu_cost, int((plan.group_size > 1).sum())
    costs = cost.per_gpu(lens, 1)
    # Exactly m costs at least its mean with every one of the gpus × m microbatches paying the
    # fixed cost (KK fills each when there are that many documents): no need to plan it where
    # the hybrid plan is already within BOUND_SLACK of that, or of what any count can reach.
    exact_floor = (float(costs.sum()) + cost.fixed * min(len(lens), gpus * m)) / gpus
    floor = max(lower_bound(costs, lens, gpus, cap, cost.fixed), exact_floor)
    if split or hybrid.max() <= floor * BOUND_SLACK:
        return hybrid, "variable", (time.perf_counter() - t0) * 1e3, hybrid, split
    res = balance_step(costs, tokens=lens, num_buckets=gpus, num_microbatches=m, cap=cap, method="kk",
                       level="interleaved")
    exact = step_cost(res, cost.fixed)
    ms = (time.perf_counter() - t0) * 1e3
    if hybrid.max() < exact.max():
        return hybrid, "variable", ms, hybrid, split
    return exact, "exact", ms, hybrid, split


def fixed_cp_gpu_costs(lens: np.ndarray, gpus: int, cap: int, model: str) -> tuple[np.ndarray, int]:
    """The planner at one CP size for the whole job, the smallest the longest document fits:
    every document split over a group of that size (its K/V exchanged), groups balanced as
    buckets of ``size × cap`` tokens with as many microbatches as they need. Per-GPU costs, size."""
    cost = cost_terms(model)
    size = int(group_sizes(lens, cap).max()) if len(lens) else 1
    groups = max(gpus // size, 1)
    padded = -(-lens // (2 * size)) * (2 * size) if size > 1 else lens
    res = balance_variable_count(cost.per_gpu(lens, size), padded, groups, size * cap, fixed=cost.fixed)
    return np.repeat(step_cost(res, cost.fixed), size)[:gpus], size


def vanilla_gpu_costs(lens: np.ndarray, gpus: int, cap: int, model: str) -> np.ndarray:
    """Per-GPU cost of Megatron's fixed windows of the same documents (window w to GPU w mod gpus),
    one attention over each window (no per-document or CP term)."""
    cost = cost_terms(model)
    windows = megatron_windows(lens, cap, -(-int(lens.sum()) // cap))
    out = np.zeros(gpus)
    for w, pieces in enumerate(windows):
        n = float(sum(pieces))
        out[w % gpus] += cost.fixed + cost.linear * n + cost.quadratic * n * n
    return out


def batch_lengths(workload: str, gpus: int, m: int, cap: int, fill: float, seed: int) -> np.ndarray:
    """One global batch filling `fill` of gpus × m × cap tokens; a long-tail batch's documents
    reach ``LONG_TAIL_SPAN × cap`` (2 % exceed the cap), the others are clipped to the cap."""
    context = LONG_TAIL_SPAN * cap if workload == "long-tail" else cap
    return fill_workload(workload, int(fill * gpus * m * cap), seed=seed, context=context).seq_lens()


def compare(workload: str, gpus: int, cap: int, model: str, *, m: int = 4, batches: int = 20, fill: float = 0.9,
            seed: int = 0) -> VsRow:
    """Medians over `batches` global batches of `workload` filling `fill` of gpus × m × cap tokens."""
    p_max, g_max, g_step, v_max, p_mom, g_mom, p_ms, g_ms = [], [], [], [], [], [], [], []
    e_max, var_max, chose, f_max, f_size, split = [], [], [], [], [], []
    for b in range(batches):
        lens = batch_lengths(workload, gpus, m, cap, fill, seed + b)
        if int(lens.max()) <= cap:  # exactly m at CP 1 exists only where every document fits a GPU
            e_max.append(float(planner_gpu_costs(lens, gpus, m, cap, model)[0].max()))
        planner, which, pms, variable, n_split = planner_per_token_gpu_costs(lens, gpus, m, cap, model)
        fixed_cp, size = fixed_cp_gpu_costs(lens, gpus, cap, model)
        f_max.append(float(fixed_cp.max()))
        f_size.append(size)
        split.append(n_split / len(lens))
        var_max.append(float(variable.max()))
        chose.append(which == "variable")
        megatron, gstep, gms = megatron_gpu_costs(lens, gpus, cap, model)
        vanilla = vanilla_gpu_costs(lens, gpus, cap, model)
        p_max.append(planner.max())
        g_max.append(megatron.max())
        g_step.append(gstep)
        v_max.append(vanilla.max())
        p_mom.append(planner.max() / planner.mean())
        g_mom.append(megatron.max() / megatron.mean())
        p_ms.append(pms)
        g_ms.append(gms)
    med = statistics.median
    return VsRow(workload=workload, gpus=gpus, cap=cap, cost_model=model, batches=batches,
                 planner_max=med(p_max), planner_exact_max=med(e_max) if e_max else None,
                 planner_variable_max=med(var_max), variable_chosen=sum(chose) / len(chose),
                 planner_fixed_cp_max=med(f_max), fixed_cp_size=max(f_size), documents_split=med(split),
                 megatron_max=med(g_max), megatron_step=med(g_step), vanilla_max=med(v_max),
                 planner_max_over_mean=med(p_mom), megatron_max_over_mean=med(g_mom),
                 planner_ms=med(p_ms), megatron_ms=med(g_ms))


def format_table(rows: list[VsRow]) -> str:
    head = ["workload", "GPUs", "cap", "cost", "planner max / Megatron max", "exactly m / Megatron",
            "variable chosen", "docs split", "one CP size / Megatron (size)", "planner max / Megatron step (barriers)",
            "vanilla max / Megatron max",
            "max/mean planner", "max/mean Megatron", "planner ms", "Megatron ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.workload, str(r.gpus), str(r.cap), r.cost_model, f"{r.planner_max / r.megatron_max:.4f}",
            "-" if r.planner_exact_max is None else f"{r.planner_exact_max / r.megatron_max:.3f}",
            f"{r.variable_chosen:.0%}", f"{r.documents_split:.1%}",
            f"{r.planner_fixed_cp_max / r.megatron_max:.3f} ({r.fixed_cp_size})",
            f"{r.planner_max / r.megatron_step:.3f}",
            f"{r.vanilla_max / r.megatron_max:.3f}", f"{r.planner_max_over_mean:.3f}",
            f"{r.megatron_max_over_mean:.3f}", f"{r.planner_ms:.1f}", f"{r.megatron_ms:.1f}"]) + " |")
    return "\n".join(lines)
