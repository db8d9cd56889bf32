"""``megascale-data bench memory``: loader memory of per-rank (colocated) loading vs this service.

Colocated baseline: every trainer rank builds Megatron's blended GPTDataset over S sources
and iterates a torch DataLoader with W forked workers (Megatron's default W = 2). It is
**measured** as real processes: ``--measure-ranks`` rank processes at once, each with its W
workers, at the source counts of ``--measure-sources``; memory is read from
``/proc/<pid>/smaps_rollup``. A rank's loader memory is the PSS of its process group (main +
workers) after building the dataset and serving batches minus its main's PSS before: torch
and Megatron, held by a trainer anyway, are not counted, nor are the pages forked workers
still share with their rank. Other (ranks, sources) are **extrapolated** with the measured
costs: per rank ``a + b * S``, a line through the measured points (b is the measured
per-source cost of a rank with its W workers), times the ranks.

Service: the partitioner (`dataplane.partitioner`) packs the S sources into loader actors;
those actors and the Planner run on a real local Ray for every (ranks, sources) of the grid,
serve ``--steps`` steps to an in-process constructor (so their buffers hold real samples), and
their USS is **measured**, plus their shared pages counted once (the conservative side: the
baseline gets no shared pages). Constructors are sidecars whose count follows the trainer nodes
(``ranks / --ranks-per-node``): one is measured, the rest extrapolated, and reported apart.
Shadow loaders (a standby per loader actor, issue 11) are measured as idle copies of the
loader actors and reported apart.

JSON ``rows[]``: ranks, sources, colocated_mib, service_mib (loader actors + planner),
ratio, and per-component columns with what was measured and what extrapolated.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megascale_data_ext.commands.profile import process_memory

NAME = "bench memory"
HELP = "loader memory: per-rank Megatron DataLoaders (measured + extrapolated) vs the service's actors (measured)"
MiB = float(1 << 20)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", default="8,16,32", help="trainer ranks of the grid")
    parser.add_argument("--sources", default="32,128", help="source counts of the grid")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (Megatron's default: 2)")
    parser.add_argument("--measure-ranks", type=int, default=2, help="colocated rank processes measured at once")
    parser.add_argument("--measure-sources", default="8,32", help="source counts the colocated ranks are measured at")
    parser.add_argument("--docs", type=int, default=400, help="documents per source")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--train-samples", type=int, default=20000,
                        help="samples the per-rank blended dataset is built for (Megatron builds indices for all)")
    parser.add_argument("--steps", type=int, default=3, help="steps the service serves before it is measured")
    parser.add_argument("--ranks-per-node", type=int, default=8,
                        help="ranks per trainer node (one constructor sidecar each); 0 = do not measure constructors")
    parser.add_argument("--actor-cap-mib", type=float, default=1024, help="partitioner's memory cap per loader actor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="F", help="write the results as JSON to F")
    parser.add_argument("--plot", default="docs/img/bench_memory.png", help="plot of memory against ranks ('' = none)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


# -- colocated baseline ------------------------------------------------------------------
class _Tokenizer:
    """The fields megatron-core's GPTDataset reads from a tokenizer (no text is tokenized)."""

    def __init__(self) -> None:
        from megascale_data_ext.commands.bench_throughput import EOD_ID, PAD_ID, VOCAB_SIZE

        self.eod, self.pad, self.vocab_size = EOD_ID, PAD_ID, VOCAB_SIZE
        self.unique_identifiers = {"class": "megascale_data_ext.commands.bench_memory._Tokenizer"}


def _rank_process(conn: Any, rank: int, prefixes: list[str], workers: int, seq_length: int, train_samples: int,
                  seed: int, cache: str) -> None:
    """One colocated trainer rank: Megatron's blended dataset + a DataLoader with `workers` workers."""
    import torch
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megascale_data_ext.commands.bench_throughput import MegatronPretrainingSampler

    torch.set_num_threads(1)
    Path(cache).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{cache}/pg{rank}", rank=0, world_size=1)
    conn.send("before")  # the parent measures what the rank holds anyway (torch, Megatron)
    conn.recv()
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=(prefixes, [1.0] * len(prefixes)),
                              split="100,0,0", tokenizer=_Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                              path_to_cache=f"{cache}/idx{rank}")
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, 0, 0], lambda: True, config).build()
    sampler = MegatronPretrainingSampler(total_samples=train_samples, consumed_samples=0, micro_batch_size=1,
                                         data_parallel_rank=0, data_parallel_size=1)
    # fork, as a torchrun rank's DataLoader does on Linux (this process was spawned, so the
    # default here would be spawn: each worker would import torch again and look far bigger)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=workers, persistent_workers=True,
                                         prefetch_factor=2, multiprocessing_context="fork" if workers else None)
    it = iter(loader)
    for _ in range(8 * max(1, workers)):  # every worker has opened the sources and served batches
        next(it)
    conn.send([p.pid for p in it._workers] if workers else [])
    conn.recv()  # measured: exit
    del it, loader
    dist.destroy_process_group()


def measure_colocated(prefixes: list[str], *, ranks: int, workers: int, seq_length: int, train_samples: int,
                      seed: int, cache: Path) -> dict[str, float]:
    """`ranks` real rank processes at once over `prefixes` (MiB, per rank).

    A rank's loader memory (``loader_pss``) is the PSS of its process group (main + DataLoader
    workers) after building the blended dataset and serving batches, minus its main's PSS
    before (torch, Megatron and the process group, which a trainer holds anyway). PSS, because
    forked workers share the parent's pages: only what the dataset and the workers' copies
    add is counted. Every rank is measured at the same point (they wait for the parent), so
    the pages the ranks share split the same way before and after.
    """
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for r in range(ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_process, args=(child, r, prefixes, workers, seq_length, train_samples, seed,
                                                    str(cache)), daemon=False)
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        for c in conns:
            c.recv()
        before = [process_memory(p.pid) for p in procs]
        for c in conns:
            c.send("go")
        pids = [c.recv() for c in conns]
        mains = [process_memory(p.pid) for p in procs]
        wk = [[process_memory(pid) for pid in group] for group in pids]
    finally:
        for c in conns:
            c.send("exit")
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    flat = [w for group in wk for w in group]
    n_w = max(1, len(flat))
    group_after = [m["pss"] + sum(w["pss"] for w in g) for m, g in zip(mains, wk, strict=True)]
    return {"loader_pss": sum(a - b["pss"] for a, b in zip(group_after, before, strict=True)) / ranks / MiB,
            "main_pss_before": sum(b["pss"] for b in before) / ranks / MiB,
            "main_uss": sum(m["uss"] for m in mains) / ranks / MiB,
            "worker_uss": sum(w["uss"] for w in flat) / n_w / MiB if flat else 0.0,
            "worker_pss": sum(w["pss"] for w in flat) / n_w / MiB if flat else 0.0}


def shared_once(mems: list[dict[str, int]]) -> float:
    """Shared pages counted once (MiB): the largest non-private set of any one of the processes."""
    return max((m["rss"] - m["uss"] for m in mems), default=0) / MiB


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x through the measured points (exact for two, least squares beyond)."""
    if len(xs) == 1:  # no slope to measure: flat in S (never grows the baseline beyond what was measured)
        return ys[0], 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


# -- the service -------------------------------------------------------------------------
def _pid_memory(handles: list[Any]) -> list[dict[str, int]]:
    import ray

    pids = ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles])
    return [process_memory(pid) for pid in pids]


def measure_service(prefixes: list[str], *, ranks: int, seq_length: int, steps: int, seed: int, cap_mib: float,
                    profiles: list[Any]) -> dict[str, Any]:
    """Partition, start loader actors + Planner on the running Ray, serve `steps`, measure (MiB)."""
    import ray

    from megascale_data_ext.commands.bench_throughput import EOD_ID
    from megascale_data_ext.dataplane.partitioner import NodeResources, PartitionLimits, partition
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.dataplane.scaling import ScalingConfig
    from megascale_data_ext.runtime.autoscaler import RoutedFetch, ScalingPlannerActor
    from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
    from megascale_data_ext.runtime.constructor import DataConstructor
    from megascale_data_ext.runtime.loader_group import LoaderGroupActor
    from megascale_data_ext.runtime.topology import ServiceTopology
    from megascale_data_ext.sources.base import SourceSpec

    specs = [SourceSpec(name=f"source{i}", format="megatron", paths=[p], append_eod=False, truncate=True,
                        eod_token_id=EOD_ID) for i, p in enumerate(prefixes)]
    tree = ClientPlaceTree.from_sizes(dp=ranks)
    cfg = ServiceConfig(sources=specs, seed=seed, samples_per_step=2 * ranks, num_microbatches=2,
                        seq_length=seq_length, strategy="vanilla", buffer_size=256, prefetch=2,
                        constructor_group=ranks, ray=RayConfig(namespace=f"bench-memory-{ranks}-{len(prefixes)}"))
    topo = ServiceTopology.of(cfg, tree)
    nodes = [NodeResources(name=f"node{i}", memory_bytes=64 << 30, cpus=64) for i in range(max(1, ranks // 8))]
    plan = partition(profiles, [1.0] * len(specs), nodes,
                     PartitionLimits(samples_per_step=cfg.samples_per_step, step_seconds=1.0,
                                     actor_memory_bytes=int(cap_mib * MiB), actor_base_bytes=80 << 20))
    groups = [a.sources for a in plan.assignments]
    planner = ScalingPlannerActor.remote(cfg, topo, ScalingConfig(capacity=(1.0,) * len(specs), max_shards=1),
                                         interval_steps=1 << 30, groups=groups)
    con = DataConstructor(list(range(ranks)), cfg, topo,
                          get_plan=lambda step, b: ray.get(planner.constructor_plan.remote(step, b)),
                          fetch=RoutedFetch(lambda step, s: ray.get(planner.route.remote(step, s))),
                          pad_id=0, image_token_id=None)
    for step in range(steps):
        for rank in range(ranks):
            con.get_step(step, rank)
    loaders = [ray.get(planner.route.remote(steps, g[0]))[0] for g in groups]
    loader_mem = _pid_memory(loaders)
    planner_mem = _pid_memory([planner])[0]
    shadows = [LoaderGroupActor.remote([(sh, specs[sh.source]) for sh in a.shards], cfg.seed, cfg.shuffle, a.workers)
               for a in plan.assignments]
    ray.get([s.ready.remote() for s in shadows])
    shadow_mem = _pid_memory(shadows)
    for h in [*shadows, *loaders, planner]:
        ray.kill(h)
    return {"loader_actors": len(loaders), "loader_uss": sum(m["uss"] for m in loader_mem) / MiB,
            "shared_once": shared_once([*loader_mem, planner_mem]),
            "loader_pss": sum(m["pss"] for m in loader_mem) / MiB, "planner_uss": planner_mem["uss"] / MiB,
            "planner_pss": planner_mem["pss"] / MiB, "shadow_uss": sum(m["uss"] for m in shadow_mem) / MiB}


def measure_constructor(prefixes: list[str], *, seq_length: int, ranks_per_node: int, seed: int) -> float:
    """USS (MiB) of one real DataConstructorActor serving a node's ranks for two steps."""
    import ray

    from megascale_data_ext.commands.bench_throughput import EOD_ID
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.actors import DataConstructorActor, PlannerActor, SourceLoaderActor
    from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
    from megascale_data_ext.runtime.topology import ServiceTopology
    from megascale_data_ext.sources.base import SourceSpec

    spec = SourceSpec(name="source0", format="megatron", paths=[prefixes[0]], append_eod=False, truncate=True,
                      eod_token_id=EOD_ID)
    cfg = ServiceConfig(sources=[spec], seed=seed, samples_per_step=2 * ranks_per_node, num_microbatches=2,
                        seq_length=seq_length, strategy="vanilla", buffer_size=256, prefetch=2,
                        constructor_group=ranks_per_node, ray=RayConfig(namespace="bench-memory-constructor"))
    topo = ServiceTopology.of(cfg, ClientPlaceTree.from_sizes(dp=ranks_per_node))
    loader = SourceLoaderActor.remote(0, spec, cfg.seed, cfg.shuffle)
    planner = PlannerActor.remote(cfg, topo, [loader])
    ray.get(loader.set_planner.remote(planner))
    con = DataConstructorActor.remote(list(topo.constructor_groups[0]), cfg, topo, planner, [loader], 0, None)
    for step in range(2):
        ray.get([con.get_step.remote(step, r) for r in range(ranks_per_node)])
    uss = _pid_memory([con])[0]["uss"] / MiB
    for h in (con, planner, loader):
        ray.kill(h)
    return uss


# -- the grid ----------------------------------------------------------------------------
def _progress(msg: str) -> None:
    print(f"[bench memory] {msg}", file=sys.stderr, flush=True)


def colocated_model(points: dict[int, dict[str, float]], workers: int) -> dict[str, Any]:
    """A rank's loader memory as a line ``a + b * S`` through the measured points (b: per-source cost)."""
    xs = sorted(points)
    a, b = fit_line(xs, [points[s]["loader_pss"] for s in xs])
    return {"per_rank_mib": [a, b], "workers": workers, "per_source_per_rank_mib": b,
            "per_source_per_process_mib": b / (workers + 1)}


def colocated_mib(model: dict[str, Any], ranks: int, sources: int) -> float:
    a, b = model["per_rank_mib"]
    return ranks * (a + b * sources)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in sorted({r["sources"] for r in rows}):
        rs = [r for r in rows if r["sources"] == s]
        x = [r["ranks"] for r in rs]
        ax.plot(x, [r["colocated_mib"] / 1024 for r in rs], "o--",
                label=f"per-rank dataset + DataLoader workers, S={s}")
        ax.plot(x, [r["service_mib"] / 1024 for r in rs], "s-", label=f"service loaders+planner, S={s}")
        ax.plot(x, [(r["service_mib"] + r["constructors_mib"]) / 1024 for r in rs], "^:",
                label=f"service + constructor sidecars, S={s}")
    ax.set_xlabel("trainer ranks")
    ax.set_ylabel("GiB (ranks: group PSS added; service: USS + shared once)", fontsize=8)
    ax.set_xticks(sorted({r["ranks"] for r in rows}))
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("bench memory: loader memory against ranks")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import ray

    from megascale_data_ext.commands.bench_throughput import write_blend
    from megascale_data_ext.commands.profile import profile_source

    ranks_grid, sources_grid, measured_s = _ints(args.ranks), _ints(args.sources), _ints(args.measure_sources)
    if not ranks_grid or not sources_grid or not measured_s or args.workers < 0 or args.measure_ranks < 1:
        print("error: --ranks, --sources and --measure-sources need values; --workers >= 0, --measure-ranks >= 1",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        root = Path(tmp)
        n_src = max(sources_grid + measured_s)
        _progress(f"writing {n_src} Megatron sources x {args.docs} documents")
        prefixes = write_blend(root / "data", sources=n_src, docs=args.docs, seq_length=args.seq_length,
                               seed=args.seed)
        points = {}
        for s in tqdm(measured_s, desc="colocated ranks (measured)", file=sys.stderr):
            points[s] = measure_colocated(prefixes[:s], ranks=args.measure_ranks, workers=args.workers,
                                          seq_length=args.seq_length, train_samples=args.train_samples,
                                          seed=args.seed, cache=root / f"cache{s}")
        model = colocated_model(points, args.workers)
        _progress(f"colocated measured in {time.perf_counter() - t0:.0f} s")
        from megascale_data_ext.sources.base import SourceSpec
        from megascale_data_ext.commands.bench_throughput import EOD_ID

        specs = [SourceSpec(name=f"source{i}", format="megatron", paths=[p], append_eod=False, truncate=True,
                            eod_token_id=EOD_ID) for i, p in enumerate(prefixes)]
        profiles = [profile_source(sp, samples=16, batch=16) for sp in tqdm(specs, desc="profile", file=sys.stderr)]
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 namespace="bench-memory")
        _progress(f"profiled and Ray started at {time.perf_counter() - t0:.0f} s")
        try:
            con_mib = measure_constructor(prefixes, seq_length=args.seq_length, ranks_per_node=args.ranks_per_node,
                                          seed=args.seed) if args.ranks_per_node > 0 else 0.0
            _progress(f"constructor measured at {time.perf_counter() - t0:.0f} s")
            grid = [(r, s) for s in sources_grid for r in ranks_grid]
            rows = []
            for r, s in tqdm(grid, desc="service (measured)", file=sys.stderr):
                svc = measure_service(prefixes[:s], ranks=r, seq_length=args.seq_length, steps=args.steps,
                                      seed=args.seed, cap_mib=args.actor_cap_mib, profiles=profiles[:s])
                service = svc["loader_uss"] + svc["planner_uss"] + svc["shared_once"]
                colo = colocated_mib(model, r, s)
                cons = -(-r // args.ranks_per_node) * con_mib if args.ranks_per_node > 0 else 0.0
                rows.append({
                    "ranks": r, "sources": s, "colocated_mib": round(colo, 1), "service_mib": round(service, 1),
                    "ratio": round(colo / service, 2), "constructors_mib": round(cons, 1),
                    "ratio_with_constructors": round(colo / (service + cons), 2),
                    "shadow_mib": round(svc["shadow_uss"], 1), "loader_actors": svc["loader_actors"],
                    "loader_mib": round(svc["loader_uss"], 1), "planner_mib": round(svc["planner_uss"], 1),
                    "service_shared_once_mib": round(svc["shared_once"], 1),
                    "service_pss_mib": round(svc["loader_pss"] + svc["planner_pss"], 1),
                    "colocated": ("measured per rank (x ranks)" if s in measured_s else
                                  "extrapolated in sources (per-source cost) and ranks"),
                    "service": "measured", "constructors": "1 measured x nodes (extrapolated)"
                    if args.ranks_per_node > 0 else "not measured (--ranks-per-node 0)",
                    "shadow": "measured",
                })
        finally:
            ray.shutdown()
    result = {"command": "megascale-data bench memory " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "",
              "workers": args.workers, "measure_ranks": args.measure_ranks, "measured_sources": measured_s,
              "train_samples": args.train_samples, "docs": args.docs, "seq_length": args.seq_length,
              "colocated_points": points, "colocated_model": model, "constructor_mib": round(con_mib, 1),
              "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'ranks':>5} {'sources':>7} {'colocated MiB':>13} {'service MiB':>11} {'ratio':>6} " \
           f"{'+constr MiB':>11} {'ratio':>6} {'shadow MiB':>10} {'actors':>6}  colocated figure"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ranks']:>5} {r['sources']:>7} {r['colocated_mib']:>13,.0f} {r['service_mib']:>11,.0f} "
                     f"{r['ratio']:>6.2f} {r['service_mib'] + r['constructors_mib']:>11,.0f} "
                     f"{r['ratio_with_constructors']:>6.2f} {r['shadow_mib']:>10,.0f} {r['loader_actors']:>6}  "
                     f"{r['colocated']}")
    return "\n".join(lines)
