"""``megascale-data heatmap``: per-step, per-rank cost of the real Planner's plans, vanilla vs balanced.

Builds the real service in one process (`InProcessService`: the Source Loaders open the
sources, the Planner mixes and balances them with the configured strategy), plans ``--steps``
steps for the layout ``--world-size N [--tp --pp --cp]`` (default: the config's ``parallel``
sizes at DP 4), and draws two heatmaps side by side — steps down, the
strategy's buckets (DP ranks for ``llm_balance``) across, colour = a bucket's cost / the step's
mean bucket cost — for the same samples split Megatron-style (contiguous, equal count:
`StepPlan.vanilla_imbalance`'s split) and as the plan balanced them (`StepPlan.bucket_costs`).
Planning reads only cost metadata, never payloads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import (
    add_config_arguments,
    add_layout_arguments,
    compose_from_args,
    fail,
    layout_tree,
)
from megascale_data_ext.commands._plotting import pyplot
from megascale_data_ext.errors import MegascaleDataError

NAME = "heatmap"
HELP = "Plot per-step per-DP-rank plan cost, vanilla vs balanced, of a data config's real Planner (PNG)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_layout_arguments(parser, default_dp=4)
    parser.add_argument("--steps", type=int, default=32, help="steps to plan (32)")
    parser.add_argument("--out", type=Path, required=True, metavar="F.png", help="the PNG to write")
    parser.add_argument("--json", type=Path, help="also write the per-step bucket costs here")


def plan_costs(service_config: Any, tree: Any, steps: int) -> dict[str, Any]:
    """Per-step bucket costs of the real Planner on `tree`: ``vanilla`` and ``balanced`` [steps, buckets]."""
    from megascale_data_ext import InProcessService

    service = InProcessService(service_config, tree)
    sizes = {"tp": tree.tp, "cp": tree.cp, "pp": tree.pp, "dp": tree.dp}
    vanilla, balanced, samples, summaries = [], [], [], []
    try:
        for step in range(steps):
            plan = service.planner.plan(step)
            vanilla.append(plan.vanilla_bucket_costs())
            balanced.append(plan.bucket_costs())
            samples.append(plan.num_samples)
            summaries.append(plan.summary())
    finally:
        for loader in service.loaders:
            loader.close()
    axis = summaries[0] if summaries else {}
    return {"layout": sizes, "axis": str(service.topology.distribution.axis.value), "strategy": service_config.strategy,
            "buckets": int(axis.get("buckets", 0)), "samples": samples, "vanilla": np.asarray(vanilla),
            "balanced": np.asarray(balanced), "summaries": summaries}


def _ratio(costs: np.ndarray) -> np.ndarray:
    mean = costs.mean(axis=1, keepdims=True)
    return np.divide(costs, mean, out=np.ones_like(costs), where=mean > 0)


def plot_heatmaps(data: dict[str, Any], path: Path, title: str = "") -> None:
    """Vanilla and balanced bucket cost / step mean as two heatmaps side by side (shared colour scale)."""
    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    ratios = {k: _ratio(data[k]) for k in ("vanilla", "balanced")}
    top = max(1.05, max(float(r.max()) for r in ratios.values()))
    low = min(0.95, min(float(r.min()) for r in ratios.values()))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=low, vmax=top)
    steps, buckets = ratios["vanilla"].shape
    fig, axes = plt.subplots(1, 2, figsize=(4 + 0.5 * 2 * buckets, 1.5 + 0.22 * steps), sharey=True,
                             layout="constrained")
    axis = data["axis"]
    for ax, key, label in ((axes[0], "vanilla", "vanilla (Megatron split)"),
                           (axes[1], "balanced", f"balanced ({data['strategy']})")):
        r = ratios[key]
        image = ax.imshow(r, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        worst = r.max(axis=1)
        ax.set_title(f"{label}\nmax/mean: mean {worst.mean():.3f}, worst {worst.max():.3f}", fontsize=10)
        ax.set_xlabel(f"{axis} bucket")
        ax.set_xticks(range(buckets))
        if steps * buckets <= 400:
            for (i, j), v in np.ndenumerate(r):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(v - 1.0) > 0.35 * (top - low) else "black")
    axes[0].set_ylabel("step")
    fig.colorbar(image, ax=axes, label="bucket cost / step mean", shrink=0.9)
    layout = data["layout"]
    fig.suptitle(title or ("per-step bucket cost, layout " + " ".join(f"{k}{v}" for k, v in layout.items())),
                 fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(data: dict[str, Any]) -> str:
    lines = ["step  samples  vanilla max/mean  balanced max/mean"]
    for step, s in enumerate(data["summaries"]):
        lines.append(f"{step:4d}  {data['samples'][step]:7d}  {s['vanilla_max_over_mean']:16.3f}  "
                     f"{s['max_over_mean']:17.3f}")
    v = np.asarray([s["vanilla_max_over_mean"] for s in data["summaries"]])
    b = np.asarray([s["max_over_mean"] for s in data["summaries"]])
    if len(v):
        lines.append(f"mean  {int(np.mean(data['samples'])):7d}  {v.mean():16.3f}  {b.mean():17.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        return fail(ValueError(f"--steps must be >= 1, got {args.steps}"))
    try:
        from megascale_data_ext.config import load_config

        cfg = compose_from_args(args)
        tree, sizes = layout_tree(cfg, args, what="plan")
        service_config = load_config(cfg, context_parallel_size=int(sizes["cp"])).to_service_config()
        data = plan_costs(service_config, tree, args.steps)
    except MegascaleDataError as exc:
        return fail(exc)
    plot_heatmaps(data, args.out)
    print(format_table(data))
    print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**{k: data[k] for k in ("layout", "axis", "strategy", "samples")},
                                         "vanilla": data["vanilla"].tolist(), "balanced": data["balanced"].tolist()},
                                        indent=1))
    return 0
