"""The service on a real local Ray: real actors, real Parquet and .bin/.idx files, and
trainer ranks (as torchrun starts them) with Megatron's parallel_state consuming it."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.tokenizer import ByteTokenizer
from tests.dist.launch import run_preloaded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=5, rows=100, image_rows=40, text_sources=2,
                         image_sources=1, megatron_rows=60, max_image_patches=128)
    return [dataclasses.replace(s, truncate=True, max_tokens=1024 - (128 if s.image_column else 0)) for s in out]




def config(specs, namespace="t", **kw):
    base = dict(sources=specs, seed=21, samples_per_step=12, num_microbatches=4, seq_length=1024,
                strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=48,
                ray=RayConfig(namespace=namespace))
    base.update(kw)
    return ServiceConfig(**base)


def train_workers(handles, out, *args: str) -> dict[int, dict]:
    """8 ranks of `trainer.train_worker` on the service, as torchrun starts them (forked from the
    session's preloaded process, `launch.run_preloaded`); returns {rank: its log}."""
    run_preloaded(["-m", "megascale_data_ext.trainer.train_worker", *args, "--seq-length", "1024",
                   "--vocab-size", ByteTokenizer().vocab_size, "--namespace", handles.namespace,
                   "--address", handles.address, "--record-digests", "--out", out], 8, timeout=540)
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in out.glob("rank*.json")}


def consume(service, tree, steps):
    out = {}
    for step in range(steps):
        for rank in service.topology.fetch_ranks():
            h = service.constructors[service.topology.constructor_of_rank(rank)]
            got = ray.get([h.get.remote(step, j, rank) for j in range(service.config.num_microbatches)])
            out[(step, rank)] = [tuple(k) for _, info in got for k in info["samples"].tolist()]
    return out


def test_real_actors_deliver_each_sample_once_and_deterministically(specs, ray_local):
    tree = ClientPlaceTree.from_sizes(tp=2, pp=2, dp=2)
    runs = []
    for seed in (21, 21, 22):
        lines = []
        svc = DataService(config(specs, seed=seed, namespace=f"t{len(runs)}"), tree, progress=lines.append)
        svc.start()
        phases = ["sources checked", "loaders up", "planner up", "first plan", "constructors up"]
        assert [line.split(" in ")[0] for line in lines] == phases  # start-up progress, in order
        assert list(svc.phases) == phases and svc.phases["constructors up"] <= svc.startup_seconds
        try:
            runs.append(consume(svc, tree, 10))
        finally:
            svc.stop()
    first = runs[0]
    stream = []
    for (step, rank), keys in first.items():
        c = tree.coords(rank)
        if c["pp"] == 0:
            stream += keys
        else:  # the last stage of a DP rank sees what its first stage sees
            assert keys == first[(step, tree.rank_of(dp=c["dp"], pp=0))]
    assert len(stream) == len(set(stream)) == 10 * 12
    for s in range(len(specs)):
        pos = sorted(p for src, p, _ in stream if src == s)
        assert pos == list(range(len(pos)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_torchrun_ranks_with_megatron_parallel_state_train_on_the_service(specs, ray_local, tmp_path):
    tree = ClientPlaceTree.from_sizes(tp=2, pp=2, dp=2)
    cfg = config(specs, namespace="torchrun")
    svc = DataService(cfg, tree)
    handles = svc.start()
    steps = 3
    try:
        logs = train_workers(handles, tmp_path, "--tp", "2", "--pp", "2", "--steps", str(steps),
                             "--num-microbatches", "4")
    finally:
        svc.stop()
    assert sorted(logs) == list(range(8))
    for rank, log in logs.items():
        c = tree.coords(rank)
        peer = tree.rank_of(tp=0, dp=c["dp"], pp=c["pp"])
        for mine, theirs in zip(log["steps"], logs[peer]["steps"], strict=True):
            assert mine["digests"] == theirs["digests"]  # TP ranks receive identical tensors
            assert mine["samples"] == theirs["samples"]
        if c["pp"] == 1:
            first = logs[tree.rank_of(dp=c["dp"], pp=0)]
            assert [s["samples"] for s in log["steps"]] == [s["samples"] for s in first["steps"]]
    delivered = [tuple(k) for r in (0, 2) for s in logs[r]["steps"] for mb in s["samples"] for k in mb]
    assert len(delivered) == len(set(delivered)) == steps * cfg.samples_per_step
    losses = [s["loss"] for s in logs[0]["steps"]]
    assert all(np.isfinite(losses))


def test_balancing_changes_the_per_rank_spread_not_the_global_batch(specs, ray_local):
    tree = ClientPlaceTree.from_sizes(dp=4)
    streams, spreads = {}, {}
    for strategy in ("vanilla", "llm_balance"):
        svc = DataService(config(specs, strategy=strategy, namespace=f"bal-{strategy}", samples_per_step=24), tree)
        svc.start()
        try:
            got = consume(svc, tree, 4)
            streams[strategy] = {step: sorted(k for (s, _), keys in got.items() if s == step for k in keys)
                                 for step in range(4)}
            spreads[strategy] = [svc.plan_summary(step)["max_over_mean"] for step in range(4)]
        finally:
            svc.stop()
    print(f"per-rank max/mean cost: vanilla {spreads['vanilla']} -> llm_balance {spreads['llm_balance']}")
    assert streams["vanilla"] == streams["llm_balance"]  # same samples in every global batch
    assert sum(spreads["llm_balance"]) < sum(spreads["vanilla"])
    assert max(spreads["llm_balance"]) <= max(spreads["vanilla"])


def test_selective_broadcast_over_tp_and_cp_only_planned_ranks_fetch(specs, ray_local, tmp_path):
    """tp2·cp2·dp2 on 8 gloo ranks with broadcast (tp, cp): only the plan's fetchers (ranks 0 and 4)
    pull from the service; every rank ends up with exactly the CP slice the constructor would
    have cut for it (checked against an in-process service delivering per rank)."""
    from megascale_data_ext.runtime.client import digest, to_torch
    from megascale_data_ext.runtime.inprocess import InProcessService

    tree = ClientPlaceTree.from_sizes(tp=2, cp=2, dp=2)
    args = {"model": "gpt-tiny", "broadcast": ["tp", "cp"]}
    cfg = config(specs, namespace="selective", samples_per_step=8, num_microbatches=2, strategy_args=args)
    svc = DataService(cfg, tree)
    handles = svc.start()
    steps = 2
    try:
        assert list(ray.get(svc.planner.plan.remote(0)).fetch_ranks) == handles.topology.fetch_ranks() == [0, 4]
        # delivery only: CP training is tested in test_megatron_cpu (CP=2 loss equals CP=1)
        logs = train_workers(handles, tmp_path, "--tp", "2", "--cp", "2", "--steps", str(steps),
                             "--num-microbatches", "2", "--no-train")
    finally:
        svc.stop()
    assert sorted(logs) == list(range(8))
    fetched = sorted(r for r, log in logs.items() if any(s["fetch_ms"] for s in log["steps"]))
    assert fetched == [0, 4]
    per_rank = InProcessService(dataclasses.replace(cfg, strategy_args={"model": "gpt-tiny"}), tree)
    want = {(step, j, src): digest(to_torch(per_rank.get(step, j, src)[0]))  # each microbatch taken once
            for step in range(steps) for src in per_rank.topology.fetch_ranks() for j in range(2)}
    bad = []
    for rank, log in sorted(logs.items()):
        c = tree.coords(rank)
        src = tree.rank_of(tp=0, cp=c["cp"], dp=c["dp"])  # who fetches this slice when cp is not broadcast
        for step, entry in enumerate(log["steps"]):
            bad += [(rank, step, j) for j in range(2) if entry["digests"][j] != want[(step, j, src)]]
    assert bad == []


def test_a_client_whose_service_was_stopped_gets_one_named_error(specs, ray_local):
    """A rank still asking after the service was stopped (another rank failed first and stopped
    it) gets `ServiceUnavailableError` saying the constructor is gone, not Ray's lookup ValueError
    (clean-clone runs 38 and 45 printed that traceback: 45 from a rank's first lookup)."""
    from megascale_data_ext.errors import ServiceUnavailableError
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.remote import RemoteConstructors

    tree = ClientPlaceTree.from_sizes(dp=2)
    svc = DataService(config(specs, namespace="stopped-under-a-client"), tree,
                      fault_tolerance=FaultToleranceConfig(client_prefetch=0))
    handles = svc.start()
    client = RemoteConstructors(handles.topology)
    client.get(0, 0, 0)
    late = RemoteConstructors(handles.topology)  # rank 1 had not asked for anything yet
    assert late.prefetch_steps == 0  # it had joined: it found the Planner and read its settings
    svc.stop()
    with pytest.raises(ServiceUnavailableError, match=r"constructor/0 is gone .*stopped while step 40 was asked"):
        client.get(40, 0, 0)  # a dead handle, looked up again by name
    with pytest.raises(ServiceUnavailableError, match=r"constructor/1 is gone .*stopped while step 0 was asked"):
        late.get(0, 0, 1)  # its first lookup of its constructor
    with pytest.raises(ServiceUnavailableError, match=r"the Planner is gone .*stopped"):
        RemoteConstructors(handles.topology).get(0, 0, 0)  # a client that joins after the stop


def test_the_trainers_calls_are_answered_while_every_planner_thread_waits_for_its_report(specs, ray_local):
    """Feedback mixing: constructors' calls for step 3 wait for step 0's loss report. With more of
    them than the Planner has threads, the trainer still gets the plan of a step it reached and its
    report through, and a loader the plans of a step it fetches (threads of their own), while a
    loader's read-ahead of step 3 is answered at once with nothing; in one pool all queued behind the
    waiting calls until the 600 s report timeout, and every waiting call failed."""
    from megascale_data_ext.runtime.actors import ACTOR_CONCURRENCY

    mixing = {"type": "feedback", "base_weights": [1.0] * len(specs), "lr": 0.5, "delay": 1}
    svc = DataService(config(specs, namespace="feedback-threads", mixing=mixing), ClientPlaceTree.from_sizes(dp=2))
    svc.start()
    try:
        waiting = [svc.planner.constructor_plans.remote(3, [0]) for _ in range(ACTOR_CONCURRENCY + 4)]
        ready, _ = ray.wait(waiting, timeout=1)
        assert ready == []  # step 3 cannot be planned before step 0's report
        assert ray.get(svc.planner.plan.remote(0), timeout=120).step == 0  # rank 0's per-step summary
        assert 0 in ray.get(svc.planner.loader_plans_ahead.remote(0, [0], 2), timeout=120)  # a loader's fetch
        assert ray.get(svc.planner.loader_plans_ahead.remote(3, [0], 2, False), timeout=120) == {}  # read-ahead
        for step in range(3):
            ray.get(svc.planner.report_loss.remote(step, {s: 1.0 + s for s in range(len(specs))}), timeout=120)
        plans = ray.get(waiting, timeout=120)
    finally:
        svc.stop()
    assert len(plans) == ACTOR_CONCURRENCY + 4 and all(len(p) == 1 for p in plans)


def test_a_constructor_killed_under_feedback_mixing_costs_no_report_timeout(specs, ray_local):
    """Feedback mixing (delay 3, the default prefetch) over 9 constructors, one killed mid-run: every
    step is delivered and nothing waits for a report. Before, each constructor parked two calls in the
    Planner for steps 3 and 4 ahead (18 for its 16 threads), the restarted one's call for the step the
    trainer needed queued behind them, and the run stalled for the report timeout, step after step.
    Then a report never sent, with the report timeout longer than the client's deadline (600 s against
    120 s by default): the client names the report (the Planner says which it waits for), not a
    silent constructor (`ServiceUnavailableError`)."""
    from megascale_data_ext.errors import ReportTimeoutError
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.remote import RemoteConstructors

    dp, kill_after = 9, 3
    mixing = {"type": "feedback", "base_weights": [1.0] * len(specs), "lr": 0.5}  # delay: the schedule's 3
    svc = DataService(config(specs, namespace="feedback-kill", mixing=mixing, samples_per_step=2 * dp,
                             num_microbatches=2, constructor_group=1), ClientPlaceTree.from_sizes(dp=dp),
                      fault_tolerance=FaultToleranceConfig(report_timeout_s=20.0))
    handles = svc.start()
    assert svc.topology.num_constructors == dp
    clients = [RemoteConstructors(handles.topology) for _ in range(dp)]  # one per rank, each prefetching
    loss = {s: 1.0 + s for s in range(len(specs))}
    delivered = []
    try:
        for step in range(10):
            for rank, client in enumerate(clients):  # ranks in lockstep
                delivered += [k for j in range(2) for k in client.get(step, j, rank)[1]["samples"].tolist()]
            clients[0].report_loss(step, loss)
            if step == kill_after:
                ray.kill(svc.constructors[2], no_restart=False)  # Ray restarts it
        timed_out = [r for c in clients for r in c.recoveries if r["error"] == "ReportTimeoutError"]
        assert timed_out == []  # before, in 4 runs of 5: steps 8 and 9 of most ranks, after 20 s each
        assert ray.get(svc.planner.stats.remote(), timeout=120)["report_waiters_most"] == 0
        assert len(delivered) == 10 * svc.config.samples_per_step
        assert len({tuple(k) for k in delivered}) == len(delivered)

        # rank 0 goes on alone (past what its first client took ahead: steps 10, 11) and step 10's loss
        # is never reported; only the client of step 13 gives up early
        RemoteConstructors(handles.topology).get(12, 0, 0)
        late = RemoteConstructors(handles.topology, fault_tolerance=dataclasses.replace(
            svc.ft, rpc_timeout_s=2.0, recovery_timeout_s=6.0, client_prefetch=4))
        with pytest.raises(ReportTimeoutError, match=r"step 13 cannot be planned: the per-source loss of step 10 "
                                                     r"was never reported .*recovery_timeout_s=6"):
            late.get(13, 0, 0)
        assert late.ft.client_prefetch == 2  # a client asks no further ahead than its service plans
    finally:
        svc.stop()


def test_a_pause_longer_than_the_report_timeout_loses_no_step_and_a_missing_report_is_named(specs, ray_local):
    """Feedback mixing of delay 1: the service asks for nothing before it can be planned (its client
    asks no step ahead, its constructor prefetches none), so a trainer's pause (a checkpoint save) longer
    than the report timeout leaves no call waiting for a report, nothing to ask again and no step
    lost. Before, the requests sent ahead waited in the Planner and timed out during the pause. A
    report that never comes is a named `ReportTimeoutError`, not a hang."""
    from megascale_data_ext.errors import ReportTimeoutError
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
    from megascale_data_ext.runtime.remote import RemoteConstructors

    mixing = {"type": "feedback", "base_weights": [1.0] * len(specs), "lr": 0.5, "delay": 1}
    svc = DataService(config(specs, namespace="feedback-pause", mixing=mixing), ClientPlaceTree.from_sizes(dp=1),
                      fault_tolerance=FaultToleranceConfig(report_timeout_s=1.0))
    assert svc.ft.client_prefetch == 0
    handles = svc.start()
    client = RemoteConstructors(handles.topology)
    loss = {s: 1.0 + s for s in range(len(specs))}
    try:
        for step in range(4):
            client.get(step, 0, 0)
            if step < 3:
                client.report_loss(step, loss)
        time.sleep(1.5)  # the trainer pauses on step 3, longer than a report is waited for
        client.report_loss(3, loss)
        for step in range(4, 8):
            client.get(step, 0, 0)
            client.report_loss(step, loss)
        assert client.recoveries == []  # nothing timed out, nothing asked again
        assert ray.get(svc.planner.stats.remote(), timeout=120)["report_waiters_most"] == 0
        client.get(8, 0, 0)  # step 8's report never comes
        with pytest.raises(ReportTimeoutError, match=r"loss of step 8 "):
            client.get(9, 0, 0)
    finally:
        svc.stop()

