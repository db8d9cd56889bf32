"""A node lost and back on a three-node `ray.cluster_utils.Cluster`, after a Planner kill.

Constructors run as sidecars beside their ranks and loader actors on their partition nodes
(trainer nodes named by their ``msd-node`` label: soft placement). The Planner is killed, then the
node holding constructor/1 and some loaders is removed, then a node comes back under its label and
the service moves those actors home. The trainer-side clients must see no error, every rank's
bytes of every step must equal a fault-free in-process run, and `megascale-data status` must show
where each actor runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from megascale_data_ext.dataplane.partitioner import MiB
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile
from megascale_data_ext.runtime.config import AutoscaleConfig, PlacementConfig, RayConfig, ServiceConfig
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors, actor_crasher
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.profiling import source_fingerprint
from tests.integration.conftest import own_ray

pytestmark = pytest.mark.slow
STEPS = 20
KILL_PLANNER, REMOVE_NODE, ADD_NODE, HOME = 3, 7, 12, 14


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=4, rows=200, text_sources=4, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True, max_tokens=2048) for s in out]


def digest(microbatches) -> str:
    h = hashlib.sha1()
    for batch, info in microbatches:
        for k in sorted(batch):
            h.update(k.encode() + np.ascontiguousarray(batch[k]).tobytes())
        h.update(np.asarray(info["samples"]).tobytes())
    return h.hexdigest()


def wait_home(service, name: str, node_id: str, timeout: float = 300.0) -> list[dict]:
    """Wait (a loaded box restarts slowly) until every actor whose home is `name` runs on `node_id`;
    those actors."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [a for a in service.actors() if a["home"] == name]
        if rows and all(a["node_id"] == node_id and a["state"] == "ALIVE" for a in rows):
            return rows
        assert time.monotonic() < deadline, f"actors not back home after {timeout} s: {rows}"
        time.sleep(0.5)


def status(handles) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "megascale_data_ext", "status", "--address", handles.address,
                          "--namespace", handles.namespace, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_planner_kill_then_node_loss_then_node_back_lose_nothing_and_raise_nothing(specs, tmp_path):
    from ray.cluster_utils import Cluster

    own_ray()  # not the modules' shared local Ray: a cluster of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2, labels={"msd-node": "trainer-0"})
    lost = cluster.add_node(num_cpus=2, labels={"msd-node": "trainer-1"})
    ray.init(address=cluster.address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        journal = tmp_path / "profiles.json"  # one source per loader actor, spread over the trainer nodes
        ProfileJournal([SourceProfile(name=s.name, fingerprint=source_fingerprint(s), num_samples=200,
                                      samples_profiled=8, latency_s=1e-3, access_state_bytes=40 * MiB,
                                      bytes_per_sample=MiB, throughput=1e3) for s in specs]).save(journal)
        cfg = ServiceConfig(
            sources=specs, seed=5, samples_per_step=16, num_microbatches=2, seq_length=2048, strategy="llm_balance",
            strategy_args={"model": "gpt-tiny"}, buffer_size=64, prefetch=1,
            ray=RayConfig(address=cluster.address, namespace="node-loss"),
            autoscale=AutoscaleConfig(enabled=True, profiles=str(journal), actor_memory_mib=160, actor_base_mib=80,
                                      scaling=False),
            placement=PlacementConfig(trainer_nodes=["trainer-0", "trainer-1"], ranks_per_node=1, move_back_s=1.0))
        tree = ClientPlaceTree.from_sizes(dp=2)
        want = {}
        reference = InProcessService(cfg, tree)
        for step in range(STEPS):
            for rank in reference.topology.fetch_ranks():
                want[(rank, step)] = digest([reference.get(step, j, rank) for j in range(cfg.num_microbatches)])

        ft = FaultToleranceConfig(client_prefetch=4, checkpoint_dir=str(tmp_path / "ckpt"))
        service = DataService(cfg, tree, fault_tolerance=ft, progress=None)
        handles = service.start()
        try:
            placed = {a["role"]: a for a in service.actors() if a["role"].startswith("constructor")}
            lost_id = lost.node_id
            assert placed["constructor/1"]["node_id"] == lost_id  # beside rank 1, on the node about to go
            assert any(a["node_id"] == lost_id for a in service.actors() if a["role"].startswith("loader"))
            topo = handles.topology
            clients = {r: RemoteConstructors(topo, fault_tolerance=ft) for r in topo.fetch_ranks()}
            got = {}
            for step in range(STEPS):
                if step == KILL_PLANNER:
                    actor_crasher(topo)("planner", 0)
                if step == REMOVE_NODE:
                    time.sleep(3)  # let the clients' prefetched replies land in the store of the node that goes
                    cluster.remove_node(lost)
                if step == ADD_NODE:
                    back = cluster.add_node(num_cpus=2, labels={"msd-node": "trainer-1"})
                if step == HOME:  # the service's watcher moves trainer-1's actors back (a restart each)
                    home = wait_home(service, "trainer-1", back.node_id)
                for rank, client in clients.items():
                    got[(rank, step)] = digest([client.get(step, j, rank) for j in range(cfg.num_microbatches)])
            assert got == want  # every step of every rank, byte for byte, and no error on the way
            recoveries = [r for c in clients.values() for r in c.recoveries]
            print("recoveries:", recoveries)
            assert any(r["constructor"] == 1 for r in recoveries)  # rank 1's constructor went with the node
            after = service.actors()
            assert all(a["node_id"] != lost_id for a in after)  # everything restarted on a live node
            assert {a["role"] for a in home} >= {"constructor/1"} and any(a["role"].startswith("loader/") for a in home)
            assert all(a["node"] == "trainer-1" for a in after if a["home"] == "trainer-1")  # still home
            listed = status(handles)  # the CLI beside the running service sees the same actors and nodes
            assert {r["role"]: (r["node"], r["home"]) for r in listed} == {
                a["role"]: (a["node"], a["home"]) for a in service.actors()}
            assert {a["role"] for a in after} >= {"planner", "constructor/0", "constructor/1"}
            assert next(a for a in after if a["role"] == "planner")["restarts"] >= 1
            assert next(a for a in after if a["role"] == "constructor/1")["restarts"] >= 1
        finally:
            service.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
