"""`megascale-data simulate`: the real Planner over simulated metadata-only loaders (64 GPUs, CP 2)."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np

import pytest

from megascale_data_ext.cli import main
from megascale_data_ext.commands import simulate as sim
from megascale_data_ext.dataplane.cp_slicing import slice_for_cp, thd_padded_length
from megascale_data_ext.dataplane.microbatch import fields_for_stage, without_patches
from megascale_data_ext.dataplane.packing import pack_microbatch
from megascale_data_ext.dataplane.placetree import ClientPlaceTree

GPUS = 64


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("simulate")
    a, b = tmp / "a.json", tmp / "b.json"
    assert main(["simulate", "--gpus", str(GPUS), "--quick", "--json", str(a)]) == 0
    assert main(["simulate", "--gpus", str(GPUS), "--quick", "--json", str(b)]) == 0
    return json.loads(a.read_text()), json.loads(b.read_text())


def test_selective_broadcast_fetches_once_per_reading_dp_stage_group(runs) -> None:
    (row,) = runs[0]["rows"]
    lay = row["layout"]
    assert row["gpus"] == GPUS and lay["cp"] == 2 and lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"] == GPUS
    tree = ClientPlaceTree.from_sizes(tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], dp=lay["dp"])
    reading = [tree.coords(r) for r in range(GPUS) if tree.coords(r)["pp"] in (0, lay["pp"] - 1)]
    dp_stage = {(c["dp"], c["pp"]) for c in reading}
    dp_cp_stage = {(c["dp"], c["cp"], c["pp"]) for c in reading}
    assert row["fetchers_selective"] < row["fetchers"]
    assert row["fetchers_selective"] == len(dp_stage) == lay["dp"] * 2
    assert row["fetchers"] == len(dp_cp_stage)
    for step in row["per_step"]:
        assert (step["fetchers"], step["fetchers_selective"]) == (row["fetchers"], row["fetchers_selective"])


def test_bytes_per_step_follow_the_byte_model_from_the_json_totals(runs) -> None:
    (row,) = runs[0]["rows"]
    cp, dp, pp = row["layout"]["cp"], row["layout"]["dp"], row["layout"]["pp"]
    d = 14 * 14 * 3  # navit-like patches are 14 px
    assert row["patch_dim"] == d and pp > 1 and row["reading_stages"] == 2

    def model(s: dict, copies: int) -> int:  # first: tokens+position_ids 16 B, last: labels+loss_mask 12 B
        segments = s["samples"] + s["microbatches"] + s["padded_microbatches"]  # cu_seqlens entries
        meta = 4 * segments + 4 * s["microbatches"] + (4 * segments if copies > 1 else 0)  # + cu_seqlens_padded
        positions = s["cp_positions"] if copies > 1 else s["positions"]  # CP slices pad every document
        return 28 * positions + copies * 2 * meta + copies * 4 * s["images"]  # image_seqlens; patches to encoders

    steps = row["per_step"]
    for s in steps:
        assert s["microbatches"] == dp * row["microbatches_per_dp"]
        assert s["tokens"] <= s["positions"] <= s["tokens"] + s["microbatches"] * 16 * cp
        assert s["samples"] + s["deferred"] == row["samples_per_step"] and sum(s["per_source"]) == s["samples"]
        assert s["bytes"]["total"] == model(s, cp)
        assert s["bytes_selective"]["total"] == model(s, 1)
    timed = steps[1:]
    assert row["tokens_per_step"] == pytest.approx(np.mean([s["tokens"] for s in timed]))
    assert row["bytes_per_step"] == pytest.approx(np.mean([model(s, cp) for s in timed]))
    assert row["bytes_per_step_selective"] == pytest.approx(np.mean([model(s, 1) for s in timed]))
    assert row["bytes_per_step_selective"] < row["bytes_per_step"]


def test_same_seed_gives_the_same_rows_except_measurements(runs) -> None:
    a, b = runs
    measured = set(a["measured_fields"])
    assert {"planner_s", "plan_call_s", "bench_balance_s"} <= measured
    strip = [{k: v for k, v in r.items() if k not in measured} for r in (a["rows"][0], b["rows"][0])]
    assert strip[0] == strip[1]
    assert a["rows"][0]["planner_s"] > 0 and a["rows"][0]["paper_s"] is None  # no Table 2 figure at 64 GPUs


def test_simulated_source_is_a_pure_function_of_seed_source_and_position() -> None:
    src = sim.SimulatedSource(1, "navit-1", seed=7, block=64)
    wide, part = src.summary(0, 300), sim.SimulatedSource(1, "navit-1", seed=7, block=64).summary(100, 150)
    np.testing.assert_array_equal(part.positions, np.arange(100, 250))
    np.testing.assert_array_equal(part.text_tokens, wide.text_tokens[100:250])
    np.testing.assert_array_equal(part.image_patches_total(), wide.image_patches_total()[100:250])
    assert (wide.text_tokens + wide.image_patches_total()).max() <= sim.CONTEXT
    other = sim.SimulatedSource(2, "navit-2", seed=7, block=64).summary(0, 300)
    assert not np.array_equal(other.text_tokens, wide.text_tokens)


@pytest.mark.parametrize("weights", [sim.WEIGHTS, (1.0,) * 120], ids=["4 sources", "120 sources"])
def test_every_source_position_is_planned_once_and_in_stream_order(weights) -> None:
    lay = sim.layout_for(GPUS)
    sources = sim.simulated_sources(0, weights)
    m = sim.microbatches_per_dp(sources, weights, sim.PER_GPU * lay.world // lay.dp)
    planner, _ = sim.build_planner(lay, sources, seed=0, broadcast=("tp", "cp"), num_microbatches=m, weights=weights)
    cursor = np.zeros(len(sources), dtype=np.int64)
    for step in range(3):
        plan = planner.plan(step)
        for s in range(len(sources)):
            pos = np.sort(plan.position[plan.source == s])
            np.testing.assert_array_equal(pos, np.arange(cursor[s], cursor[s] + len(pos)))  # each once, no gap
            cursor[s] += len(pos)
        assert plan.bucket.min() >= 0 and plan.bucket.max() < lay.dp and plan.microbatch.max() < m
        assert plan.bin_tokens().max() <= sim.CONTEXT
        # the byte model's first-stage/last-stage split against the runtime's own packing and CP slicing
        check_byte_model_against_packing(plan, lay, d=sources[0].patch_size ** 2 * 3)
    np.testing.assert_array_equal(planner.cursors, cursor)


def check_byte_model_against_packing(plan, lay: sim.Layout, *, d: int) -> None:
    enc = plan.encoder
    unit = sim.PAD_TO_MULTIPLE_OF * 2 * lay.cp
    got = {"tp": 0, "tp-cp": 0}
    totals = dict.fromkeys(("samples", "tokens", "positions", "cp_positions", "microbatches", "padded_microbatches",
                            "images", "image_patches"), 0)
    for j in range(2):  # two microbatches of bucket 0
        rows = np.flatnonzero((plan.bucket == 0) & (plan.microbatch == j))
        samples = []
        for r in rows.tolist():
            imgs = [np.zeros((int(p), d), np.float32) for p in enc.patches[enc.sample == r]]
            text = int(plan.tokens[r]) - sum(len(i) for i in imgs)
            samples.append({"tokens": np.arange(1, text + 1, dtype=np.int64), "images": imgs})
        batch = without_patches(pack_microbatch(samples, seq_length=sim.CONTEXT, pad_id=0, image_token_id=99,
                                                with_attention_mask=False, pad_to_multiple_of=unit,
                                                variable_length=True))  # as a constructor ships it
        for stage in (0, lay.pp - 1):
            got["tp-cp"] += sum(v.nbytes for v in fields_for_stage(batch, pp_rank=stage, pp_size=lay.pp).values())
            for c in range(lay.cp):
                part = slice_for_cp(batch, cp_size=lay.cp, cp_rank=c)
                got["tp"] += sum(v.nbytes for v in fields_for_stage(part, pp_rank=stage, pp_size=lay.pp).values())
        n_img = int(sum(len(s["images"]) for s in samples))
        real = int(plan.tokens[rows].sum())
        totals = {"samples": totals["samples"] + len(rows), "tokens": totals["tokens"] + real,
                  "positions": totals["positions"] + batch["tokens"].shape[1],
                  "cp_positions": totals["cp_positions"] + thd_padded_length(batch["cu_seqlens"], lay.cp),
                  "microbatches": totals["microbatches"] + 1,
                  "padded_microbatches": totals["padded_microbatches"] + int(batch["tokens"].shape[1] > real),
                  "images": totals["images"] + n_img,
                  "image_patches": totals["image_patches"] + int(sum(i.shape[0] for s in samples for i in s["images"]))}
    assert got["tp"] == sim.step_bytes(totals, pp=lay.pp, copies=lay.cp, stages=2, patch_dim=d)["total"]
    assert got["tp-cp"] == sim.step_bytes(totals, pp=lay.pp, copies=1, stages=2, patch_dim=d)["total"]


def test_sources_option_simulates_n_equal_sources(tmp_path, capsys) -> None:
    out = tmp_path / "many.json"
    assert main(["simulate", "--gpus", str(GPUS), "--quick", "--sources", "60", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["weights"] == [1.0] * 60
    for step in got["rows"][0]["per_step"]:
        counts = np.asarray(step["per_source"])
        assert len(counts) == 60 and counts.min() >= counts.max() - 1  # equal weights: within one sample
    capsys.readouterr()
    assert main(["simulate", "--gpus", str(GPUS), "--quick", "--sources", "0"]) == 2
    assert capsys.readouterr().err == "error: --sources 0: give at least 1 simulated source\n"


def test_rpc_cost_times_each_reply_size_and_counts_the_steps_calls() -> None:
    """`simulate` adds the Ray round trips of the calls a Planner actor answers per step (a local Ray)."""
    from megascale_data_ext.commands._plan_rpc import rpc_cost, start_ray

    layout, sources = sim.layout_for(GPUS), sim.simulated_sources(0)
    m = sim.microbatches_per_dp(sources, sim.WEIGHTS, sim.PER_GPU * layout.world // layout.dp)
    planner, _ = sim.build_planner(layout, sources, seed=0, broadcast=("tp",), num_microbatches=m,
                                   patch_size=sources[0].patch_size)
    plan, topology = planner.plan(0), planner.topology
    ray = start_ray()
    try:
        cost = rpc_cost(plan, topology, loader_actors=3)
    finally:
        ray.shutdown()
    # a loader actor asks for PLANS_AHEAD (4) steps' plans per call
    assert cost["rpc_calls_per_step"] == {"constructor_step": topology.num_constructors, "loader_plans": 0.75}
    assert all(t > 0 for t in cost["rpc_call_s"].values())
    one = len(pickle.dumps(plan.constructor_do_plan(topology.constructor_groups[0][0])))
    assert cost["rpc_reply_bytes"]["constructor_step"] >= one * len(topology.constructor_groups[0])
    want = sum(n * cost["rpc_call_s"][k] for k, n in cost["rpc_calls_per_step"].items())
    assert cost["rpc_per_step_s"] == pytest.approx(want)


@pytest.mark.parametrize("argv", [["simulate", "--gpus", "0"], ["bench", "faults", "--kills", "-1"],
                                  ["bench", "planner", "--repeats", "0"], ["bench", "soak", "--clients", "x"]])
def test_a_size_or_count_below_one_is_argparses_one_line_error(argv, capsys):
    """Sizes and counts are checked as they are parsed: exit 2, one line naming the flag (was a ZeroDivisionError
    from `simulate --gpus 0` and `bench faults --kills -1`, a silent 1 from `bench planner --repeats 0`)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(rf"error: argument {argv[-2]}: must be a positive integer, got '?{re.escape(argv[-1])}'?$",
                     capsys.readouterr().err.strip())


def test_demo_refuses_a_context_without_room_for_its_images_and_a_workdir_that_is_a_file(tmp_path, capsys):
    assert main(["demo", "--seq-length", "7"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --seq-length 7 leaves no room for text beside the demo's images "
                                               "(256 patches each): pass --seq-length 258 or more (default 1024)")
    (tmp_path / "f").write_text("x")
    assert main(["demo", "--workdir", str(tmp_path / "f")]) == 2
    assert "File exists; name a directory" in capsys.readouterr().err


def test_demo_refuses_a_layout_its_model_cannot_split_before_any_work(tmp_path, capsys):
    """Before the data, the service or torchrun: one line with the flags that fit (it used to start
    everything, then every rank printed a traceback)."""
    assert main(["demo", "--tp", "3", "--pp", "3", "--dp", "1", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the demo cannot start: --tp 3 does not divide the demo model's 4 attention heads: pass "
                   "--tp 1 or 2 or 4; --pp 3 does not divide the demo model's 4 layers: pass --pp 1 or 2 or 4")
    assert not (tmp_path / "w").exists()  # nothing was made
