"""Fixtures shared by the multi-process integration tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megascale_data_ext.runtime.config import INLINE_OBJECT_BYTES


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """The demo sources (`megascale-data demo-data`) that conf/sources/demo_*.yaml point at (read only:
    one copy for every module)."""
    root = tmp_path_factory.mktemp("demo_data")
    subprocess.run([sys.executable, "-m", "megascale_data_ext", "demo-data", "--out", str(root), "--rows", "200"],
                   check=True, capture_output=True)
    return root


# as a service starts its own Ray (`RayConfig.init_kwargs`): steps of a few microbatches travel inline
LOCAL_RAY = dict(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _system_config={"max_direct_call_object_size": INLINE_OBJECT_BYTES})


def shared_ray() -> None:
    """Join the local Ray of 2 CPUs that the integration modules share, starting it if none is up.

    One start (~4 s) and stop (~1.5 s) for a run of modules instead of one per module: the suite's
    budget is 15 minutes on 2 cores. Each test leaves it as it found it: its services stopped,
    its own namespace (two modules never share actor names). A module that needs a cluster of its
    own (`ray.cluster_utils.Cluster`) calls `own_ray` first; the package's end stops it.
    """
    import ray

    if not ray.is_initialized():
        ray.init(**LOCAL_RAY)


def own_ray() -> None:
    """Stop the shared Ray (if up) so that this module can start a cluster of its own."""
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """The shared local Ray (`shared_ray`) for one module; it stays up for the next one."""
    shared_ray()
    yield


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_used(request):
    """Stop the shared Ray before a module that does not use it (its idle daemons would take CPU
    from the module's torchrun ranks and its own embedded Ray)."""
    module = request.module
    if hasattr(module, "shared_ray") or hasattr(module, "own_ray"):
        return
    if any(item.module is module and "ray_local" in item.fixturenames for item in request.session.items):
        return
    own_ray()


@pytest.fixture(scope="package", autouse=True)
def _no_ray_after_the_integration_tests():
    """The unit tests that start a Ray of their own find none running."""
    yield
    own_ray()


@pytest.fixture(autouse=True)
def _no_actor_left_behind():
    """Kill the named actors a test left in a Ray that outlives it (a test failing before it stopped
    its service), so that the next test and module start from an empty cluster."""
    yield
    if "ray" not in sys.modules:
        return
    import ray

    if not ray.is_initialized():
        return
    for actor in ray.util.list_named_actors(all_namespaces=True):
        try:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        except Exception:  # already gone
            pass
