"""`megascale-data bench chaos`: random kills from outside and a lost node during one long run.

A three-node `ray.cluster_utils.Cluster` (a head and two trainer nodes, labelled ``msd-node=trainer-0/1``)
runs one DP x PP service with autoscaled loaders (partitioned over the trainer nodes, one
distinct demo source per actor) and the Data Constructors as sidecars beside their ranks. One
`RemoteConstructors` per fetching rank, all in this process, consume ``--steps`` steps while a
seeded schedule (`chaos_schedule`) fires every 3-10 steps:

* single kills (``planner``, ``loader``, ``constructor``) and double kills in the same instant
  (``planner+loader``, ``constructor+loader``: a loader on the constructor's node), each a
  SIGKILL by pid taken from `DataService.actors()` (the actor does not kill itself); a kill is
  confirmed when that actor (or, when it was respawned under a new id — a restarted Planner
  starts its loader groups anew — the actor in its role) reports a new pid, alive;
* ``node-remove``: the trainer node holding constructors and loaders is removed, and
  ``node-add`` adds a node of that label back; recovered when every actor it held is alive on
  another node. The service then moves those actors home to the returned node (restarts,
  `DataService.move_home`), inside the run like any other fault.

Rows: ``fault, at_step, victims, stall_s, recovered`` (and ``recovery_s``): ``stall_s`` is the
worst step delivery time in the ``client_prefetch + 2`` steps from the fault beyond the run's
median. Totals against a fault-free in-process run of the same config: ``lost`` / ``duplicated``
(documents as delivered token sequences, a multiset; the sources are distinct files, so a lost
and a duplicated document cannot cancel), ``order_mismatches`` (steps of a rank whose bytes
differ). The plot is each step's delivery time with the faults marked.

Shadow loaders (``--no-shadows`` turns them off): every loader actor has a warm shadow, spread
by Ray away from it, which serves while the loader restarts (`runtime.shadows`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import positive_int
from megascale_data_ext.commands._plotting import pyplot

NAME = "bench chaos"
HELP = "Seeded random SIGKILLs (single and double) and a lost node during a long run; lost/duplicated/out of order."

KILLS: tuple[str, ...] = ("planner", "loader", "constructor", "planner+loader", "constructor+loader")
LOST_NODE = "trainer-1"


@dataclass(slots=True, kw_only=True)
class FaultRow:
    """One fired fault: what, when, whom (role, pid, node), the trainer's stall and the recovery."""

    fault: str
    at_step: int
    victims: list[dict[str, Any]] = field(default_factory=list)
    stall_s: float = 0.0
    recovered: bool = False
    recovery_s: float | None = None


def chaos_schedule(steps: int, seed: int, *, every: tuple[int, int] = (3, 10), node_loss_at: int | None = None,
                   node_back_after: int = 12) -> list[tuple[int, str]]:
    """``[(step, fault)]``: a kill from `KILLS` every `every` steps (seeded), plus the node removal
    at `node_loss_at` and its return `node_back_after` steps later (None: no node fault)."""
    rng = random.Random(seed)
    out, step = [], rng.randint(*every)
    while step < steps - 2:
        out.append((step, rng.choice(KILLS)))
        step += rng.randint(*every)
    if node_loss_at is not None:
        out += [(node_loss_at, "node-remove"), (min(node_loss_at + node_back_after, steps - 1), "node-add")]
    return sorted(out)


class ActorWatch:
    """A background thread reading `DataService.actors()` about every `period` s: the latest
    snapshot picks victims without blocking the consumers (the call waits while a loader restarts),
    and each fault's recovery is the first snapshot where all its victims are back."""

    def __init__(self, service: Any, period: float = 0.5) -> None:
        self.service, self.period = service, period
        self.rows: list[dict[str, Any]] = service.actors()
        self._waiting: list[tuple[FaultRow, float, str | None]] = []  # (row, fired at, lost node id)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="actor-watch")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                rows = self.service.actors()
            except Exception:  # noqa: BLE001 - a snapshot taken mid-recovery may fail; the next one counts
                continue
            now = time.monotonic()
            with self._lock:
                self.rows = rows
                by_id, by_role = {r["actor_id"]: r for r in rows}, {r["role"]: r for r in rows}
                for row, fired, lost in list(self._waiting):  # a respawned actor (new id) takes its role's place
                    if all(_back(by_id.get(v["actor_id"]) or by_role.get(v["role"]), v, lost) for v in row.victims):
                        row.recovered, row.recovery_s = True, round(now - fired, 2)
                        self._waiting.remove((row, fired, lost))

    def alive(self, prefix: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.rows if r["role"].startswith(prefix) and r["state"] == "ALIVE" and r["pid"]]

    def on_node(self, node_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.rows if r["node_id"] == node_id]

    def expect(self, row: FaultRow, lost_node: str | None = None) -> None:
        with self._lock:
            self._waiting.append((row, time.monotonic(), lost_node))

    def wait(self, timeout: float) -> None:
        """Until every fault recovered or `timeout` s passed."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._waiting:
                    return
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _back(now: dict[str, Any] | None, victim: dict[str, Any], lost_node: str | None) -> bool:
    """The victim runs again: a new pid, alive, and (after a node loss) on another node."""
    return (now is not None and now["state"] == "ALIVE" and now["pid"] not in (None, victim["pid"])
            and (lost_node is None or now["node_id"] != lost_node))


def kill(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SIGKILL each actor's process by pid (all within a few microseconds); the victims' records."""
    for r in rows:
        with contextlib.suppress(ProcessLookupError):  # died since the snapshot: it is restarting already
            os.kill(r["pid"], signal.SIGKILL)
    return [{"role": r["role"], "pid": r["pid"], "node_id": r["node_id"], "actor_id": r["actor_id"]} for r in rows]


def pick(fault: str, watch: ActorWatch, rng: random.Random) -> list[dict[str, Any]]:
    """The victims of a kill fault, chosen from the live actors."""
    victims = []
    for part in fault.split("+"):
        live = [r for r in watch.alive("constructor/" if part == "constructor" else part) if r not in victims]
        if part == "loader" and victims:  # beside the other victim when one runs there (a node's processes)
            live = [r for r in live if r["node_id"] == victims[0]["node_id"]] or live
        if live:
            victims.append(rng.choice(live))
    return victims


def documents(batch: dict[str, np.ndarray], pad_id: int) -> list[tuple[int, ...]]:
    from megascale_data_ext.commands.bench_faults import documents as split

    return split(batch, pad_id)


def digest(microbatches: list) -> str:
    from megascale_data_ext.commands.bench_consumers import step_digest

    return step_digest(microbatches, None)


def chaos_config(root: Path, *, dp: int, pp: int, sources: int, seed: int, scaling: bool,
                 client_prefetch: int, shadows: bool = True) -> tuple[Any, Any, Any]:
    """``(ServiceConfig, tree, FaultToleranceConfig)``: distinct demo text sources, one per loader
    actor (a profile journal that makes each source fill an actor), spread over the trainer nodes."""
    from megascale_data_ext.dataplane.partitioner import MiB
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile
    from megascale_data_ext.runtime.config import AutoscaleConfig, PlacementConfig, RayConfig, ServiceConfig
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.sources.demo_data import make_demo_data
    from megascale_data_ext.sources.profiling import source_fingerprint

    specs = [dataclasses.replace(s, truncate=True, max_tokens=1024) for s in
             make_demo_data(root / "data", seed=seed, rows=400, text_sources=sources, image_sources=0,
                            megatron_source=False)]
    journal = root / "profiles.json"
    ProfileJournal([SourceProfile(name=s.name, fingerprint=source_fingerprint(s), num_samples=400, samples_profiled=8,
                                  latency_s=1e-3, access_state_bytes=40 * MiB, bytes_per_sample=MiB, throughput=1e3)
                    for s in specs]).save(journal)
    ft = FaultToleranceConfig(client_prefetch=client_prefetch, checkpoint_dir=str(root / "ckpt"),
                              shadow_loaders=shadows)
    tree = ClientPlaceTree.from_sizes(dp=dp, pp=pp)
    cfg = ServiceConfig(sources=specs, seed=seed, samples_per_step=4 * dp, num_microbatches=2, seq_length=1024,
                        strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64, prefetch=1,
                        ray=RayConfig(namespace=f"chaos-{seed}"), fault_tolerance=ft,
                        autoscale=AutoscaleConfig(enabled=True, profiles=str(journal), actor_memory_mib=160,
                                                  actor_base_mib=80, scaling=scaling),
                        placement=PlacementConfig(trainer_nodes=["trainer-0", LOST_NODE],
                                                  ranks_per_node=max(1, dp // 2)))
    return cfg, tree, ft


def reference(cfg: Any, tree: Any, steps: int, pad_id: int) -> tuple[dict, Counter]:
    """The fault-free in-process run: ``{(rank, step): digest}`` and its documents."""
    from megascale_data_ext.runtime.inprocess import InProcessService

    ref, want, docs = InProcessService(cfg, tree), {}, Counter()
    for step in range(steps):
        for rank in ref.topology.fetch_ranks():
            mbs = [ref.get(step, j, rank) for j in range(cfg.num_microbatches)]
            want[(rank, step)] = digest(mbs)
            for batch, _ in mbs:
                docs.update(documents(batch, pad_id))
    return want, docs


def run_chaos(root: Path, *, steps: int, seed: int = 3, schedule: list[tuple[int, str]] | None = None,
              dp: int = 4, pp: int = 2, sources: int = 8, scaling: bool = True, client_prefetch: int = 4,
              step_seconds: float = 0.0, shadows: bool = True, log: Any = print) -> dict[str, Any]:
    """Run the chaos schedule (default `chaos_schedule(steps, seed, node_loss_at=2 * steps // 5)`)
    on a fresh three-node cluster; returns ``{"rows", "totals", "step_s", "shadows", ...}``."""
    import ray
    from ray.cluster_utils import Cluster

    from megascale_data_ext.runtime.remote import RemoteConstructors
    from megascale_data_ext.runtime.service import DataService
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    cfg, tree, ft = chaos_config(root, dp=dp, pp=pp, sources=sources, seed=seed, scaling=scaling,
                                 client_prefetch=client_prefetch, shadows=shadows)
    log(f"shadow loaders: {'on' if shadows else 'off'}")
    schedule = chaos_schedule(steps, seed, node_loss_at=2 * steps // 5) if schedule is None else schedule
    pad_id = load_tokenizer(cfg.sources[0]).pad_id
    t0 = time.perf_counter()
    want, want_docs = reference(cfg, tree, steps, pad_id)
    log(f"fault-free in-process run: {steps} steps in {time.perf_counter() - t0:.1f} s, {sum(want_docs.values())} "
        f"documents; schedule: {schedule}")
    if ray.is_initialized():  # its Cluster's nodes are what it removes: it cannot run on a Ray joined already
        raise RuntimeError("bench chaos starts a ray.cluster_utils.Cluster of its own: "
                           "call it with Ray not initialized")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    rng = random.Random(seed + 1)
    rows: list[FaultRow] = []
    got, got_docs, step_s, errors = {}, Counter(), [], []
    service = None
    try:  # from here on, whatever fails, the cluster's processes go with it
        nodes = {name: cluster.add_node(num_cpus=2, labels={"msd-node": name}) for name in ("trainer-0", LOST_NODE)}
        ray.init(address=cluster.address, include_dashboard=False, configure_logging=False, log_to_driver=False)
        cluster.wait_for_nodes()
        service = DataService(cfg, tree, progress=None)
        topo = service.start().topology
        watch = ActorWatch(service)
        log("placement: " + ", ".join(f"{r['role']}@{_node_name(r['node_id'], nodes)}" for r in watch.rows))
        clients = {r: RemoteConstructors(topo, fault_tolerance=ft) for r in topo.fetch_ranks()}
        lost_id = None
        for step in range(steps):
            for at, fault in schedule:
                if at != step:
                    continue
                row = FaultRow(fault=fault, at_step=step)
                if fault == "node-remove":
                    lost_id = nodes[LOST_NODE].node_id
                    row.victims = [{k: r[k] for k in ("role", "pid", "node_id", "actor_id")}
                                   for r in watch.on_node(lost_id)]
                    cluster.remove_node(nodes.pop(LOST_NODE))
                    watch.expect(row, lost_id)
                elif fault == "node-add":
                    nodes[LOST_NODE] = cluster.add_node(num_cpus=2, labels={"msd-node": LOST_NODE})
                    row.recovered, row.recovery_s = True, 0.0
                else:
                    row.victims = kill(pick(fault, watch, rng))
                    watch.expect(row)
                rows.append(row)
                log(f"step {step}: {fault} -> {[v['role'] for v in row.victims]}")
            t = time.perf_counter()
            for rank, client in clients.items():
                try:
                    mbs = [client.get(step, j, rank) for j in range(cfg.num_microbatches)]
                except Exception as exc:  # noqa: BLE001 - counted and reported: the trainer would have seen it
                    errors.append(f"rank {rank} step {step}: {exc!r}"[:300])
                    continue
                got[(rank, step)] = digest(mbs)
                for batch, _ in mbs:
                    got_docs.update(documents(batch, pad_id))
            step_s.append(time.perf_counter() - t)
            time.sleep(step_seconds)
        watch.wait(60)
        watch.stop()
        recoveries = [r for c in clients.values() for r in c.recoveries]
        final = watch.rows
    finally:
        if service is not None:
            service.stop()
        ray.shutdown()
        cluster.shutdown()
    typical = float(np.median(step_s))
    for row in rows:
        row.stall_s = round(max(0.0, max(step_s[row.at_step:row.at_step + client_prefetch + 2]) - typical), 3)
    totals = {"lost": sum((want_docs - got_docs).values()), "duplicated": sum((got_docs - want_docs).values()),
              "order_mismatches": sum(got.get(k) != v for k, v in want.items()), "errors": len(errors)}
    return {"steps": steps, "seed": seed, "dp": dp, "pp": pp, "sources": sources, "scaling": scaling,
            "client_prefetch": client_prefetch, "step_seconds": step_seconds, "shadows": shadows,
            "schedule": schedule, "rows": [asdict(r) for r in rows], "totals": totals,
            "errors": errors[:20], "median_step_s": round(typical, 4), "step_s": [round(s, 4) for s in step_s],
            "client_recoveries": len(recoveries), "restarts": {r["role"]: r["restarts"] for r in final},
            "documents": sum(want_docs.values())}


def _node_name(node_id: str | None, nodes: dict[str, Any]) -> str:
    return next((name for name, n in nodes.items() if n.node_id == node_id), "head")


def plot(result: dict[str, Any], path: Path) -> None:
    """Per-step delivery time (all fetching ranks), faults as labelled vertical lines."""
    plt = pyplot()

    colours = {"planner": "tab:red", "loader": "tab:orange", "constructor": "tab:purple",
               "planner+loader": "tab:brown", "constructor+loader": "tab:pink", "node-remove": "black",
               "node-add": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.plot(range(len(result["step_s"])), result["step_s"], lw=1, color="tab:blue", label="step delivery time")
    seen = set()
    for row in result["rows"]:
        c = colours.get(row["fault"], "grey")
        ax.axvline(row["at_step"], color=c, ls="--" if "node" in row["fault"] else ":", lw=1.2,
                   label=None if row["fault"] in seen else row["fault"])
        seen.add(row["fault"])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("delivery time of the step, all fetching ranks (s)")
    t = result["totals"]
    ax.set_title(f"bench chaos: DP{result['dp']} x PP{result['pp']}, {len(result['rows'])} faults; lost {t['lost']}, "
                 f"duplicated {t['duplicated']}, order mismatches {t['order_mismatches']}, errors {t['errors']}")
    ax.legend(fontsize=8, ncol=4, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--seed", type=int, default=3, help="seeds the data and the fault schedule")
    parser.add_argument("--dp", type=positive_int, default=4)
    parser.add_argument("--pp", type=positive_int, default=2)
    parser.add_argument("--sources", type=positive_int, default=8, help="distinct demo text sources (default 8)")
    parser.add_argument("--no-scaling", action="store_true", help="keep the offline partition (no online scaling)")
    parser.add_argument("--client-prefetch", type=int, default=4)
    parser.add_argument("--no-shadows", action="store_true", help="loaders recover by restart only (no shadows)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="simulated compute per step")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--plot", type=Path, help="write the per-step delivery time plot (PNG) here")


def run(args: argparse.Namespace) -> int:
    print(f"load before: {os.getloadavg()}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        result = run_chaos(Path(tmp), steps=args.steps, seed=args.seed, dp=args.dp, pp=args.pp, sources=args.sources,
                           scaling=not args.no_scaling, client_prefetch=args.client_prefetch,
                           step_seconds=args.step_seconds, shadows=not args.no_shadows,
                           log=lambda line: print(line, flush=True))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["load_after"] = os.getloadavg()
    print("fault | at_step | victims | stall_s | recovered (s)")
    for r in result["rows"]:
        print(f"{r['fault']} | {r['at_step']} | {', '.join(v['role'] for v in r['victims']) or '-'} | {r['stall_s']} "
              f"| {r['recovered']} ({r['recovery_s']})")
    print(json.dumps({k: result[k] for k in ("totals", "median_step_s", "client_recoveries", "wall_s", "load_after")}))
    for e in result["errors"]:
        print(f"error: {e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    ok = all(v == 0 for v in result["totals"].values()) and all(r["recovered"] for r in result["rows"])
    return 0 if ok else 1
