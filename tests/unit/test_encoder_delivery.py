"""Encoder delivery of the hybrid (VLM, Alg. 2) strategy, wired in one process: every image of a
step reaches exactly one encoder rank over WORLD, as planned, and only there: the union of the
ranks' encoder images is exactly the images whose placeholders the step's microbatches hold, and
no microbatch carries patches (each image travels once)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.tokenizer import ByteTokenizer

VLM_ARGS = {"model": "gpt-tiny", "encoder_model": "vit-1b", "encoder_axis": "WORLD", "axis": "DP"}


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    specs = make_demo_data(tmp_path_factory.mktemp("demo"), seed=5, rows=60, image_rows=60, text_sources=1,
                           image_sources=2, megatron_rows=0)
    specs = [s for s in specs if s.format != "megatron"]
    return [dataclasses.replace(s, truncate=True) for s in specs]


def wire(specs, tree, *, strategy="vlm_balance", args=VLM_ARGS, group=1, **overrides):
    kwargs = dict(sources=specs, seed=7, samples_per_step=16, num_microbatches=2, seq_length=4096,
                  strategy=strategy, strategy_args=dict(args), buffer_size=64, constructor_group=group)
    kwargs.update(overrides)
    svc = InProcessService(ServiceConfig(**kwargs), tree)
    return svc.config, svc.planner, svc.constructors


def encoder_share(cons, step, rank):
    parts = [c.get_encoder_images(step, rank) for c in cons]
    return (np.concatenate([p for p, _, _ in parts]), np.concatenate([s for _, s, _ in parts]),
            np.concatenate([k for _, _, k in parts]))


def packed_images(tree, cons, step):
    """{key: patch count} of the images in the step's packed microbatches (first-stage fetchers),
    which carry no patches: those go to encoder ranks only."""
    out = {}
    layout = tree.buckets("DP")
    for rank in Distribution().fetch_ranks(tree):
        if tree.coords(rank)["pp"] != 0:
            continue
        c = next(c for c in cons if layout.bucket_of_rank(rank) in c.buckets)
        for j in range(c.config.num_microbatches):
            batch, info = c.get(step, j, rank)
            keys = info["image_keys"]
            assert "images" not in batch and len(keys) == len(batch["image_seqlens"])
            assert int((batch["tokens"] == ByteTokenizer().image_id).sum()) == int(batch["image_seqlens"].sum())
            for key, n in zip(map(tuple, keys.tolist()), batch["image_seqlens"].tolist(), strict=True):
                assert key not in out
                out[key] = int(n)
    return out


@pytest.mark.parametrize("sizes,group", [({"tp": 2, "pp": 2, "dp": 2}, 1), ({"dp": 4}, 2), ({"pp": 2, "dp": 2}, 2)])
def test_each_image_goes_to_exactly_one_encoder_rank_and_matches_the_packed_batches(specs, sizes, group):
    tree = ClientPlaceTree.from_sizes(**sizes)
    cfg, planner, cons = wire(specs, tree, group=group)
    for step in range(3):
        plan = planner.plan(step)
        enc = plan.encoder
        assert enc is not None and enc.num_buckets == tree.world_size
        shares = {r: encoder_share(cons, step, r) for r in range(tree.world_size)}
        packed = packed_images(tree, cons, step)
        delivered = Counter()
        for r, (patches, seqlens, keys) in shares.items():
            assert patches.shape == (int(seqlens.sum()), 768) and len(keys) == len(seqlens)
            want = {(int(plan.source[s]), int(plan.position[s]), int(k)): int(n)
                    for s, k, n, b in zip(enc.sample, enc.image, enc.patches, enc.bucket, strict=True) if b == r}
            got = {tuple(k): int(n) for k, n in zip(keys.tolist(), seqlens.tolist(), strict=True)}
            assert got == want  # exactly the planned images of this encoder rank, with their patch counts
            for key, n in zip(map(tuple, keys.tolist()), seqlens.tolist(), strict=True):
                delivered[key] += 1
                assert packed[key] == n  # the placeholders the microbatch left for it
        assert set(delivered) == set(packed) and set(delivered.values()) == {1}
        assert len(delivered) == len(enc.sample) > 0
        # every rank took its share: no encoder images held (pp 1's microbatches are not taken here)
        assert all(("images",) not in keys for c in cons for keys in c.untaken(step).values())
        assert any(c.untaken(step) for c in cons) == (tree.pp > 1)


def test_encoder_images_no_rank_asks_for_are_let_go_and_a_late_ask_is_refused(specs):
    tree = ClientPlaceTree.from_sizes(dp=2)
    cfg, _, cons = wire(specs, tree)
    for step in range(12):  # a GPT-only loop never asks for encoder images
        for rank in Distribution().fetch_ranks(tree):
            for j in range(cfg.num_microbatches):
                cons[rank].get(step, j, rank)
    # rank 0 moved on (its own constructor released its shares); rank 1 never asked constructor 0
    # for anything, so its shares there go a few steps behind: only the newest steps are held
    kept = max(4, 2 * cfg.prefetch + 2)
    assert all(c.buffered_steps() <= kept + 1 for c in cons)
    with pytest.raises(PlanError, match="released"):
        cons[0].get_encoder_images(0, 0)
    _, _, text_cons = wire(specs, tree, strategy="llm_balance", args={"model": "gpt-tiny"})
    with pytest.raises(PlanError, match="vlm_balance"):
        text_cons[0].get_encoder_images(0, 0)
