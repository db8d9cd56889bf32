"""``megascale-data info``: what the sources of a ``data`` config hold, and how fast training eats them.

Per source: rows, tokens (as the Planner counts them: EOD included, cut at ``max_tokens`` when
``truncate``), mean/max tokens per row, rows longer than ``max_tokens``, images and their
patches, the mixing weight and its share, and the expected samples and epochs over
``--steps`` steps (``samples_per_step`` x the schedule's share, summed over the steps, / rows;
with ``overflow: defer`` ``samples_per_step`` is a maximum, so these are upper bounds).

The config is given like a training run's (`commands._config_args`, shared with ``lint``,
``heatmap`` and ``plan``): Hydra overrides on the package's ``conf/train_gpt.yaml``
(``sources=demo_vlm data.data_root=/data data.samples_per_step=64``), another config by
``--config-dir``/``--config-name``, or a YAML file first (a Hydra config with ``defaults`` is
composed from its directory; a plain one is read as it is, a ``data`` node or a whole config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import add_config_arguments, fail, load_data_config
from megascale_data_ext.errors import MegascaleDataError

NAME = "info"
HELP = "Rows, tokens, images and expected epochs per source of a data config (Hydra overrides or a YAML file)."


# -- info ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=1000, help="training steps the epochs are computed for (1000)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def expected_shares(service_config: Any, steps: int) -> np.ndarray:
    """Sum over steps [0, steps) of each source's mixing weight (the schedule's normalised weights)."""
    from megascale_data_ext.dataplane.mixing import ConstantSchedule, build_schedule

    schedule = build_schedule(service_config.mixing_config(), source_names=service_config.source_names)
    if isinstance(schedule, ConstantSchedule):
        return np.asarray(schedule.weights(0), dtype=np.float64) * steps
    total = np.zeros(len(service_config.sources), dtype=np.float64)
    for step in range(steps):
        total += schedule.weights(step)
    return total


def source_info(spec: Any) -> dict[str, Any]:
    """Counts of one source, opened as the service opens it but with uncut token counts."""
    from megascale_data_ext.sources.registry import open_source

    raw = dataclasses.replace(spec, max_tokens=None, truncate=False)
    src = open_source(raw)
    try:
        meta = src.metadata(None)
        files = len(getattr(src, "paths", None) or getattr(src, "prefixes", None) or spec.paths)
    finally:
        src.close()
    uncut = np.asarray(meta["text_tokens"], dtype=np.int64)
    cap = spec.max_tokens
    tokens = np.minimum(uncut, cap) if (spec.truncate and cap is not None) else uncut
    n = len(uncut)
    return {
        "name": spec.name, "format": spec.format, "files": files, "rows": n,
        "tokens": int(tokens.sum()), "mean_tokens": float(tokens.mean()) if n else 0.0,
        "max_tokens": int(tokens.max()) if n else 0,
        "uncut_tokens": int(uncut.sum()), "uncut_max_tokens": int(uncut.max()) if n else 0,
        "cap": cap, "truncate": bool(spec.truncate),
        "over_cap": int((uncut > cap).sum()) if cap is not None else 0,
        "images": int(np.asarray(meta["num_images"]).sum()),
        "patches": int(np.asarray(meta["image_patch_counts"]).sum()),
        "weight": float(spec.weight),
    }


def collect(cfg: Any, steps: int) -> dict[str, Any]:
    """The info of every source of a validated config, with expected samples/epochs over `steps`."""
    svc = cfg.to_service_config()
    rows = [source_info(spec) for spec in svc.sources]
    shares = expected_shares(svc, steps)
    for row, share in zip(rows, shares.tolist(), strict=True):
        row["share"] = share / steps if steps else 0.0
        row["expected_samples"] = svc.samples_per_step * share
        row["expected_epochs"] = row["expected_samples"] / row["rows"] if row["rows"] else float("inf")
    total = {k: sum(r[k] for r in rows) for k in ("files", "rows", "tokens", "uncut_tokens", "images", "patches")}
    return {"steps": steps, "samples_per_step": svc.samples_per_step, "seq_length": svc.seq_length,
            "overflow": svc.overflow, "mixing": svc.mixing_config(), "sources": rows, "total": total}


def format_table(info: dict[str, Any]) -> str:
    head = ["source", "format", "files", "rows", "tokens", "mean", "max", ">cap", "images", "patches", "weight",
            "share", f"samples/{info['steps']} steps", "epochs"]
    body = []
    for r in info["sources"]:
        over = f"{r['over_cap']} {'cut' if r['truncate'] else 'bad'}" if r["over_cap"] else "0"
        body.append([r["name"], r["format"], str(r["files"]), f"{r['rows']:,}", f"{r['tokens']:,}",
                     f"{r['mean_tokens']:.1f}", f"{r['max_tokens']:,}", over, f"{r['images']:,}", f"{r['patches']:,}",
                     f"{r['weight']:g}", f"{r['share']:.3f}", f"{r['expected_samples']:,.0f}",
                     f"{r['expected_epochs']:.3f}"])
    t = info["total"]
    body.append(["total", "", str(t["files"]), f"{t['rows']:,}", f"{t['tokens']:,}", "", "", "", f"{t['images']:,}",
                 f"{t['patches']:,}", "", "", f"{info['samples_per_step'] * info['steps']:,}", ""])
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             .rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = (f"tokens include EOD and are cut at max_tokens (seq_length {info['seq_length']}) where truncate is set; "
            f">cap = rows longer than that. {info['samples_per_step']} samples/step")
    if info["overflow"] == "defer":
        note += " at most (overflow: defer), so samples and epochs are upper bounds"
    return "\n".join(lines) + "\n" + note + "."


def run(args: argparse.Namespace) -> int:
    if args.steps < 0:
        return fail(ValueError(f"--steps must be >= 0, got {args.steps}"))
    try:
        info = collect(load_data_config(args), args.steps)
    except MegascaleDataError as exc:
        return fail(exc)
    print(json.dumps(info, indent=1) if args.json else format_table(info))
    return 0
