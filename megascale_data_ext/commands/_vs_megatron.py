"""`bench balance --vs megatron`: the planner's balancing against megatron-core's own (issue 26).

megatron-core 0.16 balances data for ``--hybrid-context-parallel`` with `BalancedCPScheduler`
(`pipeline_parallel/hybrid_cp_schedule.py`): every sequence gets its own CP size (the next
power of two of its length over ``max_seqlen_per_dp_cp_rank``) and sub-samples are grouped so
every DP×CP GPU carries about the same s² work; each GPU runs one forward/backward per
sub-sample. Here it runs planning only, on a stand-in process group of `gpus` ranks, against
the project's planner at one CP size (CP 1: every document of these batches fits one GPU's
cap): KK at the interleaved level, exactly m microbatches per GPU under the cap, as
`LLMBalance` — and, as Megatron's condition for its own scheduler (a per-token loss) allows,
as many microbatches per GPU as its documents need (`balancers.variable_count`); where that
plan stays above what any count could reach, exactly m is planned too and the cost model keeps
the cheaper (`planner_max`, timed as `planner_ms`; both plans' costs are also reported). Vanilla is Megatron's fixed windows of cap tokens cut from the same documents,
attention over the whole window, window w to GPU w mod `gpus`.

Per GPU the cost of the step is summed under one of two cost models (`megatron_max`, as the
issue defines it); `megatron_step` adds what Megatron's schedule also does, a barrier over all
DP×CP ranks after every group, so its step is the sum over groups of each group's slowest GPU:

* ``s2``: Megatron's own estimator, s² per sequence (s²/g per GPU for a sequence over g GPUs);
* ``calibrated``: seconds ``fixed + linear·s + quadratic·s²`` fitted on an H100 (the profile
  step of `docs/results/gpu_balance.json`), the fixed term paid once per forward/backward: per
  microbatch for the planner and vanilla, per sub-sample for Megatron, which runs each
  sequence separately; a sequence over g GPUs costs each of them 1/g of its tokens' terms.

Neither model has a CP-communication term; the issue asks for one, and for hybrid CP in the
planner, which does not exist yet: this compares what exists. The variable-count plan exists
in the planner's balancers only: the trainer side still runs m microbatches per rank.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.balancers import balance_step
from megascale_data_ext.dataplane.balancers.variable_count import balance_variable_count, lower_bound, step_cost
from megascale_data_ext.dataplane.workloads import fill_workload, megatron_windows

#: The H100 profile-step fit (hidden 2048, 8 layers, bf16, flash varlen; docs/results/gpu_balance.json).
H100_FIT = {"fixed_s": 0.0398, "linear_s_per_token": 4.125e-6, "quadratic_s_per_token2": 2.564e-10}
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
    planner_exact_max: float
    planner_variable_max: float
    variable_chosen: float
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


def _terms(model: str) -> tuple[float, float, float]:
    if model == "s2":
        return 0.0, 0.0, 1.0
    return H100_FIT["fixed_s"], H100_FIT["linear_s_per_token"], H100_FIT["quadratic_s_per_token2"]


def megatron_gpu_costs(lens: np.ndarray, gpus: int, cap: int, model: str) -> tuple[np.ndarray, float, float]:
    """Per-GPU cost of megatron-core's hybrid-CP grouping of `lens`, the step's cost with the
    barrier its schedule puts after every group (Σ over groups of the group's slowest GPU), and
    its planning ms."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    fixed, linear, quad = _terms(model)
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=_Group(gpus))
    t0 = time.perf_counter()
    _, sample_id_groups = scheduler.get_groups_and_subsamples([(i, int(s)) for i, s in enumerate(lens)], None)
    ms = (time.perf_counter() - t0) * 1e3
    cost, step = np.zeros(gpus), 0.0
    for per_gpu in sample_id_groups:
        share: dict[int, int] = {}
        for ids in per_gpu:
            for i in ids:
                share[i] = share.get(i, 0) + 1  # how many GPUs of the group split sample i
        group = np.zeros(gpus)
        for g, ids in enumerate(per_gpu):
            for i in ids:
                s = float(lens[i])
                group[g] += fixed + (linear * s + quad * s * s) / share[i]
        cost += group
        step += float(group.max())
    return cost, step, ms


def planner_gpu_costs(lens: np.ndarray, gpus: int, m: int, cap: int, model: str) -> tuple[np.ndarray, float]:
    """Per-GPU cost of the planner's split (KK interleaved, m microbatches, cap), and its ms."""
    fixed, linear, quad = _terms(model)
    s = lens.astype(np.float64)
    t0 = time.perf_counter()
    res = balance_step(linear * s + quad * s * s, tokens=lens, num_buckets=gpus, num_microbatches=m, cap=cap,
                       method="kk", level="interleaved")
    ms = (time.perf_counter() - t0) * 1e3
    return step_cost(res, fixed), ms


def planner_per_token_gpu_costs(lens: np.ndarray, gpus: int, m: int, cap: int, model: str
                                ) -> tuple[np.ndarray, str, float, np.ndarray | None]:
    """What the planner does where the loss is per token: as many microbatches per GPU as its
    documents need, unless that plan stays above the bound any count can reach (`lower_bound`,
    within 0.1 %), in which case exactly m is planned too and the cheaper kept. Returns the chosen
    per-GPU costs, which it was (``"variable"`` / ``"exact"``), the planning ms of this decision,
    and the variable plan's costs."""
    fixed, linear, quad = _terms(model)
    s = lens.astype(np.float64)
    costs = linear * s + quad * s * s
    t0 = time.perf_counter()
    variable = step_cost(balance_variable_count(costs, lens, gpus, cap, fixed=fixed), fixed)
    if variable.max() <= lower_bound(costs, lens, gpus, cap, fixed) * BOUND_SLACK:
        return variable, "variable", (time.perf_counter() - t0) * 1e3, variable
    res = balance_step(costs, tokens=lens, num_buckets=gpus, num_microbatches=m, cap=cap, method="kk",
                       level="interleaved")
    exact = step_cost(res, fixed)
    ms = (time.perf_counter() - t0) * 1e3
    return (variable, "variable", ms, variable) if variable.max() < exact.max() else (exact, "exact", ms, variable)


def vanilla_gpu_costs(lens: np.ndarray, gpus: int, cap: int, model: str) -> np.ndarray:
    """Per-GPU cost of Megatron's fixed windows of the same documents (window w to GPU w mod gpus)."""
    fixed, linear, quad = _terms(model)
    windows = megatron_windows(lens, cap, -(-int(lens.sum()) // cap))
    cost = np.zeros(gpus)
    for w, pieces in enumerate(windows):
        n = float(sum(pieces))
        cost[w % gpus] += fixed + linear * n + quad * n * n
    return cost


def compare(workload: str, gpus: int, cap: int, model: str, *, m: int = 4, batches: int = 20, fill: float = 0.9,
            seed: int = 0) -> VsRow:
    """Medians over `batches` global batches of `workload` filling `fill` of gpus × m × cap tokens."""
    p_max, g_max, g_step, v_max, p_mom, g_mom, p_ms, g_ms = [], [], [], [], [], [], [], []
    e_max, var_max, chose = [], [], []
    for b in range(batches):
        lens = fill_workload(workload, int(fill * gpus * m * cap), seed=seed + b, context=cap).seq_lens()
        exact, _ = planner_gpu_costs(lens, gpus, m, cap, model)  # reported beside the choice
        planner, which, pms, variable = planner_per_token_gpu_costs(lens, gpus, m, cap, model)
        e_max.append(float(exact.max()))
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
                 planner_max=med(p_max), planner_exact_max=med(e_max),
                 planner_variable_max=med(var_max), variable_chosen=sum(chose) / len(chose),
                 megatron_max=med(g_max), megatron_step=med(g_step), vanilla_max=med(v_max),
                 planner_max_over_mean=med(p_mom), megatron_max_over_mean=med(g_mom),
                 planner_ms=med(p_ms), megatron_ms=med(g_ms))


def format_table(rows: list[VsRow]) -> str:
    head = ["workload", "GPUs", "cap", "cost", "planner max / Megatron max", "exactly m / Megatron",
            "variable chosen", "planner max / Megatron step (barriers)",
            "vanilla max / Megatron max",
            "max/mean planner", "max/mean Megatron", "planner ms", "Megatron ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.workload, str(r.gpus), str(r.cap), r.cost_model, f"{r.planner_max / r.megatron_max:.4f}",
            f"{r.planner_exact_max / r.megatron_max:.3f}", f"{r.variable_chosen:.0%}",
            f"{r.planner_max / r.megatron_step:.3f}",
            f"{r.vanilla_max / r.megatron_max:.3f}", f"{r.planner_max_over_mean:.3f}",
            f"{r.megatron_max_over_mean:.3f}", f"{r.planner_ms:.1f}", f"{r.megatron_ms:.1f}"]) + " |")
    return "\n".join(lines)
