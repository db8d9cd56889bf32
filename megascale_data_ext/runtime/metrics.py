"""Service metrics: Ray metrics (Prometheus format) plus an in-process registry, never on the failure path.

What is measured (Ray exports each as ``ray_<name>``), and where it is recorded:

- ``megascale_fetch_latency_seconds`` (histogram, tag ``rank``): `Client.fetch`, trainer side.
- ``megascale_constructor_buffered_steps`` (gauge, tag ``constructor``): steps a Data
  Constructor built that still wait for their clients (`constructor_actor.DataConstructorActor.get`).
- ``megascale_plan_seconds`` (histogram): planning time of each step (the Planner's ``on_planned`` hook, `record_plan`).
- ``megascale_plan_max_over_mean`` (histogram, tag ``split``) and ``megascale_plan_last_max_over_mean``
  (gauge, newest step): max/mean bucket cost of each planned step, ``split`` = ``balanced``
  (the plan), ``vanilla`` (the same samples split Megatron-style) or ``encoder`` (hybrid
  strategies); ``megascale_plan_last_step`` (gauge) is the newest planned step.
- ``megascale_source_samples_total`` / ``_tokens_total`` / ``_skipped_total`` (counters, tag
  ``source``): what Source Loaders hand to constructors (`LoaderGroup.fetch`); their
  Prometheus ``rate()`` is the per-source throughput.

`ServiceMetrics` is the facade every part records through; each part is handed one
(`service_metrics()` is the process's, which the actors and the in-process wiring pass on: Ray's
metric objects are per process, so a second registry would export the same series twice). It exports through :mod:`ray.util.metrics` only when Ray is already
imported and initialised in the process (Ray actors, a trainer rank that joined the service);
otherwise (unit tests, `InProcessService`) that side is a no-op. Whatever happens, it also
keeps an in-process registry (`snapshot()`), and it never raises: a metric that cannot be
recorded is logged once and Ray export is turned off for the process. ``MEGASCALE_METRICS=0``
turns Ray export off.

Scraping: Ray's per-node metrics agent serves every process's metrics as Prometheus text at
``http://<node>:<metrics_export_port>/metrics``; pin the port with
``ray.init(_metrics_export_port=8080)`` / ``ray start --metrics-export-port=8080``, or find it
with `export_ports()` (``ray.nodes()[i]["MetricsExportPort"]``); `scrape()` reads and filters
it. Ray reports to the agent every ``metrics_report_interval_ms`` (10 s by default), and
rebuilds histograms from bucket counts, so a histogram's ``_sum`` is approximate (bucket
midpoints). See ``docs/observability.md``.

Imports neither torch, megatron nor Ray (Ray is looked up in ``sys.modules``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)

ENV_SWITCH = "MEGASCALE_METRICS"
RAY_PREFIX = "ray_"

_LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATIO_BOUNDS = (1.001, 1.005, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0)


@dataclass(frozen=True, slots=True)
class MetricDef:
    """One metric: Ray kind (``counter``, ``gauge``, ``histogram``), help text, tag keys, buckets."""

    kind: str
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


FETCH_LATENCY = "megascale_fetch_latency_seconds"
BUFFERED_STEPS = "megascale_constructor_buffered_steps"
CONSTRUCTOR_LEAD = "megascale_constructor_lead_steps"
PLAN_SECONDS = "megascale_plan_seconds"
PLAN_BALANCE = "megascale_plan_max_over_mean"
PLAN_LAST_BALANCE = "megascale_plan_last_max_over_mean"
PLAN_LAST_STEP = "megascale_plan_last_step"
SOURCE_SAMPLES = "megascale_source_samples_total"
SOURCE_TOKENS = "megascale_source_tokens_total"
SOURCE_SKIPPED = "megascale_source_skipped_total"

METRICS: dict[str, MetricDef] = {
    FETCH_LATENCY: MetricDef("histogram", "Seconds a fetching rank waits for one microbatch (Client.fetch)",
                             ("rank",), _LATENCY_BOUNDS),
    BUFFERED_STEPS: MetricDef("gauge", "Steps a Data Constructor has built and not yet handed to every client",
                              ("constructor",)),
    CONSTRUCTOR_LEAD: MetricDef("gauge", "Steps a Data Constructor holds ahead of its slowest fetching rank "
                                "(at data.fault_tolerance.max_lead_steps, the fast ranks wait)", ("constructor",)),
    PLAN_SECONDS: MetricDef("histogram", "Seconds the Planner took to plan one step", (), _LATENCY_BOUNDS),
    PLAN_BALANCE: MetricDef("histogram", "Max/mean bucket cost of each planned step (balanced, vanilla, encoder)",
                            ("split",), _RATIO_BOUNDS),
    PLAN_LAST_BALANCE: MetricDef("gauge", "Max/mean bucket cost of the newest planned step", ("split",)),
    PLAN_LAST_STEP: MetricDef("gauge", "Newest step the Planner planned"),
    SOURCE_SAMPLES: MetricDef("counter", "Samples Source Loaders handed to Data Constructors", ("source",)),
    SOURCE_TOKENS: MetricDef("counter", "Tokens of the samples Source Loaders handed out", ("source",)),
    SOURCE_SKIPPED: MetricDef("counter", "Bad samples Source Loaders skipped", ("source",)),
}

#: split tag values of the balance metrics, keyed by the `StepPlan.summary()` key they come from.
BALANCE_SPLITS = {"max_over_mean": "balanced", "vanilla_max_over_mean": "vanilla",
                  "encoder_max_over_mean": "encoder"}


def _ray_if_initialized() -> Any:
    """The ``ray`` module when this process imported it and is connected, else None (never imports Ray)."""
    ray = sys.modules.get("ray")
    try:
        return ray if ray is not None and ray.is_initialized() else None
    except Exception:  # a half-imported or shut-down Ray
        return None


COUNTER_FLUSH_S = 1.0
"""Longest a counter's increment waits before it goes to Ray (`ServiceMetrics.flush`)."""


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor), not a driver: only actors defer their
    counters (a driver's timer thread could outlive its interpreter's teardown)."""
    ray = sys.modules.get("ray")
    try:
        return ray is not None and ray._private.worker.global_worker.mode == ray.WORKER_MODE
    except Exception:
        return False


class ServiceMetrics:
    """Records the service's metrics to Ray (when connected) and to an in-process registry.

    Thread-safe; every public method swallows its own errors (a metric never fails a fetch).

    Args:
        export: Export through Ray when it is initialised; None = unless ``MEGASCALE_METRICS=0``.
    """

    def __init__(self, *, export: bool | None = None) -> None:
        self.export = os.environ.get(ENV_SWITCH, "1") != "0" if export is None else bool(export)
        self._lock = threading.Lock()
        self._ray_metrics: dict[str, Any] = {}
        self._warned = False
        self._values: dict[str, dict[tuple[str, ...], Any]] = {name: {} for name in METRICS}
        self._pending: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # counter increments not in Ray yet
        self._flush_timer: threading.Timer | None = None

    # -- generic -------------------------------------------------------------------
    @property
    def exporting(self) -> bool:
        """Whether records currently go to Ray too."""
        return self.export and _ray_if_initialized() is not None

    def _ray_metric(self, name: str) -> Any:
        ray = _ray_if_initialized() if self.export else None
        if ray is None:
            return None
        metric = self._ray_metrics.get(name)
        if metric is None:
            from ray.util import metrics as ray_metrics

            d = METRICS[name]
            kwargs: dict[str, Any] = {"description": d.description, "tag_keys": d.tag_keys}
            if d.kind == "histogram":
                kwargs["boundaries"] = list(d.boundaries)
            metric = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge,
                      "histogram": ray_metrics.Histogram}[d.kind](name, **kwargs)
            self._ray_metrics[name] = metric
        return metric

    def record(self, name: str, value: float, tags: Mapping[str, str] | None = None) -> None:
        """Add to a counter, set a gauge or observe a histogram value; never raises."""
        try:
            d = METRICS[name]
            value = float(value)
            tags = {k: str(v) for k, v in (tags or {}).items()}
            key = tuple(tags.get(k, "") for k in d.tag_keys)
            with self._lock:
                values = self._values[name]
                if d.kind == "counter":
                    values[key] = values.get(key, 0.0) + value
                elif d.kind == "gauge":
                    values[key] = value
                else:
                    h = values.get(key)
                    values[key] = ({"count": 1, "sum": value, "min": value, "max": value} if h is None else
                                   {"count": h["count"] + 1, "sum": h["sum"] + value, "min": min(h["min"], value),
                                    "max": max(h["max"], value)})
                metric = self._ray_metric(name)
                if metric is not None and d.kind == "counter" and _in_ray_worker():
                    if value > 0:  # Ray refuses counter increments <= 0
                        self._count_later(name, value, tags)
                    return
            if metric is None or (d.kind == "counter" and value <= 0):  # Ray refuses counter increments <= 0
                return
            if d.kind == "counter":
                metric.inc(value, tags=tags)
            elif d.kind == "gauge":
                metric.set(value, tags=tags)
            else:
                metric.observe(value, tags=tags)
        except Exception as exc:  # metrics must never break the data path
            self._disable(name, exc)

    def _count_later(self, name: str, value: float, tags: dict[str, str]) -> None:
        """Under the lock: add to a counter's increment that goes to Ray within `COUNTER_FLUSH_S`
        (a loader counts every source of every fetch: at 1,000+ sources a Ray ``inc`` each was a
        fifth of its step; Ray exports every few seconds anyway)."""
        key = (name, tuple(tags.items()))
        self._pending[key] = self._pending.get(key, 0.0) + value
        if self._flush_timer is None:
            self._flush_timer = threading.Timer(COUNTER_FLUSH_S, self.flush)
            self._flush_timer.daemon = True
            self._flush_timer.start()

    def flush(self) -> None:
        """Hand the counters' pending increments to Ray now; never raises."""
        with self._lock:
            pending, self._pending, self._flush_timer = self._pending, {}, None
            metrics = dict(self._ray_metrics)
        for (name, tags), value in pending.items():
            try:
                metrics[name].inc(value, tags=dict(tags))
            except Exception as exc:  # metrics must never break the data path
                self._disable(name, exc)

    def _disable(self, name: str, exc: Exception) -> None:
        self.export = False
        if not self._warned:
            self._warned = True
            _log.warning("metric %s could not be recorded (%s: %s); Ray metric export is off in this process",
                         name, type(exc).__name__, exc)

    def snapshot(self) -> dict[str, dict[tuple[str, ...], Any]]:
        """The in-process registry: ``{name: {tag values (in tag_keys order): value}}``.

        Counters hold their total, gauges their last value, histograms ``{count, sum, min, max}``.
        """
        with self._lock:
            return {name: {k: (dict(v) if isinstance(v, dict) else v) for k, v in vals.items()}
                    for name, vals in self._values.items() if vals}

    def reset(self) -> None:
        """Forget the in-process values and the Ray metric objects (tests; a new Ray session)."""
        with self._lock:
            self._values = {name: {} for name in METRICS}
            self._ray_metrics.clear()
            self._pending.clear()

    # -- the service's metrics -----------------------------------------------------
    def fetch_latency(self, seconds: float, rank: int) -> None:
        self.record(FETCH_LATENCY, seconds, {"rank": rank})

    def buffered_steps(self, steps: int, constructor: str) -> None:
        self.record(BUFFERED_STEPS, steps, {"constructor": constructor})

    def constructor_lead(self, steps: int | None, constructor: str) -> None:
        if steps is not None:
            self.record(CONSTRUCTOR_LEAD, steps, {"constructor": constructor})

    def record_plan(self, plan: Any, seconds: float) -> None:
        """`Planner`'s ``on_planned`` hook: one newly planned step's time and balance."""
        try:
            self.plan_made(seconds, plan.summary())
        except Exception as exc:  # plan.summary() of an odd plan: never fail planning for a metric
            self._disable(PLAN_SECONDS, exc)

    def plan_made(self, seconds: float, summary: Mapping[str, Any]) -> None:
        """One planned step: its planning time and balance (`StepPlan.summary()`)."""
        self.record(PLAN_SECONDS, seconds)
        self.record(PLAN_LAST_STEP, summary.get("step", 0))
        for key, split in BALANCE_SPLITS.items():
            if key in summary:
                self.record(PLAN_BALANCE, summary[key], {"split": split})
                self.record(PLAN_LAST_BALANCE, summary[key], {"split": split})

    def source_read(self, source: str, *, samples: int, tokens: int = 0, skipped: int = 0) -> None:
        self.record(SOURCE_SAMPLES, samples, {"source": source})
        self.record(SOURCE_TOKENS, tokens, {"source": source})
        self.record(SOURCE_SKIPPED, skipped, {"source": source})


_PROCESS_METRICS: ServiceMetrics | None = None
_PROCESS_LOCK = threading.Lock()


def service_metrics() -> ServiceMetrics:
    """This process's `ServiceMetrics` (one per process: each Ray actor has its own)."""
    global _PROCESS_METRICS
    if _PROCESS_METRICS is None:
        with _PROCESS_LOCK:
            if _PROCESS_METRICS is None:
                _PROCESS_METRICS = ServiceMetrics()
    return _PROCESS_METRICS


def rss_bytes() -> int:
    """This process's resident memory (what a loader actor, or its shadow, costs)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def samples_in(fetched: Mapping[str, list]) -> tuple[int, int, int]:
    """(samples, tokens, skipped) of a `SourceLoader.fetch` result."""
    samples = fetched.get("samples", ())
    return len(samples), sum(len(s.tokens) for _, _, s in samples), len(fetched.get("skipped", ()))


# -- scraping --------------------------------------------------------------------
def export_ports() -> list[tuple[str, int]]:
    """``(node address, metrics export port)`` of every alive node of the connected Ray cluster."""
    import ray

    return [(n["NodeManagerAddress"], int(n["MetricsExportPort"])) for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def scrape(port: int, host: str = "127.0.0.1", *, prefix: str = RAY_PREFIX + "megascale_", timeout: float = 5.0) -> str:
    """The Prometheus text lines of a node's metrics agent whose metric name starts with `prefix`
    (``# HELP`` / ``# TYPE`` lines included); raises OSError when the agent does not answer."""
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode("utf-8", "replace")
    keep = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and len(line.split(" ")) > 2 else line
        if name.startswith(prefix):
            keep.append(line)
    return "\n".join(keep)


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of Prometheus text: ``{metric name: [(labels, value)]}`` (comments skipped)."""
    import re

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    pattern = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
    for line in text.splitlines():
        m = pattern.match(line)
        if not m or line.startswith("#"):
            continue
        labels = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out
