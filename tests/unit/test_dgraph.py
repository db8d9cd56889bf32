"""DGraph primitives, strategies and StepPlan views over simulated worlds (no Ray, no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.dgraph import DGraph
from megascale_data_ext.dataplane.mixing import ConstantSchedule, Mixer
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.strategies import LLMBalance, Vanilla, build_strategy
from megascale_data_ext.dataplane.summary import BufferSummary, SourceSummary
from megascale_data_ext.errors import ConfigError, PlanError


def make_summary(seed: int = 0, sizes=(200, 150, 100), images: bool = True) -> BufferSummary:
    rng = np.random.default_rng(seed)
    parts = []
    for s, n in enumerate(sizes):
        text = np.where(rng.random(n) < 0.05, rng.integers(300, 900, n), rng.integers(4, 64, n))
        nimg = rng.integers(0, 3, n) if images and s == 0 else np.zeros(n, np.int64)
        offs = np.concatenate([[0], np.cumsum(nimg)])
        parts.append(SourceSummary(source=s, name=f"src{s}", positions=np.arange(n), indices=rng.permutation(n),
                                   text_tokens=text, image_offsets=offs,
                                   image_patch_counts=rng.integers(16, 200, int(offs[-1]))))
    return BufferSummary.of(parts)


def mixed(tree, step=0, batch=96, weights=(0.5, 0.3, 0.2), summary=None) -> DGraph:
    summary = summary or make_summary()
    mixer = Mixer(ConstantSchedule(list(weights)), summary.names, seed=7)
    return DGraph.from_summary(summary, tree, step=step).mix(mixer, batch_size=batch)


TREE = ClientPlaceTree.from_sizes(tp=2, pp=2, dp=4)


def test_mix_takes_stream_heads_in_mixer_counts():
    g = mixed(TREE)
    src, pos = g.cols["source"], g.cols["position"]
    counts = np.bincount(src, minlength=3)
    assert counts.sum() == 96 and counts.tolist() == [48, 29, 19]
    for s in range(3):  # each source contributes its next samples in stream order, once
        assert sorted(pos[src == s].tolist()) == list(range(counts[s]))


def test_llm_balance_plan_accounts_every_sample_once_and_respects_cap():
    plan = LLMBalance(num_microbatches=3, cap=4096, model="gpt-tiny")(mixed(TREE)).plan()
    assert plan.num_buckets == 4 and plan.num_samples == 96
    keys = set(zip(plan.source.tolist(), plan.position.tolist(), strict=True))
    assert len(keys) == 96
    assert plan.bin_tokens().max() <= 4096
    assert set(plan.microbatch.tolist()) <= {0, 1, 2}
    # loader and constructor views partition the same set
    via_loaders = {(s, int(p)) for s in range(3) for p in plan.loader_do_plan(s).positions}
    via_constructors = {(r.source, r.position) for b in range(4)
                        for mb in plan.constructor_do_plan(b).microbatches for r in mb}
    assert via_loaders == via_constructors == keys
    # TP0 of first and last PP stage of every DP rank fetch; nobody else
    ends = (0, TREE.pp - 1)
    assert plan.fetch_ranks == tuple(r for r in range(TREE.world_size)
                                     if TREE.coords(r)["tp"] == 0 and TREE.coords(r)["pp"] in ends)


def test_balanced_beats_vanilla_on_the_same_samples():
    cost = "llama-12b"
    van = Vanilla(num_microbatches=2, model=cost)(mixed(TREE)).plan()
    bal = LLMBalance(num_microbatches=2, cap=None, model=cost, level="inter")(mixed(TREE)).plan()
    same = lambda p: sorted(zip(p.source.tolist(), p.position.tolist(), strict=True))  # noqa: E731
    assert same(van) == same(bal)
    assert bal.imbalance() < van.imbalance()
    assert bal.imbalance() <= 1.05
    assert van.vanilla_imbalance() == pytest.approx(van.imbalance())


def test_keep_order_keeps_global_batch_order_inside_microbatches():
    plan = LLMBalance(num_microbatches=2, cap=8192, model="gpt-tiny", keep_order=True)(mixed(TREE)).plan()
    for b in range(plan.num_buckets):
        for j in range(plan.num_microbatches):
            rows = np.flatnonzero((plan.bucket == b) & (plan.microbatch == j))
            assert np.all(np.diff(rows) > 0)


def test_vlm_balance_assigns_every_image_to_a_world_bucket():
    g = mixed(TREE)
    n_images = int(g.cols["num_images"].sum())
    plan = build_strategy("vlm_balance", num_microbatches=2, cap=8192, model="gpt-tiny", encoder_model="vit-1b")(g).plan()
    enc = plan.encoder
    assert enc is not None and enc.num_buckets == TREE.world_size
    assert len(enc.bucket) == n_images
    pairs = set(zip(enc.sample.tolist(), enc.image.tolist(), strict=True))
    assert len(pairs) == n_images
    ec = enc.bucket_costs()
    assert ec.max() / ec.mean() < 1.5


def test_group_size_balances_within_subgroups():
    tree = ClientPlaceTree.from_sizes(dp=8)
    plan = LLMBalance(num_microbatches=2, cap=None, model="gpt-tiny", group_size=2, level="inter")(
        mixed(tree, batch=160, summary=make_summary(sizes=(400, 300, 200)))).plan()
    assert plan.num_buckets == 8
    assert plan.imbalance() < 1.1


def test_errors_name_the_problem():
    with pytest.raises(ConfigError, match="known strategies"):
        build_strategy("nope")
    summary = make_summary(sizes=(10, 10, 10))
    with pytest.raises(PlanError, match="src0.*buffer"):
        mixed(TREE, batch=96, summary=summary)
    with pytest.raises(PlanError, match="distribute"):
        mixed(TREE).balance("kk")


def test_inspection_dot_and_str():
    g = LLMBalance(num_microbatches=2, cap=8192, model="gpt-tiny")(mixed(TREE))
    text = str(g)
    assert "mix(" in text and "distribute(axis='DP'" in text and "balance('kk'" in text
    dot = g.to_dot()
    assert dot.startswith("digraph") and "src0 -> b" in dot and "clients 0,1,8,9" in dot
    small = g.to_dot(per_sample=True)
    assert small.count("shape=ellipse") == len(g)


def test_strategies_resolve_cost_models_when_built_and_declare_axis_and_broadcast():
    with pytest.raises(ConfigError, match=r"unknown cost model 'no-such-model'; known: \['tokens', .*'llama-12b'"):
        LLMBalance(num_microbatches=2, model="no-such-model")
    with pytest.raises(ConfigError, match="unknown cost model 'nope'"):
        build_strategy("vlm_balance", num_microbatches=2, encoder_model="nope")
    assert LLMBalance(num_microbatches=2, model="tokens")(mixed(TREE)).plan().num_samples == 96
    vanilla = Vanilla(num_microbatches=2)
    assert (vanilla.axis, vanilla.broadcast) == ("DP", ("tp",))
    vlm = build_strategy("vlm_balance", num_microbatches=2, model="gpt-tiny", axis="WORLD", broadcast=())
    assert (vlm.axis, vlm.broadcast) == ("WORLD", ())


def test_serving_by_bucket_index_equals_scanning_every_row():
    """`bucket_rows` / `encoder_images_of` / `source_rows` (indexes built once per plan) give what
    scanning all rows per bucket or source gives, and so the constructors' and loaders' views; the
    indexes are not shipped."""
    import pickle

    from megascale_data_ext.runtime.constructor import encoder_rows

    for seed, dp in ((0, 4), (1, 8), (2, 1)):
        tree = ClientPlaceTree.from_sizes(tp=1, pp=2, dp=dp)
        g = mixed(tree, batch=200, summary=make_summary(seed, sizes=(300, 200, 150)))
        plan = build_strategy("vlm_balance", num_microbatches=3, cap=8192, model="gpt-tiny",
                              encoder_model="vit-1b")(g).plan()
        image_bucket = plan.bucket[plan.encoder.sample]
        for b in range(dp):
            np.testing.assert_array_equal(plan.bucket_rows(b), np.flatnonzero(plan.bucket == b))
            np.testing.assert_array_equal(plan.encoder_images_of([b]), np.flatnonzero(image_bucket == b))
        group = [dp - 1, 0] if dp > 1 else [0]
        np.testing.assert_array_equal(plan.encoder_images_of(group), np.flatnonzero(np.isin(image_bucket, group)))
        rows = encoder_rows(plan, group)
        assert rows.rank.tolist() == plan.encoder.bucket[np.isin(image_bucket, group)].tolist()
        for s in range(len(plan.source_names) + 1):  # one past the last: no rows
            np.testing.assert_array_equal(plan.source_rows(s), np.flatnonzero(plan.source == s))
        views = plan.loader_do_plans([2, 0, 2])
        assert sorted(views) == [s for s in (0, 2) if (plan.source == s).any()]
        for s, view in views.items():
            rows = np.flatnonzero(plan.source == s)
            rows = rows[np.argsort(plan.position[rows], kind="stable")]
            np.testing.assert_array_equal(view.positions, plan.position[rows])
            np.testing.assert_array_equal(view.bucket, plan.bucket[rows])
            np.testing.assert_array_equal(plan.loader_do_plan(s).indices, plan.index[rows])
        shipped = pickle.loads(pickle.dumps(plan))
        assert plan._by_bucket is not None and shipped._by_bucket is None and shipped._images_by_bucket is None
        assert plan._by_source is not None and shipped._by_source is None
        np.testing.assert_array_equal(shipped.bucket_rows(0), plan.bucket_rows(0))


def test_mix_takes_each_sources_stream_heads_with_one_sort_as_a_scan_per_source_would():
    """`mix` picks, for the slots of source s in the mixer's order, s's lowest-position buffer rows in
    position order (ties by row): the per-source scan it replaced is the reference, on buffers in
    stream order, shuffled, with repeated positions, sources the mixer does not know, empty counts."""
    from megascale_data_ext.dataplane.dgraph import _stream_heads

    def scan(src, position, counts, order):
        picked = np.empty(len(order), dtype=np.int64)
        for s, n in enumerate(counts.tolist()):
            rows = np.flatnonzero(src == s)
            picked[order == s] = rows[np.argsort(position[rows], kind="stable")][:n]
        return picked

    rng = np.random.default_rng(3)
    for trial in range(600):
        k, extra = int(rng.integers(1, 12)), int(rng.integers(0, 3))
        sizes = rng.integers(0, 30, k + extra)
        src = np.repeat(np.arange(k + extra), sizes).astype(np.int32)
        kind = trial % 3  # stream order, a shuffled stream, repeated positions
        position = np.concatenate([np.arange(h) if kind == 0 else rng.permutation(h) if kind == 1
                                   else rng.integers(0, 5, h) for h in sizes]).astype(np.int64)
        if trial % 4 == 0:  # rows not grouped by source
            p = rng.permutation(len(src))
            src, position = src[p], position[p]
        held = np.bincount(src, minlength=k)
        counts = np.array([int(rng.integers(0, h + 1)) for h in held[:k]], dtype=np.int64)
        order = rng.permutation(np.repeat(np.arange(k), counts)).astype(np.int64)
        np.testing.assert_array_equal(_stream_heads(src, position, held, counts, order, "m"),
                                      scan(src, position, counts, order), err_msg=f"trial {trial}")
    with pytest.raises(PlanError, match="order\\(\\) must hold each source"):
        _stream_heads(src, position, held, counts + 1, order, "MyMixer")


def test_buffer_columns_of_many_sources_match_each_sources_own_summary():
    """The graph builds its columns for all sources at once; per source they are what its summary says
    (empty sources, sources without images and ragged image counts included)."""
    rng = np.random.default_rng(5)
    parts = []
    for s in range(40):
        n = int(rng.integers(0, 12)) if s % 7 else 0
        nimg = rng.integers(0, 3, n) if s % 3 else np.zeros(n, np.int64)
        offs = np.concatenate([[0], np.cumsum(nimg)])
        parts.append(SourceSummary(source=s, name=f"s{s}", positions=np.arange(n) + 3, indices=rng.permutation(n),
                                   text_tokens=rng.integers(1, 50, n), image_offsets=offs,
                                   image_patch_counts=rng.integers(1, 100, int(offs[-1]))))
    g = DGraph.from_summary(BufferSummary.of(parts), TREE, step=0)
    for p in parts:
        rows = np.flatnonzero(g.cols["source"] == p.source)
        np.testing.assert_array_equal(g.cols["position"][rows], p.positions)
        np.testing.assert_array_equal(g.cols["image_patches"][rows], p.image_patches_total())
        np.testing.assert_array_equal(g.cols["num_images"][rows], np.diff(p.image_offsets))
        got = [g.image_patch_counts[g.image_offsets[r]:g.image_offsets[r + 1]] for r in rows.tolist()]
        want = [p.image_patch_counts[p.image_offsets[i]:p.image_offsets[i + 1]] for i in range(len(p))]
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert g.cols["source"].dtype == np.int32 and len(g) == sum(len(p) for p in parts)


def test_a_summary_window_equals_the_checked_summary_of_its_slice():
    """`window` skips the checks a slice of a checked summary cannot fail; what it returns is what the
    checked constructor makes of the same slice (ragged images, none, extra columns, past the end)."""
    rng = np.random.default_rng(9)
    for trial in range(50):
        n = int(rng.integers(0, 40))
        images = rng.integers(0, 4, n) * (trial % 2)
        offsets = np.concatenate(([0], np.cumsum(images)))
        full = SourceSummary(source=3, name="s", positions=np.arange(n) + 100, indices=rng.permutation(n),
                             text_tokens=rng.integers(1, 99, n), image_offsets=offsets,
                             image_patch_counts=rng.integers(1, 50, int(offsets[-1])),
                             extra={"w": rng.random(n)} if trial % 3 else {})
        start, k = int(rng.integers(0, n + 1)), int(rng.integers(0, 20))
        got, stop = full.window(start, k), min(start + k, n)
        off = full.image_offsets[start:stop + 1]
        want = SourceSummary(source=3, name="s", positions=full.positions[start:stop],
                             indices=full.indices[start:stop], text_tokens=full.text_tokens[start:stop],
                             image_offsets=off - off[0], image_patch_counts=full.image_patch_counts[off[0]:off[-1]],
                             extra={key: v[start:stop] for key, v in full.extra.items()})
        for field in ("positions", "indices", "text_tokens", "image_offsets", "image_patch_counts"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=f"{trial} {field}")
            assert getattr(got, field).dtype == np.int64
        assert got.extra.keys() == want.extra.keys() and (got.source, got.name) == (3, "s")
        np.testing.assert_array_equal(got.seq_lengths(), want.seq_lengths())
