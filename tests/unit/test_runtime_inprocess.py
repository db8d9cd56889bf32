"""Planner, Source Loader and Data Constructor logic wired in one process (their Ray façades
are exercised in tests/integration/test_service_ray.py): accounting, determinism, resume."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext.dataplane.cp_slicing import reassemble_cp
from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import CapacityError, ResumeError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.sources.demo_data import make_demo_data


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    specs = make_demo_data(tmp_path_factory.mktemp("demo"), seed=3, rows=120, image_rows=40, text_sources=2,
                           image_sources=1, megatron_rows=80)
    return [dataclasses.replace(s, truncate=True) for s in specs]


def wire(specs, tree, **overrides):
    kwargs = dict(sources=specs, seed=11, samples_per_step=24, num_microbatches=2, seq_length=4096,
                  strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64)
    kwargs.update(overrides)
    svc = InProcessService(ServiceConfig(**kwargs), tree)
    return svc.config, svc.loaders, svc.planner, svc.constructors


def consume(tree, cons, steps, start=0):
    """Every fetching rank takes every microbatch; returns {(step, rank): [sample keys]}."""
    out = {}
    layout = tree.buckets("DP")
    for step in range(start, start + steps):
        for rank in Distribution().fetch_ranks(tree):
            c = cons[layout.bucket_of_rank(rank)]
            keys = []
            for j in range(c.config.num_microbatches):
                batch, info = c.get(step, j, rank)
                keys += [tuple(k) for k in info["samples"].tolist()]
            out[(step, rank)] = (keys, batch)
    return out


@pytest.mark.parametrize("window", [0, 8], ids=["global-shuffle", "window-shuffle"])
def test_full_pass_delivers_each_sample_once_per_epoch(specs, window):
    tree = ClientPlaceTree.from_sizes(tp=2, pp=2, dp=2)
    cfg, loaders, planner, cons = wire([dataclasses.replace(s, shuffle_window=window) for s in specs], tree)
    steps = 12
    got = consume(tree, cons, steps)
    layout = tree.buckets("DP")
    per_dp: dict[int, list] = {}
    for (step, rank), (keys, _) in got.items():
        c = tree.coords(rank)
        if c["pp"] == 0:  # first stage's stream per DP rank
            per_dp.setdefault(layout.bucket_of_rank(rank), []).extend(keys)
        else:  # last stage sees the same samples as the first stage of its DP rank
            first = tree.rank_of(tp=0, cp=0, dp=c["dp"], pp=0)
            assert keys == got[(step, first)][0]
    all_keys = [k for keys in per_dp.values() for k in keys]
    assert len(all_keys) == len(set(all_keys)) == steps * cfg.samples_per_step  # none duplicated across DP
    for s, ld in enumerate(loaders):  # per source: positions 0..n-1 exactly, indices once per epoch
        pos = sorted(p for src, p, _ in all_keys if src == s)
        assert pos == list(range(len(pos)))
        idx = [i for src, p, i in sorted(all_keys) if src == s and p < ld.size]
        assert len(idx) == len(set(idx))


def test_same_seed_same_stream_other_seed_differs(specs):
    tree = ClientPlaceTree.from_sizes(dp=2)
    a = consume(tree, wire(specs, tree)[3], 3)
    b = consume(tree, wire(specs, tree)[3], 3)
    c = consume(tree, wire(specs, tree, seed=12)[3], 3)
    keys = lambda d: {k: v[0] for k, v in d.items()}  # noqa: E731
    assert keys(a) == keys(b)
    assert keys(a) != keys(c)


def test_resume_from_state_matches_uninterrupted(specs):
    tree = ClientPlaceTree.from_sizes(tp=2, dp=2)
    full = consume(tree, wire(specs, tree)[3], 6)
    _, _, planner, cons = wire(specs, tree)
    consume(tree, cons, 3)
    state = planner.state_dict(3)
    _, _, planner2, cons2 = wire(specs, tree)
    planner2.load_state_dict(state)
    resumed = consume(tree, cons2, 3, start=3)
    for key, (keys, batch) in resumed.items():
        assert keys == full[key][0]
        for field, value in batch.items():
            np.testing.assert_array_equal(value, full[key][1][field])


def test_resume_refuses_changed_config(specs):
    tree = ClientPlaceTree.from_sizes(dp=2)
    _, _, planner, _ = wire(specs, tree)
    planner.plan(1)
    state = planner.state_dict(1)
    _, _, other, _ = wire(specs, tree, samples_per_step=32)
    with pytest.raises(ResumeError, match="samples_per_step"):
        other.load_state_dict(state)
    _, _, moved, _ = wire(specs, ClientPlaceTree.from_sizes(dp=4))
    with pytest.raises(ResumeError, match="layout"):
        moved.load_state_dict(state)


def test_cp_slices_reassemble_the_packed_sequence(specs):
    tree = ClientPlaceTree.from_sizes(cp=2, dp=2)
    _, _, _, cons = wire(specs, tree)
    full = cons[0].packed(0, 0, 0)
    ranks = [tree.rank_of(cp=r, dp=0) for r in range(2)]
    slices = [cons[0].get(0, 0, r)[0] for r in ranks]
    again = reassemble_cp(slices, 2)
    for field in ("tokens", "labels", "loss_mask", "position_ids"):
        np.testing.assert_array_equal(again[field], full[field])


def test_overflowing_steps_defer_samples_without_losing_any(specs):
    """A batch larger than DP x m x seq_length: the planner defers what does not fit."""
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg, loaders, planner, cons = wire(specs, tree, samples_per_step=40, num_microbatches=1, seq_length=1024)
    got = consume(tree, cons, 6)
    keys = [k for (step, rank), (ks, _) in sorted(got.items()) for k in ks]
    assert len(keys) == len(set(keys))
    per_step = [planner.plan(s).num_samples for s in range(6)]
    assert max(per_step) < 40  # deferral happened
    for s in range(len(specs)):  # each source's stream stays a gap-free prefix
        pos = sorted(p for src, p, _ in keys if src == s)
        assert pos == list(range(len(pos)))
    assert all(planner.plan(s).bin_tokens().max() <= 1024 for s in range(6))
    _, _, strict, _ = wire(specs, tree, samples_per_step=40, num_microbatches=1, seq_length=1024, overflow="error")
    with pytest.raises(CapacityError, match="fits no bin"):
        strict.plan(0)


def test_bad_source_files_fail_at_start_naming_the_file(tmp_path, specs):
    from megascale_data_ext.errors import SourceError
    from megascale_data_ext.runtime.service import check_sources
    from megascale_data_ext.sources.base import SourceSpec

    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(SourceError, match="broken.parquet"):
        check_sources([*specs, SourceSpec(name="broken", format="parquet", paths=[str(bad)])])
    with pytest.raises(SourceError, match="nowhere"):
        check_sources([SourceSpec(name="gone", format="parquet", paths=[str(tmp_path / "nowhere.parquet")])])


def test_undecodable_images_are_skipped_counted_and_accounted(tmp_path, specs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megascale_data_ext.sources.base import SourceSpec
    from megascale_data_ext.sources.images import synthetic_jpeg

    n = 30
    images = [[b"\x00not an image"] if i % 10 == 3 else [synthetic_jpeg(48, 32, seed=i)] for i in range(n)]
    table = pa.table({"text": [f"caption {i}" for i in range(n)], "image": images})
    pq.write_table(table, tmp_path / "img.parquet")
    src = SourceSpec(name="shaky", format="parquet", paths=[str(tmp_path / "img.parquet")], image_column="image",
                     max_bad_fraction=0.5)
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg, loaders, planner, cons = wire([specs[0], src], tree, samples_per_step=12)
    got = consume(tree, cons, 4)
    delivered = {k for ks, _ in got.values() for k in ks}
    skipped = {(s, p) for c in cons for (_, s, p, _) in c.skipped}
    planned = {(int(s), int(p)) for step in range(4) for s, p in zip(planner.plan(step).source,
                                                                      planner.plan(step).position, strict=True)}
    assert skipped and all(s == 1 for s, _ in skipped)
    assert {(s, p) for s, p, _ in delivered} | skipped == planned  # none lost: delivered or counted as skipped
    assert not ({(s, p) for s, p, _ in delivered} & skipped)
    assert sum(ld.skipped_total for ld in loaders) == len(skipped)


def test_read_ahead_refills_without_reading_twice(specs):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg, loaders, planner, cons = wire(specs, tree)
    baseline = consume(tree, wire(specs, tree)[3], 3)
    for ld in loaders:
        assert ld.read_ahead(0) is True and ld.read_ahead(0) is False  # staged once
        ld.read_ahead(1)
    got = consume(tree, cons, 3)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in baseline.items()}
    planned = sum(planner.plan(s).num_samples for s in range(3))
    assert sum(ld.samples_read + ld.skipped_total for ld in loaders) == planned  # nothing read twice
    assert all(ld.read_ahead(0) is False for ld in loaders)  # a handed-out step is not read again
    assert all(ld.stats()["staged_steps"] == 0 for ld in loaders)  # nothing left staged


def test_middle_pipeline_stages_get_the_document_masks(specs):
    tree = ClientPlaceTree.from_sizes(pp=4, dp=2)
    cfg, _, _, cons = wire(specs, tree)
    assert cons[0].topology.fetch_ranks() == sorted(tree.rank_of(dp=d, pp=p) for d in range(2) for p in range(4))
    first, middle, last = (cons[0].get(0, 0, tree.rank_of(dp=0, pp=p))[0] for p in (0, 1, 3))
    assert set(middle) == {"attention_mask", "cu_seqlens", "max_seqlen"}
    for key in middle:
        np.testing.assert_array_equal(middle[key], first[key])
        np.testing.assert_array_equal(middle[key], last[key])
    _, _, _, ends_only = wire(specs, tree, middle_stage_masks=False)
    assert ends_only[0].topology.fetch_ranks() == sorted(tree.rank_of(dp=d, pp=p) for d in range(2) for p in (0, 3))


def test_one_client_per_rank_over_the_in_process_service(specs):
    """The trainer-side Client (the one hooks, provider and examples use) over InProcessService:
    each fetching rank gets exactly its constructor's microbatches, in order, as torch tensors."""
    from megascale_data_ext import Client, InProcessService

    tree = ClientPlaceTree.from_sizes(pp=2, dp=2)
    cfg = ServiceConfig(sources=specs, seed=11, samples_per_step=24, num_microbatches=2, seq_length=4096,
                        strategy="llm_balance", strategy_args={"model": "gpt-tiny"}, buffer_size=64)
    served, reference = InProcessService(cfg, tree), InProcessService(cfg, tree)
    clients = {r: Client(served.topology, r, source=served, num_microbatches=2, broadcast=False)
               for r in range(tree.world_size)}
    assert sorted(r for r, c in clients.items() if c.fetches) == served.topology.fetch_ranks() == [0, 1, 2, 3]
    for step in range(3):
        for rank, client in clients.items():
            for j in range(2):
                got = client.next_microbatch()
                want, info = reference.get(step, j, rank)
                assert client.last_info["samples"].tolist() == info["samples"].tolist()
                assert sorted(got) == sorted(want)
                for key in want:
                    np.testing.assert_array_equal(got[key].numpy(), want[key])
            assert (client.step, client.microbatch) == (step + 1, 0)


def test_a_microbatch_asked_for_again_after_delivery_is_refused_not_rebuilt_empty(specs):
    tree = ClientPlaceTree.from_sizes(dp=2)
    _, _, _, cons = wire(specs, tree)
    for j in range(2):
        cons[0].get(0, j, 0)  # rank 0 is bucket 0's only fetcher: step 0 is now fully delivered
    from megascale_data_ext.errors import PlanError

    with pytest.raises(PlanError, match="step 0 of constructor for buckets \\[0\\] was already taken by every consumer"):
        cons[0].get(0, 0, 0)


def test_an_adopted_cost_model_balances_the_steps_not_planned_yet_and_resumes_with_them(specs):
    """The running Planner re-costs with a fit (the trainer's online calibration): planned steps
    keep their plans, later ones are balanced under the fit, and a state saved after the adoption
    plans them alike, while one saved before it does not adopt it."""
    from megascale_data_ext.dataplane.calibration import CalibratedCost

    tree = ClientPlaceTree.from_sizes(dp=4)
    fit = CalibratedCost(fixed=0.03, linear=1e-6, quadratic=1e-6).to_dict()  # attention-bound: s² dominates

    def plans(planner, steps):
        return {s: (planner.plan(s).bucket.tolist(), planner.plan(s).microbatch.tolist()) for s in steps}

    _, _, reference, _ = wire(specs, tree)
    flops = plans(reference, range(8))
    _, _, planner, _ = wire(specs, tree)
    before = plans(planner, range(3))
    state_before = planner.state_dict(3)
    assert planner.adopt_cost_model(fit) == 3
    after = plans(planner, range(3, 8))
    assert before == {s: flops[s] for s in range(3)}  # already planned: unchanged
    assert after != {s: flops[s] for s in range(3, 8)}  # re-costed: other assignments
    state = planner.state_dict(5)
    assert state["cost_model"] == fit and state_before["cost_model"] is None
    _, _, resumed, _ = wire(specs, tree)
    resumed.load_state_dict(state)
    assert plans(resumed, range(5, 8)) == {s: after[s] for s in range(5, 8)}
    _, _, old, _ = wire(specs, tree)
    old.load_state_dict(state_before)
    assert plans(old, range(3, 8)) == {s: flops[s] for s in range(3, 8)}
    with pytest.raises(Exception, match="must be finite and >= 0"):
        planner.adopt_cost_model({**fit, "coefficients": {**fit["coefficients"], "linear_s_per_token": -1.0}})
