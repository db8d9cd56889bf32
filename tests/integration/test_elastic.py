"""Elastic resharding on a real local Ray with torchrun gloo ranks: DP 2 -> 1 -> 2, each sample once.

Three jobs consume the same data stream under different layouts. Between jobs the service
is stopped (what its constructors had prefetched is dropped) and a new one starts from the
Planner state saved at the step the job reached, re-stamped for the new layout
(``DataService.start(state=..., reshard=True)``). The global batch is kept (DP x
microbatches constant, as Megatron's GBS = DP x MBS x m), so every step must hold exactly
the samples it holds in a run that never changed layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ResumeError
from megascale_data_ext.runtime.config import RayConfig, ServiceConfig
from megascale_data_ext.runtime.elastic import step_of_position
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.sources.demo_data import make_demo_data
from tests.dist.launch import run_torchrun
from tests.integration.conftest import shared_ray

pytestmark = pytest.mark.slow
STEPS, SAMPLES = 3, 8
PHASES = ((2, 4), (1, 8), (2, 4))  # (dp, num_microbatches): dp x m stays 8 (2 ranks at most: import time)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = make_demo_data(tmp_path_factory.mktemp("elastic"), seed=4, rows=80, text_sources=2, image_sources=0,
                         megatron_source=False)
    return [dataclasses.replace(s, truncate=True) for s in out]


def config(specs, m: int, namespace: str) -> ServiceConfig:
    return ServiceConfig(sources=specs, seed=13, samples_per_step=SAMPLES, num_microbatches=m, seq_length=1024,
                         strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=32,
                         ray=RayConfig(namespace=namespace))


def rank_main(argv: list[str]) -> None:
    """One torchrun rank (this file run as a script): gloo + Megatron parallel_state, a Client
    resumed at the saved data position, STEPS steps consumed, then its records and position."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megascale_data_ext.patches.cpu import apply_cpu_shims
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.runtime.remote import RemoteConstructors, fetch_topology

    address, namespace, m, out = argv[0], argv[1], int(argv[2]), Path(argv[3])
    position = json.loads(argv[4])
    dist.init_process_group("gloo")
    apply_cpu_shims()
    parallel_state.initialize_model_parallel()
    rank, tree = dist.get_rank(), ClientPlaceTree.from_megatron()
    shared = [fetch_topology(address, namespace) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    assert shared[0].tree.layout() == tree.layout(), (shared[0].tree.layout(), tree.layout())
    client = Client(shared[0], rank, source=RemoteConstructors(shared[0], address), num_microbatches=m)
    client.load_state_dict({**client.state_dict(), **position})  # the saved position, this job's fingerprint
    steps = []
    for _ in range(STEPS):
        step = client.step
        batches = list(client.step_iterator())
        infos = client.drain()["delivered"]
        steps.append({"step": step, "samples": [i["samples"].tolist() for i in infos], "tokens": [
            int(b["tokens"].numel()) for b in batches]})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": steps, "position": client.state_dict()}))
    dist.barrier()
    dist.destroy_process_group()


def job(handles, out: Path, dp: int, m: int, position: dict) -> dict[int, dict]:
    pos = json.dumps({"step": position["step"], "microbatch": position["microbatch"]})
    run_torchrun(Path(__file__), dp, [handles.address, handles.namespace, m, out, pos], env=handles.ray_env,
                 timeout=540, preloaded=True)
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_dp2_to_dp1_to_dp2_delivers_each_sample_exactly_once(specs, tmp_path):
    shared_ray()
    delivered: dict[int, list[tuple[int, int]]] = {}  # step -> (source, position) over every rank
    state, position = None, {"step": 0, "microbatch": 0}
    for phase, (dp, m) in enumerate(PHASES):
        svc = DataService(config(specs, m, f"elastic{phase}"), ClientPlaceTree.from_sizes(dp=dp), progress=None)
        handles = svc.start(state=state, reshard=True)
        start = step_of_position(position)
        try:
            logs = job(handles, tmp_path / f"phase{phase}", dp, m, position)
            state = svc.state_dict(start + STEPS)  # the planner before the next job's first step
        finally:
            svc.stop()
        assert sorted(logs) == list(range(dp))
        for log in logs.values():
            for entry in log["steps"]:
                delivered.setdefault(entry["step"], []).extend(
                    (s, p) for mb in entry["samples"] for s, p, _ in mb)
        position = logs[0]["position"]  # the trainer's saved data position (Client.state_dict)
        assert all(log["position"]["step"] == start + STEPS for log in logs.values())
    keys = [k for step in sorted(delivered) for k in delivered[step]]
    assert sorted(delivered) == list(range(len(PHASES) * STEPS))
    assert len(keys) == len(set(keys))  # nothing twice
    for s in range(len(specs)):  # nothing skipped: every stream is consumed as a prefix
        pos = sorted(p for src, p in keys if src == s)
        assert pos == list(range(len(pos)))
    ref = InProcessService(config(specs, 4, "ref"), ClientPlaceTree.from_sizes(dp=2))
    for step, got in delivered.items():  # the same samples per step as a run that never resharded
        plan = ref.planner.plan(step)
        assert sorted(got) == sorted(zip(plan.source.tolist(), plan.position.tolist(), strict=True))


def test_elastic_resume_refuses_a_change_of_data_and_a_mid_step_position(specs):
    from megascale_data_ext.runtime.elastic import reshard_planner_state

    a = InProcessService(config(specs, 2, "a"), ClientPlaceTree.from_sizes(dp=4)).planner
    b = InProcessService(dataclasses.replace(config(specs, 4, "b"), seed=14), ClientPlaceTree.from_sizes(dp=2)).planner
    a.plan(1)
    with pytest.raises(ResumeError, match="`seed` \\(saved 13, now 14\\)"):
        reshard_planner_state(a.state_dict(2), b.fingerprint())
    with pytest.raises(ResumeError, match="step boundary"):
        step_of_position({"step": 3, "microbatch": 1})


if __name__ == "__main__":
    import sys

    rank_main(sys.argv[1:])
