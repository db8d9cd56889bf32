"""`megascale-data bench soak`: hundreds of trainer-side clients for minutes; errors, memory, p99.

One service on embedded Ray (distinct demo text sources, autoscaled loaders, ``llm_balance``)
laid out for ``--clients`` fetching ranks (DP = clients, ``--constructors`` Data Constructors,
each serving a contiguous group of ranks) is consumed for ``--seconds`` by one thread per rank,
each with its own `RemoteConstructors` client pulling whole steps as fast as they arrive. As in
training, where every step ends in collectives (the DP gradient all-reduce) that no rank leaves
before all have joined, a client starts step s only once every client has finished step
s - ``--max-spread`` (default 1; their clients still prefetch ahead); ``--max-spread -1`` lets the
clients drift apart without bound, as no training job can (the service then holds every step
between the slowest and the fastest consumer: memory follows that spread).

Every ``--sample-seconds`` the memory of every service actor (Planner, loaders, constructors;
read from ``/proc`` by the pid Ray reports) and of this process is recorded: its own memory
(``smaps`` Private_Clean + Private_Dirty outside Ray's object store: heap, anonymous memory,
libraries), the object-store pages only it has touched (objects it wrote that no reader mapped
yet: private by the kernel's count but the store's, bounded by its size; reported apart,
`_proc_stats.private_split_mib`) and its RSS. Memory is *flat* when each actor's own memory over
the last fifth of the warm samples (median) is within ``--flat`` (5 %) of its median over the first
fifth (warm: after ``--warmup`` of the run): allocator warm-up is not a leak, steady growth is,
and a working set that swings from sample to sample is neither; ``flat`` is the verdict over the
service's actors (this process, which hosts every client thread, is reported beside them). Each
constructor's ``held_mib`` (the packs it holds for its consumers) is sampled beside it. Fetch
latency is each ``get`` of a step (waits on backpressure included): p50, p99, max. Errors: every
exception a client thread raised, with its rank and step.

``--heap-profile DIR`` records each constructor's allocations from warm-up to the end with memray
(native stacks; one aggregated capture per constructor): what is still live at the end, by stack,
tells a leak (a site that grows with the steps served) from memory the allocator keeps.

JSON: ``clients``, ``constructors``, ``seconds``, ``steps`` (min/median/max over ranks),
``fetches``, ``errors``, ``fetch_ms`` (p50/p99/max), ``memory`` (own memory per process:
``warm_mib``, ``end_mib``, ``max_mib``, ``growth``, ``growth_endpoints``, ``flat``), ``object_store``
and ``rss`` (the same of the object-store pages and of RSS), ``flat``, ``samples`` (the time series,
with ``held_mib`` and ``held_steps`` per constructor), ``allocators`` (the settings the service's
processes started with), ``load``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import positive_int
from megascale_data_ext.commands._plotting import pyplot

NAME = "bench soak"
HELP = "Hundreds of concurrent clients for minutes: errors, every actor's memory over time, fetch p99."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=positive_int, default=256, help="fetching ranks, one client thread each (DP size)")
    p.add_argument("--constructors", type=positive_int, default=4, help="Data Constructors (clients divide among them)")
    p.add_argument("--seconds", type=float, default=300.0, help="how long the clients pull")
    p.add_argument("--sources", type=positive_int, default=8, help="distinct demo text sources")
    p.add_argument("--client-prefetch", type=int, default=2, help="steps each client keeps requested ahead")
    p.add_argument("--max-spread", type=int, default=1,
                   help="steps the fastest consumer may be ahead of the slowest (1: lockstep, as collectives hold "
                        "training ranks; -1: unbounded)")
    p.add_argument("--sample-seconds", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run before memory counts as warm")
    p.add_argument("--flat", type=float, default=0.05, help="largest growth after warm-up that counts as flat")
    p.add_argument("--json", type=Path, default=None, help="write the summary and the samples here")
    p.add_argument("--plot", type=Path, default=None, help="write the memory-over-time plot (PNG) here")
    p.add_argument("--heap-profile", type=Path, default=None, metavar="DIR",
                   help="record each constructor's native heap with memray from warm-up to the end, one "
                        "capture per constructor in DIR (`pip install memray`; read with `memray table --leaks`)")


def soak_config(root: Path, *, clients: int, constructors: int, sources: int, client_prefetch: int) -> tuple:
    """``(ServiceConfig, ClientPlaceTree)`` for `clients` DP ranks served by `constructors` actors."""
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.sources.demo_data import make_demo_data

    if clients % constructors:
        raise SystemExit(f"error: --clients {clients} must divide by --constructors {constructors}")
    specs = [dataclasses.replace(s, truncate=True, max_tokens=512)
             for s in make_demo_data(root / "data", seed=21, rows=2000, text_sources=sources, image_sources=0,
                                     megatron_source=False)]
    cfg = ServiceConfig(sources=specs, seed=21, samples_per_step=clients, num_microbatches=1, seq_length=512,
                        strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=4 * clients,
                        constructor_group=clients // constructors,
                        ray=RayConfig(namespace="bench-soak", num_cpus=2),
                        fault_tolerance=FaultToleranceConfig(client_prefetch=client_prefetch))
    return cfg, ClientPlaceTree.from_sizes(dp=clients)


VERDICT_WINDOW = 0.2
"""The fraction of the warm samples at each end whose medians the verdict compares."""

CLIENTS = "bench (clients)"
"""This process: every client thread, reported beside the service's actors but not judged with them
(it started with glibc's defaults, and a trainer rank hosts one client, not hundreds)."""


def memory_summary(samples: list[dict[str, Any]], *, warm_from: float, flat: float,
                   measure: str = "own_mib", window: float = VERDICT_WINDOW) -> dict[str, dict[str, Any]]:
    """Per process (role): its memory (`measure` of each sample) once warm, at the end, the most
    seen, and its growth after warm-up.

    ``growth`` (the verdict) is the median of the last `window` of the warm samples against the
    median of the first: a constructor's memory swings with the packs it is building and holding
    (±10 % from one sample to the next under 256 clients), which two single samples would judge
    as growth or shrinkage by chance; a steady rise moves both medians apart all the same.
    ``growth_endpoints`` is the last warm sample against the first."""
    out: dict[str, dict[str, Any]] = {}
    roles = sorted({role for s in samples for role in s[measure]})
    for role in roles:
        series = [(s["t"], s[measure][role]) for s in samples if role in s[measure]]
        warm = [v for t, v in series if t >= warm_from]
        if not warm:
            continue
        k = max(1, round(len(warm) * window))
        first, last = float(np.median(warm[:k])), float(np.median(warm[-k:]))
        growth = (last - first) / first if first else 0.0
        endpoints = (warm[-1] - warm[0]) / warm[0] if warm[0] else 0.0
        out[role] = {"warm_mib": round(warm[0], 1), "end_mib": round(warm[-1], 1),
                     "max_mib": round(max(v for _, v in series), 1), "growth": round(growth, 4),
                     "growth_endpoints": round(endpoints, 4), "flat": growth <= flat}
    return out


def service_flat(memory: dict[str, dict[str, Any]]) -> bool:
    """The verdict: every service actor flat (the clients' process is reported, not judged)."""
    return all(m["flat"] for role, m in memory.items() if role != CLIENTS)


class LockstepWindow:
    """Consumers of one job that may drift at most `spread` steps apart (< 0: unbounded): a
    consumer starts step s once all `n` have finished step s - spread (what a step's collectives
    do to training ranks). The waiters are woken once per step the slowest finishes."""

    def __init__(self, n: int, spread: int, stop: threading.Event) -> None:
        self.n, self.spread, self.stop = n, spread, stop
        self.low = 0  # the first step some consumer has not finished
        self._done: dict[int, int] = {}
        self._cond = threading.Condition()

    def finished(self, step: int) -> None:
        with self._cond:
            self._done[step] = self._done.get(step, 0) + 1
            moved = False
            while self._done.get(self.low, 0) >= self.n:
                del self._done[self.low]
                self.low += 1
                moved = True
            if moved:
                self._cond.notify_all()

    def wait_turn(self, step: int) -> bool:
        """Block until `step` may start; False when the run is stopping."""
        if self.spread < 0:
            return not self.stop.is_set()
        with self._cond:
            while step - self.low > self.spread:
                if self.stop.is_set():
                    return False
                self._cond.wait(0.5)
        return not self.stop.is_set()


_TRACKER: Any = None


def _start_heap_tracker(_actor: Any, path: str) -> int:
    """Run inside an actor (`__ray_call__`): record every allocation still live when it stops."""
    global _TRACKER
    import memray

    _TRACKER = memray.Tracker(path, native_traces=True, trace_python_allocators=True,
                              file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
    _TRACKER.__enter__()
    return os.getpid()


def _stop_heap_tracker(_actor: Any) -> None:
    global _TRACKER
    if _TRACKER is not None:
        _TRACKER.__exit__(None, None, None)
        _TRACKER = None


def plot(result: dict[str, Any], path: Path) -> None:
    """Own memory of every process over the run, the verdict's two windows shaded; below it, what
    each constructor held for its consumers at the same samples."""
    plt = pyplot()

    samples = result["samples"]
    held = any(s.get("held_mib") for s in samples)
    fig, axes = plt.subplots(2 if held else 1, 1, figsize=(9, 6.5 if held else 4.5), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1]} if held else None)
    ax = axes[0][0]
    colors = plt.get_cmap("tab20").colors  # one colour a process: 14 or more lines
    for i, role in enumerate(sorted(result["memory"])):
        ax.plot([s["t"] for s in samples if role in s["own_mib"]],
                [s["own_mib"][role] for s in samples if role in s["own_mib"]], label=role, lw=1,
                color=colors[i % len(colors)])
    warm = [s["t"] for s in samples if s["t"] >= result["warm_from_s"]]
    if warm:
        k = max(1, round(len(warm) * VERDICT_WINDOW))
        for lo, hi in ((warm[0], warm[k - 1]), (warm[-k], warm[-1])):
            ax.axvspan(lo, hi, color="grey", alpha=0.12, lw=0)
    ax.axvline(result["warm_from_s"], color="grey", ls="--", lw=0.8)
    ax.set_ylabel("own memory (MiB, without object-store pages)")
    ax.set_title(f"bench soak: {result['clients']} clients, {result['seconds']:.0f} s, "
                 f"{result['fetches']} fetches, {len(result['errors'])} errors (shaded: the windows compared)")
    ax.legend(fontsize=6, ncol=3)
    if held:
        low = axes[1][0]
        for role in sorted({r for s in samples for r in s.get("held_mib", {})}):
            low.plot([s["t"] for s in samples if role in s.get("held_mib", {})],
                     [s["held_mib"][role] for s in samples if role in s.get("held_mib", {})], label=role, lw=0.8)
        low.set_ylabel("held packs (MiB)")
        low.legend(fontsize=6, ncol=4)
    axes[-1][0].set_xlabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def held_by_constructor(constructors: list[Any]) -> dict[str, tuple[float, int]]:
    """``constructor/i -> (MiB, steps)`` each constructor holds for its consumers right now:
    memory that follows their pace (bounded by ``max_lead``), shown beside the process's own."""
    import ray

    try:
        stats = ray.get([c.stats.remote() for c in constructors], timeout=30)
    except Exception:  # a sample without it, never a failed bench  # noqa: BLE001
        return {}
    return {f"constructor/{i}": (s["held_bytes"] / 2**20, s["buffered_steps"]) for i, s in enumerate(stats)}


def run(args: argparse.Namespace) -> int:
    import ray

    if args.heap_profile:  # refused before anything starts, not after the warm-up
        try:
            import memray  # noqa: F401
        except ImportError:
            from megascale_data_ext.errors import ConfigError

            raise ConfigError("`--heap-profile` records with memray, which is not installed: pip install memray, "
                              "or leave --heap-profile out") from None

    from megascale_data_ext.commands._proc_stats import private_split_mib, rss_mib
    from megascale_data_ext.runtime.malloc import allocator_environment
    from megascale_data_ext.runtime.remote import RemoteConstructors
    from megascale_data_ext.runtime.service import DataService

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        cfg, tree = soak_config(Path(tmp), clients=args.clients, constructors=args.constructors,
                                sources=args.sources, client_prefetch=args.client_prefetch)
        svc = DataService(cfg, tree, progress=print)
        handles = svc.start()
        allocators = allocator_environment()  # what the embedded Ray's processes inherited
        topo = handles.topology
        ranks = topo.fetch_ranks()
        stop = threading.Event()
        latencies: list[list[float]] = [[] for _ in ranks]
        steps = [0] * len(ranks)
        errors: list[dict[str, Any]] = []
        samples: list[dict[str, Any]] = []
        t0 = time.perf_counter()

        lockstep = LockstepWindow(len(ranks), args.max_spread, stop)

        def consume(i: int, rank: int) -> None:
            client = RemoteConstructors(topo, fault_tolerance=svc.ft)
            step = 0
            while not stop.is_set():
                if not lockstep.wait_turn(step):
                    return
                t = time.perf_counter()
                try:
                    batch, _ = client.get(step, 0, rank)
                    if batch["tokens"].size == 0:
                        raise AssertionError(f"empty microbatch at step {step}")
                except Exception as exc:  # counted and shown, never hidden
                    errors.append({"rank": rank, "step": step, "error": f"{type(exc).__name__}: {exc}"[:500]})
                    return
                latencies[i].append(time.perf_counter() - t)
                lockstep.finished(step)
                step += 1
                steps[i] = step

        def key(actor: dict[str, Any]) -> str:
            """A name that stays with the actor: loaders' positions shift when the autoscaler reclaims one."""
            role = actor["role"]
            if role.startswith(("loader/", "shadow/")):
                return f"{role.split('/')[0]} {actor['actor_id'][:8]}"
            return role

        def sample() -> None:
            while True:
                actors = svc.actors()
                pids = {key(a): a["pid"] for a in actors if a.get("pid")}
                pids[CLIENTS] = os.getpid()
                resident = {k: got[0] for k, pid in pids.items() if (got := rss_mib([pid]))}
                split = {k: got for k, pid in pids.items() if (got := private_split_mib(pid)) is not None}
                private = {k: v["own"] for k, v in split.items()}
                held = held_by_constructor(svc.constructors)
                now = time.perf_counter() - t0
                samples.append({"t": round(now, 1), "rss_mib": {k: round(v, 1) for k, v in resident.items()},
                                "own_mib": {k: round(v, 1) for k, v in private.items()},
                                "object_store_mib": {k: round(v["object_store"], 1) for k, v in split.items()},
                                "held_mib": {k: round(v[0], 1) for k, v in held.items()},
                                "held_steps": {k: v[1] for k, v in held.items()},
                                "steps_min": min(steps), "steps_max": max(steps)})
                print(f"[soak] {now:6.0f}/{args.seconds:.0f} s | steps {min(steps)}..{max(steps)} | "
                      f"fetches {sum(map(len, latencies))} | errors {len(errors)} | "
                      f"own memory: planner {private.get('planner', 0):.0f} MiB, constructors "
                      f"{[round(v) for k, v in private.items() if k.startswith('constructor/')]} MiB, of it held "
                      f"for consumers {[round(v[0]) for v in held.values()]} MiB", flush=True)
                if stop.wait(args.sample_seconds):
                    return

        threads = [threading.Thread(target=consume, args=(i, r), daemon=True, name=f"client-{r}")
                   for i, r in enumerate(ranks)]
        sampler = threading.Thread(target=sample, daemon=True, name="sampler")
        sampler.start()
        for t in threads:
            t.start()
        profiled = []
        if args.heap_profile:
            args.heap_profile.mkdir(parents=True, exist_ok=True)
            if not stop.wait(args.warmup * args.seconds):
                profiled = svc.constructors
                ray.get([c.__ray_call__.remote(_start_heap_tracker, str(args.heap_profile / f"constructor{i}.bin"))
                         for i, c in enumerate(profiled)])
                print(f"[soak] heap profile of {len(profiled)} constructors from "
                      f"{time.perf_counter() - t0:.0f} s into {args.heap_profile}", flush=True)
        stop.wait(max(0.0, args.seconds - (time.perf_counter() - t0)))
        stop.set()
        for t in threads:
            t.join(timeout=max(60.0, svc.ft.recovery_timeout_s))
        sampler.join(timeout=60)
        stuck = [t.name for t in threads if t.is_alive()]
        wall = time.perf_counter() - t0
        ray.get([c.__ray_call__.remote(_stop_heap_tracker) for c in profiled])
        svc.stop()
    ray.shutdown()
    ms = np.asarray([x for lat in latencies for x in lat]) * 1e3
    warm_from = args.warmup * args.seconds
    memory = memory_summary(samples, warm_from=warm_from, flat=args.flat)
    rss = memory_summary(samples, warm_from=warm_from, flat=args.flat, measure="rss_mib")
    store = memory_summary(samples, warm_from=warm_from, flat=args.flat, measure="object_store_mib")
    result = {
        "clients": len(ranks), "constructors": args.constructors, "sources": args.sources,
        "client_prefetch": args.client_prefetch, "max_spread": args.max_spread,
        "spread_max": max((s["steps_max"] - s["steps_min"] for s in samples), default=0), "seconds": round(wall, 1), "warm_from_s": warm_from,
        "steps": {"min": min(steps), "median": int(np.median(steps)), "max": max(steps)},
        "fetches": int(ms.size), "errors": errors + [{"rank": n, "error": "still fetching at the end"}
                                                         for n in stuck],
        "fetch_ms": {q: round(float(np.percentile(ms, p)), 2) for q, p in (("p50", 50), ("p99", 99))}
        | {"max": round(float(ms.max()), 2)} if ms.size else {},
        "memory": memory, "object_store": store, "rss": rss,
        "flat": service_flat(memory),
        "samples": samples, "allocators": allocators, "load": {"before": load_before, "after": os.getloadavg()},
    }
    print(f"clients {result['clients']} | {result['seconds']} s | steps per client {result['steps']} | "
          f"fetches {result['fetches']} | errors {len(result['errors'])} | fetch ms {result['fetch_ms']}")
    print("process | own MiB: warm | end | max | growth (medians of the first and last fifth) | "
          "object-store pages MiB: warm | end | RSS MiB: warm | end")
    for role, m in memory.items():
        r, o = rss.get(role, {}), store.get(role, {})
        print(f"{role} | {m['warm_mib']} | {m['end_mib']} | {m['max_mib']} | {m['growth']:+.1%} "
              f"({m['growth_endpoints']:+.1%} first to last)"
              f"{'' if m['flat'] else ' (not flat)'} | {o.get('warm_mib')} | {o.get('end_mib')} | "
              f"{r.get('warm_mib')} | {r.get('end_mib')}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0 if not result["errors"] else 1
