"""`megascale-data demo`: the main job, end to end on one machine.

Creates sample data (coyo-like image-text Parquet with real JPEG bytes, long-short text
Parquet, a Megatron .bin/.idx source), starts the service on an embedded local Ray
(loaders, planner, constructors), launches a torchrun job whose ranks build Megatron's
`parallel_state` (gloo on CPU; NCCL for CUDA tensors when CUDA is present) and train a
megatron-core GPTModel with per-document attention on the delivered batches (with ``--cp`` > 1
on each rank's zigzag slice of every document), and prints per step: loss, per-rank cost
imbalance (vanilla vs balanced), samples (deferred, per source), tokens/s, data wait.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from megascale_data_ext.commands._config_args import fail, positive_int
from megascale_data_ext.errors import ConfigError, ParallelLayoutError

NAME = "demo"
HELP = "run the end-to-end main job: sample data -> Ray service -> torchrun megatron-core GPT training"


#: The demo's GPT (hidden, layers, attention heads), passed to every rank: the layout must split it.
HIDDEN, LAYERS, HEADS = 64, 4, 4


def layout_problems(args: argparse.Namespace) -> list[str]:
    """What the ranks' model would refuse for this layout, said before any work starts."""
    problems = []
    if HEADS % args.tp:
        fits = [t for t in range(1, HEADS + 1) if HEADS % t == 0]
        problems.append(f"--tp {args.tp} does not divide the demo model's {HEADS} attention heads: pass --tp "
                        + " or ".join(map(str, fits)))
    if LAYERS % args.pp:
        fits = [q for q in range(1, LAYERS + 1) if LAYERS % q == 0]
        problems.append(f"--pp {args.pp} does not divide the demo model's {LAYERS} layers: pass --pp "
                        + " or ".join(map(str, fits)))
    if args.cp > 1 and args.attention == "dense":
        problems.append(f"--cp {args.cp} needs per-document attention: pass --attention auto or flex, or --cp 1")
    return problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=positive_int, default=2)
    p.add_argument("--pp", type=positive_int, default=2)
    p.add_argument("--dp", type=positive_int, default=2)
    p.add_argument("--cp", type=positive_int, default=1, help="context parallel size (THD slices per document)")
    p.add_argument("--attention", default="auto", choices=["auto", "te", "flex", "dense"])
    p.add_argument("--bf16", action="store_true", help="Megatron bf16 mixed precision (GPU)")
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--strategy", default="llm_balance", choices=["vanilla", "llm_balance", "vlm_balance"])
    p.add_argument("--samples-per-step", type=positive_int, default=12)
    p.add_argument("--num-microbatches", type=positive_int, default=4)
    p.add_argument("--seq-length", type=positive_int, default=1024)
    p.add_argument("--rows", type=positive_int, default=600, help="rows per demo text source")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--autoscale", action=argparse.BooleanOptionalAction, default=True,
                   help="loader actors from profiles + mixture (auto-partitioning); --no-autoscale: one per source")
    p.add_argument("--workdir", type=Path, default=None, help="where data and logs go (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    from megascale_data_ext.trainer.app import quiet_imports

    quiet_imports()  # before anything imports megatron-core (the sample data's tokenizers do)
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
    from megascale_data_ext.runtime.service import DataService
    from megascale_data_ext.sources.demo_data import make_demo_data
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    problems = layout_problems(args)
    if problems:
        return fail(ParallelLayoutError("the demo cannot start: " + "; ".join(problems)))
    patches = 256  # image-text samples keep room for one image of <= 256 patches
    if args.seq_length < patches + 2:
        return fail(ConfigError(f"--seq-length {args.seq_length} leaves no room for text beside the demo's images "
                                f"({patches} patches each): pass --seq-length {patches + 2} or more (default 1024)"))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="megascale-demo-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return fail(ConfigError(f"--workdir {str(work)!r}: {exc.strerror}; name a directory to create or an "
                                "existing one"))
    print(f"[demo] workdir {work}", flush=True)
    t0 = time.perf_counter()
    # Long documents are cut to the context (truncate); without it they would be named errors.
    # Image-text samples keep room for their image placeholders.
    specs = [
        replace(s, truncate=True, max_tokens=args.seq_length - (patches if s.image_column else 0))
        for s in make_demo_data(work / "data", seed=args.seed, rows=args.rows, max_image_patches=patches)
    ]
    print(f"[demo] sample data: {len(specs)} sources ({', '.join(s.name for s in specs)}) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    world = args.tp * args.pp * args.cp * args.dp
    tree = ClientPlaceTree.from_sizes(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp)
    strategy_args = {"model": "gpt-tiny"}
    if args.strategy == "vlm_balance":
        strategy_args["encoder_model"] = "vit-1b"
    cfg = ServiceConfig(
        sources=specs, seed=args.seed, samples_per_step=args.samples_per_step,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length, strategy=args.strategy,
        strategy_args=strategy_args, buffer_size=512, with_attention_mask=args.attention == "dense",
        ray=RayConfig(namespace=f"megascale-demo-{os.getpid()}", num_cpus=2),
        autoscale=AutoscaleConfig(enabled=args.autoscale, profiles=str(work / "profiles.json"), profile_samples=16),
    )
    service = DataService(cfg, tree)
    handles = service.start()
    print(f"[demo] service up in {service.startup_seconds:.1f} s: {describe_loaders(service)}, 1 planner, "
          f"{handles.topology.num_constructors} data constructors on Ray {handles.address}", flush=True)
    print(handles.topology.describe(), flush=True)
    vocab = load_tokenizer(specs[0].tokenizer).vocab_size
    out = work / "ranks"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
        "-m", "megascale_data_ext.trainer.train_worker",
        "--tp", str(args.tp), "--pp", str(args.pp), "--cp", str(args.cp), "--steps", str(args.steps),
        "--hidden", str(HIDDEN), "--layers", str(LAYERS), "--heads", str(HEADS),
        "--attention", args.attention, *(["--bf16"] if args.bf16 else []),
        "--samples-per-step", str(args.samples_per_step),
        "--num-microbatches", str(args.num_microbatches), "--seq-length", str(args.seq_length),
        "--vocab-size", str(vocab), "--namespace", handles.namespace, "--address", handles.address,
        "--out", str(out),
    ]
    # CUDA_DEVICE_MAX_CONNECTIONS=1: what Megatron-LM's launch scripts set (its TP layers warn otherwise)
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_ADDRESS=handles.address, CUDA_DEVICE_MAX_CONNECTIONS="1")
    print(f"[demo] torchrun {world} ranks (TP{args.tp} PP{args.pp} CP{args.cp} DP{args.dp}) ...", flush=True)
    t1 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env)
    finally:
        stats = service.stats()
        service.stop()
    if proc.returncode != 0:
        print(f"[demo] torchrun failed with exit code {proc.returncode}", file=sys.stderr)
        return proc.returncode
    logs = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    waits = sorted(sum(s["fetch_ms"]) for log in logs for s in log["steps"] if s["fetch_ms"])
    if waits:
        print(f"[demo] data wait per step over {len(waits)} (rank, step) pairs: median {waits[len(waits) // 2]:.1f} "
              f"ms, max {waits[-1]:.1f} ms (clients fetch whole steps, "
              f"{cfg.fault_tolerance.client_prefetch} ahead)")
    skipped = sum(c["skipped_total"] for c in stats["constructors"])
    print(f"[demo] {args.steps} steps in {time.perf_counter() - t1:.1f} s; loaders read "
          f"{samples_read(stats['loaders'])} samples, skipped {skipped} bad ones; logs in {out}")
    return 0


def describe_loaders(service: Any) -> str:
    """``6 source loaders`` or, autoscaled, which sources each loader actor serves and its workers."""
    names = service.config.source_names
    if service.partition is None:
        return f"{len(names)} source loaders"
    actors = "; ".join(
        "+".join(names[sh.source] + (f"[{sh.shard}/{sh.num_shards}]" if sh.num_shards > 1 else "") for sh in a.shards)
        + f" ({a.workers} worker{'s' if a.workers > 1 else ''}, {a.node[:8]})" for a in service.partition.assignments)
    return f"{len(names)} sources in {len(service.partition.assignments)} loader actors [{actors}]"


def samples_read(loader_stats: list[Any]) -> int:
    """Samples read by every loader actor (summed over its members)."""
    return sum(m["samples_read"] for s in filter(None, loader_stats) for m in s["members"].values())
