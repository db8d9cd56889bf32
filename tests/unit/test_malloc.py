"""The malloc arena cap (`runtime.malloc`): in the environment the embedded Ray inherits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megascale_data_ext.runtime.malloc import DEFAULT_ARENAS, cap_arenas_for_embedded_ray


def test_the_cap_goes_into_the_environment_unless_set_or_turned_off():
    env: dict[str, str] = {}
    assert cap_arenas_for_embedded_ray(env) == str(DEFAULT_ARENAS) and env["MALLOC_ARENA_MAX"] == "2"
    env = {"MALLOC_ARENA_MAX": "8"}
    assert cap_arenas_for_embedded_ray(env) == "8"  # the user's own setting wins
    env = {"MEGASCALE_MALLOC_ARENAS": "4"}
    assert cap_arenas_for_embedded_ray(env) == "4"
    env = {"MEGASCALE_MALLOC_ARENAS": "0"}
    assert cap_arenas_for_embedded_ray(env) is None and "MALLOC_ARENA_MAX" not in env


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
svc = DataService(cfg, ClientPlaceTree.from_sizes(dp=2), progress=None)
svc.start()
try:
    actors = [svc.planner, *svc.loader_actors(), *svc.constructors]
    seen = ray.get([a.__ray_call__.remote(lambda _s: os.environ.get("MALLOC_ARENA_MAX")) for a in actors])
    print("MALLOC_ARENA_MAX of the actors:", sorted(set(seen)), flush=True)
finally:
    svc.stop()
"""


@pytest.mark.slow
def test_every_actor_of_an_embedded_service_starts_with_capped_arenas():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "MEGASCALE_MALLOC_ARENAS")}
    out = subprocess.run([sys.executable, "-c", SERVICE_ACTORS_ENV], env=env, capture_output=True, text=True,
                         timeout=540)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = [line for line in out.stdout.splitlines() if line.startswith("MALLOC_ARENA_MAX of the actors:")]
    assert seen == ["MALLOC_ARENA_MAX of the actors: ['2']"], out.stdout[-2000:]  # Ray's own lines share stdout
