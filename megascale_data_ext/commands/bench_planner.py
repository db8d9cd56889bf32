"""`megascale-data bench planner`: the planner's cost() and balance() time at Table 2's sizes.

Setup (paper Table 2: Llama-12B + ViT-2B on navit, 8k context, batch 72 per GPU):

* "72 per GPU" is read as a global batch of 72 × #GPUs samples (20,736 at 288 GPUs), the
  ~20k samples the planner sees per step; the images of those samples (≈1.2 per sample) are
  balanced over all GPUs (the encoder's WORLD axis).
* Each DP bucket gets m = ceil(tokens / (DP × context × 0.9)) packed micro-batches of at most
  `context` tokens (a sample = text tokens + image patches, clipped to the context).
* cost() = Llama-12B `TransformerCost` over every sample + ViT-2B `ViTCost` over every image.
* balance() = Alg. 2 (hybrid): images → WORLD buckets by greedy `partition`, then the
  backbone → DP buckets by `balance_step(level="interleaved", method="greedy", cap=context)`;
  with group_size 2, contiguous pairs of DP buckets form the groups.

Times are the median (and min) of `--repeats` runs in this process, data generated once. The
thread CPU time of balance() is reported too: on a shared machine wall time includes waiting
for a core, CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megascale_data_ext.commands._config_args import positive_int
from megascale_data_ext.dataplane.balancers import balance_step, partition
from megascale_data_ext.dataplane.costs import TransformerCost, ViTCost
from megascale_data_ext.dataplane.workloads import generate_workload

NAME = "bench planner"
HELP = "Time the planner's cost() and balance() at the paper's Table 2 sizes and compare with its figures."

FILL = 0.9


@dataclass(slots=True, kw_only=True, frozen=True)
class Setup:
    label: str
    tp: int
    pp: int
    dp: int
    per_gpu: int
    context: int
    group_size: int
    paper_cost_s: float
    paper_balance_s: float

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


TABLE2: tuple[Setup, ...] = (
    Setup(label="288 GPUs (baseline)", tp=4, pp=8, dp=9, per_gpu=72, context=8192, group_size=1,
          paper_cost_s=0.004, paper_balance_s=0.016),
    Setup(label="batch 72 → 144", tp=4, pp=8, dp=9, per_gpu=144, context=8192, group_size=1,
          paper_cost_s=0.006, paper_balance_s=0.027),
    Setup(label="seq 8k → 16k", tp=4, pp=8, dp=9, per_gpu=72, context=16384, group_size=1,
          paper_cost_s=0.012, paper_balance_s=0.173),
    Setup(label="1152 GPUs", tp=4, pp=8, dp=36, per_gpu=72, context=8192, group_size=1,
          paper_cost_s=0.107, paper_balance_s=0.357),
    Setup(label="1152 GPUs, group_size 2", tp=4, pp=8, dp=36, per_gpu=72, context=8192, group_size=2,
          paper_cost_s=0.106, paper_balance_s=0.195),
)


@dataclass(slots=True, kw_only=True)
class Timing:
    label: str
    world: int
    dp: int
    samples: int
    images: int
    microbatches: int
    cost_median_s: float
    cost_min_s: float
    balance_median_s: float
    balance_min_s: float
    balance_cpu_median_s: float
    paper_cost_s: float
    paper_balance_s: float
    cost_speedup: float
    balance_speedup: float
    backbone_max_over_mean: float
    encoder_max_over_mean: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the timings as JSON here")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed repeats per setup (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="baseline setup only, 3 repeats (smoke test)")


def time_setup(s: Setup, *, repeats: int, seed: int) -> Timing:
    wl = generate_workload("navit", s.world * s.per_gpu, seed=seed, context=s.context).clip(s.context)
    lens, patches = wl.seq_lens(), wl.image_patch_counts
    m = int(np.ceil(lens.sum() / (s.dp * s.context * FILL)))
    groups = None
    if s.group_size > 1:
        groups = tuple(tuple(range(i, min(i + s.group_size, s.dp))) for i in range(0, s.dp, s.group_size))
    backbone, encoder = TransformerCost("llama-12b"), ViTCost("vit-2b")
    cost_t, bal_t, bal_cpu = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sample_cost, image_cost = backbone(lens), encoder(patches)
        t1, c1 = time.perf_counter(), time.thread_time()
        image_bucket = partition(image_cost, s.world, method="greedy")
        res = balance_step(sample_cost, tokens=lens, num_buckets=s.dp, num_microbatches=m, cap=s.context,
                           method="greedy", level="interleaved", groups=groups)
        t2, c2 = time.perf_counter(), time.thread_time()
        cost_t.append(t1 - t0)
        bal_t.append(t2 - t1)
        bal_cpu.append(c2 - c1)
    enc = np.bincount(image_bucket, weights=image_cost, minlength=s.world)
    cost_med, bal_med = float(np.median(cost_t)), float(np.median(bal_t))
    return Timing(label=s.label, world=s.world, dp=s.dp, samples=wl.num_samples, images=wl.num_images,
                  microbatches=m, cost_median_s=cost_med, cost_min_s=float(min(cost_t)), balance_median_s=bal_med,
                  balance_min_s=float(min(bal_t)), balance_cpu_median_s=float(np.median(bal_cpu)), paper_cost_s=s.paper_cost_s, paper_balance_s=s.paper_balance_s,
                  cost_speedup=s.paper_cost_s / cost_med, balance_speedup=s.paper_balance_s / bal_med,
                  backbone_max_over_mean=res.imbalance(), encoder_max_over_mean=float(enc.max() / enc.mean()))


def format_table(rows: list[Timing]) -> str:
    lines = [
        "| setup | samples / images | m | cost() ms (min) | paper | faster | balance() ms (min) | CPU ms | paper "
        "| faster | backbone / encoder max/mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.samples} / {r.images} | {r.microbatches} | {r.cost_median_s * 1e3:.2f} "
            f"({r.cost_min_s * 1e3:.2f}) | {r.paper_cost_s * 1e3:.0f} | {r.cost_speedup:.1f}× "
            f"| {r.balance_median_s * 1e3:.2f} ({r.balance_min_s * 1e3:.2f}) | {r.balance_cpu_median_s * 1e3:.2f} "
            f"| {r.paper_balance_s * 1e3:.0f} "
            f"| {r.balance_speedup:.1f}× | {r.backbone_max_over_mean:.4f} / {r.encoder_max_over_mean:.4f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    setups = TABLE2[:1] if args.quick else TABLE2
    repeats = 3 if args.quick else max(1, args.repeats)
    rows = [time_setup(s, repeats=repeats, seed=args.seed) for s in tqdm(setups, desc="bench planner", file=sys.stderr)]
    print(format_table(rows))
    worst = min(min(r.cost_speedup, r.balance_speedup) for r in rows)
    cpu_worst = min(r.paper_balance_s / r.balance_cpu_median_s for r in rows)
    best_worst = min(r.paper_balance_s / r.balance_min_s for r in rows)
    print(f"\nslowest ratio to the paper (median wall times): {worst:.1f}× faster (goal >= 5×: "
          f"{'met' if worst >= 5 else 'NOT met'}); by balance() CPU time: {cpu_worst:.1f}×; {repeats} repeats per setup")
    print(f"balance() by the min of the repeats, slowest row: {best_worst:.1f}× faster than the paper "
          f"(target >= 10× the paper on every row: {'met' if best_worst >= 10 else 'NOT met'})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"repeats": repeats, "fill": FILL, "rows": [asdict(r) for r in rows]},
                                        indent=1))
    return 0
