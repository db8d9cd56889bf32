"""examples/pretrain_gpt.py under torchrun on gloo with Megatron's parallel_state: trains through
the real schedule (TP2·PP2, PP2 with VPP), and resumes bit-exactly from its own checkpoint.

Every run of this module joins one local Ray (``data.ray.address``, a namespace per run) instead
of starting and stopping an embedded one, and starts its ranks through ``tests/dist/lazy_compile.py``.
An example's embedded Ray is run by test_example_app and test_vlm_example, its plain start-up (no
lazy_compile) by test_example_app.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import ray

from tests.dist import launch
from tests.integration.conftest import shared_ray

pytestmark = pytest.mark.slow
RUNS = itertools.count()  # each run's own Ray namespace: a stopped run's actor names are not reused


@pytest.fixture(scope="module")
def ray_cluster():
    """(address, env) of a local Ray the example's rank 0 joins; the RAY_AUTH_* env lets it in."""
    shared_ray()
    yield ray.get_runtime_context().gcs_address, {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH_")}


@pytest.fixture
def run_example(data_root, ray_cluster):
    address, env = ray_cluster

    def run(log_dir: Path, *overrides: str, nproc: int = 4) -> dict[int, list[dict]]:
        ray_args = (f"data.ray.address={address}", f"data.ray.namespace=examples{next(RUNS)}")
        return launch.run_example("pretrain_gpt.py", data_root, log_dir, *ray_args, *overrides, nproc=nproc, env=env,
                                  preloaded=True)[1]

    return run


def test_resume_from_checkpoint_continues_the_exact_stream(run_example, tmp_path):
    """The uninterrupted run checkpoints at steps 2 and 4; the resumed run starts from the step-2
    checkpoint as a job killed during step 2 or 3 leaves it (`latest` = 2) and must continue that
    run's stream and losses. (A mid-run `state_dict(step)` of the live planner leaving the stream as
    a never-saved run's is asserted by test_elastic against an in-process reference.)"""
    layout = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
              "data.samples_per_step=16", "train.eval_interval=2"]  # validation on the held-out valid-text
    ckpt, killed = tmp_path / "ckpt", tmp_path / "killed"
    full = run_example(tmp_path / "full", *layout, "train.train_iters=4", f"train.save={ckpt}", "train.save_interval=2")
    assert (ckpt / "latest").read_text() == "4"
    shutil.copytree(ckpt / "step_0000002", killed / "step_0000002")
    (killed / "latest").write_text("2")
    resumed = run_example(tmp_path / "resumed", *layout, "train.train_iters=4", f"train.load={killed}")
    assert sorted(resumed) == sorted(full) == [0, 1, 2, 3]
    for rank, log in resumed.items():
        assert [s["step"] for s in log] == [2, 3]
        for got, want in zip(log, full[rank][2:], strict=True):
            assert got["digests"] == want["digests"]  # bit-identical batches
            assert got["samples"] == want["samples"]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
    # The validation stream resumes where the interrupted run's was: the evaluation after step 4
    # reads validation step 1 (step 0 was the evaluation after step 2) in both runs.
    for rank, log in resumed.items():
        assert [("valid" in s) for s in full[rank]] == [False, True, False, True]
        got, want = log[-1]["valid"], full[rank][-1]["valid"]
        assert got["steps"] == want["steps"] == [1, 2]
        assert got["samples"] == want["samples"] and got["samples"] != full[rank][1]["valid"]["samples"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)


def test_gpt_example_trains_at_tp2_pp2_and_with_vpp(run_example, tmp_path):
    logs = run_example(tmp_path / "tp2pp2", "train.train_iters=3")
    losses = [s["loss"] for s in logs[0]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    for rank in (1, 3):  # TP rank 1 received exactly what TP rank 0 fetched
        assert [s["digests"] for s in logs[rank]] == [s["digests"] for s in logs[rank - 1]]
    vpp = run_example(tmp_path / "vpp", "parallel.tensor_model_parallel_size=1",  # one pipeline: 2 ranks
                      "parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
                      "model.num_layers=4", "train.train_iters=2", nproc=2)
    assert all(np.isfinite(s["loss"]) for s in vpp[0])
    assert [s["samples"] for s in vpp[0]] == [s["samples"] for s in vpp[1]]  # both stages, the same samples


def test_gpt_example_pp4_middle_stages_train_with_document_masks(run_example, tmp_path):
    logs = run_example(tmp_path / "pp4", "parallel.tensor_model_parallel_size=1",
                       "parallel.pipeline_model_parallel_size=4", "model.num_layers=4", "train.train_iters=2")
    assert all(np.isfinite(s["loss"]) for s in logs[0])
    for rank in (1, 2):  # middle stages received one (mask-only) microbatch per schedule slot
        assert all(len(s["digests"]) == len(logs[0][i]["digests"]) for i, s in enumerate(logs[rank]))


def test_loss_driven_mixing_end_to_end(run_example, tmp_path):
    """Feedback mixing through the real example: the hooks report each step's per-source loss
    from the last pipeline stage, and the Planner applies step k's report exactly at k + delay."""
    ckpt = tmp_path / "ckpt"
    logs = run_example(tmp_path / "fb", "parallel.tensor_model_parallel_size=1",  # one pipeline: 2 ranks
                       "parallel.pipeline_model_parallel_size=2", "data.samples_per_step=16", "train.train_iters=4",
                       "data.mixing.type=feedback", "+data.mixing.params.base_weights=[1,1,1,1]",
                       "+data.mixing.params.delay=2", "+data.mixing.params.lr=0.5", f"train.save={ckpt}",
                       "train.save_interval=4", nproc=2)
    assert all(np.isfinite(s["loss"]) for s in logs[0])
    import json

    state = json.loads((ckpt / "step_0000004" / "data_state.json").read_text())
    schedule = state["mixer"]["schedule"]
    assert schedule["last_step"] == 1 and schedule["num_reports"] == 2  # steps 0, 1 applied (planning 2, 3)
    assert [k for k, _ in state["reports"]] == [2, 3]  # reported, to be applied when planning steps 4 and 5
    for _, losses in state["reports"]:
        assert any(v is not None and 0 < v < 20 for v in losses)
    assert schedule["weights"] != [0.25] * 4  # the mixture moved with the reported losses


def test_hybrid_cp_example_trains_each_sample_once_to_the_fixed_cp_losses(run_example, tmp_path):
    """strategy=hybrid_cp at PP 2 x CP 2 through megatron-core's 1F1B schedule: each document its own
    group of the 2 DP x CP ranks of a stage (short ones whole on one), each rank its own number of
    microbatches; the same steps' samples as the fixed-CP run of llm_balance, each once, and with a
    per-token loss the same losses; a resume from its checkpoint continues the same stream. (DP 2 x
    CP 2, groups of 4, runs in-process in test_hybrid_cp_service and on the trainer in
    test_megatron_cpu.)"""
    layout = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
              "parallel.context_parallel_size=2", "train.per_token_loss=true", "data.seq_length=512",
              "data.samples_per_step=12", "data.num_microbatches=8", "train.train_iters=3"]
    ckpt = tmp_path / "ckpt"
    hybrid = run_example(tmp_path / "hybrid", *layout, "strategy=hybrid_cp", f"train.save={ckpt}",
                         "train.save_interval=2")
    fixed = run_example(tmp_path / "fixed", *layout)
    for step in range(3):
        got = [tuple(k) for rank in (0, 1) for mb in hybrid[rank][step]["samples"] for k in mb]  # stage 0
        assert len(got) == len(set(got)) == 12  # every sample of the step once over the stage's ranks
        want = {tuple(k) for mb in fixed[0][step]["samples"] for k in mb}  # the CP rank 0 of stage 0
        assert set(got) == want
        assert hybrid[0][step]["loss"] == pytest.approx(fixed[0][step]["loss"], rel=1e-4)
        for rank in (0, 1):  # each stage-1 rank ran its pipeline's microbatches
            assert len(hybrid[rank + 2][step]["digests"]) == len(hybrid[rank][step]["digests"])
    counts = {rank: [len(s["digests"]) for s in log] for rank, log in hybrid.items()}
    assert counts[0] != counts[1]  # the two ranks of a stage ran different numbers of microbatches
    # Resumed from its step-2 checkpoint, each rank gets step 2's microbatches again, bit for bit.
    resumed = run_example(tmp_path / "resumed", *layout, "strategy=hybrid_cp", f"train.load={ckpt}")
    for rank, log in resumed.items():
        assert [s["step"] for s in log] == [2]
        assert log[0]["digests"] == hybrid[rank][2]["digests"] and log[0]["samples"] == hybrid[rank][2]["samples"]
        assert log[0]["loss"] == pytest.approx(hybrid[rank][2]["loss"], rel=1e-6, abs=1e-7)
