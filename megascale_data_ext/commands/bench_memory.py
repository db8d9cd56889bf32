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

Workloads (``--workload``): ``text`` (above: Megatron-indexed text sources, memory-mapped,
almost free per rank) and ``navit`` (seeded navit-like image-text Parquet sources written with
the project's own writer: variable-size JPEGs as raw bytes plus texts, ``--row-groups`` row
groups of about ``--row-group-mib`` MiB decoded per source, seeded lognormal mixing weights).
In ``navit`` each colocated rank builds a blended dataset over the S sources with Megatron's
``build_blending_indices`` (the same weights the service mixes with), each source a
``ParquetSource`` (``open_source``) opened lazily by the process that reads it, iterated by the
same forked DataLoader; every rank and every service loader is read until each source's
row-group cache (``row_group_cache``, the same spec on both sides) is full, so both sides hold
the same per-source state per process that reads the source (the steady state of a long run).

Baselines (``--baselines``): navit is measured against the project's own Parquet reader per rank
(``own_reader``, above) and against Megatron-Energon's per-rank loader on the same rows
(``energon``, `_energon_baseline`: what multimodal Megatron users run); text against Megatron's
GPTDataset (``megatron``). Ray's own cost is measured beside the service's actors in every row
(`_ray_cost`): its daemons (PSS), the object store's bytes, and a core worker in every fetching rank.

JSON ``rows[]``: workload, baseline, ranks, sources, colocated_mib (the baseline's), service_mib
(loaders + planner), ratio, ray_daemons_mib, object_store_mib, trainer_core_workers_mib,
service_all_in_mib, ratio_all_in, and per-component columns (what was measured, what extrapolated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megascale_data_ext.commands._colocated_memory import (
    NAVIT_MAX_PATCHES,
    NAVIT_PATCH,
    fit_line,
    measure_colocated,
    measure_colocated_navit,
    row_group_mib_measured,
    shared_once,
    write_navit_sources,
)
from megascale_data_ext.commands._config_args import positive_int
from megascale_data_ext.commands._loader_caches import cache_state
from megascale_data_ext.commands._plotting import pyplot
from megascale_data_ext.commands._ray_cost import client_core_worker_mib, daemons_pss_mib, object_store_mib
from megascale_data_ext.sources.profiling import process_memory

NAME = "bench memory"
HELP = "loader memory: per-rank Megatron DataLoaders (measured + extrapolated) vs the service's actors (measured)"
MiB = float(1 << 20)


WORKLOADS = ("text", "navit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both",
                        help="text: Megatron-indexed text sources; navit: image-text Parquet sources; both (default)")
    parser.add_argument("--ranks", default="8,16,32", help="trainer ranks of the grid")
    parser.add_argument("--sources", default="32,128", help="source counts of the grid")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (Megatron's default: 2)")
    parser.add_argument("--measure-ranks", type=positive_int, default=2,
                        help="colocated rank processes measured at once")
    parser.add_argument("--measure-sources", default="8,32", help="source counts the colocated ranks are measured at")
    parser.add_argument("--docs", type=positive_int, default=400, help="documents per source (text)")
    parser.add_argument("--seq-length", type=positive_int, default=1024, help="sequence length (text)")
    parser.add_argument("--row-group-mib", type=float, default=16.0,
                        help="navit: decoded size of a Parquet row group (production: 512 MB - 1 GB)")
    parser.add_argument("--row-groups", type=positive_int, default=4,
                        help="navit: row groups per source (>= the sources' row_group_cache, so caches can fill)")
    parser.add_argument("--weight-sigma", type=float, default=0.5,
                        help="navit: sigma of the seeded lognormal mixing weights (0 = equal weights: Megatron's "
                             "blend is then periodic and each of W workers reads only S/W sources)")
    parser.add_argument("--navit-seq-length", type=positive_int, default=8192,
                        help="navit: sequence length of the service")
    parser.add_argument("--shuffle-window", type=int, default=0,
                        help="navit: the service's sources draw in storage order, rows shuffled within windows of "
                             "this many rows (`shuffle_window`; Energon's way of reading); 0 = a global shuffle")
    parser.add_argument("--decode-images", choices=["loader", "constructor"], default="loader",
                        help="navit: where the service decodes images (`decode_images`): in the loaders, or in "
                             "the constructors beside the ranks (transformation reordering)")
    parser.add_argument("--max-fill-steps", type=int, default=1000,
                        help="navit: most steps the service serves until its loaders' row-group caches are full")
    parser.add_argument("--train-samples", type=int, default=20000,
                        help="samples the per-rank blended dataset is built for (Megatron builds indices for all)")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps the service serves before it is measured")
    parser.add_argument("--ranks-per-node", type=int, default=8,
                        help="ranks per trainer node (one constructor sidecar each); 0 = do not measure constructors")
    parser.add_argument("--actor-cap-mib", type=float, default=1024, help="partitioner's memory cap per loader actor")
    parser.add_argument("--baselines", default="own_reader,energon",
                        help="navit baselines: own_reader (the project's Parquet reader per rank; always measured), "
                             "energon (Megatron-Energon's loader per rank on the same rows as WebDataset shards); "
                             "text is measured against Megatron's GPTDataset")
    parser.add_argument("--energon-batches", type=int, default=0,
                        help="navit: samples each Energon rank reads before it is measured (0: 40 per source, "
                             "at least 400: its shuffle buffers full and every source's reader open)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="F", help="write the results as JSON to F")
    parser.add_argument("--plot", default="docs/img/bench_memory.png", help="plot of memory against ranks ('' = none)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def _baselines(args: argparse.Namespace) -> list[str]:
    return [b.strip() for b in str(args.baselines).split(",") if b.strip()]


# -- the service -------------------------------------------------------------------------
def _pids(handles: list[Any]) -> list[int]:
    import ray

    return ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles])


def _pid_memory(handles: list[Any]) -> list[dict[str, int]]:
    return [process_memory(pid) for pid in _pids(handles)]


def text_specs(prefixes: list[str]) -> list[Any]:
    """The text workload's Megatron sources as specs (EOD already in the documents)."""
    from megascale_data_ext.commands.bench_throughput import EOD_ID
    from megascale_data_ext.sources.base import SourceSpec

    return [SourceSpec(name=f"source{i}", format="megatron", paths=[p], append_eod=False, truncate=True,
                       eod_token_id=EOD_ID) for i, p in enumerate(prefixes)]


def measure_service(specs: list[Any], *, ranks: int, seq_length: int, steps: int, seed: int, cap_mib: float,
                    profiles: list[Any], image_token_id: int | None = None, fill_steps: int = 0) -> dict[str, Any]:
    """Partition, start loader actors + Planner on the running Ray, serve `steps`, measure (MiB).

    With ``fill_steps`` > 0 it goes on serving (at most that many steps in all) until every
    loader's row-group caches are full: the state a long run reaches.
    """
    import ray

    from megascale_data_ext.dataplane.partitioner import NodeResources, PartitionLimits, partition
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.dataplane.scaling import ScalingConfig
    from megascale_data_ext.runtime.actors import NO_FAULT_TOLERANCE
    from megascale_data_ext.runtime.autoscale_plan import AutoscalePlan, LoaderActorSpec
    from megascale_data_ext.runtime.routing import RoutedFetch
    from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
    from megascale_data_ext.runtime.constructor import DataConstructor
    from megascale_data_ext.runtime.loader_group import spawn_shadows
    from megascale_data_ext.runtime.ray_actor import Held
    from megascale_data_ext.runtime.topology import ServiceTopology
    from megascale_data_ext.runtime.wiring import start_planner

    tree = ClientPlaceTree.from_sizes(dp=ranks)
    cfg = ServiceConfig(sources=specs, seed=seed, samples_per_step=2 * ranks, num_microbatches=2,
                        seq_length=seq_length, strategy="vanilla", buffer_size=256, prefetch=2,
                        constructor_group=ranks, ray=RayConfig(namespace=f"bench-memory-{ranks}-{len(specs)}"))
    topo = ServiceTopology.of(cfg, tree)
    nodes = [NodeResources(name=f"node{i}", memory_bytes=64 << 30, cpus=64) for i in range(max(1, ranks // 8))]
    plan = partition(profiles, [spec.weight for spec in specs], nodes,
                     PartitionLimits(samples_per_step=cfg.samples_per_step, step_seconds=1.0,
                                     actor_memory_bytes=int(cap_mib * MiB), actor_base_bytes=80 << 20))
    groups = [a.sources for a in plan.assignments]
    fleet = AutoscalePlan(actors=[LoaderActorSpec(shards=list(a.shards), workers=a.workers) for a in plan.assignments],
                          scaling=ScalingConfig(capacity=(1.0,) * len(specs), max_shards=1), online=False)
    planner = start_planner(cfg, topo, fleet, NO_FAULT_TOLERANCE, named=False)
    con = DataConstructor(list(range(ranks)), cfg, topo,
                          get_plans=lambda step, bs: ray.get(planner.constructor_plans.remote(step, bs)),
                          fetch=RoutedFetch(lambda step, ss: ray.get(planner.routes.remote(step, ss))),
                          pad_id=0, image_token_id=image_token_id)
    step = 0
    held = want = nbytes = 0
    while True:
        for rank in range(ranks):
            con.get_step(step, rank)
        step += 1
        if step < steps:
            continue
        loaders = [reps[0].primary for reps in ray.get(planner.routes.remote(step, [g[0] for g in groups]))]
        if fill_steps <= 0:
            break
        held, want, nbytes = cache_state(loaders)
        if held >= want or step >= fill_steps:
            break
    loader_mem = _pid_memory(loaders)
    planner_mem = _pid_memory([planner])[0]
    daemons_mib, daemons = daemons_pss_mib(_pids([*loaders, planner]))  # Ray's own processes beside them
    store_mib = object_store_mib()
    shadow = spawn_shadows(cfg, planner, {}, topo.job)
    shadows = [shadow([(sh, specs[sh.source]) for sh in a.shards]) for a in plan.assignments]
    ray.get([s.ready.remote() for s in shadows])
    shadow_mem = _pid_memory(shadows)
    for h in [*shadows, *loaders, planner]:
        ray.kill(h)
    Held.release_all(topo.job)  # the loader groups' members, put by the Planner and here
    return {"loader_actors": len(loaders), "loader_uss": sum(m["uss"] for m in loader_mem) / MiB,
            "shared_once": shared_once([*loader_mem, planner_mem]),
            "loader_pss": sum(m["pss"] for m in loader_mem) / MiB, "planner_uss": planner_mem["uss"] / MiB,
            "planner_pss": planner_mem["pss"] / MiB, "shadow_uss": sum(m["uss"] for m in shadow_mem) / MiB,
            "steps_served": step, "row_groups_held": held, "row_groups_full": want, "row_group_mib": nbytes / MiB,
            "ray_daemons_mib": daemons_mib, "ray_daemon_processes": daemons, "object_store_mib": store_mib}


def measure_constructor(spec: Any, *, seq_length: int, ranks_per_node: int, seed: int) -> float:
    """USS (MiB) of one real DataConstructorActor serving a node's ranks for two steps from `spec`
    (its pad and image tokens from `spec`'s tokenizer, as the service's)."""
    import ray

    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.actors import NO_FAULT_TOLERANCE
    from megascale_data_ext.runtime.autoscale_plan import per_source_plan
    from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
    from megascale_data_ext.runtime.ray_actor import Held
    from megascale_data_ext.runtime.topology import ServiceTopology
    from megascale_data_ext.runtime.wiring import start_constructors, start_planner

    cfg = ServiceConfig(sources=[spec], seed=seed, samples_per_step=2 * ranks_per_node, num_microbatches=2,
                        seq_length=seq_length, strategy="vanilla", buffer_size=256, prefetch=2,
                        constructor_group=ranks_per_node, ray=RayConfig(namespace="bench-memory-constructor"))
    topo = ServiceTopology.of(cfg, ClientPlaceTree.from_sizes(dp=ranks_per_node))
    planner = start_planner(cfg, topo, per_source_plan(cfg), NO_FAULT_TOLERANCE, named=False)
    con, = start_constructors(cfg, topo, planner, NO_FAULT_TOLERANCE, named=False)
    for step in range(2):
        ray.get([con.get_step.remote(step, r) for r in range(ranks_per_node)])
    uss = _pid_memory([con])[0]["uss"] / MiB
    for h in (con, planner):  # the loader dies with the Planner that owns it
        ray.kill(h)
    Held.release_all(topo.job)  # its members, put by the Planner
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
    plt = pyplot()

    workloads = list(dict.fromkeys(r.get("workload", "text") for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.8), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        wrows = [r for r in rows if r.get("workload", "text") == wl]
        for s in sorted({r["sources"] for r in wrows}):
            rs = [r for r in wrows if r["sources"] == s and r.get("baseline") != "energon"]
            x = [r["ranks"] for r in rs]
            extra = " (extrapolated)" if any(r["colocated"].startswith("extrapolated") for r in rs) else ""
            ax.plot(x, [r["colocated_mib"] / 1024 for r in rs], "o--",
                    label=f"per-rank dataset + DataLoader workers, S={s}{extra}")
            en = [r for r in wrows if r["sources"] == s and r.get("baseline") == "energon"]
            if en:
                ax.plot([r["ranks"] for r in en], [r["colocated_mib"] / 1024 for r in en], "v--",
                        label=f"per-rank Megatron-Energon loader, S={s}")
            if rs and "service_all_in_mib" in rs[0]:
                ax.plot(x, [r["service_all_in_mib"] / 1024 for r in rs], "D-.",
                        label=f"service all-in (+ Ray daemons, object store, ranks' core workers), S={s}")
            ax.plot(x, [r["service_mib"] / 1024 for r in rs], "s-", label=f"service loaders+planner, S={s}")
            ax.plot(x, [(r["service_mib"] + r["constructors_mib"]) / 1024 for r in rs], "^:",
                    label=f"service + constructor sidecars, S={s}")
        ax.set_xlabel("trainer ranks")
        ax.set_ylabel("GiB (ranks: group PSS added; service: USS + shared once)", fontsize=8)
        ax.set_xticks(sorted({r["ranks"] for r in wrows}))
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        what = {"text": "Megatron-indexed text sources", "navit": "navit-like image-text Parquet sources"}
        ax.set_title(f"{wl}: {what.get(wl, wl)}", fontsize=10)
    fig.suptitle("bench memory: loader memory against ranks")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_workload(workload: str, args: argparse.Namespace, root: Path, t0: float) -> dict[str, Any]:
    """Write one workload's sources, measure the colocated ranks, then the service over the grid."""
    import ray

    from megascale_data_ext.commands.bench_throughput import write_blend
    from megascale_data_ext.commands.profile import profile_source

    ranks_grid, sources_grid, measured_s = _ints(args.ranks), _ints(args.sources), _ints(args.measure_sources)
    n_src = max(sources_grid + measured_s)
    details: dict[str, Any] = {}
    points = {}
    energon_model = None
    if workload == "text":
        _progress(f"text: writing {n_src} Megatron sources x {args.docs} documents")
        prefixes = write_blend(root / "data", sources=n_src, docs=args.docs, seq_length=args.seq_length,
                               seed=args.seed)
        specs = text_specs(prefixes)
        seq_length, image_token_id, fill_steps = args.seq_length, None, 0
        details.update(docs=args.docs, seq_length=args.seq_length)
        for s in tqdm(measured_s, desc="text: colocated ranks (measured)", file=sys.stderr):
            points[s] = measure_colocated(prefixes[:s], ranks=args.measure_ranks, workers=args.workers,
                                          seq_length=args.seq_length, train_samples=args.train_samples,
                                          seed=args.seed, cache=root / f"cache{s}")
    else:
        from megascale_data_ext.sources.tokenizer import ByteTokenizer

        _progress(f"navit: writing {n_src} image-text Parquet sources x {args.row_groups} row groups of "
                  f"{args.row_group_mib:g} MiB")
        specs, written = write_navit_sources(root / "data", sources=n_src, row_group_mib=args.row_group_mib,
                                             row_groups=args.row_groups, seed=args.seed,
                                             weight_sigma=args.weight_sigma)
        seq_length, image_token_id, fill_steps = args.navit_seq_length, ByteTokenizer.IMAGE, args.max_fill_steps
        details.update(written, row_group_mib=args.row_group_mib, row_groups=args.row_groups,
                       row_group_mib_decoded=round(row_group_mib_measured(specs[0]), 2),
                       row_group_cache=specs[0].row_group_cache, patch_size=NAVIT_PATCH,
                       max_image_patches=NAVIT_MAX_PATCHES, seq_length=seq_length)
        _progress(f"navit: written in {time.perf_counter() - t0:.0f} s ({written['file_mib']:,.0f} MiB)")
        for s in tqdm(measured_s, desc="navit: colocated ranks (measured)", file=sys.stderr):
            points[s] = measure_colocated_navit(specs[:s], ranks=args.measure_ranks, workers=args.workers,
                                                train_samples=args.train_samples, seed=args.seed,
                                                cache=root / f"cache{s}")
            unfilled = [i for i in points[s]["ranks_info"] if i["workers_full"] < i["processes"]]
            if unfilled:
                _progress(f"navit: S={s}: {len(unfilled)} rank(s) ended the sampler before every worker's "
                          "row-group caches were full (raise --train-samples)")
        if "energon" in _baselines(args):
            from megascale_data_ext.commands import _energon_baseline as energon

            energon_points = energon.measure_points(specs, measured_s, ranks=args.measure_ranks, workers=args.workers,
                                                    batches=args.energon_batches, root=root / "energon")
            details["energon_points"] = energon_points
            details["energon_model"] = energon_model = colocated_model(energon_points, args.workers)
    model = colocated_model(points, args.workers)
    _progress(f"{workload}: colocated measured at {time.perf_counter() - t0:.0f} s")
    served = [dataclasses.replace(sp, shuffle_window=args.shuffle_window, decode_images=args.decode_images)
              for sp in specs] if workload == "navit" else specs  # as served: the partitioner sizes actors by them
    profiles = [profile_source(sp, samples=16, batch=16)
                for sp in tqdm(served, desc=f"{workload}: profile", file=sys.stderr)]
    from megascale_data_ext.runtime.config import RayConfig
    from megascale_data_ext.runtime.embedded_ray import init_ray

    # the Ray a service starts for itself (arena cap, preloads), so the actors measured are the users'
    init_ray(RayConfig(num_cpus=2, namespace="bench-memory"), log_to_driver=False)
    _progress(f"{workload}: profiled and Ray started at {time.perf_counter() - t0:.0f} s")
    try:
        client_mib = client_core_worker_mib(ray.get_runtime_context().gcs_address, "bench-memory")
        details["trainer_core_worker_mib"] = round(client_mib, 1)
        con_mib = measure_constructor(served[0], seq_length=seq_length, ranks_per_node=args.ranks_per_node,
                                      seed=args.seed) \
            if args.ranks_per_node > 0 else 0.0
        _progress(f"{workload}: constructor measured at {time.perf_counter() - t0:.0f} s")
        grid = [(r, s) for s in sources_grid for r in ranks_grid]
        rows = []
        for r, s in tqdm(grid, desc=f"{workload}: service (measured)", file=sys.stderr):
            svc = measure_service(served[:s], ranks=r, seq_length=seq_length, steps=args.steps, seed=args.seed,
                                  cap_mib=args.actor_cap_mib, profiles=profiles[:s], image_token_id=image_token_id,
                                  fill_steps=fill_steps)
            service = svc["loader_uss"] + svc["planner_uss"] + svc["shared_once"]
            colo = colocated_mib(model, r, s)
            cons = -(-r // args.ranks_per_node) * con_mib if args.ranks_per_node > 0 else 0.0
            row = {
                "workload": workload, "ranks": r, "sources": s, "colocated_mib": round(colo, 1),
                "service_mib": round(service, 1), "ratio": round(colo / service, 2),
                "constructors_mib": round(cons, 1), "ratio_with_constructors": round(colo / (service + cons), 2),
                "shadow_mib": round(svc["shadow_uss"], 1), "loader_actors": svc["loader_actors"],
                "loader_mib": round(svc["loader_uss"], 1), "planner_mib": round(svc["planner_uss"], 1),
                "service_shared_once_mib": round(svc["shared_once"], 1),
                "service_pss_mib": round(svc["loader_pss"] + svc["planner_pss"], 1),
                "service_steps": svc["steps_served"],
                "colocated": ("measured per rank (x ranks)" if s in measured_s else
                              "extrapolated in sources (per-source cost) and ranks"),
                "service": "measured", "constructors": "1 measured x nodes (extrapolated)"
                if args.ranks_per_node > 0 else "not measured (--ranks-per-node 0)",
                "shadow": "measured",
            }
            ray_mib = svc["ray_daemons_mib"] + svc["object_store_mib"] + r * client_mib
            row.update(baseline="megatron" if workload == "text" else "own_reader",
                       ray_daemons_mib=round(svc["ray_daemons_mib"], 1), ray_daemon_processes=svc["ray_daemon_processes"],
                       object_store_mib=round(svc["object_store_mib"], 1),
                       trainer_core_workers_mib=round(r * client_mib, 1),
                       service_all_in_mib=round(service + cons + ray_mib, 1),
                       ratio_all_in=round(colo / (service + cons + ray_mib), 2))
            if workload == "navit":
                _progress(f"navit: {r} ranks x {s} sources: {svc['steps_served']} steps served, row groups cached "
                          f"{svc['row_groups_held']}/{svc['row_groups_full']} ({svc['row_group_mib']:,.0f} MiB)")
                row.update(shuffle_window=args.shuffle_window, decode_images=args.decode_images,
                           service_row_groups_held=svc["row_groups_held"],
                           service_row_groups_full=svc["row_groups_full"],
                           service_row_group_mib=round(svc["row_group_mib"], 1))
            rows.append(row)
            if energon_model is not None:
                en = colocated_mib(energon_model, r, s)
                rows.append({**row, "baseline": "energon", "colocated_mib": round(en, 1),
                             "ratio": round(en / service, 2), "ratio_with_constructors": round(en / (service + cons), 2),
                             "ratio_all_in": round(en / (service + cons + ray_mib), 2)})
    finally:
        ray.shutdown()
    return {**details, "colocated_points": points, "colocated_model": model, "constructor_mib": round(con_mib, 1),
            "rows": rows}


def run(args: argparse.Namespace) -> int:
    from megascale_data_ext.trainer.app import quiet_imports

    quiet_imports()  # megatron-core's TE/Apex fallback notices (writing the text sources imports it), as demo does
    ranks_grid, sources_grid, measured_s = _ints(args.ranks), _ints(args.sources), _ints(args.measure_sources)
    if not ranks_grid or not sources_grid or not measured_s or args.workers < 0 or args.measure_ranks < 1:
        print("error: --ranks, --sources and --measure-sources need values; --workers >= 0, --measure-ranks >= 1",
              file=sys.stderr)
        return 2
    if args.row_group_mib <= 0 or args.row_groups < 1 or args.shuffle_window < 0:
        print("error: --row-group-mib must be > 0, --row-groups >= 1 and --shuffle-window >= 0", file=sys.stderr)
        return 2
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    unknown = sorted(set(_baselines(args)) - {"own_reader", "energon"})
    if unknown:
        print(f"error: --baselines {args.baselines!r}: unknown {unknown}; choose from own_reader, energon",
              file=sys.stderr)
        return 2
    if "navit" in workloads and "energon" in _baselines(args):
        from megascale_data_ext.commands._energon_baseline import missing

        why = missing()
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    per: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for wl in workloads:
            per[wl] = _run_workload(wl, args, Path(tmp) / wl, t0)
            shutil.rmtree(Path(tmp) / wl, ignore_errors=True)
    rows = [r for wl in workloads for r in per[wl].pop("rows")]
    result = {"command": "megascale-data bench memory " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "",
              "workload": args.workload, "workers": args.workers, "measure_ranks": args.measure_ranks,
              "measured_sources": measured_s, "train_samples": args.train_samples, "steps": args.steps,
              "workloads": per, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'workload':>8} {'baseline':>10} {'ranks':>5} {'sources':>7} {'baseline MiB':>12} {'service MiB':>11} " \
           f"{'ratio':>6} {'+constr MiB':>11} {'ratio':>6} {'all-in MiB':>10} {'ratio':>6} {'actors':>6}  baseline figure"
    lines = [head, "-" * len(head)]
    for r in rows:
        with_cons = r["service_mib"] + r["constructors_mib"]
        lines.append(f"{r.get('workload', 'text'):>8} {r.get('baseline', ''):>10} {r['ranks']:>5} {r['sources']:>7} "
                     f"{r['colocated_mib']:>12,.0f} {r['service_mib']:>11,.0f} {r['ratio']:>6.2f} {with_cons:>11,.0f} "
                     f"{r['ratio_with_constructors']:>6.2f} {r.get('service_all_in_mib', 0):>10,.0f} "
                     f"{r.get('ratio_all_in', 0):>6.2f} {r['loader_actors']:>6}  {r['colocated']}")
    return "\n".join(lines)
