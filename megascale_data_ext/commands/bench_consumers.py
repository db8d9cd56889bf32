"""`megascale-data bench consumers`: ranks as fast as a GPU step, one that stalls; memory stays bounded.

One service on embedded Ray (seeded image-text and text Parquet sources, ``vlm_balance`` by
default, DP x PP ranks; ``hybrid_cp`` on text sources over DP x CP x PP, each rank its own count of
microbatches) is consumed by one thread per rank, each pulling its encoder share and
its microbatches as fast as they arrive (``--client-prefetch`` steps in flight). At
``--stall-at`` the last fetching rank sleeps ``--stall`` seconds, then races to catch up. Every
``--sample-seconds`` the resident memory of each Data Constructor actor and of this client
process is read, with each constructor's held steps and its lead over its slowest fetcher.

What it shows: data is released when taken, not by a window, so a fast rank never loses a step
(every rank's bytes are compared with a slow lockstep in-process consumer's, ``mismatches``), and
memory is bounded by backpressure: constructors hold at most ``max_lead`` steps
(``fault_tolerance.max_lead_steps``) however long the stall. Rows (JSON ``samples``): ``wall_s``,
``slowest_step``, ``fastest_step``, ``constructor_rss_mib`` (per constructor), ``client_rss_mib``,
``held_steps``, ``lead``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._config_args import positive_int

NAME = "bench consumers"
HELP = "Racing and stalling trainer ranks on the Ray service: every step whole, constructor/client memory bounded."

VLM_ARGS = {"model": "gpt-tiny", "encoder_model": "vit-1b", "encoder_axis": "WORLD", "axis": "DP"}
STRATEGY_ARGS = {"vlm_balance": VLM_ARGS, "llm_balance": {"model": "gpt-tiny"}, "hybrid_cp": {"model": "gpt-tiny"}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=500, help="steps every rank consumes")
    p.add_argument("--strategy", default="vlm_balance", choices=sorted(STRATEGY_ARGS))
    p.add_argument("--dp", type=positive_int, default=3)
    p.add_argument("--pp", type=positive_int, default=2)
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context parallel size (hybrid_cp: groups of the DP x CP ranks)")
    p.add_argument("--client-prefetch", type=int, default=4, help="steps each rank keeps requested ahead")
    p.add_argument("--stall-at", type=int, default=50, help="step at which the last fetching rank stalls")
    p.add_argument("--stall", type=float, default=30.0, help="seconds it stalls before racing")
    p.add_argument("--sample-seconds", type=float, default=1.0, help="seconds between memory samples")
    p.add_argument("--check-steps", type=int, default=40,
                   help="steps compared byte for byte with an in-process lockstep consumer (0 = none)")
    p.add_argument("--json", default=None, help="write the summary and samples here")


# -- racing consumers (shared with tests/integration/test_fast_consumers.py) -----------------
def step_digest(microbatches: list, images: Any) -> str:
    """SHA-1 of what a rank got for one step: its microbatches' fields and samples, its encoder share."""
    h = hashlib.sha1()
    for batch, info in microbatches:
        for k in sorted(batch):
            h.update(k.encode() + np.ascontiguousarray(batch[k]).tobytes())
        h.update(np.asarray(info["samples"]).tobytes())
    if images is not None:
        for part in images:
            h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def consume(source: Any, topology: Any, rank: int, steps: range, *, images_first: bool, hybrid: bool, m: int,
            stall: tuple[int, float] | None = None, on_step: Any = None) -> dict[int, str]:
    """One rank pulling `steps` as fast as they come: ``{step: digest}``."""
    out = {}
    fetches = topology.fetches(rank)
    for step in steps:
        if stall is not None and step == stall[0]:
            time.sleep(stall[1])
        images = source.get_encoder_images(step, rank) if hybrid and images_first else None
        mbs = []
        while fetches and len(mbs) < (m if not mbs else mbs[0][1].get("microbatches", m)):  # hybrid CP: its own count
            mbs.append(source.get(step, len(mbs), rank))
        if hybrid and not images_first:
            images = source.get_encoder_images(step, rank)
        out[step] = step_digest(mbs, images)
        if on_step is not None:
            on_step(rank, step)
    return out


def race(make_source: Any, topology: Any, steps: range, *, stall: tuple[int, float] | None = None,
         **kw: Any) -> dict[int, dict[int, str]]:
    """Every rank in its own thread (the last fetching rank stalls, if asked): ``{rank: {step: digest}}``;
    raises the first rank's error."""
    got, errors = {}, []
    staller = topology.fetch_ranks()[-1]

    def run(rank: int) -> None:
        try:
            got[rank] = consume(make_source(), topology, rank, steps, stall=stall if rank == staller else None, **kw)
        except BaseException as exc:  # re-raised below with its rank
            errors.append((rank, exc))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(topology.tree.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3600)
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a consumer did not finish within an hour (hung)")
    if errors:
        rank, exc = errors[0]
        raise RuntimeError(f"rank {rank} failed: {exc!r}") from exc
    return got


def lockstep(service: Any, steps: list[int], *, hybrid: bool, m: int) -> dict[int, dict[int, str]]:
    """The slow consumer: one process, every rank in turn each step, images first."""
    topo = service.topology
    out: dict[int, dict[int, str]] = {r: {} for r in range(topo.tree.world_size)}
    for step in steps:
        for rank in range(topo.tree.world_size):
            out[rank].update(consume(service, topo, rank, range(step, step + 1), images_first=True, hybrid=hybrid, m=m))
    return out


# -- the benchmark ------------------------------------------------------------------------
def _specs(root: Path, *, images: bool = True) -> list[Any]:
    from megascale_data_ext.sources.demo_data import make_demo_data

    out = make_demo_data(root, seed=8, rows=400, image_rows=400, text_sources=1 if images else 3,
                         image_sources=2 if images else 0, megatron_source=False, max_image_patches=64)
    return [dataclasses.replace(s, truncate=True, max_tokens=1024 - (64 if s.image_column else 0)) for s in out]


def run(args: argparse.Namespace) -> int:
    import ray

    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.inprocess import InProcessService
    from megascale_data_ext.runtime.metrics import rss_bytes
    from megascale_data_ext.runtime.remote import RemoteConstructors
    from megascale_data_ext.runtime.service import DataService

    hybrid = args.strategy == "vlm_balance"
    tree = ClientPlaceTree.from_sizes(dp=args.dp, pp=args.pp, cp=args.cp)
    with tempfile.TemporaryDirectory(prefix="bench-consumers-") as tmp:  # hybrid CP plans text only
        cfg = ServiceConfig(sources=_specs(Path(tmp), images=args.strategy != "hybrid_cp"), seed=13,
                            samples_per_step=4 * args.dp * args.cp, num_microbatches=2,
                            seq_length=1024, strategy=args.strategy, strategy_args=dict(STRATEGY_ARGS[args.strategy]),
                            buffer_size=64, ray=RayConfig(namespace=f"bench-consumers-{args.strategy}", num_cpus=2))
        ft = FaultToleranceConfig(client_prefetch=args.client_prefetch)
        m = cfg.num_microbatches
        check = list(range(min(args.check_steps, args.steps)))
        want = lockstep(InProcessService(cfg, tree), check, hybrid=hybrid, m=m) if check else {}
        svc = DataService(cfg, tree, fault_tolerance=ft, progress=None)
        handles = svc.start()
        samples: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        at: dict[int, int] = {}  # rank -> last step it finished
        done = threading.Event()

        def sample() -> None:  # every --sample-seconds, so the stall itself is seen
            while not done.wait(args.sample_seconds):
                try:
                    rss = ray.get([c.__ray_call__.remote(lambda _self: rss_bytes()) for c in svc.constructors])
                    stats = ray.get([c.stats.remote() for c in svc.constructors])
                except Exception:  # the service is stopping
                    return
                steps = list(at.values()) or [0]
                row = {"wall_s": round(time.perf_counter() - t0, 2), "slowest_step": min(steps),
                       "fastest_step": max(steps), "constructor_rss_mib": [round(b / 2**20, 1) for b in rss],
                       "client_rss_mib": round(rss_bytes() / 2**20, 1),
                       "held_steps": [x["buffered_steps"] for x in stats], "lead": [x["lead"] for x in stats]}
                samples.append(row)
                if len(samples) % 10 == 1:
                    print(f"{row['wall_s']:7.1f} s | ranks at steps {row['slowest_step']}..{row['fastest_step']}/"
                          f"{args.steps} | constructors {row['constructor_rss_mib']} MiB | client "
                          f"{row['client_rss_mib']} MiB | held steps {row['held_steps']} | lead {row['lead']}", flush=True)

        sampler = threading.Thread(target=sample, daemon=True, name="sampler")
        sampler.start()
        try:
            topo = handles.topology
            got = race(lambda: RemoteConstructors(topo, prefetch_steps=args.client_prefetch, fault_tolerance=ft), topo,
                       range(args.steps), images_first=True, hybrid=hybrid, m=m,
                       on_step=lambda rank, step: at.__setitem__(rank, step), stall=(args.stall_at, args.stall))
            final = ray.get([c.stats.remote() for c in svc.constructors])
        finally:
            done.set()
            sampler.join()
            svc.stop()
    mismatches = sum(got[r][s] != want[r][s] for r in want for s in check)
    warm = [r for r in samples if r["slowest_step"] >= min(args.stall_at, 20)]
    summary = {
        "steps": args.steps, "ranks": tree.world_size, "strategy": args.strategy, "client_prefetch": args.client_prefetch,
        "stall_at": args.stall_at, "stall_s": args.stall, "max_lead_steps": ft.max_lead(cfg.prefetch),
        "mismatches": mismatches, "checked_steps": len(check), "wall_s": round(time.perf_counter() - t0, 1),
        "max_held_steps": max((max(r["held_steps"]) for r in samples), default=None),
        "max_lead": max((max(x for x in r["lead"] if x is not None) for r in samples
                         if any(x is not None for x in r["lead"])), default=None),
        "backpressure_waits": sum(s["backpressure_waits"] for s in final),
        "constructor_rss_mib_warm": [min(r["constructor_rss_mib"][j] for r in warm) for j in range(len(final))]
        if warm else None,
        "constructor_rss_mib_max": [max(r["constructor_rss_mib"][j] for r in samples) for j in range(len(final))]
        if samples else None,
        "client_rss_mib_warm": min(r["client_rss_mib"] for r in warm) if warm else None,
        "client_rss_mib_max": max(r["client_rss_mib"] for r in samples) if samples else None,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    return 0 if mismatches == 0 else 1
