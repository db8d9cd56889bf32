"""Synthetic workloads: the skew statistics quoted in the paper, determinism, clipping, filling."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.workloads import fill_workload, generate_workload, workload_names
from megascale_data_ext.errors import ConfigError


@pytest.fixture(scope="module")
def coyo():
    return generate_workload("coyo", 100_000, seed=3)


def test_coyo_text_skew_matches_paper(coyo) -> None:
    t = coyo.text_tokens
    assert (t <= 64).mean() == pytest.approx(0.9823, abs=0.003)  # paper: 98.23% <= 64 tokens
    assert (t > 64).mean() == pytest.approx(0.0162, abs=0.003)  # paper: top 1.62% ...
    assert t[t > 64].sum() / t.sum() == pytest.approx(0.093, abs=0.01)  # ... carry 9.3% of tokens


def test_coyo_images_are_skewed_likewise(coyo) -> None:
    p = coyo.image_patch_counts
    assert coyo.num_images == coyo.num_samples and coyo.patch_size == 16
    top = p > np.quantile(p, 0.983)
    assert 0.06 < p[top].sum() / p.sum() < 0.15  # the top ~1.7% images carry ~10% of patches
    assert p.max() >= 30 * 30 and p.min() >= 16
    assert set(np.unique(coyo.source)) == set(range(5))


def test_navit_shape() -> None:
    nv = generate_workload("navit", 50_000, seed=1)
    coyo_text = generate_workload("coyo", 50_000, seed=1).text_tokens
    assert nv.num_sources == 306 and nv.patch_size == 14
    assert np.unique(nv.source).size > 250
    assert nv.text_tokens.mean() > 4 * coyo_text.mean()  # longer texts than coyo
    per = nv.images_per_sample()
    assert (per > 1).mean() > 0.1 and (per == 0).any()  # several images sometimes, text-only sometimes
    assert nv.image_patch_counts.max() <= 73 * 73
    assert nv.image_offsets[-1] == nv.num_images and nv.image_offsets.shape == (nv.num_samples + 1,)


def test_long_short_mixture() -> None:
    ls = generate_workload("long-short", 50_000, seed=2, context=8192)
    t = ls.text_tokens
    assert ls.num_images == 0 and t.max() <= 8192
    long = t >= 2048
    assert 0.02 < long.mean() < 0.06  # a few very long documents ...
    assert t[long].sum() / t.sum() > 0.2  # ... that carry a large share of the tokens
    assert np.median(t) < 500


@pytest.mark.parametrize("name", workload_names())
def test_deterministic_and_dtypes(name: str) -> None:
    a, b = generate_workload(name, 2000, seed=7), generate_workload(name, 2000, seed=7)
    np.testing.assert_array_equal(a.text_tokens, b.text_tokens)
    np.testing.assert_array_equal(a.image_patch_counts, b.image_patch_counts)
    assert not np.array_equal(a.text_tokens, generate_workload(name, 2000, seed=8).text_tokens)
    assert a.source.dtype == np.int32 and a.text_tokens.dtype == np.int64
    assert a.image_offsets.dtype == np.int64 and a.image_patch_counts.dtype == np.int64


@pytest.mark.parametrize("name", workload_names())
@pytest.mark.parametrize("context", [4096, 32768])
def test_clip_and_fill(name: str, context: int) -> None:
    clipped = generate_workload(name, 5000, seed=0, context=context).clip(context)
    assert clipped.seq_lens().max() <= context
    assert np.all(clipped.image_patch_counts >= 1)
    target = 8 * 4 * context
    wl = fill_workload(name, target, seed=0, context=context)
    total = int(wl.seq_lens().sum())
    assert total <= target and total > target - context
    np.testing.assert_array_equal(wl.image_sample_index().shape, (wl.num_images,))


def test_unknown_workload() -> None:
    with pytest.raises(ConfigError, match=r"unknown workload 'laion'; known workloads: \['coyo', 'navit', 'long-short', 'long-tail'\]"):
        generate_workload("laion", 10)


def test_megatron_windows_cut_the_concatenated_stream_at_every_seq_length() -> None:
    from megascale_data_ext.dataplane.workloads import megatron_windows

    # documents 5, 3, 10, 2, 1 -> one stream of 21 tokens in windows of 4
    assert megatron_windows([5, 3, 10, 2, 1], 4, 6) == [[4], [1, 3], [4], [4], [2, 2], [1]]
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 3000, 400)
    windows = megatron_windows(lens, 1024, 100)
    assert all(sum(w) == 1024 for w in windows)  # every window full while the documents last
    flat = np.array([p for w in windows for p in w])
    # pieces rebuild the documents in order: a document split at an edge continues in the next window
    ends = np.cumsum(lens)
    cut = np.cumsum(flat)
    assert set(ends[ends <= 100 * 1024].tolist()) <= set(cut.tolist())
