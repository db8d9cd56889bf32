"""Service metrics: the facade without Ray (in-process registry, never raises), the wiring through
the Planner's `on_planned` hook and `Client.fetch`, and real Prometheus text from Ray's metrics agent."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime import metrics as m
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.metrics import ServiceMetrics, service_metrics
from megascale_data_ext.sources.demo_data import make_demo_data


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("demo"), seed=7, rows=80, text_sources=2, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True) for s in out]


def config(specs, **kw):
    base = dict(sources=specs, seed=3, samples_per_step=16, num_microbatches=2, seq_length=2048, buffer_size=64,
                strategy="llm_balance", strategy_args={"model": "gpt-tiny"})
    return ServiceConfig(**{**base, **kw})


@pytest.fixture
def fresh():
    service_metrics().reset()
    yield service_metrics()
    service_metrics().reset()


def test_the_metrics_module_loads_neither_torch_megatron_nor_ray():
    code = ("import sys, megascale_data_ext.runtime.metrics as m\n"
            "m.service_metrics().fetch_latency(0.01, 0)\n"
            "heavy = sorted({'torch', 'ray', 'megatron'} & {k.split('.')[0] for k in sys.modules})\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_ray_the_facade_only_keeps_its_registry():
    sm = ServiceMetrics()
    assert not sm.exporting  # Ray is not initialised in this process
    sm.fetch_latency(0.02, rank=3)
    sm.fetch_latency(0.04, rank=3)
    sm.buffered_steps(2, "0")
    sm.source_read("web", samples=5, tokens=100, skipped=0)  # a zero increment is fine too
    sm.source_read("web", samples=2, tokens=10, skipped=1)
    snap = sm.snapshot()
    lat = snap[m.FETCH_LATENCY][("3",)]
    assert lat["count"] == 2 and lat["sum"] == pytest.approx(0.06) and lat["max"] == 0.04
    assert snap[m.BUFFERED_STEPS] == {("0",): 2.0}
    assert snap[m.SOURCE_SAMPLES] == {("web",): 7.0} and snap[m.SOURCE_TOKENS] == {("web",): 110.0}
    assert snap[m.SOURCE_SKIPPED] == {("web",): 1.0}


def test_a_failing_metric_never_fails_the_caller(monkeypatch, caplog):
    sm = ServiceMetrics()

    class Broken:
        def observe(self, *a, **k):
            raise RuntimeError("agent gone")

    monkeypatch.setattr(sm, "_ray_metric", lambda name: Broken())
    sm.fetch_latency(0.5, rank=0)  # must not raise
    assert sm.export is False and "agent gone" in caplog.text
    sm.record("no_such_metric", 1.0)  # unknown names and bad values are swallowed as well
    sm.record(m.FETCH_LATENCY, "not a number")
    assert sm.snapshot()[m.FETCH_LATENCY][("0",)]["count"] == 1


def test_each_new_step_is_timed_once_and_its_balance_recorded(specs, fresh):
    svc = InProcessService(config(specs), ClientPlaceTree.from_sizes(dp=4))  # on_planned = ServiceMetrics.record_plan
    svc.planner.plan(3)
    svc.planner.plan(2)  # cached: not timed again
    snap = fresh.snapshot()
    assert snap[m.PLAN_SECONDS][()]["count"] == 4
    assert snap[m.PLAN_LAST_STEP] == {(): 3.0}
    summaries = [svc.planner.plan(s).summary() for s in range(4)]
    balanced, vanilla = snap[m.PLAN_BALANCE][("balanced",)], snap[m.PLAN_BALANCE][("vanilla",)]
    assert balanced["count"] == vanilla["count"] == 4
    assert balanced["sum"] == pytest.approx(sum(s["max_over_mean"] for s in summaries))
    assert vanilla["max"] == pytest.approx(max(s["vanilla_max_over_mean"] for s in summaries))
    assert snap[m.PLAN_LAST_BALANCE][("balanced",)] == pytest.approx(summaries[3]["max_over_mean"])
    assert ("encoder",) not in snap[m.PLAN_BALANCE]  # text-only strategy: no encoder sub-plan


def test_client_fetch_records_latency_per_rank(specs, fresh):
    from megascale_data_ext.runtime.client import Client

    tree = ClientPlaceTree.from_sizes(dp=2)
    svc = InProcessService(config(specs), tree)
    clients = {r: Client(svc.topology, r, source=svc, num_microbatches=2) for r in svc.topology.fetch_ranks()}
    for step in range(2):
        for r, c in clients.items():
            for j in range(2):
                c.fetch(step, j)
    snap = fresh.snapshot()[m.FETCH_LATENCY]
    assert set(snap) == {(str(r),) for r in clients}
    for r, c in clients.items():
        assert snap[(str(r),)]["count"] == 4
        assert snap[(str(r),)]["sum"] == pytest.approx(sum(c.fetch_seconds))


def test_scrape_and_parse_filter_prometheus_text(monkeypatch):
    text = ("# HELP ray_megascale_x_total help\n# TYPE ray_megascale_x_total counter\n"
            'ray_megascale_x_total{source="a",Component="core_worker"} 3.0\n'
            "# HELP ray_other other\nray_other 1.0\n")

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return text.encode()

    monkeypatch.setattr("urllib.request.urlopen", lambda url, timeout: Resp())
    got = m.scrape(1234)
    assert "ray_other" not in got and got.count("ray_megascale_x_total") == 3
    assert m.parse_prometheus(got) == {"ray_megascale_x_total": [({"source": "a", "Component": "core_worker"}, 3.0)]}


# -- real Ray ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poll(port: int, want, timeout: float = 600.0) -> dict:
    """Scrape until `want(parsed)` holds (at once on a quiet box; a loaded one exports late, so the
    budget is generous); the last parse is returned either way."""
    deadline, parsed = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            parsed = m.parse_prometheus(m.scrape(port))
        except OSError:  # the agent is not up yet
            parsed = {}
        if want(parsed):
            break
        time.sleep(0.5)
    return parsed


def _values(parsed: dict, name: str, **labels: str) -> list[float]:
    return [v for lab, v in parsed.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]


@pytest.fixture(scope="module")
def ray_metrics_port():
    """A local Ray whose metrics agent serves Prometheus text on a known port, reporting every second."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process")
    port = _free_port()
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False,
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000})
    service_metrics().reset()  # drop Ray metric objects of an earlier session in this process
    yield port
    ray.shutdown()
    service_metrics().reset()


@pytest.mark.slow
def test_metrics_recorded_in_an_actor_are_scrapeable_as_prometheus_text(ray_metrics_port):
    import ray

    @ray.remote(num_cpus=0)
    class Recorder:
        def record(self):
            sm = service_metrics()
            sm.source_read("web", samples=7, tokens=700, skipped=1)
            sm.buffered_steps(3, "0+1")
            sm.plan_made(0.02, {"step": 5, "max_over_mean": 1.01, "vanilla_max_over_mean": 1.4})
            for seconds in (0.003, 0.03, 0.3):
                sm.fetch_latency(seconds, rank=2)
            return sm.exporting

    recorder = Recorder.remote()  # alive while Ray scrapes it (its counters are handed to Ray within a second)
    assert ray.get(recorder.record.remote()) is True
    p = "ray_megascale_"
    # an actor's counters reach Ray within COUNTER_FLUSH_S of their last increment, the rest at once
    parsed = _poll(ray_metrics_port, lambda d: all(f"{p}{k}" in d for k in (
        "fetch_latency_seconds_count", "plan_seconds_count", "source_samples_total", "source_skipped_total")))
    assert _values(parsed, f"{p}source_samples_total", source="web") == [7.0]
    assert _values(parsed, f"{p}source_tokens_total", source="web") == [700.0]
    assert _values(parsed, f"{p}source_skipped_total", source="web") == [1.0]
    assert _values(parsed, f"{p}constructor_buffered_steps", constructor="0+1") == [3.0]
    assert _values(parsed, f"{p}plan_last_step") == [5.0]
    assert _values(parsed, f"{p}plan_last_max_over_mean", split="vanilla") == [1.4]
    assert _values(parsed, f"{p}plan_seconds_count") == [1.0]
    assert _values(parsed, f"{p}fetch_latency_seconds_count", rank="2") == [3.0]
    # cumulative buckets: 0.003 <= 0.005, 0.03 <= 0.05, 0.3 <= 0.5 (Ray's _sum is rebuilt from bucket midpoints)
    buckets = {lab["le"]: v for lab, v in parsed[f"{p}fetch_latency_seconds_bucket"] if lab.get("rank") == "2"}
    assert (buckets["0.005"], buckets["0.05"], buckets["0.5"], buckets["+Inf"]) == (1.0, 2.0, 3.0, 3.0)


@pytest.mark.slow
def test_the_running_service_exports_its_metrics(specs, ray_metrics_port):
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.runtime.service import DataService

    tree = ClientPlaceTree.from_sizes(dp=2)
    svc = DataService(config(specs, ray=RayConfig(namespace="metrics_test")), tree)
    handles = svc.start()
    try:
        clients = {r: Client.connect(handles, r, num_microbatches=2) for r in handles.topology.fetch_ranks()}
        steps, delivered = 3, 0
        for step in range(steps):
            for c in clients.values():
                for j in range(2):
                    delivered += len(c.fetch(step, j)[1]["samples"])
        p, names = "ray_megascale_", {s.name for s in specs}
        # wait for each rank's own series: the test above left a rank-2 series in this Ray session
        # every source's series: each loader actor exports on its own schedule, and one that read ahead
        # can make the sum alone reach `delivered` before the other's first export (clean-clone run 37)
        parsed = _poll(ray_metrics_port, lambda d: (
            names <= {lab.get("source") for lab, _ in d.get(f"{p}source_samples_total", [])}
            and sum(v for lab, v in d.get(f"{p}source_samples_total", []) if lab.get("source") in names) >= delivered
            and all(sum(_values(d, f"{p}fetch_latency_seconds_count", rank=str(r))) >= 2 * steps for r in clients)
            and _values(d, f"{p}plan_max_over_mean_count", split="vanilla")
            and max(_values(d, f"{p}plan_seconds_count") or [0]) >= steps  # the Planner's series flush on their own
            and {"0", "1"} <= {lab.get("constructor") for lab, _ in d.get(f"{p}constructor_buffered_steps", [])}))
    finally:
        svc.stop()
    # (series of the test above, from the same Ray session, are still exported: filter by label)
    samples = {lab["source"]: v for lab, v in parsed[f"{p}source_samples_total"] if lab["source"] in names}
    assert set(samples) == names and sum(samples.values()) >= delivered  # loaders may have read ahead
    for r in clients:  # the client side (this driver process): one observation per fetch
        assert _values(parsed, f"{p}fetch_latency_seconds_count", rank=str(r)) == [2.0 * steps]
    assert max(_values(parsed, f"{p}plan_seconds_count")) >= steps
    assert {"0", "1"} <= {lab["constructor"] for lab, _ in parsed[f"{p}constructor_buffered_steps"]}
    assert all(v >= 1.0 for v in _values(parsed, f"{p}plan_last_max_over_mean"))
    assert np.isfinite(_values(parsed, f"{p}plan_last_step")).all()


def test_a_constructor_counts_the_bytes_of_the_steps_it_holds_until_they_are_taken(specs):
    """`held_bytes` (sampled by `bench soak` beside each constructor's memory) is the packed arrays
    of the held steps: a step's whole pack while any rank has yet to take it, none after."""
    import numpy as np

    svc = InProcessService(config(specs, constructor_group=2), ClientPlaceTree.from_sizes(dp=2))
    constructor, = svc.constructors  # one for both ranks
    ranks = svc.topology.fetch_ranks()
    assert constructor.held_bytes() == 0
    got = constructor.get_step(0, ranks[0])
    packed = [constructor.packed(0, constructor.layout.bucket_of_rank(r), j) for r in ranks for j in range(len(got))]
    expected = sum(a.nbytes for batch in packed for a in batch.values() if isinstance(a, np.ndarray))
    assert expected > 0 and constructor.stats()["held_bytes"] == expected
    constructor.get_step(0, ranks[1])  # the last taker: the step goes
    assert constructor.held_bytes() == 0 and constructor.stats()["buffered_steps"] == 0
