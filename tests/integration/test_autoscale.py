"""The AutoScaler on real Ray: a source's weight ramps up and down, its loader shards are created
and reclaimed, and every sample is delivered exactly once and equals a run that never rescaled;
loaders and constructors placed by a DataService on the nodes of a 3-node local cluster."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import ray

from megascale_data_ext.dataplane.partitioner import MiB
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.profiles import SourceProfile
from megascale_data_ext.dataplane.scaling import ScalingConfig
from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.runtime.actors import PlannerActor
from megascale_data_ext.runtime.autoscaler import AutoscalePlan, LoaderActorSpec, RoutedFetch
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.constructor import DataConstructor
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.sources.demo_data import make_demo_data

pytestmark = pytest.mark.slow
STEPS = 20


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=3, rows=160, text_sources=3, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True, max_tokens=2048) for s in out]


def ramp_config(specs) -> ServiceConfig:
    # source 0: 1/9 of the mixture, then 8/10 from step 4, back to 1/9 from step 12
    mixing = {"type": "piecewise", "boundaries": [0, 4, 12], "weights": [[1, 4, 4], [8, 1, 1], [1, 4, 4]]}
    return ServiceConfig(sources=specs, seed=7, samples_per_step=16, num_microbatches=2, seq_length=2048,
                         strategy="vanilla", buffer_size=64, mixing=mixing, prefetch=1, ray=RayConfig(namespace="as"))


def test_ramp_creates_and_reclaims_shards_and_delivers_every_sample_once(specs):
    cfg = ramp_config(specs)
    tree = ClientPlaceTree.from_sizes(dp=2)
    topo = ServiceTopology.of(cfg, tree)
    reference = InProcessService(cfg, tree)  # the same stream, never rescaled
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        scaling = ScalingConfig(capacity=(0.3, 1.0, 1.0), window=2, patience=1, max_shards=3)
        shared = LoaderActorSpec(shards=[ShardRef(source=1), ShardRef(source=2)])  # sources 1 and 2 in one actor
        plan = AutoscalePlan(actors=[shared], scaling=scaling, interval_steps=2, lead_steps=1)
        planner = PlannerActor.remote(cfg, topo, [], None, None, None, plan)
        delivered: Counter = Counter()
        route = RoutedFetch(lambda step, s: ray.get(planner.route.remote(step, s)))

        def fetch(s, step, buckets):
            out = route(s, step, buckets)
            delivered.update((s, p) for _, p, _ in out["samples"] + out["skipped"])
            return out

        con = DataConstructor(list(range(tree.dp)), cfg, topo,
                              get_plan=lambda step, b: ray.get(planner.constructor_plan.remote(step, b)),
                              fetch=fetch, pad_id=reference.constructors[0].pad_id, image_token_id=None)
        live, planned = [], Counter()
        for step in range(STEPS):
            for s in range(3):
                planned.update((s, int(p)) for p in reference.planner.loader_plan(step, s).positions)
            for rank in topo.fetchers(0) + topo.fetchers(1):
                got = con.get_step(step, rank)
                want = reference.constructor_of(rank).get_step(step, rank)
                for (b1, _), (b2, _) in zip(got, want, strict=True):
                    assert np.array_equal(b1["tokens"], b2["tokens"]), f"step {step} rank {rank} differs"
            ray.get(planner.release.remote(step))
            live.append(len(ray.get(planner.loader_actors.remote())))
        events = ray.get(planner.scaling_events.remote())
        # exactly once: every planned (source, position) of every step, none twice
        assert max(delivered.values()) == 1 and set(delivered) == set(planned)
        created = [e for e in events if e["event"] == "created" and e["source"] == 0]
        assert max(e["new"] for e in created) == 3  # 0.8 of the mixture / 0.3 per shard
        assert any(e["new"] < e["old"] for e in created), events  # scaled back down
        assert any(e["event"] == "reclaimed" for e in events)
        assert max(live) > 2 and live[-1] == 2, live  # grew with the ramp, back to the shared group + one
    finally:
        ray.shutdown()


def test_service_places_loaders_by_partition_and_constructors_beside_their_ranks(specs, tmp_path):
    from ray.cluster_utils import Cluster

    from megascale_data_ext.dataplane.profiles import ProfileJournal
    from megascale_data_ext.runtime.config import AutoscaleConfig, PlacementConfig
    from megascale_data_ext.runtime.service import DataService
    from megascale_data_ext.sources.profiling import source_fingerprint

    # three nodes (the head is one of them): fewer raylets on a small test box
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
        cfg = dataclasses.replace(
            ramp_config(specs), mixing=None, prefetch=1, ray=RayConfig(address=cluster.address, namespace="placed"),
            autoscale=AutoscaleConfig(enabled=True, profiles=str(journal), actor_memory_mib=160, actor_base_mib=80,
                                      scaling=False),
            placement=PlacementConfig(trainer_nodes=trainers, ranks_per_node=1))
        tree = ClientPlaceTree.from_sizes(dp=3)
        service = DataService(cfg, tree, progress=None)
        service.start()
        nodes = service._nodes()
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
