"""Killed actors on a real local Ray: the trainer's delivered tokens stay exactly the fault-free stream.

Every kill is a SIGKILL the actor sends itself (`runtime.fault_injection`). The reference is the same
config wired in one process without Ray (`InProcessService`), whose delivered documents are
compared with the faulted run's as multisets of token sequences (not the service's counters).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from megascale_data_ext.commands.bench_faults import compare, consume, documents
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.errors import ServiceUnavailableError
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors, actor_crasher
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def text_spec(tmp_path_factory):
    spec = make_demo_data(tmp_path_factory.mktemp("faults"), seed=3, rows=120, text_sources=1, image_sources=0,
                          megatron_source=False)[0]
    return dataclasses.replace(spec, truncate=True)




def config(spec, sources: int, namespace: str) -> ServiceConfig:
    return ServiceConfig(sources=[dataclasses.replace(spec, name=f"text-{i}") for i in range(sources)], seed=9,
                         samples_per_step=8, num_microbatches=2, seq_length=1024, strategy="llm_balance",
                         strategy_args={"model": "gpt-tiny"}, buffer_size=32, ray=RayConfig(namespace=namespace))


def reference_docs(cfg: ServiceConfig, tree: ClientPlaceTree, steps: int) -> Counter:
    svc = InProcessService(cfg, tree)
    pad = ByteTokenizer().pad_id
    return Counter(d for step in range(steps) for rank in svc.topology.fetch_ranks()
                   for j in range(cfg.num_microbatches) for d in documents(svc.get(step, j, rank)[0], pad))


def run_with_faults(cfg, tree, ft, steps, faults):
    svc = DataService(cfg, tree, fault_tolerance=ft, progress=None)
    handles = svc.start()
    try:
        return consume(svc, handles, steps, faults=faults, step_seconds=0.05)
    finally:
        svc.stop()


def test_loaders_planner_and_constructors_killed_the_trainer_gets_every_sample_once(text_spec, ray_local):
    """16 loaders, 5 killed at once; the planner every 15 steps; two constructor kills."""
    tree = ClientPlaceTree.from_sizes(dp=2, pp=2)
    cfg, steps = config(text_spec, 16, "faults"), 31
    ft = FaultToleranceConfig(rpc_timeout_s=20, recovery_timeout_s=120, client_prefetch=4)
    got = run_with_faults(cfg, tree, ft, steps, "loader:0-4@3,planner@every15,constructor:1@6,constructor:0@20")
    want_kills = [("loader", i, 3) for i in range(5)] + [("planner", 0, 15), ("planner", 0, 30),
                                                         ("constructor", 1, 6), ("constructor", 0, 20)]
    assert sorted(got.kill_steps) == sorted(want_kills)
    want = reference_docs(cfg, tree, steps)
    assert sum(want.values()) > steps * 4
    assert compare(want, got.docs) == (0, 0)  # (lost, duplicated) from the delivered tokens
    stats = got.stats
    assert stats["planner"]["restored_from"] is not None  # the last restart restored a checkpoint
    assert [c["restarted"] for c in stats["constructors"]] == [True, True]
    print(f"step waits: {[round(w, 2) for w in got.step_wait_s]}; recoveries {got.recoveries}")


def test_shadows_replace_dead_loaders_and_a_constructor_that_stays_dead_is_named(text_spec, ray_local):
    """Without restarts: killed primaries never return, their shadows serve every later step;
    then a constructor dies for good and the client names it instead of hanging."""
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg, steps = config(text_spec, 3, "shadows"), 10
    # budgets a loaded CI box never runs out of: the dead constructor is named by its retry count, not a clock
    ft = FaultToleranceConfig(restart=False, shadow_loaders=True, hedge_s=0.3, rpc_timeout_s=30, recovery_timeout_s=120,
                              retries=2)
    svc = DataService(cfg, tree, fault_tolerance=ft, progress=None)
    handles = svc.start()
    try:
        got = consume(svc, handles, steps, faults="loader:0-1@1", step_seconds=0.05)
        assert compare(reference_docs(cfg, tree, steps), got.docs) == (0, 0)
        assert sum(s["direct_fetches"] for s in got.stats["shadows"]) > 0
        assert got.memory["shadows_rss"] > 0
        start = steps + ft.client_prefetch + 1  # consume's client already took the steps it prefetched
        client = RemoteConstructors(handles.topology, fault_tolerance=ft, prefetch_steps=1)
        client.get(start, 0, 0)
        actor_crasher(handles.topology)("constructor", 0)
        with pytest.raises(ServiceUnavailableError, match=r"constructor/0 .*did not deliver step \d"):
            for step in range(start + 1, start + 6):
                client.get(step, 0, 0)
    finally:
        svc.stop()
