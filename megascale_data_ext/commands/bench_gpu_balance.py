"""`megascale-data bench gpu-balance`: does cost balancing buy measured step time on a GPU?

`bench balance` predicts speedups from a cost model; this command measures them. For each
workload (long-short, navit, coyo) and token cap, one stream of documents feeds `--dp`
simulated DP ranks twice: vanilla is what Megatron-LM trains on (GPTDataset's fixed windows:
the documents concatenated and cut every cap tokens, a document split at a window edge; m
windows per rank, window j·DP + r to rank r; `dataplane.workloads.megatron_windows`), balanced
is the stream's first documents filling `--fill` of DP × m × cap tokens, whole, split by
`--method` at the interleaved level under the cap, as `LLMBalance` (what does not fit waits
for the next step). Every rank's microbatches then run forward + backward serially on the one
local device through the project's own GPT (`trainer/model.py`), timed with CUDA events on a
GPU (bf16 autocast) and `time.perf_counter` on CPU (fp32). Vanilla's attention is Megatron's
default, one causal sequence per window (`--vanilla-attention window`), or per document piece as
with Megatron's ``--reset-attention-mask`` (`document`). With synchronous DP the
slowest rank sets the step, and the variants carry different token counts, so the speedup is
one of tokens per second of the step:

    speedup_measured  = (tokens balanced / max balanced rank time) / (tokens vanilla / max vanilla rank time)
    speedup_predicted = the same ratio of the cost model's rank predictions

`speedup_predicted` comes from a calibrated model with its fixed per-microbatch term: the fit
given by `--calibration` (written by `megascale-data profile --model`), else one this run
fits first on the profile step's packs (one long to many short documents, out of sample for
the rows); `speedup_predicted_flops` from the FLOPs model of the timed shape alone. The
balancer costs samples with the same calibration (`balanced_by`): on an H100 the FLOPs model
overweights long documents under flash attention and left balanced ranks 2–5% apart where the
calibrated split is within 0.3–3.5% (docs/benchmarks.md). Every microbatch timed in the rows is also a
calibration observation: the run ends by fitting one to them (in-sample, `self_fit`).

With no CUDA device the command runs a tiny CPU shape as a smoke test and says so; peak
memory is then not measured (null), and the per-document vs dense memory comparison of one
`--memory-pack`-token pack is reported as not measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from megascale_data_ext.commands import _profile_model as pm
from megascale_data_ext.dataplane.balancers import BalanceResult, balance_step, balancer_names
from megascale_data_ext.dataplane.calibration import CalibratedCost, fit_calibration, load_calibration
from megascale_data_ext.dataplane.costs import TransformerCost
from megascale_data_ext.dataplane.workloads import PAPER_WORKLOADS, fill_workload, megatron_windows, workload_names
from megascale_data_ext.errors import ConfigError

NAME = "bench gpu-balance"
HELP = ("Measured (CUDA events) vs predicted step speedup of cost balancing over vanilla, "
        "simulated DP ranks on one GPU (tiny CPU smoke shape without CUDA).")

Rank = list[list[int]]  # one rank's microbatches, each a list of document lengths
#: A microbatch whose host launch time reaches this share of its device time was launch-bound.
LAUNCH_BOUND = 0.9


@dataclass(slots=True, kw_only=True)
class Row:
    """One workload × cap: predicted and measured rank times of vanilla and balanced splits."""

    workload: str
    dp: int
    cap: int
    microbatches: int
    samples: int
    tokens: int
    tokens_vanilla: int
    speedup_measured: float
    speedup_predicted: float
    predicted_by: str
    speedup_predicted_flops: float
    max_over_mean_measured: float
    max_over_mean_predicted: float
    balanced_by: str
    vanilla_max_over_mean_measured: float
    rank_ms_vanilla: list[float]
    rank_ms_balanced: list[float]
    max_microbatch_tokens_vanilla: int
    max_microbatch_tokens_balanced: int
    peak_mem_gb: float | None
    speedup_predicted_fitted: float | None = None
    launch_bound_share: float | None = None
    _ranks: dict[str, list[Rank]] = field(default_factory=dict, repr=False)
    _mb_seconds: dict[str, list[list[float]]] = field(default_factory=dict, repr=False)

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the rows (and the run's device/shape) as JSON here")
    parser.add_argument("--dp", type=int, default=4, help="simulated DP ranks (default 4)")
    parser.add_argument("--caps", type=int, nargs="+", default=None,
                        help="token caps = context, one row per workload and cap (default 8192 on CUDA, 256 on CPU)")
    parser.add_argument("--workloads", nargs="+", default=None, choices=workload_names(),
                        help="workloads (default: coyo navit long-short)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per rank m (default 4)")
    parser.add_argument("--fill", type=float, default=0.9, help="fraction of DP×m×cap the batch fills (0.9)")
    parser.add_argument("--method", default="kk", choices=balancer_names(), help="balancer (default kk)")
    parser.add_argument("--vanilla-attention", choices=("window", "document"), default="window",
                        help="vanilla's attention: one causal sequence per fixed window (Megatron's default) or "
                             "per document piece (Megatron's --reset-attention-mask)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per rank, median kept "
                                                                    "(default 3 on CUDA, 1 on CPU)")
    parser.add_argument("--calibration", type=Path, help="a fit from `megascale-data profile --model`: predict "
                                                         "and balance with it instead of the FLOPs model")
    parser.add_argument("--calibration-out", type=Path,
                        help="without --calibration: save the fit of this run's profile step here")
    pm.add_shape_arguments(parser)
    parser.add_argument("--memory-pack", type=int, default=8192,
                        help="tokens of the pack whose peak memory is compared per-document vs dense (CUDA only; "
                             "0 skips it)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")


def _check(args: argparse.Namespace, caps: list[int]) -> None:
    problems = [f"--{k} must be >= 1, got {v}" for k, v in (("dp", args.dp), ("microbatches", args.microbatches))
                if v < 1]
    problems += [f"--caps must be >= 16 tokens, got {c}" for c in caps if c < 16]
    if not 0 < args.fill <= 1:
        problems.append(f"--fill must be in (0, 1], got {args.fill}")
    if args.repeats is not None and args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    if args.device == "cuda" and not pm.cuda_available():
        problems.append("--device cuda: torch sees no CUDA device on this machine; drop --device to run the CPU smoke")
    if problems:
        raise ConfigError("bench gpu-balance: " + "; ".join(problems))


def _ranks(res: BalanceResult, lens: np.ndarray, dp: int, m: int) -> list[Rank]:
    """Each rank's non-empty microbatches as document lengths, in delivery order."""
    out = []
    for r in range(dp):
        mbs = [lens[res.members(r, j)].astype(int).tolist() for j in range(m)]
        out.append([mb for mb in mbs if mb])
    return out


def flops_per_rank(ranks: list[Rank], cost: TransformerCost) -> np.ndarray:
    """Each rank's cost under `cost`: the sum over its microbatches' samples."""
    return np.array([sum(float(cost(np.asarray(mb)).sum()) for mb in rank) for rank in ranks])


def _predicted(ranks: list[Rank], model: CalibratedCost | TransformerCost) -> np.ndarray:
    if isinstance(model, CalibratedCost):
        return np.array([model.predict([rank])[0] if rank else 0.0 for rank in ranks])
    return flops_per_rank(ranks, model)


def speedup(vanilla: np.ndarray, balanced: np.ndarray, token_ratio: float = 1.0) -> float:
    """Step throughput of balancing over vanilla: the slowest vanilla rank over the slowest
    balanced one, times balanced tokens / vanilla tokens (the steps carry different amounts)."""
    return float(vanilla.max() / balanced.max() * token_ratio) if balanced.max() > 0 else float("nan")


def tokens_of(ranks: list[Rank]) -> int:
    return int(sum(sum(mb) for rank in ranks for mb in rank))


def plan_row(name: str, *, dp: int, m: int, cap: int, fill: float, seed: int, method: str,
             cost: CalibratedCost | TransformerCost, vanilla_attention: str = "window"
             ) -> tuple[dict[str, list[Rank]], int, int]:
    """Megatron's windows and the balanced split of one document stream: ({variant: ranks},
    balanced samples, balanced tokens). With ``vanilla_attention="window"`` a window is one
    document of its length (attention across the pieces, Megatron's default)."""
    stream = fill_workload(name, dp * m * cap + cap, seed=seed, context=cap).seq_lens()  # >= DP·m full windows
    windows = megatron_windows(stream, cap, dp * m)
    if vanilla_attention == "window":
        windows = [[sum(w)] for w in windows]
    vanilla = [[windows[j * dp + r] for j in range(m)] for r in range(dp)]  # Megatron's sampler: mb j of rank r
    lens = stream[:int(np.searchsorted(np.cumsum(stream), int(fill * dp * m * cap), side="right"))]
    balanced = balance_step(cost(lens), tokens=lens, num_buckets=dp, num_microbatches=m, cap=cap, method=method,
                            level="interleaved")
    return {"vanilla": vanilla, "balanced": _ranks(balanced, lens, dp, m)}, len(lens), int(lens.sum())


def _measure(timer: pm.ModelTimer, ranks: dict[str, list[Rank]], repeats: int, *, seed: int = 0
             ) -> dict[str, tuple[np.ndarray, list[list[float]], list[list[float]], list[list[list[float]]]]]:
    """Per variant: median seconds per rank over `repeats` serial runs, each microbatch's median
    device and host (launch) seconds, and every run's seconds per microbatch.

    Every repeat times all (variant, rank) pairs in a fresh random order, so neither drift in the
    machine's speed nor what ran just before (allocator, caches, clocks) sides with a rank or a variant.
    """
    pairs = [(v, r) for v in ranks for r in range(len(ranks[v])) if ranks[v][r]]
    runs: dict[tuple[str, int], list[list[float]]] = {pair: [] for pair in pairs}
    hosts: dict[tuple[str, int], list[list[float]]] = {pair: [] for pair in pairs}
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        for i in rng.permutation(len(pairs)):
            v, r = pairs[i]
            runs[v, r].append(timer.time_rank(ranks[v][r]))
            hosts[v, r].append(timer.host_seconds)
    out = {}
    for v, variant in ranks.items():
        def median_per_mb(store: dict[tuple[str, int], list[list[float]]], r: int, rank: Rank) -> list[float]:
            return [statistics.median(run[j] for run in store[v, r]) for j in range(len(rank))] if rank else []

        per_mb = [median_per_mb(runs, r, rank) for r, rank in enumerate(variant)]
        host_mb = [median_per_mb(hosts, r, rank) for r, rank in enumerate(variant)]
        every = [[[run[j] for run in runs[v, r]] for j in range(len(rank))] if rank else []
                 for r, rank in enumerate(variant)]
        out[v] = (np.array([sum(mbs) for mbs in per_mb]), per_mb, host_mb, every)
    return out


def _memory_rows(shape: pm.ModelShape, tokens: int, on_row: Callable[[list[dict[str, Any]]], None] = lambda _: None
                 ) -> list[dict[str, Any]]:
    """Peak memory of one `tokens`-token pack of 32 documents, per-document vs dense (CUDA only);
    `on_row` sees the rows so far after each (the dense one may run out of memory)."""
    docs = max(1, min(32, tokens))
    pack = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    per_doc = pm.per_document_backend(shape.device)
    kinds = [per_doc or "per-document", "dense"]

    def unmeasured(kind: str, note: str) -> dict[str, Any]:
        return {"attention": kind, "tokens": tokens, "docs": docs, "peak_mem_gb": None, "ms": None, "note": note}

    if not shape.device.startswith("cuda"):
        return [unmeasured(k, "not measured (no CUDA device: CPU smoke run)") for k in kinds]
    import torch

    rows = [] if per_doc else [unmeasured("per-document", "not measured: trainer/model.py offers no per-document "
                                                          "attention")]
    for kind in kinds[0 if per_doc else 1:]:
        timer = None
        try:
            timer = pm.ModelTimer(pm.ModelShape(**{**asdict(shape), "attention": kind, "seq": max(shape.seq, tokens)}))
            timer.time_rank([pack])  # warm-up
            timer.reset_peak_memory()
            ms = timer.time_rank([pack])[0] * 1e3
            rows.append({"attention": kind, "tokens": tokens, "docs": docs, "peak_mem_gb": timer.peak_memory_gb(),
                         "ms": ms, "note": "torch.cuda.max_memory_allocated over one forward+backward"})
        except torch.cuda.OutOfMemoryError as exc:  # the dense S×S mask at long packs: a result, not a crash
            rows.append(unmeasured(kind, f"out of GPU memory: {str(exc).splitlines()[0][:200]}"))
        on_row(rows)
        del timer
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _self_fit(rows: list[Row], shape: pm.ModelShape) -> dict[str, Any] | None:
    """Fit a calibration to every microbatch timed in this run; set each row's fitted prediction."""
    obs = [[mb] for row in rows for v in ("vanilla", "balanced") for rank in row._ranks[v] for mb in rank]
    secs = [s for row in rows for v in ("vanilla", "balanced") for rank in row._mb_seconds[v] for s in rank]
    try:
        model, report = fit_calibration(obs, secs, fitted_for=shape.fitted_for())
    except ConfigError as exc:  # too few or too uniform microbatches (e.g. one tiny row)
        return {"error": str(exc)}
    for row in rows:
        row.speedup_predicted_fitted = speedup(_predicted(row._ranks["vanilla"], model),
                                                _predicted(row._ranks["balanced"], model),
                                                row.tokens / row.tokens_vanilla)
    return {**model.to_dict(), "report": report.to_dict()}


def format_table(rows: list[Row]) -> str:
    head = ["workload", "DP", "cap", "tokens (vanilla / balanced)", "speedup measured (tokens/s)",
            "predicted (calibrated)", "predicted (FLOPs)",
            "predicted (self-fit)", "max/mean measured (vanilla → balanced)", "max MB tokens (vanilla / balanced)",
            "peak GB", "launch-bound MBs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fitted = "n/a" if r.speedup_predicted_fitted is None else f"{r.speedup_predicted_fitted:.3f}×"
        lines.append("| " + " | ".join([
            r.workload, str(r.dp), str(r.cap), f"{r.tokens_vanilla} / {r.tokens}", f"{r.speedup_measured:.3f}×",
            f"{r.speedup_predicted:.3f}×", f"{r.speedup_predicted_flops:.3f}×", fitted,
            f"{r.vanilla_max_over_mean_measured:.3f} → {r.max_over_mean_measured:.3f}",
            f"{r.max_microbatch_tokens_vanilla} / {r.max_microbatch_tokens_balanced}",
            "null (CPU)" if r.peak_mem_gb is None else f"{r.peak_mem_gb:.2f}",
            "n/a (CPU)" if r.launch_bound_share is None else f"{100 * r.launch_bound_share:.0f}%",
        ]) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if pm.cuda_available() else "cpu")
    cuda = device == "cuda"
    caps = args.caps or ([8192] if cuda else [pm.CPU_SMOKE["seq"]])
    _check(args, caps)
    repeats = args.repeats or (3 if cuda else 1)
    workloads = args.workloads or list(PAPER_WORKLOADS)
    calibration = load_calibration(args.calibration) if args.calibration else None
    shape = pm.resolve_shape(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab,
                             seq=max(caps), attention=args.attention, device=device)
    flops = TransformerCost(shape.cost_config())
    predicted_by = f"calibrated:{args.calibration}" if calibration else "calibrated:profile step of this run"
    balanced_by = predicted_by  # the balancer costs samples with the same calibration
    if calibration is not None:
        for problem in calibration.mismatches(device=shape.device, hidden=shape.hidden, layers=shape.layers,
                                              attention=shape.attention, dtype=shape.dtype):
            print(f"warning: --calibration {args.calibration}: {problem}", file=sys.stderr)

    def plan_rows(cost: CalibratedCost | TransformerCost) -> list[tuple[str, int, dict[str, list[Rank]], int, int]]:
        return [(name, cap, *plan_row(name, dp=args.dp, m=args.microbatches, cap=cap, fill=args.fill, seed=args.seed,
                                      method=args.method, cost=cost, vanilla_attention=args.vanilla_attention))
                for name in workloads for cap in caps]

    kind = "" if cuda else " — CPU smoke test (tiny shape; not a GPU measurement)"
    print(f"bench gpu-balance on {shape.describe()}{kind}; DP {args.dp} × m {args.microbatches}, fill {args.fill}, "
          f"balancer {args.method} interleaved, {repeats} timed run(s) per rank, "
          f"{'CUDA events' if cuda else 'time.perf_counter, 1 torch thread'}")
    rows: list[Row] = []
    results = JsonReport(args.json, {
        "device": shape.device, "device_name": pm.device_name(shape.device), "smoke": not cuda,
        "torch": pm.torch_version(), "command": getattr(args, "_command_line", NAME),
        "shape": asdict(shape), "timing": "cuda events" if cuda else "time.perf_counter",
        "peak_mem_source": "torch.cuda.max_memory_allocated" if cuda else "null: not measured on CPU",
        "fill": args.fill, "seed": args.seed, "method": args.method, "repeats": repeats,
        "vanilla": f"Megatron's fixed windows of cap tokens, attention per {args.vanilla_attention}",
        "calibration": str(args.calibration) if args.calibration else None,
        # every timed microbatch as [workload, cap, variant, rank, document lengths, median device seconds,
        # median host launch seconds, device seconds of every run]: refit a cost model offline
        "observations": {"profile": [], "rows": []}})
    with pm.single_process_megatron(device=shape.device):
        timer = pm.ModelTimer(shape)
        if calibration is None:
            packs = pm.profile_packs(max(caps), seed=args.seed)
            seconds = pm.measure_packs(timer, packs, repeats=repeats)  # warms up kernels and allocator too
            calibration, report = fit_calibration([[p] for p in packs], seconds, fitted_for=shape.fitted_for())
            print("profile step (calibration for speedup_predicted):\n"
                  + pm.fit_report_lines(calibration, report, shape, packs) + "\n")
            if args.calibration_out:
                calibration.save(args.calibration_out)
            results.header["observations"]["profile"] = [[[int(d) for d in p], s] for p, s in zip(packs, seconds,
                                                                                                   strict=True)]
        else:
            timer.time_rank([[max(caps)]])  # warm-up: kernels, allocator
        # balanced with what was measured (fixed per-microbatch time, the kernel's real attention cost),
        # never the FLOPs model; every microbatch of both variants is <= its cap (= shape.seq)
        for name, cap, ranks, samples, tokens in plan_rows(calibration):
            timer.reset_peak_memory()
            measured = _measure(timer, ranks, repeats, seed=args.seed)
            peak = timer.peak_memory_gb()
            van, bal = measured["vanilla"][0], measured["balanced"][0]
            ratio = tokens / tokens_of(ranks["vanilla"])
            predicted_bal = _predicted(ranks["balanced"], calibration)
            results.header["observations"]["rows"] += [
                [name, cap, v, r, mb, measured[v][1][r][j], measured[v][2][r][j], measured[v][3][r][j]]
                for v in ranks for r, rank in enumerate(ranks[v]) for j, mb in enumerate(rank)]
            launch_bound = [h >= LAUNCH_BOUND * d for v in ranks for r in range(len(ranks[v]))
                            for d, h in zip(measured[v][1][r], measured[v][2][r], strict=True)]
            rows.append(Row(
                workload=name, dp=args.dp, cap=cap, microbatches=args.microbatches, samples=samples, tokens=tokens,
                tokens_vanilla=tokens_of(ranks["vanilla"]), speedup_measured=speedup(van, bal, ratio),
                speedup_predicted=speedup(_predicted(ranks["vanilla"], calibration),
                                           _predicted(ranks["balanced"], calibration), ratio),
                predicted_by=predicted_by,
                speedup_predicted_flops=speedup(flops_per_rank(ranks["vanilla"], flops),
                                                 flops_per_rank(ranks["balanced"], flops), ratio),
                max_over_mean_measured=float(bal.max() / bal.mean()),
                max_over_mean_predicted=float(predicted_bal.max() / predicted_bal.mean()), balanced_by=balanced_by,
                vanilla_max_over_mean_measured=float(van.max() / van.mean()),
                rank_ms_vanilla=(van * 1e3).round(3).tolist(), rank_ms_balanced=(bal * 1e3).round(3).tolist(),
                max_microbatch_tokens_vanilla=max(sum(mb) for rank in ranks["vanilla"] for mb in rank),
                max_microbatch_tokens_balanced=max(sum(mb) for rank in ranks["balanced"] for mb in rank),
                peak_mem_gb=peak,
                launch_bound_share=sum(launch_bound) / max(1, len(launch_bound)) if cuda else None,
                _ranks=ranks, _mb_seconds={v: measured[v][1] for v in measured},
            ))
            results.header["calibration_used"] = calibration.to_dict()
            results.write(rows)
        del timer
        self_fit = _self_fit(rows, shape)
        results.write(rows, self_fit=self_fit)
        memory = _memory_rows(shape, args.memory_pack, on_row=lambda done: results.write(
            rows, self_fit=self_fit, memory=done)) if args.memory_pack > 0 else []
    print(f"predicted (calibrated) by {predicted_by}\n" + format_table(rows))
    if self_fit and "report" in self_fit:
        rep, co = self_fit["report"], self_fit["coefficients"]
        print(f"\nself-fit over {rep['observations']} timed microbatches: fixed {co['fixed_s'] * 1e3:.3f} ms, "
              f"Pearson r {'n/a' if rep['pearson_r'] is None else round(rep['pearson_r'], 4)}, "
              f"mean |error| {rep['mean_abs_pct_error']:.1f}% (in-sample)")
    for mem in memory:
        gb = mem["note"] if mem["peak_mem_gb"] is None else f"{mem['peak_mem_gb']:.2f} GB, {mem['ms']:.1f} ms"
        print(f"peak memory, {mem['tokens']}-token pack of {mem['docs']} documents, {mem['attention']}: {gb}")
    results.write(rows, self_fit=self_fit, memory=memory, complete=True)
    return 0


@dataclass(slots=True)
class JsonReport:
    """The run's JSON, rewritten after every row and stage: one OOM or timeout late in the run
    (the dense memory row is last) must not lose the rows already measured."""

    path: Path | None
    header: dict[str, Any]

    def write(self, rows: list[Row], *, self_fit: dict[str, Any] | None = None,
              memory: list[dict[str, Any]] | None = None, complete: bool = False) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        device = self.header.get("device_name")
        tmp.write_text(json.dumps({**self.header, "complete": complete,
                                   "rows": [{**r.public(), "device": device} for r in rows],
                                   "self_fit": self_fit, "memory": memory or []}, indent=1))
        tmp.replace(self.path)
