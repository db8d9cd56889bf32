"""Token-budget steps (``tokens_per_step``): the pool's pieces, the Planner's full microbatches
under the cap, exact accounting of carried documents, the mixture, resume and config errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascale_data_ext.dataplane.mixing import ConstantSchedule, Mixer
from megascale_data_ext.dataplane.mixing.budget import Pool, draw_size, fill_rooms, offer_prefix
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.sources.demo_data import make_demo_data


def test_pool_chops_long_text_into_windows_and_keeps_images_whole():
    pool = Pool.of([[0, 5, 50, 0, 700, []], [1, 2, 20, 100, 90, []], [2, 0, 9, 0, 400, [64, 64]]])
    pieces = pool.chop(256)
    assert pieces.start.tolist() == [0, 256, 512, 100, 0] and pieces.length.tolist() == [256, 256, 188, 90, 400]
    assert pieces.position.tolist() == [5, 5, 5, 2, 0] and pieces.patches[-1] == (64, 64)
    assert pieces.seq_len.tolist()[-1] == 528 and not pieces.splittable[-1]
    assert Pool.of(pool.rows()).rows() == pool.rows()  # the carry's row form round-trips


def test_fill_rooms_whole_first_then_heads_within_budget():
    room = np.array([100, 30, 0])
    whole = fill_rooms(room, np.array([120, 25, 60]), np.ones(3, bool), budget=1000, split=False)
    assert [(p.row, p.bin, p.length) for p in whole] == [(2, 0, 60), (1, 1, 25)]  # best fit; 120 fits nowhere
    split = fill_rooms(room, np.array([120, 25, 60]), np.ones(3, bool), budget=1000, split=True)
    assert sum(p.length for p in split) == 130  # every room full
    heads = [(p.row, p.bin, p.start, p.length) for p in split if p.row == 0]
    assert heads == [(0, 0, 0, 40), (0, 1, 40, 5)]  # roomiest bin first; the rest (75) stays in the pool
    capped = fill_rooms(room, np.array([120]), np.ones(1, bool), budget=40, split=True)
    assert sum(p.length for p in capped) == 40
    assert offer_prefix(np.array([10, 20, 30]), 35) == 2


def test_draw_size_is_the_fewest_mixed_documents_reaching_the_tokens():
    mixer = Mixer(ConstantSchedule([1.0, 1.0]), ["a", "b"], seed=0)
    lengths = [np.full(50, 10), np.full(50, 30)]
    n = draw_size(lambda b: mixer.preview(0, b), lengths, 200)
    assert n == 10  # 5 + 5 documents: 50 + 150 tokens
    assert mixer.preview(0, n).tolist() == [5, 5] and mixer.next_step is None  # preview takes nothing
    assert mixer.counts(0, n).tolist() == [5, 5]
    with pytest.raises(Exception, match="buffer_size"):
        draw_size(lambda b: mixer.preview(1, b), [np.full(3, 10), np.full(3, 10)], 10_000)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    specs = make_demo_data(tmp_path_factory.mktemp("tokens"), seed=7, rows=300, image_rows=0, text_sources=2,
                           image_sources=0, megatron_rows=200)
    return [dataclasses.replace(s, truncate=True) for s in specs]


def service(specs, tree=None, **kw):
    args = dict(sources=specs, seed=2, num_microbatches=4, seq_length=512, strategy="llm_balance",
                strategy_args={"model": "gpt-tiny"}, buffer_size=512, tokens_per_step=2 * 4 * 512,
                with_attention_mask=False)
    args.update(kw)
    return InProcessService(ServiceConfig(**args), tree or ClientPlaceTree.from_sizes(dp=2))


def test_steps_fill_microbatches_under_the_cap_and_carry_loses_nothing(specs):
    L = 2048
    svc = service(specs, seq_length=L, tokens_per_step=2 * 4 * L)
    steps, capacity = 8, 2 * 4 * L
    plans = [svc.planner.plan(s) for s in range(steps)]
    bins = np.stack([p.bin_tokens() for p in plans])
    assert bins.max() <= L  # the cap holds
    assert bins.sum() / (steps * capacity) >= 0.97  # whole documents (no split) of long-short text
    assert max(p.imbalance() for p in plans) < 1.5  # still balanced by the strategy
    placed = [(int(s), int(p)) for plan in plans for s, p in zip(plan.source, plan.position, strict=True)]
    carried = [(s, p) for s, p, *_ in svc.planner.carry]
    assert len(placed) == len(set(placed))  # no document placed twice
    drawn = {(s, p) for s in range(len(specs)) for p in range(int(svc.planner.cursors[s]))}
    assert set(placed) | set(carried) == drawn and not set(placed) & set(carried)
    # the mixture follows the weights over what was drawn (exact within one document per source)
    target = np.asarray([s.weight for s in specs], float)
    share = svc.planner.cursors / svc.planner.cursors.sum()
    assert np.allclose(share, target / target.sum(), atol=2 / svc.planner.cursors.sum() + 0.01)
    # what the constructors pack is what was planned
    batch, info = svc.get(0, 0, 0)
    assert int(batch["num_tokens"][0]) == int(plans[0].bin_tokens()[0, 0])


def test_split_mode_fills_every_microbatch_and_resume_recomputes_the_same_plans(specs):
    tree = ClientPlaceTree.from_sizes(dp=2)
    longer = [dataclasses.replace(s, truncate=False) for s in specs]
    full = service(longer, tree, split_documents=True)
    plans = [full.planner.plan(s) for s in range(6)]
    assert all((p.bin_tokens() == 512).all() for p in plans)
    half = service(longer, tree, split_documents=True)
    half.planner.plan(2)
    state = half.planner.state_dict(3)
    again = service(longer, tree, split_documents=True)
    again.planner.load_state_dict(state)
    for s in range(3, 6):
        a, b = plans[s], again.planner.plan(s)
        for col in ("source", "position", "span_start", "span_stop", "bucket", "microbatch"):
            np.testing.assert_array_equal(getattr(a, col), getattr(b, col))


def test_config_errors_name_the_keys(specs):
    with pytest.raises(ConfigError, match="tokens_per_step.*>= seq_length"):
        ServiceConfig(sources=specs, seq_length=512, tokens_per_step=100)
    with pytest.raises(ConfigError, match="split_documents.*tokens_per_step"):
        ServiceConfig(sources=specs, split_documents=True)
    with pytest.raises(ConfigError, match="tokens_per_step.*vanilla"):
        ServiceConfig(sources=specs, strategy="vanilla", tokens_per_step=4096)
    with pytest.raises(ConfigError, match="tokens_per_step.*replay"):
        ServiceConfig(sources=specs, tokens_per_step=4096, replay_dir="plans")
    with pytest.raises(ConfigError, match="`tokens_per_step` = 999999 exceeds"):
        service(specs, tokens_per_step=999_999)
    kept = ServiceConfig(sources=[dataclasses.replace(s, max_tokens=None) for s in specs], seq_length=512,
                         tokens_per_step=4096, split_documents=True)
    assert all(s.max_tokens is None for s in kept.sources)  # split, not truncated
    assert ServiceConfig(sources=specs, tokens_per_step=4096).fingerprint()["tokens_per_step"] == 4096


def test_image_samples_stay_whole_and_reach_the_encoder(tmp_path):
    specs = [s for s in make_demo_data(tmp_path, seed=3, rows=120, image_rows=60, text_sources=1, image_sources=1,
                                       megatron_rows=0) if s.format != "megatron"]
    svc = service([dataclasses.replace(s, truncate=True) for s in specs], num_microbatches=2, seq_length=4096,
                  tokens_per_step=2 * 2 * 4096, split_documents=True, strategy="vlm_balance")
    image_source = next(i for i, s in enumerate(specs) if s.image_column)
    for step in range(3):
        plan = svc.planner.plan(step)
        assert (plan.bin_tokens() == 4096).all()  # text fills around the images
        rows = np.flatnonzero(plan.source == image_source)
        assert (plan.span_start[rows] == 0).all()  # an image sample is never split
        assert set(np.unique(plan.encoder.sample).tolist()) <= set(rows.tolist())
        with_images = set(rows[plan.tokens[rows] > plan.span_stop[rows]].tolist())  # rows carrying patches
        assert with_images <= set(plan.encoder.sample.tolist())  # every image is encoded by some rank


def test_fresh_draws_take_each_sources_next_samples_in_mixing_order():
    """`_fresh` gives slot i of the mixer's order the next unused sample of its source (its stream heads
    in order, images along), as a scan of the order per source did, at 200 sources of which most draw nothing."""
    from megascale_data_ext.dataplane.summary import SourceSummary
    from megascale_data_ext.runtime.token_budget import _fresh

    rng = np.random.default_rng(2)
    k = 200
    counts = np.where(rng.random(k) < 0.2, rng.integers(1, 6, k), 0)
    order = rng.permutation(np.repeat(np.arange(k), counts))
    summaries = []
    for s in range(k):
        n = int(counts[s]) + int(rng.integers(0, 3))
        nimg = rng.integers(0, 3, n) if s % 2 else np.zeros(n, np.int64)
        offs = np.concatenate([[0], np.cumsum(nimg)])
        summaries.append(SourceSummary(source=s, name=f"s{s}", positions=np.arange(n) + 10 * s,
                                       indices=rng.permutation(n), text_tokens=rng.integers(1, 99, n),
                                       image_offsets=offs, image_patch_counts=rng.integers(1, 50, int(offs[-1]))))
    pool = _fresh(summaries, counts, order)
    seen = np.zeros(k, dtype=np.int64)
    for i, s in enumerate(order.tolist()):
        j, summ = int(seen[s]), summaries[s]
        seen[s] += 1
        assert (pool.source[i], pool.position[i], pool.index[i], pool.length[i]) == (
            s, summ.positions[j], summ.indices[j], summ.text_tokens[j])
        assert pool.patches[i] == tuple(summ.image_patch_counts[summ.image_offsets[j]:summ.image_offsets[j + 1]])
