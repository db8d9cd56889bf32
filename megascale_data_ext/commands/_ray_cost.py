"""What Ray itself costs a user of the service, in memory (`bench memory`, issue 21).

Beside the service's actors a user pays Ray's daemons (GCS, raylet, dashboard and its agents, the
log monitor, the worker processes Ray keeps prestarted), the object store's used bytes, and in
every fetching trainer rank a Ray core worker (the `Client` talks to the actors through it).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import re
from collections.abc import Iterable
from typing import Any

MiB = float(1 << 20)


def daemons_pss_mib(exclude: Iterable[int]) -> tuple[float, int]:
    """PSS (MiB) and count of this driver's Ray processes other than `exclude` (the measured actors)."""
    from megascale_data_ext.commands._proc_stats import descendants
    from megascale_data_ext.sources.profiling import process_memory

    skip, total, n = set(exclude), 0, 0
    for pid in descendants():
        if pid in skip:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ray" not in f.read():  # the bench's own helpers (multiprocessing's resource tracker)
                    continue
            total += process_memory(pid)["pss"]
            n += 1
        except OSError:  # gone meanwhile
            continue
    return total / MiB, n


def object_store_mib() -> float:
    """Bytes the object store of this driver's Ray holds now (Ray's own aggregate), MiB."""
    import ray
    from ray._private.internal_api import memory_summary

    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    got = re.search(r"Plasma memory usage (\d+) MiB", summary)
    return float(got.group(1)) if got else 0.0


def _client_process(conn: Any, address: str, namespace: str) -> None:
    import torch  # noqa: F401  (a trainer rank has it: not what Ray adds)

    from megascale_data_ext.sources.profiling import process_memory

    before = process_memory()["pss"]
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
    ray.get(ray.put(b"x"))  # a round trip through the store, as a fetch's reply takes (no worker started)
    conn.send((process_memory()["pss"] - before) / MiB)
    conn.recv()
    ray.shutdown()


def client_core_worker_mib(address: str, namespace: str) -> float:
    """PSS (MiB) a trainer rank (torch imported) adds by joining the Ray at `address` and calling it
    once: the core worker every fetching rank of the service carries."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_client_process, args=(child, address, namespace))
    p.start()
    try:
        while not parent.poll(1.0):  # a client that died (an import error) must not hang the bench
            if not p.is_alive():
                raise RuntimeError(f"the process measuring a trainer's Ray core worker exited with code {p.exitcode}")
        return float(parent.recv())
    finally:
        parent.send("exit")
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
