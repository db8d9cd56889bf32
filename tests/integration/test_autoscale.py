"""Placement on a multi-node local Ray: a DataService with autoscaled loaders on a 3-node
`ray.cluster_utils.Cluster` puts each loader on its partition node and each constructor beside
the ranks it serves. (Scaling, exactly-once delivery and failures: test_autoscale_service.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import ray

from megascale_data_ext.dataplane.partitioner import MiB
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile
from megascale_data_ext.runtime.config import AutoscaleConfig, PlacementConfig, RayConfig, ServiceConfig
from megascale_data_ext.runtime.placement import ClusterNodes
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.profiling import source_fingerprint
from tests.integration.conftest import own_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=3, rows=160, text_sources=3, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True, max_tokens=2048) for s in out]


def test_service_places_loaders_by_partition_and_constructors_beside_their_ranks(specs, tmp_path):
    from ray.cluster_utils import Cluster

    # three nodes (the head is one of them): fewer raylets on a small test box
    own_ray()  # not the modules' shared local Ray: a cluster of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"msd_node:trainer-0": 1}})
    for i in (1, 2):
        cluster.add_node(num_cpus=2, resources={f"msd_node:trainer-{i}": 1})
    ray.init(address=cluster.address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        # 40 MiB of access state per source under a 160 MiB actor cap (80 MiB base): one source per
        # actor, spread over the trainer nodes
        journal = tmp_path / "profiles.json"
        ProfileJournal([SourceProfile(name=s.name, fingerprint=source_fingerprint(s), num_samples=160,
                                      samples_profiled=8, latency_s=1e-3, access_state_bytes=40 * MiB,
                                      bytes_per_sample=MiB, throughput=1e3) for s in specs]).save(journal)
        trainers = [f"trainer-{i}" for i in range(3)]
        cfg = ServiceConfig(
            sources=specs, seed=7, samples_per_step=16, num_microbatches=2, seq_length=2048, strategy="vanilla",
            buffer_size=64, prefetch=1, ray=RayConfig(address=cluster.address, namespace="placed"),
            autoscale=AutoscaleConfig(enabled=True, profiles=str(journal), actor_memory_mib=160, actor_base_mib=80,
                                      scaling=False),
            placement=PlacementConfig(trainer_nodes=trainers, ranks_per_node=1))
        tree = ClientPlaceTree.from_sizes(dp=3)
        service = DataService(cfg, tree, progress=None)
        service.start()
        nodes = ClusterNodes.discover(memory_fraction=cfg.autoscale.node_memory_fraction)  # what the service saw
        assert set(trainers) <= set(nodes.ids)
        where = ray.get([h.ready.remote() for h in service.loader_actors()])
        want = {a.node for a in service.partition.assignments}
        assert len(want) >= 2, "the tight cap should spread the loaders over nodes"
        assert sorted(w["node_id"] for w in where) == sorted(nodes.node_id(a.node)
                                                              for a in service.partition.assignments)
        for j, con in enumerate(service.constructors):  # constructor j serves rank j, which runs on trainer-j
            node = ray.get(con.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))
            assert node == nodes.node_id(trainers[j]), f"constructor/{j} is not beside its rank"
            batch = ray.get(con.get_step.remote(0, j))  # one step through loaders on other nodes
            assert len(batch) == cfg.num_microbatches and batch[0][0]["tokens"].size > 0
        service.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
