"""A constructor killed under feedback mixing: every step's wall time, and what waited for a report.

    python scripts/feedback_constructor_kill.py [DP] [KILL_AT] [REPORT_TIMEOUT_S]

DP ranks in lockstep (threads of this process, one `RemoteConstructors` each, a 0.3 s "GPU step")
take 18 steps from a service with one Data Constructor per rank (``constructor_group: 1``) and a
feedback mixing schedule of the default delay (3); rank 0 reports the per-source loss after every
step, and kills constructor 2 (Ray restarts it) after step KILL_AT. Prints the service's look-ahead,
then one JSON line: each step's seconds, the slowest, the ranks' errors and the most calls that waited
for a loss report at once in the Planner. Defaults: 9 ranks, step 6, 40 s.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import threading
import time

import ray

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.remote import RemoteConstructors
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data

STEPS, STEP_S, MICROBATCHES = 18, 0.3, 2


def main(dp: int = 9, kill_at: int = 6, report_timeout_s: float = 40.0) -> dict:
    specs = make_demo_data(tempfile.mkdtemp(prefix="fb-kill-"), seed=5, rows=400, text_sources=2, image_sources=0,
                           megatron_source=False)
    specs = [dataclasses.replace(s, truncate=True) for s in specs]
    mixing = {"type": "feedback", "base_weights": [1.0] * len(specs), "lr": 0.5}
    cfg = ServiceConfig(sources=specs, seed=1, samples_per_step=2 * dp, num_microbatches=MICROBATCHES,
                        seq_length=1024, strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=32,
                        mixing=mixing, constructor_group=1, ray=RayConfig(namespace="fb-kill", num_cpus=4))
    svc = DataService(cfg, ClientPlaceTree.from_sizes(dp=dp),
                      fault_tolerance=FaultToleranceConfig(report_timeout_s=report_timeout_s))
    print(f"client_prefetch {svc.ft.client_prefetch}, max lead {svc.ft.max_lead(cfg.prefetch)}, "
          f"constructors {svc.topology.num_constructors}", flush=True)
    handles = svc.start()
    loss = {s: 1.0 + s for s in range(len(specs))}
    barrier, ends, errors = threading.Barrier(dp), {}, []

    def rank_loop(rank: int) -> None:
        try:
            client = RemoteConstructors(handles.topology)
            for step in range(STEPS):
                for j in range(MICROBATCHES):
                    client.get(step, j, rank)
                time.sleep(STEP_S)
                barrier.wait()
                if rank == 0:
                    client.report_loss(step, loss)
                    ends[step] = time.perf_counter()
                    if step == kill_at:
                        ray.kill(svc.constructors[2], no_restart=False)
                barrier.wait()
        except Exception as e:  # noqa: BLE001 - reported, and the other ranks let go
            errors.append(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            barrier.abort()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    marks = [t0] + [ends[s] for s in sorted(ends)]
    step_s = [round(b - a, 2) for a, b in zip(marks, marks[1:])]
    out = {"step_s": step_s, "slowest_step_s": max(step_s, default=None), "errors": errors,
           "report_waiters_most": ray.get(svc.planner.stats.remote()).get("report_waiters_most")}
    svc.stop()
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), *(float(a) for a in args[2:3]))
