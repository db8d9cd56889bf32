"""`megascale-data simulate`: the real Planner over metadata-only loaders, up to 4,096 GPUs.

What runs is the production path minus the payloads: `runtime.planner.Planner` with a real
`ServiceConfig`, `ServiceTopology.of(config, ClientPlaceTree.from_sizes(...))`, the
registered ``vlm_balance`` strategy (Alg. 2: images over WORLD, packed sequences over DP),
the real Mixer, DGraph and balancers. Only the Source Loaders are simulated: a
`SimulatedSource` answers ``summarize(source, start, count)`` with a `SourceSummary` whose
text tokens and image patch counts come from the seeded navit-like generator of
`dataplane.workloads`, as a pure function of (seed, source, position).

World (paper Table 2: Llama-12B + ViT-2B, navit, 8k tokens, "batch 72 per GPU"):

* "72 per GPU" is read as `bench planner` reads it: a global batch of 72 x #GPUs samples
  (20,736 at 288 GPUs), i.e. 72 x TP x CP x PP samples per DP rank (2,304 with the layouts
  below). The planner's problem size (samples, images, DP buckets, WORLD encoder buckets,
  microbatches) is then the same as `bench planner`'s at 288 and 1,152 GPUs.
* Layouts keep TP 4 and add CP 2 (the paper's case study is PP 9 x DP 8 x CP 2 x TP 4) so
  that selective broadcasting matters; PP 4 keeps DP at Table 2's 9 and 36:
  64 = TP4·CP2·PP2·DP4 (smoke test), 288 = TP4·CP2·PP4·DP9, 1,152 = TP4·CP2·PP4·DP36,
  4,096 = TP4·CP2·PP4·DP128 (same samples per DP rank). Other sizes: TP4·CP2·PP4 when
  #GPUs divides by 32, else PP2; `--pp` overrides.
* 4 simulated sources, mixing weights 0.4 / 0.3 / 0.2 / 0.1 (`--sources N`: N equal ones), deterministic mixing;
  m = ceil(samples per DP x mean sequence length / (8192 x 0.9)) packed microbatches per DP
  rank (`bench planner`'s FILL), token cap 8192, `overflow="defer"`; the strategy's own
  balancers (`VLMBalance`'s defaults: KK for the sequences, greedy for the images); Megatron's reading
  stages (first and last; `--middle-stage-masks` adds the middle ones); no attention mask
  (THD kernels with `cu_seqlens`).

Per GPU count two Planners plan the same steps over the same sources: the default
``broadcast=("tp",)`` (Megatron's TP-rank-0 broadcast) and selective broadcasting
``broadcast=("tp", "cp")``. Their assignments must be identical (checked); fetchers are
``len(plan.fetch_ranks)`` of each.

Times: `plan()` of `--steps` steps after one warm-up step, median. ``planner_s`` is plan()
minus the time spent inside the simulated ``summarize`` (generating metadata stands in for a
loader RPC and is reported as ``summarize_s``); ``plan_call_s`` is the whole call and
``planner_cpu_s`` the planner's thread CPU time (wall time includes waiting for a core).
``serve_s`` is what the Planner actor also does per step, measured: every constructor's and
loader's view of the plan, pickled as Ray ships a reply (`serving_seconds`);
``planner_with_serving_s`` adds it, ``planner_with_rpc_s`` also the step's calls answered over Ray,
each round trip measured with a reply of its size (`_plan_rpc`; one loader actor per source). For Table 2
the cost() and balance() phases are also timed with `bench planner`'s own helper
(`time_setup`) on an equal-size navit batch. ``plan_peak_mib`` is the tracemalloc peak of one
more plan() call.

Bytes per step follow the byte model of `megascale_data_ext.dataplane.traffic` (constructor ->
fetching clients, as `DataConstructor.get` ships it), with c = CP copies when only TP broadcasts
and c = 1 with TP x CP selective broadcasting.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import pickle
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megascale_data_ext.commands._config_args import positive_int
from megascale_data_ext.commands._plan_rpc import rpc_cost, start_ray
from megascale_data_ext.commands._simulated_source import CONTEXT, WORKLOAD, SimulatedSource
from megascale_data_ext.commands.bench_planner import FILL, TABLE2, Setup, time_setup
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.plan import StepPlan
from megascale_data_ext.dataplane.summary import SourceSummary
from megascale_data_ext.dataplane.traffic import (
    PAD_TO_MULTIPLE_OF,
    encoder_bytes,
    plan_nbytes,
    reading_stages,
    step_bytes,
    step_totals,
)
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import encoder_rows
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.sources.base import SourceSpec

NAME = "simulate"
HELP = ("Run the real Planner over simulated metadata-only loaders at up to 4,096 GPUs: Table 2 side by side, "
        "planner time, fetching clients and bytes per step with and without selective broadcasting.")

PER_GPU = 72
WEIGHTS: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
BROADCAST = {"tp": ("tp",), "tp-cp": ("tp", "cp")}
STRATEGY_ARGS: dict[str, Any] = {"model": "llama-12b", "encoder_model": "vit-2b", "level": "interleaved"}
"""The balancers are the strategy's own defaults (`VLMBalance`: KK for the backbone, greedy for the
encoder), as a run configured with ``strategy: vlm_balance`` plans."""
# Paper Table 2 (see ../shared/WORKLOADS.md): cost()/balance() from bench planner's TABLE2, iteration s here.
PAPER: dict[int, dict[str, float]] = {
    TABLE2[0].world: {"cost_s": TABLE2[0].paper_cost_s, "balance_s": TABLE2[0].paper_balance_s, "iteration_s": 14.31},
    TABLE2[3].world: {"cost_s": TABLE2[3].paper_cost_s, "balance_s": TABLE2[3].paper_balance_s, "iteration_s": 13.56},
}
PAPER_WHAT = "Table 2 balance() s (Llama-12B + ViT-2B, navit, 8k, batch 72 per GPU)"
MEASURED_FIELDS: tuple[str, ...] = (
    "planner_s", "planner_min_s", "planner_cpu_s", "plan_call_s", "summarize_s", "planner_selective_s", "bench_cost_s",
    "bench_balance_s", "bench_balance_cpu_s", "plan_peak_mib", "rss_peak_mib", "wall_s", "steps_planner_s",
    "serve_s", "planner_with_serving_s",
)
"""Row fields that are timings or memory measurements (everything else is a function of the seed)."""


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}·CP{self.cp}·PP{self.pp}·DP{self.dp}"


LAYOUTS: dict[int, Layout] = {64: Layout(4, 2, 2, 4), 288: Layout(4, 2, 4, 9), 1152: Layout(4, 2, 4, 36),
                              4096: Layout(4, 2, 4, 128)}


def layout_for(gpus: int, pp: int | None = None) -> Layout:
    """The layout simulated at `gpus` GPUs (TP 4, CP 2; see the module docstring)."""
    if pp is None:
        if gpus in LAYOUTS:
            return LAYOUTS[gpus]
        pp = 4 if gpus % 32 == 0 else 2
    if gpus % (8 * pp):
        raise ConfigError(f"{gpus} GPUs do not split into TP 4 x CP 2 x PP {pp} x DP; pick a multiple of {8 * pp}")
    return Layout(4, 2, pp, gpus // (8 * pp))


# ------------------------------------------------------------------ simulated loaders
def simulated_sources(seed: int, weights: Sequence[float] = WEIGHTS, *,
                      context: int = CONTEXT) -> list[SimulatedSource]:
    return [SimulatedSource(i, f"{WORKLOAD}-{i}", seed=seed, context=context) for i in range(len(weights))]


def microbatches_per_dp(sources: Sequence[SimulatedSource], weights: Sequence[float], samples_per_dp: int,
                        context: int = CONTEXT) -> int:
    """m = ceil(samples per DP x mean sequence length / (context x FILL)), the mean taken over
    the first block of every source weighted by the mixing weights (a function of the seed)."""
    w = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    mean = float(sum(wi * s._block(0).seq_lens().mean() for wi, s in zip(w, sources, strict=True)))
    return max(1, math.ceil(samples_per_dp * mean / (context * FILL)))


# ------------------------------------------------------------------ the world
DEFAULT_KEEP: int = inspect.signature(Planner).parameters["keep"].default
"""Plans a Planner caches behind the newest by default (the simulation itself keeps 4)."""
PLAN_CACHE_BYTES: int = inspect.signature(Planner).parameters["plan_cache_bytes"].default
"""The default byte budget of those plans (`Planner.plan_cache_bytes`)."""

def make_config(layout: Layout, *, seed: int, broadcast: Sequence[str], num_microbatches: int,
                per_gpu: int = PER_GPU, context: int = CONTEXT, weights: Sequence[float] = WEIGHTS,
                patch_size: int = 14, middle_stage_masks: bool = False) -> ServiceConfig:
    """A real ServiceConfig for the simulated world (parquet sources with paths never opened)."""
    batch = per_gpu * layout.world
    specs = [SourceSpec(name=f"{WORKLOAD}-{i}", format="parquet", paths=[f"/simulated/{WORKLOAD}-{i}/*.parquet"],
                        weight=float(w), patch_size=patch_size, image_column="image")
             for i, w in enumerate(weights)]
    buffer = math.ceil(max(weights) / sum(weights) * batch * 1.05) + 256
    return ServiceConfig(sources=specs, seed=seed, samples_per_step=batch, num_microbatches=num_microbatches,
                         seq_length=context, buffer_size=buffer, pad_to_multiple_of=PAD_TO_MULTIPLE_OF,
                         with_attention_mask=False, middle_stage_masks=middle_stage_masks, overflow="defer",
                         strategy="vlm_balance", strategy_args={**STRATEGY_ARGS, "broadcast": list(broadcast)})


class TimedSummaries:
    """``summarize`` for the Planner over simulated sources, accumulating the time spent inside."""

    def __init__(self, sources: Sequence[SimulatedSource]):
        self.sources, self.seconds, self.cpu_seconds = list(sources), 0.0, 0.0

    def __call__(self, source: int, start: int, count: int) -> SourceSummary:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.sources[source].summary(start, count)
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.thread_time() - c0


def build_planner(layout: Layout, sources: Sequence[SimulatedSource],
                  **config_kw: Any) -> tuple[Planner, TimedSummaries]:
    config = make_config(layout, **config_kw)
    tree = ClientPlaceTree.from_sizes(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp)
    summaries = TimedSummaries(sources)
    return Planner(config, ServiceTopology.of(config, tree), summaries, keep=4), summaries


# ------------------------------------------------------------------ one row
def serving_seconds(plan: StepPlan, topology: Any, num_sources: int) -> float:
    """The Planner's own work to hand one step out, measured: every constructor's view of its buckets
    and their images (`constructor_step`) and every source's loader view, each pickled as Ray ships a
    reply (the round trips themselves, ~0.1-1 ms each on the callers' side, are not in it)."""
    t0 = time.perf_counter()
    for group in topology.constructor_groups:
        views = ([plan.constructor_do_plan(b) for b in group], encoder_rows(plan, group))
        pickle.dumps(views, protocol=pickle.HIGHEST_PROTOCOL)
    pickle.dumps(plan.loader_do_plans(range(num_sources)), protocol=pickle.HIGHEST_PROTOCOL)
    return time.perf_counter() - t0


def simulate_row(gpus: int, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    t_row = time.perf_counter()
    layout, weights = layout_for(gpus, args.pp), mixing_weights(args)
    sources = simulated_sources(args.seed, weights)
    batch = PER_GPU * layout.world
    m = microbatches_per_dp(sources, weights, batch // layout.dp)
    patch_size = sources[0].patch_size
    patch_dim = patch_size * patch_size * 3
    kw = dict(seed=args.seed, num_microbatches=m, patch_size=patch_size, middle_stage_masks=args.middle_stage_masks,
              weights=weights)
    planners = {name: build_planner(layout, sources, broadcast=dims, **kw) for name, dims in BROADCAST.items()}
    strategy = planners["tp"][0].strategy
    effective = {"method": strategy.backbone.method, "encoder_method": strategy.encoder_method}
    stages = reading_stages(layout.pp, args.middle_stage_masks)

    steps = max(1, args.steps)
    plan_s: dict[str, list[float]] = {name: [] for name in planners}
    own_s: dict[str, list[float]] = {name: [] for name in planners}
    own_cpu_s: list[float] = []
    summ_s: list[float] = []
    per_step: list[dict[str, Any]] = []
    for step in range(steps + 1):  # step 0 is the warm-up (first windows, caches)
        plans: dict[str, StepPlan] = {}
        for name, (planner, summaries) in planners.items():
            before, before_cpu = summaries.seconds, summaries.cpu_seconds
            t0, c0 = time.perf_counter(), time.thread_time()
            plans[name] = planner.plan(step)
            took, in_summ = time.perf_counter() - t0, summaries.seconds - before
            cpu = time.thread_time() - c0 - (summaries.cpu_seconds - before_cpu)
            if step > 0:
                plan_s[name].append(took)
                own_s[name].append(took - in_summ)
                if name == "tp":
                    summ_s.append(in_summ)
                    own_cpu_s.append(cpu)
            bar.update(1)
        base, sel = plans["tp"], plans["tp-cp"]
        for f in ("source", "position", "bucket", "microbatch"):
            if not np.array_equal(getattr(base, f), getattr(sel, f)):
                raise AssertionError(f"step {step}: the two broadcast variants planned different `{f}`")
        totals = step_totals(base, cp=layout.cp)
        enc_costs = base.encoder.bucket_costs()
        counts = base.counts_per_source()
        per_step.append({
            "step": step, **totals, "per_source": counts.tolist(),
            "deferred": int(batch - base.num_samples),
            "fetchers": len(base.fetch_ranks), "fetchers_selective": len(sel.fetch_ranks),
            "bytes": step_bytes(totals, pp=layout.pp, copies=layout.cp, stages=stages, patch_dim=patch_dim),
            "bytes_selective": step_bytes(totals, pp=layout.pp, copies=1, stages=stages, patch_dim=patch_dim),
            "encoder_bytes": encoder_bytes(totals, patch_dim=patch_dim),
            "backbone_max_over_mean": round(base.imbalance(), 6),
            "encoder_max_over_mean": round(float(enc_costs.max() / enc_costs.mean()), 6),
        })
    last = planners["tp"][0].plan(steps)
    serve_s = serving_seconds(last, planners["tp"][0].topology, len(sources))
    rpc = rpc_cost(last, planners["tp"][0].topology, loader_actors=len(sources)) if args.rpc else {}
    tracemalloc.start()
    planners["tp"][0].plan(steps + 1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    bar.update(1)

    timing = time_setup(Setup(label=f"{gpus} GPUs", tp=layout.tp, pp=layout.cp * layout.pp, dp=layout.dp,
                              per_gpu=PER_GPU, context=CONTEXT, group_size=1, paper_cost_s=math.nan,
                              paper_balance_s=math.nan), repeats=args.bench_repeats, seed=args.seed)
    bar.update(1)

    paper = PAPER.get(layout.world)
    timed = per_step[1:]

    def mean(key: str, sub: str | None = None) -> float:
        vals = [s[key][sub] if sub else s[key] for s in timed]
        return float(sum(vals) / len(vals))

    row: dict[str, Any] = {
        "gpus": layout.world,
        "layout": {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp},
        "samples_per_step": batch,
        "microbatches_per_dp": m,
        "buffer_size": planners["tp"][0].config.buffer_size,
        "patch_dim": patch_dim,
        "reading_stages": stages,
        "steps_timed": steps,
        "planner_s": statistics.median(own_s["tp"]),
        "planner_min_s": min(own_s["tp"]),
        "planner_cpu_s": statistics.median(own_cpu_s),
        "serve_s": serve_s,
        "planner_with_serving_s": statistics.median(own_s["tp"]) + serve_s,
        **rpc,
        "planner_with_rpc_s": statistics.median(own_s["tp"]) + serve_s + rpc["rpc_per_step_s"] if rpc else None,
        "balancers": {"backbone": effective["method"], "encoder": effective["encoder_method"]},
        "plan_call_s": statistics.median(plan_s["tp"]),
        "summarize_s": statistics.median(summ_s),
        "planner_selective_s": statistics.median(own_s["tp-cp"]),
        "steps_planner_s": own_s["tp"],
        "bench_cost_s": timing.cost_median_s,
        "bench_balance_s": timing.balance_median_s,
        "bench_balance_cpu_s": timing.balance_cpu_median_s,
        "paper_s": paper["balance_s"] if paper else None,
        "paper_what": PAPER_WHAT if paper else "no Table 2 figure at this size",
        "paper_cost_s": paper["cost_s"] if paper else None,
        "paper_iteration_s": paper["iteration_s"] if paper else None,
        "fetchers": timed[0]["fetchers"],
        "fetchers_selective": timed[0]["fetchers_selective"],
        "encoder_fetchers": layout.world,
        "tokens_per_step": mean("tokens"),
        "positions_per_step": mean("positions"),
        "images_per_step": mean("images"),
        "bytes_per_step": mean("bytes", "total"),
        "bytes_per_step_selective": mean("bytes_selective", "total"),
        "bytes_breakdown": {k: mean("bytes", k) for k in ("sequence", "metadata", "images")},
        "bytes_breakdown_selective": {k: mean("bytes_selective", k) for k in ("sequence", "metadata", "images")},
        "encoder_bytes_per_step": mean("encoder_bytes"),
        "deferred_samples": sum(s["deferred"] for s in per_step),
        "plan_nbytes": plan_nbytes(last),
        # what a Planner with the default keep and byte budget holds once its constructors are past
        # the older steps: the newest plan and as many behind it as the budget takes, up to `keep`
        "plan_cache_nbytes_default": plan_nbytes(last) * min(DEFAULT_KEEP + 1,
                                                             max(1, PLAN_CACHE_BYTES // max(1, plan_nbytes(last)))),
        "plan_peak_mib": peak / 2**20,
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "per_step": per_step,
    }
    row["wall_s"] = time.perf_counter() - t_row
    return row


# ------------------------------------------------------------------ output
def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| GPUs | layout | samples / images per step | m | paper cost() / balance() s (iteration s) "
        "| bench cost() + balance() ms | planner s wall / CPU "
        "(plan() s) | + serving s | + RPC s | fetchers TP → TP·CP | GB/step TP → TP·CP | of which sequence fields GB | encoder GB/step "
        "| plan MiB (peak) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lay = Layout(**r["layout"])
        paper = (f"{r['paper_cost_s']:.3f} / {r['paper_s']:.3f} ({r['paper_iteration_s']:.2f})"
                 if r["paper_s"] is not None else "—")
        cells = [
            f"{r['gpus']:,}", str(lay), f"{r['samples_per_step']:,} / {r['images_per_step']:,.0f}",
            str(r["microbatches_per_dp"]), paper, f"{r['bench_cost_s'] * 1e3:.2f} + {r['bench_balance_s'] * 1e3:.2f}",
            f"{r['planner_s']:.3f} / {r['planner_cpu_s']:.3f} ({r['plan_call_s']:.3f})", f"{r['serve_s']:.3f}",
            "—" if r["planner_with_rpc_s"] is None else f"{r['rpc_per_step_s']:.3f}",
            f"{r['fetchers']:,} → {r['fetchers_selective']:,}",
            f"{_gb(r['bytes_per_step'])} → {_gb(r['bytes_per_step_selective'])}",
            _gb(r["bytes_breakdown"]["sequence"]), _gb(r["encoder_bytes_per_step"]),
            f"{r['plan_nbytes'] / 2**20:.1f} ({r['plan_peak_mib']:.0f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=positive_int, nargs="+", default=[288, 1152, 4096],
                        help="world sizes (default 288 1152 4096)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--steps", type=positive_int, default=3,
                        help="timed steps per world after one warm-up (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated sources and the mixer (default 0)")
    parser.add_argument("--pp", type=positive_int, default=None,
                        help="pipeline size (default: the layouts in the docstring)")
    parser.add_argument("--bench-repeats", type=positive_int, default=5,
                        help="repeats of bench planner's cost()/balance() timing")
    parser.add_argument("--middle-stage-masks", action="store_true",
                        help="middle pipeline stages fetch cu_seqlens too (the runtime's default); "
                             "off = Megatron's ends")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 64 GPUs unless --gpus is given, 2 steps, no Ray round trips")
    parser.add_argument("--sources", type=int, default=None,
                        help="N equally weighted simulated sources instead of the docstring's 4 (blends of 1,000+)")
    parser.add_argument("--no-rpc", action="store_true",
                        help="leave out the measured Ray round trips of the Planner's replies (no Ray started)")


def mixing_weights(args: argparse.Namespace) -> tuple[float, ...]:
    if args.sources is not None and args.sources < 1:
        raise ConfigError(f"--sources {args.sources}: give at least 1 simulated source")
    return WEIGHTS if args.sources is None else (1.0,) * args.sources


def run(args: argparse.Namespace) -> int:
    mixing_weights(args)  # fail fast
    if args.quick:
        if args.gpus == [288, 1152, 4096]:
            args.gpus = [64]
        args.steps, args.bench_repeats = min(args.steps, 2), 1
    layouts = [layout_for(g, args.pp) for g in args.gpus]  # fail fast on sizes that do not split
    args.rpc = not (args.quick or args.no_rpc)
    per_row = 2 * (max(1, args.steps) + 1) + 2
    rows = []
    ray = start_ray() if args.rpc else None
    try:
        with tqdm(total=per_row * len(layouts), desc="simulate", unit="plan", file=sys.stderr) as bar:
            for lay in layouts:
                bar.set_postfix_str(f"{lay.world} GPUs ({lay})")
                rows.append(simulate_row(lay.world, args, bar))
    finally:
        if ray is not None:
            ray.shutdown()
    print(format_table(rows))
    print(f"\nplanner s = median plan() over {max(1, args.steps)} steps after a warm-up, minus the simulated "
          "summarize(); bench = bench planner's helper on an equal-size navit batch; "
          "bytes = constructor → fetching clients (model: `megascale_data_ext/dataplane/traffic.py`)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"seed": args.seed, "steps": args.steps, "context": CONTEXT, "per_gpu": PER_GPU, "workload": WORKLOAD,
                "weights": list(mixing_weights(args)), "fill": FILL, "strategy": "vlm_balance", "strategy_args": STRATEGY_ARGS,
                "broadcast": {k: list(v) for k, v in BROADCAST.items()}, "measured_fields": list(MEASURED_FIELDS),
                "byte_model": {
                    "packed_positions": "s = max(ceil(T/u)*u, u), u = pad_to_multiple_of(8) * 2 * cp",
                    "sequence": "28 B/position (first: tokens+position_ids int64; last: labels int64 + loss_mask "
                                "float32); pp=1 adds num_tokens int64 per microbatch per copy",
                    "metadata": "per reading stage and copy: cu_seqlens int32 (samples + microbatches + padded) "
                                "+ max_seqlen int32 per microbatch; CP slices (copies > 1) also cu_seqlens_padded",
                    "cp_positions": "with copies > 1 every segment (document or padding) rounded up to 2 * cp, "
                                    "as CP slices cut per document",
                    "images": "first stage, per copy: float32 patches * patch_dim + int32 image_seqlens",
                    "copies": "cp without cp broadcast (each CP fetcher), 1 with tp-cp broadcast",
                    "encoder": "WORLD delivery, every image once: float32 patches + int32 seqlen + 3 int64 keys",
                }}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=_json_default))
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
