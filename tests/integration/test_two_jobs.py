"""Two training jobs on one Ray cluster: each in its own `data.ray.namespace`, side by side.

Both services run at once on one embedded Ray, with different sources and seeds; each job's
clients get exactly their in-process run, byte for byte, while the other job is served. A client
holding one job's topology that reaches the other job's actors is refused by name
(`JobMismatchError`), a third service started in a namespace in use is refused naming
``data.ray.namespace``, and stopping one job leaves the other serving.
"""

from __future__ import annotations

import dataclasses

import pytest

from megascale_data_ext.commands.bench_consumers import step_digest
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ConfigError, JobMismatchError
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.remote import RemoteConstructors
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from tests.integration.conftest import shared_ray

pytestmark = pytest.mark.slow
STEPS = 6
FT = FaultToleranceConfig(client_prefetch=2)


def job_config(root, name: str, seed: int) -> ServiceConfig:
    specs = make_demo_data(root / name, seed=seed, rows=120, text_sources=2, image_sources=0, megatron_source=False)
    return ServiceConfig(sources=[dataclasses.replace(s, truncate=True) for s in specs], seed=seed,
                         samples_per_step=8, num_microbatches=2, seq_length=1024, strategy="llm_balance",
                         strategy_args={"model": "gpt-tiny"}, buffer_size=32, ray=RayConfig(namespace=name),
                         fault_tolerance=FT)


def steps_of(source, topology, steps, m=2) -> dict[tuple[int, int], str]:
    return {(rank, step): step_digest([source.get(step, j, rank) for j in range(m)], None)
            for step in steps for rank in topology.fetch_ranks()}


def test_two_jobs_side_by_side_and_a_foreign_client_is_refused(tmp_path):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfgs = {"job-a": job_config(tmp_path, "job-a", 31), "job-b": job_config(tmp_path, "job-b", 32)}
    want = {name: steps_of(InProcessService(cfg, tree), InProcessService(cfg, tree).topology, range(STEPS + 2))
            for name, cfg in cfgs.items()}
    assert want["job-a"] != want["job-b"]
    shared_ray()
    services = {}
    try:
        for name, cfg in cfgs.items():
            services[name] = DataService(cfg, tree, progress=None)
        topo = {name: svc.start().topology for name, svc in services.items()}
        assert topo["job-a"].job != topo["job-b"].job and topo["job-a"].job.startswith("job-a#")
        ids = {name: {a["actor_id"] for a in svc.actors()} for name, svc in services.items()}
        assert not ids["job-a"] & ids["job-b"]
        clients = {name: RemoteConstructors(t, fault_tolerance=FT) for name, t in topo.items()}
        got = {name: {} for name in cfgs}
        for step in range(STEPS):  # interleaved: both jobs in flight at once
            for name, client in clients.items():
                got[name].update(steps_of(client, topo[name], [step]))
        for name in cfgs:
            assert got[name] == {k: v for k, v in want[name].items() if k[1] < STEPS}, name

        # job A's topology pointed at job B's actors: refused by name, not served B's data
        stray = RemoteConstructors(dataclasses.replace(topo["job-a"], namespace="job-b"), fault_tolerance=FT)
        with pytest.raises(JobMismatchError, match=rf"data service '{topo['job-b'].job}' refuses a request from a "
                                                   rf"client of '{topo['job-a'].job}'"):
            stray.get(STEPS, 0, 0)
        with pytest.raises(ConfigError, match=rf"`data.ray.namespace` 'job-a' is in use by the running data service "
                                              rf"'{topo['job-a'].job}'"):
            DataService(cfgs["job-a"], tree, progress=None).start()

        services.pop("job-b").stop()  # B goes; A goes on, unharmed by the refused client and the refused start
        assert steps_of(clients["job-a"], topo["job-a"], [STEPS, STEPS + 1]) == \
            {k: v for k, v in want["job-a"].items() if k[1] >= STEPS}
    finally:
        for svc in services.values():
            svc.stop()
