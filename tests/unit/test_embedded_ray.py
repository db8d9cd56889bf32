"""The environment an embedded Ray inherits (`runtime.embedded_ray`): the malloc arena cap and the preloads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from megascale_data_ext.runtime.embedded_ray import PRELOAD_VARIABLE, SERVICE_MODULES, preload_service_modules
from megascale_data_ext.runtime.malloc import DEFAULT_ARENAS, tune_allocators_for_embedded_ray


def test_the_allocator_settings_go_into_the_environment_unless_set_or_turned_off():
    env: dict[str, str] = {}
    assert tune_allocators_for_embedded_ray(env) == env == {
        "MALLOC_ARENA_MAX": str(DEFAULT_ARENAS), "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0",
        "ARROW_DEFAULT_MEMORY_POOL": "system"}
    env = {"MALLOC_ARENA_MAX": "8", "ARROW_DEFAULT_MEMORY_POOL": "jemalloc",
           "GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}
    assert tune_allocators_for_embedded_ray(dict(env)) == env  # the user's own settings win
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # other tunables are kept, the cache limit added
    tuned = tune_allocators_for_embedded_ray(env)["GLIBC_TUNABLES"]
    assert tuned == "glibc.malloc.hugetlb=1:glibc.malloc.tcache_count=0"
    env = {"MEGASCALE_MALLOC_ARENAS": "4", "MEGASCALE_MALLOC_TCACHE": "2", "MEGASCALE_ARROW_POOL": "mimalloc"}
    assert tune_allocators_for_embedded_ray(env) == {
        "MALLOC_ARENA_MAX": "4", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=2",
        "ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}
    env = {"MEGASCALE_MALLOC_ARENAS": "0", "MEGASCALE_MALLOC_TCACHE": "default", "MEGASCALE_ARROW_POOL": "default"}
    assert tune_allocators_for_embedded_ray(env) == {}  # each turned off: glibc's and pyarrow's own


def test_a_constructor_process_trims_its_heap_on_a_daemon_thread_unless_turned_off(monkeypatch):
    from megascale_data_ext.runtime import malloc

    trimmed = threading.Event()
    monkeypatch.setattr(malloc, "_malloc_trim", lambda: lambda pad: trimmed.set() or 1)
    assert malloc.trim_periodically({"MEGASCALE_MALLOC_TRIM_S": "0"}) is None
    stop = threading.Event()
    thread = malloc.trim_periodically({"MEGASCALE_MALLOC_TRIM_S": "0.01"}, name="trim-test", stop=stop)
    assert thread is not None and thread.daemon and trimmed.wait(30)
    stop.set()
    thread.join(30)
    assert not thread.is_alive()
    monkeypatch.setattr(malloc, "_malloc_trim", lambda: None)  # a C library without malloc_trim
    assert malloc.trim_periodically({}) is None


def test_the_service_modules_are_preloaded_unless_set_or_turned_off():
    env: dict[str, str] = {}
    assert preload_service_modules(env) == env[PRELOAD_VARIABLE] == ",".join(SERVICE_MODULES)
    env = {PRELOAD_VARIABLE: "numpy"}
    assert preload_service_modules(env) == "numpy"  # the user's own setting wins
    env = {"MEGASCALE_PRELOAD": "0"}
    assert preload_service_modules(env) is None and PRELOAD_VARIABLE not in env


def test_the_service_modules_import_and_hold_every_actor_class():
    """A preloaded module that does not exist would only be logged by the worker: they must import, and
    every actor class the service starts must live in one of them."""
    import importlib

    from megascale_data_ext.runtime.actors import PlannerActor
    from megascale_data_ext.runtime.constructor_actor import DataConstructorActor
    from megascale_data_ext.runtime.loader_group import LoaderGroupActor

    modules = {importlib.import_module(name).__name__ for name in SERVICE_MODULES}
    assert {c.__module__ for c in (PlannerActor, DataConstructorActor, LoaderGroupActor)} <= modules


SERVICE_ACTORS_ENV = """
import dataclasses, os, sys, tempfile
from pathlib import Path
import ray
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
specs = make_demo_data(Path(tempfile.mkdtemp()), seed=1, rows=40, text_sources=2, image_sources=0, megatron_source=False)
cfg = ServiceConfig(sources=[dataclasses.replace(s, truncate=True, max_tokens=512) for s in specs], samples_per_step=4,
                    num_microbatches=1, seq_length=512, ray=RayConfig(num_cpus=2), autoscale=AutoscaleConfig(enabled=False))
from megascale_data_ext.commands._proc_stats import descendants
from megascale_data_ext.runtime.embedded_ray import init_ray
init_ray(cfg.ray, log_to_driver=False)  # as the service starts it; the raylet forks prestarted workers at once
def workers():  # Ray's worker processes: default_worker.py until it names itself ray::IDLE / ray::<Actor>
    n = 0
    for pid in descendants():
        try:
            argv = open(f"/proc/{pid}/cmdline").read().split(chr(0))
        except OSError:
            continue
        n += (argv[0].startswith("ray::") and not argv[0].endswith("Agent")) or any(
            a.endswith("workers/default_worker.py") for a in argv[1:2])
    return n
print("worker processes before the service:", workers(), flush=True)
svc = DataService(cfg, ClientPlaceTree.from_sizes(dp=2), progress=None)
svc.start()
try:
    actors = [svc.planner, *svc.loader_actors(), *svc.constructors]
    print("worker processes beside the actors:", workers() - len(actors), flush=True)
    def allocators(_self):
        import pyarrow
        from megascale_data_ext.runtime.malloc import allocator_environment
        return repr(sorted({**allocator_environment(), "arrow": pyarrow.default_memory_pool().backend_name}.items()))
    seen = ray.get([a.__ray_call__.remote(allocators) for a in actors])
    print("allocators of the actors:", sorted(set(seen)), flush=True)
    preloaded = ray.get([a.__ray_call__.remote(lambda _s: [x for x in sys.argv if x.startswith("--worker-preload-modules")])
                         for a in actors])
    print("preloads of the actors:", sorted({tuple(p) for p in preloaded}), flush=True)
    trims = ray.get([a.__ray_call__.remote(lambda _s: any(t.name == "malloc-trim" for t in __import__("threading").enumerate()))
                     for a in [*svc.loader_actors(), *svc.constructors]])
    print("loaders and constructors trimming their heap:", trims, flush=True)
finally:
    svc.stop()
"""


@pytest.mark.slow
def test_every_actor_of_an_embedded_service_starts_with_the_allocator_settings_and_preloaded_modules():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL", "MEGASCALE_MALLOC_ARENAS",
                        "MEGASCALE_MALLOC_TCACHE", "MEGASCALE_ARROW_POOL", PRELOAD_VARIABLE, "MEGASCALE_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", SERVICE_ACTORS_ENV], env=env, capture_output=True, text=True,
                         timeout=540)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = [line for line in out.stdout.splitlines() if line.startswith("allocators of the actors:")]
    expected = repr(sorted({"MALLOC_ARENA_MAX": "2", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0",
                            "ARROW_DEFAULT_MEMORY_POOL": "system", "arrow": "system"}.items()))
    assert seen == [f"allocators of the actors: [{expected!r}]"], out.stdout[-2000:]  # Ray's own lines share stdout
    # no idle prestarted workers (data.ray.prestart_workers=false): one per CPU otherwise, for as long as Ray runs
    assert "worker processes before the service: 0\n" in out.stdout, out.stdout[-2000:]
    assert "worker processes beside the actors: 0\n" in out.stdout, out.stdout[-2000:]
    trims = [line for line in out.stdout.splitlines() if line.startswith("loaders and constructors trimming")]
    assert len(trims) == 1 and "False" not in trims[0] and "True" in trims[0], out.stdout[-2000:]
    preloads = [line for line in out.stdout.splitlines() if line.startswith("preloads of the actors:")]
    assert preloads == [f"preloads of the actors: [('--worker-preload-modules={','.join(SERVICE_MODULES)}',)]"], \
        out.stdout[-2000:]


LARGE_BLEND = """
import dataclasses, tempfile
from pathlib import Path
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.client import Client
from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
spec, = make_demo_data(Path(tempfile.mkdtemp()), seed=1, rows=40, text_sources=1, image_sources=0, megatron_source=False)
specs = [dataclasses.replace(spec, name=f"copy{i:04d}", truncate=True, max_tokens=512) for i in range(1000)]
cfg = ServiceConfig(sources=specs, samples_per_step=8, num_microbatches=1, seq_length=512, ray=RayConfig(num_cpus=2),
                    autoscale=AutoscaleConfig(enabled=True))
svc = DataService(cfg, ClientPlaceTree.from_sizes(dp=2), progress=None)
handles = svc.start()
try:
    batch = Client.connect(handles, 0, num_microbatches=1, broadcast=False).next_microbatch()
    print("first microbatch tokens:", int(batch["tokens"].numel()), flush=True)
finally:
    svc.stop()
"""


@pytest.mark.slow
def test_a_healthy_start_of_a_1000_source_blend_logs_no_error_line():
    """Its config and its loader group's members are over Ray's 100 KiB inline limit: passed by value,
    Ray logged an error line per restartable actor on the console (ray-project/ray#53727, the
    Planner's for its loaders too); `Held` keeps them out of the arguments."""
    out = subprocess.run([sys.executable, "-c", LARGE_BLEND], capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "first microbatch tokens:" in out.stdout, out.stdout[-2000:]
    errors = [line for line in out.stderr.splitlines() if " E " in line[:40] or "core_worker.cc" in line]
    assert not errors, errors[:3]


@pytest.mark.slow
def test_held_values_come_back_until_released():
    import ray

    from megascale_data_ext.runtime.ray_actor import Held, resolve

    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        held = Held.put({"sources": list(range(50_000))}, owner="job-0")
        assert ray.get(ray.remote(lambda h: resolve(h)["sources"][-1]).remote(held)) == 49_999  # in another process
        assert resolve(7) == 7
        held.release()
        mine = [Held.put(i, owner="job-a") for i in range(3)]
        other = Held.put("b", owner="job-b")
        Held.release_all("job-a")  # what a stopping service does: every value it or its Planner put
        assert other.get() == "b"
        for h in mine:
            with pytest.raises(RuntimeError):
                h.get()
        with pytest.raises(RuntimeError, match="gone from Ray's key-value store"):
            held.get()
    finally:
        ray.shutdown()
