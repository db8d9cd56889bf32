"""The offline partitioner over simulated worlds: caps, worker bounds, load balance, named errors."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest

from megascale_data_ext.dataplane.partitioner import MiB, NodeResources, PartitionLimits, partition
from megascale_data_ext.dataplane.profiles import SourceProfile
from megascale_data_ext.errors import ConfigError


def navit_world(n: int = 306, seed: int = 0) -> tuple[list[SourceProfile], list[float]]:
    """Heavy-tailed (lognormal) latency, access state and sample size; Zipf-like mixture weights."""
    rng = np.random.default_rng(seed)
    lat = rng.lognormal(np.log(2e-3), 1.2, n)  # seconds per sample: 0.2 ms .. 100 ms
    access = rng.lognormal(np.log(8 * MiB), 1.0, n)
    per_sample = rng.lognormal(np.log(1 * MiB), 1.5, n)  # images: KiB .. tens of MiB
    weights = 1.0 / np.arange(1, n + 1) ** 0.8
    rng.shuffle(weights)
    profiles = [SourceProfile(name=f"src{i}", fingerprint="x", num_samples=10_000, samples_profiled=64,
                              latency_s=float(lat[i]), access_state_bytes=int(access[i]),
                              bytes_per_sample=int(per_sample[i]), throughput=1.0 / float(lat[i]))
                for i in range(n)]
    return profiles, weights.tolist()


def nodes(k: int = 16, mem_gib: float = 64.0, cpus: float = 32) -> list[NodeResources]:
    return [NodeResources(name=f"node{i}", memory_bytes=int(mem_gib * 1024 * MiB), cpus=cpus) for i in range(k)]


LIMITS = PartitionLimits(samples_per_step=4096, step_seconds=1.0, actor_memory_bytes=2048 * MiB,
                         actor_base_bytes=80 * MiB, worker_bytes=16 * MiB, max_workers_per_actor=8,
                         max_workers_per_source=64)


def test_navit_world_respects_caps_bounds_and_balances_load() -> None:
    profiles, weights = navit_world()
    plan = partition(profiles, weights, nodes(), LIMITS)
    a = plan.assignments
    # every source served exactly: shards 0..n-1 of each source, each once
    for s in range(len(profiles)):
        shards = plan.shards_of(s)
        assert [sh.shard for _, sh in shards] == list(range(shards[0][1].num_shards))
    # caps: actor memory, node memory and CPUs
    assert max(x.memory_bytes for x in a) <= LIMITS.actor_memory_bytes
    for n in plan.nodes:
        assert plan.node_memory()[n.name] <= n.memory_bytes
        assert sum(x.workers for x in a if x.node == n.name) <= n.cpus
    # worker bounds: w_actor per actor, w_src over a source's shards, and every actor keeps up (O_j / w_j <= O_up)
    assert all(1 <= x.workers <= LIMITS.max_workers_per_actor for x in a)
    assert all(x.per_worker_s <= LIMITS.step_seconds + 1e-9 for x in a)
    # grouping: small sources share actors; outliers split
    summary = plan.summary()
    assert summary["actors"] < len(profiles) / 2
    assert summary["split_sources"] > 0
    # load balance across nodes (greedy list-scheduling bound): max node load <= mean + largest actor load
    node_load = Counter({n.name: 0.0 for n in plan.nodes})
    for x in a:
        node_load[x.node] += x.load_s
    mean = sum(node_load.values()) / len(plan.nodes)
    assert max(node_load.values()) <= mean + max(x.load_s for x in a) + 1e-9


def test_outlier_splits_into_data_parallel_shards_sized_by_memory() -> None:
    big = SourceProfile(name="video", fingerprint="x", num_samples=100, samples_profiled=8, latency_s=1e-3,
                        access_state_bytes=10 * MiB, bytes_per_sample=8 * MiB, throughput=1000)
    small = SourceProfile(name="text", fingerprint="x", num_samples=100, samples_profiled=8, latency_s=1e-4,
                          access_state_bytes=1 * MiB, bytes_per_sample=1024, throughput=1e4)
    lim = PartitionLimits(samples_per_step=256, step_seconds=1.0, actor_memory_bytes=512 * MiB,
                          actor_base_bytes=50 * MiB, buffer_steps=2)
    plan = partition([big, small], [0.5, 0.5], nodes(2), lim)
    shards = plan.shards_of(0)
    # buffer = 2 steps x 128 samples x 8 MiB = 2048 MiB; room per actor = 512 - 50 - 10 = 452 MiB -> 5 shards
    assert len(shards) == math.ceil(2048 / 452) == 5
    assert all(x.memory_bytes <= lim.actor_memory_bytes for x in plan.assignments)
    assert {x.node for x in plan.assignments} == {"node0", "node1"}  # spread, not stacked


def test_workers_follow_ceil_of_load_over_budget() -> None:
    slow = SourceProfile(name="slow", fingerprint="x", num_samples=100, samples_profiled=8, latency_s=0.05,
                         access_state_bytes=MiB, bytes_per_sample=1024, throughput=20)
    lim = PartitionLimits(samples_per_step=100, step_seconds=1.0, actor_memory_bytes=1024 * MiB,
                          max_workers_per_actor=4)
    plan = partition([slow], [1.0], nodes(1), lim)
    # O = 100 x 50 ms = 5 worker-seconds per step; w_actor = 4 -> 2 shards of 2.5 s -> 3 workers each
    assert [(x.workers, round(x.load_s, 6)) for x in plan.assignments] == [(3, 2.5), (3, 2.5)]


def test_unmeetable_caps_name_the_source_or_node_and_what_to_raise() -> None:
    huge_state = SourceProfile(name="webdataset", fingerprint="x", num_samples=1, samples_profiled=1, latency_s=1e-3,
                               access_state_bytes=4096 * MiB, bytes_per_sample=1, throughput=1)
    lim = PartitionLimits(samples_per_step=8, step_seconds=1.0, actor_memory_bytes=1024 * MiB)
    with pytest.raises(ConfigError, match="'webdataset'.*raise the actor memory cap"):
        partition([huge_state], [1.0], nodes(1), lim)
    many = [dataclasses.replace(huge_state, name=f"wds{i}") for i in range(40)]
    with pytest.raises(ConfigError) as err:
        partition(many, [1.0] * 40, nodes(1), lim)
    lines = str(err.value).splitlines()
    assert lines[0] == "cannot partition 40 of 40 sources:" and len(lines) == 7  # 5 named, then a count
    assert "'wds4'" in lines[5] and lines[6] == "  - ... and 35 more sources like these"
    slow = SourceProfile(name="slow", fingerprint="x", num_samples=1, samples_profiled=1, latency_s=10.0,
                         access_state_bytes=1, bytes_per_sample=1, throughput=0.1)
    with pytest.raises(ConfigError, match="'slow' needs 80 workers.*max_workers_per_source"):
        partition([slow], [1.0], nodes(1), lim)
    profiles, weights = navit_world(40)
    with pytest.raises(ConfigError, match=r"fit no node.*node0: .* MiB / .* CPUs free.*add nodes"):
        partition(profiles, weights, nodes(1, mem_gib=1.0), LIMITS)
    with pytest.raises(ConfigError, match="`weights` must be non-negative"):
        partition(profiles[:2], [1.0, -1.0], nodes(1), LIMITS)
