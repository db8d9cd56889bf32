"""Replay mode: plans written by `megascale-data plan` are served instead of planned, with an
identical delivered stream; replaying under another config, layout or past the end is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext import ClientPlaceTree, InProcessService
from megascale_data_ext.cli import main
from megascale_data_ext.dataplane.plan_store import PlanStore
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.sources.demo_data import make_demo_data
from tests.harness import check_save_load


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    make_demo_data(out, seed=2, rows=40, image_rows=16, max_image_patches=64)
    return out


def overrides(data_dir, *extra):
    return ["sources=demo_text", f"data.data_root={data_dir}", "data.samples_per_step=12", "data.seq_length=1024",
            "data.num_microbatches=2", "parallel.tensor_model_parallel_size=2",
            "parallel.pipeline_model_parallel_size=1", *extra]


def live_service(data_dir, *extra, replay_dir=None, world_size=4):
    from megascale_data_ext.config import compose_config, load_config

    cfg = compose_config(overrides(data_dir, *extra))
    service_cfg = dataclasses.replace(load_config(cfg.data).to_service_config(), replay_dir=replay_dir)
    tree = ClientPlaceTree.from_sizes(tp=2, world_size=world_size)
    return InProcessService(service_cfg, tree)


def delivered(svc, steps):
    out = []
    for step in steps:
        for rank in svc.topology.fetch_ranks():
            for j in range(svc.config.num_microbatches):
                batch, info = svc.get(step, j, rank)
                out.append((rank, info["samples"].tolist(), batch["tokens"].tolist()))
    return out


def test_replayed_plans_deliver_the_same_stream(data_dir, tmp_path, capsys):
    plans = tmp_path / "plans"
    assert main(["plan", *overrides(data_dir), "--steps", "5", "--out", str(plans), "--world-size", "4"]) == 0
    assert "wrote 5 plans" in capsys.readouterr().out
    assert PlanStore(plans).num_steps == 5 and sorted(p.name for p in plans.glob("step_*.npz"))[-1] == "step_00000004.npz"
    live, replay = live_service(data_dir), live_service(data_dir, replay_dir=str(plans))
    for step in range(5):
        a, b = live.planner.plan(step), replay.planner.plan(step)
        for field in ("source", "position", "index", "tokens", "cost", "bucket", "microbatch"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert (a.fetch_ranks, a.bucket_ranks, a.cap) == (b.fetch_ranks, b.bucket_ranks, b.cap)
    assert delivered(replay, range(5)) == delivered(live_service(data_dir), range(5))
    with pytest.raises(ConfigError, match=r"steps 0..4, step 5 was asked"):
        replay.planner.plan(5)
    # a replaying planner resumes like a live one (its state is the same schema)
    check_save_load(lambda: live_service(data_dir, replay_dir=str(plans)).planner,
                    lambda p, i: p.plan(i).position, steps=5, resume_at=[0, 3])


def test_replay_refuses_plans_of_another_config_or_layout(data_dir, tmp_path):
    plans = tmp_path / "plans"
    assert main(["plan", *overrides(data_dir), "--steps", "2", "--out", str(plans), "--world-size", "4"]) == 0
    with pytest.raises(ConfigError, match=r"`seed`: planned with 1234, now 99.*megascale-data plan"):
        live_service(data_dir, "data.seed=99", replay_dir=str(plans))
    with pytest.raises(ConfigError, match=r"`world`: planned with"):
        live_service(data_dir, replay_dir=str(plans), world_size=8)
    with pytest.raises(ConfigError, match="manifest.json is missing"):
        live_service(data_dir, replay_dir=str(tmp_path / "nothing"))


def test_plan_refuses_a_bad_out_or_step_count_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write plans to '.*notes.txt' \(File exists\): name a directory"):
        PlanStore.create(tmp_path / "notes.txt", {})
    assert main(["plan", "--steps", "0", "--out", str(tmp_path / "p"), "--world-size", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --steps must be >= 1, got 0"


def test_a_service_checks_its_plans_before_starting_and_asks_for_nothing_past_them(data_dir, tmp_path):
    """`DataService` checks the plans when it is made (in the trainer's process, one named error
    rather than one per actor) and stamps how many steps they cover: its constructors prefetch
    and its clients ask ahead no further (a healthy run of exactly those steps logs no error)."""
    from megascale_data_ext.runtime.constructor import DataConstructor
    from megascale_data_ext.runtime.service import DataService

    plans = tmp_path / "plans"
    assert main(["plan", *overrides(data_dir), "--steps", "3", "--out", str(plans), "--world-size", "4"]) == 0
    config = live_service(data_dir, replay_dir=str(plans)).config
    with pytest.raises(ConfigError, match=r"`world`: planned with"):
        DataService(config, ClientPlaceTree.from_sizes(tp=2, world_size=8), progress=None)
    topology = DataService(config, ClientPlaceTree.from_sizes(tp=2, world_size=4), progress=None).topology
    assert topology.replay_steps == 3
    made = DataConstructor([0], config, topology, get_plans=None, fetch=None, pad_id=0, max_lead=8)
    assert [made.plannable(s) for s in range(5)] == [True, True, True, False, False]
