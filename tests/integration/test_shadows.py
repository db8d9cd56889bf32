"""Shadow loaders beside autoscaled loader groups, on a real local Ray.

One loader runtime: with ``autoscale.enabled`` (the main job's default) every loader actor the
Planner starts has a warm shadow; a loader process SIGKILLed from outside is restarted by Ray
while its shadow serves, and the trainer's stream stays the fault-free one, byte for byte.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest

from megascale_data_ext.dataplane.partitioner import MiB
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile
from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.profiling import source_fingerprint

pytestmark = pytest.mark.slow
STEPS, KILL_AT = 14, 4


def autoscaled_config(tmp_path, shadows: bool) -> ServiceConfig:
    specs = [dataclasses.replace(s, truncate=True, max_tokens=1024) for s in
             make_demo_data(tmp_path / "data", seed=5, rows=160, text_sources=3, image_sources=0,
                            megatron_source=False)]
    journal = tmp_path / "profiles.json"  # each source fills an actor: three loader groups
    ProfileJournal([SourceProfile(name=s.name, fingerprint=source_fingerprint(s), num_samples=160, samples_profiled=8,
                                  latency_s=1e-3, access_state_bytes=40 * MiB, bytes_per_sample=MiB, throughput=1e3)
                    for s in specs]).save(journal)
    return ServiceConfig(sources=specs, seed=4, samples_per_step=8, num_microbatches=2, seq_length=1024,
                         strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=32,
                         ray=RayConfig(namespace=f"shadows-{shadows}"),
                         autoscale=AutoscaleConfig(enabled=True, profiles=str(journal), actor_memory_mib=160,
                                                   actor_base_mib=80, scaling=False),
                         fault_tolerance=FaultToleranceConfig(shadow_loaders=shadows, client_prefetch=2, hedge_s=0.5,
                                                              rpc_timeout_s=60, recovery_timeout_s=300))


def reference(cfg: ServiceConfig, tree: ClientPlaceTree) -> dict[tuple[int, int, int], np.ndarray]:
    svc = InProcessService(cfg, tree)
    return {(step, rank, j): svc.get(step, j, rank)[0]["tokens"] for step in range(STEPS)
            for rank in svc.topology.fetch_ranks() for j in range(cfg.num_microbatches)}


def test_a_loader_killed_from_outside_is_served_by_its_shadow_with_autoscale(tmp_path, ray_local):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg = autoscaled_config(tmp_path, shadows=True)
    want = reference(cfg, tree)
    svc = DataService(cfg, tree, progress=None)
    handles = svc.start()
    try:
        rows = svc.actors()
        loaders = {r["role"]: r for r in rows if r["role"].startswith("loader/")}
        shadows = {r["role"]: r for r in rows if r["role"].startswith("shadow/")}
        assert len(loaders) == len(shadows) == 3  # one shadow per loader group, both with autoscale
        assert all(shadows[f"shadow/{k}"]["serves"] == loaders[f"loader/{k}"]["serves"] for k in range(3))
        victim = next(r for r in loaders.values() if 0 in r["serves"])
        client = RemoteConstructors(handles.topology, fault_tolerance=svc.ft)
        for step in range(STEPS):
            if step == KILL_AT:
                os.kill(victim["pid"], signal.SIGKILL)  # the process, from outside: not a self-crash
            for rank in handles.topology.fetch_ranks():
                for j in range(cfg.num_microbatches):
                    batch, _ = client.get(step, j, rank)
                    np.testing.assert_array_equal(batch["tokens"], want[(step, rank, j)],
                                                  err_msg=f"step {step} rank {rank} microbatch {j}")
        stats = svc.stats()
        after = {r["role"]: r for r in svc.actors()}
    finally:
        svc.stop()
    assert sum(s["direct_fetches"] for s in stats["shadows"] if s) > 0, "no shadow served while its loader was down"
    assert sum(c["failovers"] for c in stats["constructors"] if c) > 0
    restarted = next(r for r in after.values() if r["actor_id"] == victim["actor_id"])
    assert restarted["pid"] != victim["pid"] and restarted["restarts"] >= 1 and restarted["state"] == "ALIVE"
