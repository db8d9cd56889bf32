"""Fixtures shared by the multi-process integration tests."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """The demo sources (`megascale-data demo-data`) that conf/sources/demo_*.yaml point at (read only:
    one copy for every module)."""
    root = tmp_path_factory.mktemp("demo_data")
    subprocess.run([sys.executable, "-m", "megascale_data_ext", "demo-data", "--out", str(root), "--rows", "200"],
                   check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray of 2 CPUs for one module (started and stopped with it)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
