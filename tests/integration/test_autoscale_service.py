"""A DataService with ``autoscale.enabled`` on real Ray: the partition groups the sources into
fewer loader actors, a source whose share of the mixture ramps up and down gets shards created
and reclaimed, a killed loader group is restarted by Ray, and every sample is delivered exactly
once and equal to an in-process service that never rescaled."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import ray

from megascale_data_ext.dataplane.partitioner import MiB
from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.profiling import source_fingerprint
from tests.integration.conftest import shared_ray

pytestmark = pytest.mark.slow
STEPS = 28
SOURCES = 5


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=11, rows=160, text_sources=SOURCES, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True, max_tokens=2048) for s in out]


def journal(specs, path, *, latency_s):
    """Profiles with known costs (a real run measures them: `megascale-data profile`), keyed by each
    source's real fingerprint so the service takes them from the journal instead of measuring."""
    ProfileJournal([SourceProfile(name=s.name, fingerprint=source_fingerprint(s), num_samples=160,
                                  samples_profiled=8, latency_s=lat, access_state_bytes=MiB, bytes_per_sample=4096,
                                  throughput=1 / lat) for s, lat in zip(specs, latency_s, strict=True)]).save(path)
    return str(path)


def ramp_config(specs, profiles, **autoscale) -> ServiceConfig:
    # source 0: 1/9 of the mixture, 8/12 from step 4, back to 1/9 from step 10
    rest = [2] * (SOURCES - 1)
    mixing = {"type": "piecewise", "boundaries": [0, 4, 10], "weights": [[1, *rest], [8, *[1] * (SOURCES - 1)],
                                                                          [1, *rest]]}
    # one worker keeps up with 0.3 of the mixture of source 0 (1 s / (16 samples x 0.2 s)): 0.8 needs 3 shards
    auto = AutoscaleConfig(enabled=True, profiles=profiles, max_workers_per_actor=1, step_seconds=1.0,
                           interval_steps=2, lead_steps=1, window=2, patience=1, max_shards=3, **autoscale)
    return ServiceConfig(sources=specs, seed=7, samples_per_step=16, num_microbatches=2, seq_length=2048,
                         strategy="vanilla", buffer_size=64, mixing=mixing, prefetch=1, autoscale=auto,
                         ray=RayConfig(namespace="autoscale-service"))


def delivered(service, tree, step) -> tuple[list, list]:
    """(per fetching rank and microbatch: the tokens, every (source, position) delivered) of `step`."""
    tokens, keys = [], []
    for rank in service.topology.fetch_ranks():
        h = service.constructors[service.topology.constructor_of_rank(rank)]
        for batch, info in ray.get(h.get_step.remote(step, rank)):
            tokens.append(batch["tokens"])
            keys += [(int(s), int(p)) for s, p, *_ in info["samples"].tolist()]
    return tokens, keys


def test_autoscaled_service_groups_scales_survives_a_kill_and_delivers_every_sample_once(specs, tmp_path):
    profiles = journal(specs, tmp_path / "profiles.json", latency_s=[0.2] + [1e-4] * (SOURCES - 1))
    cfg = ramp_config(specs, profiles)
    tree = ClientPlaceTree.from_sizes(dp=2)
    reference = InProcessService(cfg, tree)  # the same stream, one loader per source, never rescaled
    lines: list[str] = []
    shared_ray()
    service = DataService(cfg, tree, progress=lines.append)
    service.start()
    assert any(line.startswith(f"profiles: {SOURCES} from the journal, 0 measured") for line in lines), lines
    first = len(service.loader_actors())
    assert first < SOURCES, f"{first} loader actors for {SOURCES} light sources: nothing grouped"
    seen: Counter = Counter()
    planned: Counter = Counter()
    live = []
    for step in range(STEPS):
        if step == 7:  # kill the actors serving source 0 now (mid-ramp: its shards)
            for h in ray.get(service.planner.loaders_of.remote(0)):
                h.crash.remote()
        got, keys = delivered(service, tree, step)
        want, _ = delivered_reference(reference, tree, step)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b), f"step {step}: a microbatch differs from the never-rescaled run"
        seen.update(keys)
        for s in range(SOURCES):
            plan = reference.planner.loader_plan(step, s)
            planned.update((s, int(p)) for p in plan.positions)
        live.append(len(service.loader_actors()))
    events = ray.get(service.planner.scaling_events.remote())
    stats = service.stats()
    service.stop()
    assert max(seen.values()) == 1, "a sample was delivered twice"
    assert set(seen) == set(planned), "a planned sample was never delivered"
    created = [e for e in events if e["event"] == "created" and e["source"] == 0]
    assert max(e["new"] for e in created) == 3, events  # 8/12 of the mixture at 0.3 per shard
    assert any(e["new"] < e["old"] for e in created), events  # back down with the mixture
    assert any(e["event"] == "reclaimed" for e in events), events
    assert max(live) > first and live[-1] < max(live), live
    assert all("members" in s for s in stats["loaders"] if s is not None)  # loader groups, not per-source loaders


def delivered_reference(reference, tree, step):
    tokens, keys = [], []
    for rank in Distribution().fetch_ranks(tree):
        for batch, info in reference.constructor_of(rank).get_step(step, rank):
            tokens.append(batch["tokens"])
            keys += [(int(s), int(p)) for s, p, *_ in info["samples"].tolist()]
    return tokens, keys


def test_partition_that_cannot_fit_names_the_config_key(specs, tmp_path):
    profiles = journal(specs, tmp_path / "p.json", latency_s=[1e-4] * SOURCES)
    cfg = ramp_config(specs, profiles, actor_memory_mib=1.0, actor_base_mib=80.0)
    shared_ray()
    with pytest.raises(ConfigError, match=r"autoscale\.actor_memory_mib"):
        DataService(cfg, ClientPlaceTree.from_sizes(dp=2), progress=None).start()
    with pytest.raises(ValueError):  # refused before any actor started: no Planner to find
        ray.get_actor("planner", namespace=cfg.ray.namespace)


def test_injected_planner_and_loader_kills_through_the_client_lose_nothing(specs, tmp_path):
    """Fault injection from the trainer-side client (``planner@8,loader:0@11``) during the ramp: the
    Planner owns the loader actors, so killed it is restored from its checkpoint and starts new ones
    with the shard counts it had scaled to (its old actors died with it); the loader kill hits the
    actors serving source 0 then (`loaders_of`). Constructors re-route; every microbatch equals the
    in-process run."""
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.remote import RemoteConstructors

    profiles = journal(specs, tmp_path / "profiles.json", latency_s=[0.2] + [1e-4] * (SOURCES - 1))
    cfg = dataclasses.replace(ramp_config(specs, profiles), ray=RayConfig(namespace="autoscale-kill"),
                              fault_tolerance=FaultToleranceConfig(inject="planner@8,loader:0@11"))
    tree = ClientPlaceTree.from_sizes(dp=2)
    reference = InProcessService(cfg, tree)
    shared_ray()
    service = DataService(cfg, tree, progress=None)
    service.start()
    before = set(service.loader_actors())  # handles compare by actor id
    client = RemoteConstructors(service.topology)
    seen: Counter = Counter()
    for step in range(14):
        for rank in Distribution().fetch_ranks(tree):
            want = reference.constructor_of(rank).get_step(step, rank)
            for j, (batch, info) in enumerate(want):
                got, got_info = client.get(step, j, rank)
                assert np.array_equal(got["tokens"], batch["tokens"]), f"step {step} rank {rank} differs"
                seen.update((int(s), int(p)) for s, p, _ in got_info["samples"].tolist())
    after = set(service.loader_actors())
    fired = [(e.component, e.step) for e in client.injector.events]
    planner = service.stats()["planner"]
    restored = planner["restored_from"]
    back = [e for e in planner["autoscale"]["events"] if e["event"] == "restored"]
    service.stop()
    assert max(seen.values()) == 1
    assert ("planner", 8) in fired and ("loader", 11) in fired, fired
    assert restored is not None and not before & after, "the restarted Planner did not start a new fleet"
    # killed at step 8, between the scale-up (decided at step 5) and its reclaim (after the scale-down
    # for step 12 or later): source 0 comes back with the 3 shards it had, not the partition's one
    assert back and max(n for _, n in back[0]["layouts"][0]) == 3, f"not restarted at the scaled layout: {back}"
