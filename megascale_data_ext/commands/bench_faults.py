"""`megascale-data bench faults`: kill loaders, the Planner and constructors; count what the trainer got.

One service on embedded Ray (demo text sources, DP x PP layout) is consumed by one process
playing every fetching rank through `RemoteConstructors` (the trainer's path: whole steps,
``client_prefetch`` steps in flight) with ``--step-seconds`` of simulated compute per step.
The run is repeated per component with a fault schedule (`runtime.fault_injection`: each kill is a
SIGKILL the actor sends itself) and compared with a run without faults in the same process:

* ``lost`` / ``duplicated``: documents of the fault-free run missing from / extra in the
  faulted run, as multisets of the *delivered token sequences* (split at ``cu_seqlens``), not
  the service's own counters; the sources are distinct files, so a lost document and a
  duplicated one cannot cancel out;
* ``order_mismatches``: microbatches (step, rank, index) whose documents differ from the
  fault-free run's, in content or order;
* ``confirmed_deaths`` / ``pids_changed``: restarts Ray counted for the killed kind's actors
  during the run, and how many of them run under another process id than before it (an
  injection is only a request; these confirm it happened);
* ``max_stall_s``: per kill, the worst wait for a step in the steps after it, minus the
  fault-free run's median wait (what the trainer would see; 0 when prefetch hid it);
* ``ettr``: fault-free wall time / faulted wall time (the paper's effective training time ratio).

The memory cost of the shadows (resident bytes of the primary loaders and of the shadows)
is printed beside the loader row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import positive_int

NAME = "bench faults"
HELP = "Kill loaders, the Planner and Data Constructors during a run; report lost/duplicated samples and stalls."


def documents(batch: dict[str, np.ndarray], pad_id: int) -> list[tuple[int, ...]]:
    """The documents of a packed microbatch as token tuples (padding segments dropped)."""
    if "tokens" not in batch:
        return []
    tokens, cu = np.asarray(batch["tokens"]).reshape(-1), np.asarray(batch["cu_seqlens"]).reshape(-1)
    docs = [tokens[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    return [tuple(d.tolist()) for d in docs if len(d) and not np.all(d == pad_id)]


@dataclass(slots=True, kw_only=True)
class FaultRun:
    """What one consumption run delivered and how long each step waited."""

    docs: Counter = field(repr=False)
    order: dict[tuple[int, int, int], int] = field(repr=False)  # (step, rank, microbatch) -> hash of its documents
    step_wait_s: list[float]
    kill_steps: list[tuple[str, int, int]]  # (component, index, step)
    wall_s: float
    recoveries: list[dict[str, Any]]
    stats: dict[str, Any] = field(repr=False)
    memory: dict[str, int] = field(default_factory=dict)
    actors_before: list[dict[str, Any]] = field(default_factory=list, repr=False)
    actors_after: list[dict[str, Any]] = field(default_factory=list, repr=False)


def consume(service: Any, handles: Any, steps: int, *, faults: str = "", step_seconds: float = 0.0) -> FaultRun:
    """Pull `steps` steps for every fetching rank of `service`, firing `faults` on the way."""
    from megascale_data_ext.runtime.fault_injection import FaultInjector, parse_faults
    from megascale_data_ext.runtime.remote import RemoteConstructors, actor_crasher
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    topo, ft = handles.topology, service.ft
    pad_id = load_tokenizer(service.config.sources[0].tokenizer).pad_id
    client = RemoteConstructors(topo, fault_tolerance=ft)
    injector = FaultInjector(parse_faults(faults), actor_crasher(topo))
    docs: Counter = Counter()
    order: dict[tuple[int, int, int], int] = {}
    waits = []
    before = service.actors()
    t_start = time.perf_counter()
    for step in range(steps):
        injector.on_step(step)
        t0 = time.perf_counter()
        for rank in topo.fetch_ranks():
            for j in range(service.config.num_microbatches):
                batch, _info = client.get(step, j, rank)
                got = documents(batch, pad_id)
                docs.update(got)
                order[(step, rank, j)] = hash(tuple(got))
        waits.append(time.perf_counter() - t0)
        time.sleep(step_seconds)  # the trainer's compute, which prefetch overlaps
    wall = time.perf_counter() - t_start
    return FaultRun(docs=docs, order=order, step_wait_s=waits, wall_s=wall, recoveries=client.recoveries,
                    kill_steps=[(e.component, e.index, e.step) for e in injector.events], stats=service.stats(),
                    memory=service.memory(), actors_before=before, actors_after=service.actors())


def compare(reference: Counter, got: Counter) -> tuple[int, int]:
    """(lost, duplicated) documents of `got` against `reference`."""
    return sum((reference - got).values()), sum((got - reference).values())


def confirmed_deaths(run: FaultRun, component: str) -> tuple[int, int]:
    """(restarts Ray counted, actors now under another pid) of `component`'s actors during `run`;
    actors are matched by id, which a restart keeps."""
    before = {r["actor_id"]: r for r in run.actors_before if r["role"].split("/")[0] == component}
    restarts = changed = 0
    for row in run.actors_after:
        old = before.get(row["actor_id"])
        if old is not None:
            restarts += max(0, (row["restarts"] or 0) - (old["restarts"] or 0))
            changed += row["pid"] != old["pid"]
    return restarts, changed


def order_mismatches(run: FaultRun, baseline: FaultRun) -> int:
    """Microbatches whose documents differ (in content or order) from the fault-free run's."""
    return sum(run.order.get(key) != want for key, want in baseline.order.items())


def stalls(run: FaultRun, baseline: FaultRun, window: int) -> list[float]:
    """Per kill step, the worst wait in the `window` steps from it beyond the baseline's median wait."""
    typical = float(np.median(baseline.step_wait_s))
    kill_steps = sorted({s for _, _, s in run.kill_steps})
    return [max(0.0, max(run.step_wait_s[s:s + window]) - typical) for s in kill_steps if s < len(run.step_wait_s)]


def schedule(component: str, kills: int, steps: int, count: int) -> str:
    """A schedule of at least `kills` kills of `component` spread over `steps` (rotating over `count` actors)."""
    if component == "planner":
        every = max(1, (steps - 2) // kills)
        return f"planner@every{every}"
    if component == "loader":  # five at once, as a node with five loaders would fail
        group = min(5, count)
        firings = -(-kills // group)
        every = max(1, (steps - 2) // firings)
        return ",".join(f"loader:{(k * group + t) % count}@{every * (k + 1)}"
                        for k in range(firings) for t in range(group))
    every = max(1, (steps - 2) // kills)
    return ",".join(f"constructor:{k % count}@{every * (k + 1)}" for k in range(kills))


@dataclass(slots=True, kw_only=True)
class Row:
    component: str
    schedule: str
    kills: int
    confirmed_deaths: int
    pids_changed: int
    lost: int
    duplicated: int
    order_mismatches: int
    max_stall_s: float
    median_stall_s: float
    steps_completed: int
    wall_s: float
    baseline_wall_s: float
    ettr: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", type=positive_int, default=16,
                        help="demo text sources = Source Loaders (default 16)")
    parser.add_argument("--dp", type=positive_int, default=3)
    parser.add_argument("--pp", type=positive_int, default=2)
    parser.add_argument("--steps", type=positive_int, default=64, help="steps per run (default 64)")
    parser.add_argument("--kills", type=positive_int, default=20, help="kills per component type (default 20)")
    parser.add_argument("--components", default="loader,planner,constructor")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="simulated compute per step (default 0.5)")
    parser.add_argument("--client-prefetch", type=int, default=4)
    parser.add_argument("--no-shadows", action="store_true", help="loaders recover by restart only")
    parser.add_argument("--autoscale", action="store_true",
                        help="autoscaled loader groups (the main job's default) instead of one loader per source")
    parser.add_argument("--num-cpus", type=positive_int, default=2)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")


def run(args: argparse.Namespace) -> int:
    import ray

    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
    from megascale_data_ext.runtime.embedded_ray import init_ray
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.service import DataService
    from megascale_data_ext.sources.demo_data import make_demo_data

    tmp = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    specs = [dataclasses.replace(s, truncate=True) for s in  # distinct files: a loss and a duplicate cannot cancel
             make_demo_data(tmp, seed=7, rows=400, text_sources=args.sources, image_sources=0, megatron_source=False)]
    tree = ClientPlaceTree.from_sizes(dp=args.dp, pp=args.pp)
    ft = FaultToleranceConfig(shadow_loaders=not args.no_shadows, client_prefetch=args.client_prefetch)
    init_ray(RayConfig(num_cpus=args.num_cpus), log_to_driver=False)  # as the service starts its own
    print(f"load before: {os.getloadavg()}")

    def one(component: str, faults: str) -> FaultRun:
        cfg = ServiceConfig(sources=specs, seed=11, samples_per_step=4 * args.dp, num_microbatches=2, seq_length=1024,
                            strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64,
                            ray=RayConfig(namespace=f"faults-{component}"),
                            autoscale=AutoscaleConfig(enabled=args.autoscale))
        svc = DataService(cfg, tree, fault_tolerance=ft, progress=None)
        handles = svc.start()
        try:
            return consume(svc, handles, args.steps, faults=faults, step_seconds=args.step_seconds)
        finally:
            svc.stop()

    baseline = one("none", "")
    print(f"baseline: {args.steps} steps in {baseline.wall_s:.1f} s, median step wait "
          f"{np.median(baseline.step_wait_s) * 1e3:.1f} ms, {sum(baseline.docs.values())} documents")
    counts = {"loader": args.sources, "planner": 1, "constructor": args.dp}
    rows, memory = [], baseline.memory
    for component in args.components.split(","):
        faults = schedule(component, args.kills, args.steps, counts[component])
        got = one(component, faults)
        lost, dup = compare(baseline.docs, got.docs)
        per_kill = stalls(got, baseline, args.client_prefetch + 2) or [0.0]
        deaths, pids = confirmed_deaths(got, component)
        row = Row(component=component, schedule=faults, kills=len(got.kill_steps), confirmed_deaths=deaths,
                  pids_changed=pids, lost=lost, duplicated=dup, order_mismatches=order_mismatches(got, baseline),
                  max_stall_s=round(max(per_kill), 3), median_stall_s=round(float(np.median(per_kill)), 3),
                  steps_completed=len(got.step_wait_s), wall_s=round(got.wall_s, 2),
                  baseline_wall_s=round(baseline.wall_s, 2), ettr=round(baseline.wall_s / got.wall_s, 3))
        rows.append(row)
        print(json.dumps(asdict(row)))
        if args.step_seconds > 0:
            print(f"{component}: worst stall {row.max_stall_s:.3f} s = {row.max_stall_s / args.step_seconds:.2f} "
                  f"steps of {args.step_seconds:g} s")
        if component == "loader":
            mem = memory = got.memory
            ratio = (mem["loaders_rss"] + mem["shadows_rss"]) / max(mem["loaders_rss"], 1)
            print(f"memory: primary loaders {mem['loaders_rss'] / 2**20:.0f} MiB, shadows "
                  f"{mem['shadows_rss'] / 2**20:.0f} MiB ({args.sources} each): x{ratio:.2f} loader memory with shadows")
    print(f"load after: {os.getloadavg()}")
    ray.shutdown()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"steps": args.steps, "step_seconds": args.step_seconds,
                                         "autoscale": args.autoscale,
                                         "client_prefetch": args.client_prefetch, "shadows": not args.no_shadows,
                                         "memory": memory, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0 if all(r.lost == 0 and r.duplicated == 0 and r.order_mismatches == 0 and r.confirmed_deaths > 0
                    for r in rows) else 1
