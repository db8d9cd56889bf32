"""Balancers: exact assignment accounting, caps, sizes, KK vs LPT, level semantics, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megascale_data_ext.dataplane.balancers import balance_step, get_balancer, partition, register_balancer, registry
from megascale_data_ext.dataplane.balancers.merge import merge_rows
from megascale_data_ext.dataplane.costs import TransformerCost
from megascale_data_ext.errors import ConfigError, PlanError

METHODS = ["greedy", "kk"]


def _loads(bins: np.ndarray, costs: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(bins, weights=costs, minlength=k)


def _heap_lpt(costs: np.ndarray, k: int) -> float:
    """Textbook LPT (reference): largest item to the least-loaded bin."""
    loads = np.zeros(k)
    for c in np.sort(costs)[::-1]:
        loads[np.argmin(loads)] += c
    return float(loads.max())


costs_st = st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=0, max_size=300).map(np.array)


@settings(max_examples=60, deadline=None)
@given(costs=costs_st, k=st.integers(1, 17), method=st.sampled_from(METHODS))
def test_every_item_once_in_a_valid_bin_and_deterministic(costs: np.ndarray, k: int, method: str) -> None:
    bins = partition(costs, k, method=method)
    assert bins.dtype == np.int64 and bins.shape == costs.shape
    assert np.all((bins >= 0) & (bins < k))
    np.testing.assert_array_equal(bins, partition(costs.copy(), k, method=method))
    if costs.size:  # within one item of the mean, as LPT guarantees
        assert _loads(bins, costs, k).max() <= costs.sum() / k + costs.max() + 1e-6 * costs.sum()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 100), min_size=1, max_size=200).map(lambda x: np.array(x, dtype=np.int64)),
    k=st.integers(1, 12),
    method=st.sampled_from(METHODS),
    slack=st.floats(1.3, 3.0),
)
def test_token_caps_are_respected(tokens: np.ndarray, k: int, method: str, slack: float) -> None:
    # feasible by construction: some bin always has <= the average, i.e. room for any item
    cap = int(np.ceil(slack * tokens.sum() / k)) + int(tokens.max())
    costs = tokens.astype(np.float64) ** 2
    bins = partition(costs, k, method=method, tokens=tokens, cap=cap)
    assert np.all((bins >= 0) & (bins < k))
    assert np.bincount(bins, weights=tokens, minlength=k).max() <= cap


@settings(max_examples=60, deadline=None)
@given(data=st.data(), k=st.integers(1, 9), method=st.sampled_from(METHODS))
def test_exact_sizes_are_respected(data: st.DataObject, k: int, method: str) -> None:
    sizes = np.array(data.draw(st.lists(st.integers(0, 12), min_size=k, max_size=k)), dtype=np.int64)
    costs = np.array(data.draw(st.lists(st.floats(0, 1e4), min_size=int(sizes.sum()), max_size=int(sizes.sum()))))
    bins = partition(costs, k, method=method, sizes=sizes)
    np.testing.assert_array_equal(np.bincount(bins, minlength=k), sizes)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(1.0, 1e4), min_size=1, max_size=200).map(np.array), k=st.integers(2, 12))
def test_kk_is_no_worse_than_greedy_by_more_than_ten_percent(costs: np.ndarray, k: int) -> None:
    kk_max = _loads(partition(costs, k, method="kk"), costs, k).max()
    greedy_max = _loads(partition(costs, k, method="greedy"), costs, k).max()
    assert kk_max <= greedy_max * 1.1 + 1e-9


def test_greedy_matches_textbook_lpt_on_skewed_data() -> None:
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0.0, 1.5, 3000)
    for k in (3, 16, 64):
        ours = _loads(partition(costs, k), costs, k).max()
        assert ours <= _heap_lpt(costs, k) * 1.01
        assert ours <= max(costs.sum() / k, costs.max()) * 1.02


def test_equal_sizes_balance_bins_into_buckets() -> None:
    rng = np.random.default_rng(1)
    bin_costs = rng.normal(100.0, 5.0, 9 * 300)
    for method in METHODS:
        buckets = partition(bin_costs, 9, method=method, sizes=[300] * 9)
        assert np.all(np.bincount(buckets, minlength=9) == 300)
        loads = _loads(buckets, bin_costs, 9)
        assert loads.max() - loads.min() <= bin_costs.max() - bin_costs.min()


def test_item_over_cap_names_item_tokens_and_cap() -> None:
    tokens = np.array([10, 20, 9000, 30])
    with pytest.raises(PlanError, match=r"item 2 has 9000 tokens but the per-bin token cap is 8192.*raise the cap"):
        partition(tokens.astype(float), 2, tokens=tokens, cap=8192)
    with pytest.raises(PlanError, match="item 2 has 9000 tokens"):
        balance_step(tokens.astype(float), tokens=tokens, num_buckets=2, num_microbatches=2, cap=8192)


def test_overfull_step_raises_plan_error() -> None:
    tokens = np.full(10, 60)
    with pytest.raises(PlanError, match="fits no bin.*add micro-batches"):
        partition(tokens.astype(float), 2, tokens=tokens, cap=100)


def test_unknown_method_and_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"unknown balancing method 'zigzag'; known methods: \['greedy', 'kk'"):
        partition(np.ones(3), 2, method="zigzag")
    with pytest.raises(ConfigError, match="unknown balance level"):
        balance_step(np.ones(3), tokens=None, num_buckets=1, num_microbatches=1, level="global")
    with pytest.raises(ConfigError, match="`sizes` must be 2 non-negative counts summing to 3"):
        partition(np.ones(3), 2, sizes=[1, 1])
    with pytest.raises(ConfigError, match="`cap` needs `tokens`"):
        partition(np.ones(3), 2, cap=5)
    with pytest.raises(ConfigError, match="finite and >= 0"):
        partition(np.array([1.0, -1.0]), 2)
    with pytest.raises(ConfigError, match="`groups` must partition buckets 0..3"):
        balance_step(np.ones(8), tokens=None, num_buckets=4, num_microbatches=1, groups=((0, 1), (1, 2)))


def test_register_custom_balancer() -> None:
    def round_robin(costs, k, *, tokens, cap, sizes):  # noqa: ANN001, ANN202
        return np.arange(costs.shape[0]) % k

    register_balancer("round-robin", round_robin)
    try:
        assert get_balancer("round-robin") is round_robin
        np.testing.assert_array_equal(partition(np.ones(5), 2, method="round-robin"), [0, 1, 0, 1, 0])
        res = balance_step(np.ones(8), tokens=None, num_buckets=2, num_microbatches=2, method="round-robin")
        assert np.all(res.bin_cost == 2.0)
    finally:
        registry._BALANCERS.pop("round-robin")


# ----------------------------------------------------------------------------- levels


def _batch(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.clip(rng.lognormal(5.5, 1.0, n), 16, 4096).astype(np.int64)
    return TransformerCost("llama-12b")(tokens), tokens


def test_level_none_is_contiguous_equal_count_split() -> None:
    costs, tokens = _batch(103)
    res = balance_step(costs, tokens=tokens, num_buckets=4, num_microbatches=3, level="none")
    idx = np.arange(103)
    for b, part in enumerate(np.array_split(idx, 4)):
        np.testing.assert_array_equal(np.flatnonzero(res.bucket == b), part)
        for j, mb in enumerate(np.array_split(part, 3)):
            np.testing.assert_array_equal(np.flatnonzero((res.bucket == b) & (res.microbatch == j)), mb)
    np.testing.assert_array_equal(res.order(), idx)


@pytest.mark.parametrize("level", ["inter", "intra", "interleaved"])
@pytest.mark.parametrize("method", METHODS)
def test_levels_keep_the_sample_set_and_respect_the_cap(level: str, method: str) -> None:
    costs, tokens = _batch()
    k, m = 4, 8
    cap = int(np.ceil(tokens.sum() / (k * m) / 0.8)) if level != "intra" else 4096 * 4
    res = balance_step(costs, tokens=tokens, num_buckets=k, num_microbatches=m, cap=cap, method=method, level=level)
    order = res.order()
    np.testing.assert_array_equal(np.sort(order), np.arange(costs.size))  # same set, each once
    assert res.bin_tokens.max() <= cap
    assert res.bin_cost.sum() == pytest.approx(costs.sum())
    np.testing.assert_allclose(res.bucket_cost, np.bincount(res.bucket, weights=costs, minlength=k))
    vanilla = balance_step(costs, tokens=tokens, num_buckets=k, num_microbatches=m, level="none")
    if level != "intra":  # intra keeps vanilla bucket membership
        assert res.bucket_cost.max() < vanilla.bucket_cost.max()
        assert res.bucket_cost.max() <= max(costs.sum() / k, costs.max()) * 1.03
    if level == "inter":  # micro-batches are contiguous in sample order inside each bucket
        for b in range(k):
            mbs = res.microbatch[res.bucket == b]
            assert np.all(np.diff(mbs) >= 0)


def test_keep_order_keeps_original_order_inside_each_microbatch() -> None:
    costs, tokens = _batch()
    kept = balance_step(costs, tokens=tokens, num_buckets=4, num_microbatches=4, cap=16384, keep_order=True)
    free = balance_step(costs, tokens=tokens, num_buckets=4, num_microbatches=4, cap=16384, keep_order=False)
    np.testing.assert_array_equal(kept.bucket, free.bucket)
    for b in range(4):
        for j in range(4):
            mb = kept.members(b, j)
            assert np.all(np.diff(mb) > 0)
            assert np.all(np.diff(costs[free.members(b, j)]) <= 0) or free.members(b, j).size == 0
    # interleaved + keep_order: micro-batches of a bucket follow the stream (first samples ascending)
    for b in range(4):
        firsts = [kept.members(b, j)[0] for j in range(4) if kept.members(b, j).size]
        assert firsts == sorted(firsts)


@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (3, 1, 2, 2)])
def test_groups_keep_every_sample_and_balance_across_groups(sizes: tuple[int, ...]) -> None:
    costs, tokens = _batch(500)
    ids = np.arange(8)
    groups = tuple(tuple(int(x) for x in g) for g in np.split(ids, np.cumsum(sizes)[:-1]))
    res = balance_step(costs, tokens=tokens, num_buckets=8, num_microbatches=4, cap=16384, method="greedy",
                       groups=groups)
    np.testing.assert_array_equal(np.sort(res.order()), np.arange(500))
    assert res.bin_tokens.max() <= 16384
    # Buckets are balanced across groups too (super-buckets weighted by group size).
    assert res.bucket_cost.max() <= max(costs.sum() / 8, costs.max()) * 1.05


def test_empty_batch_and_more_bins_than_items() -> None:
    for method in METHODS:
        res = balance_step(np.zeros(0), tokens=np.zeros(0, dtype=np.int64), num_buckets=3, num_microbatches=2,
                           cap=10, method=method)
        assert res.bucket.shape == (0,) and res.bin_cost.shape == (3, 2)
        res = balance_step(np.ones(4), tokens=np.ones(4, dtype=np.int64), num_buckets=3, num_microbatches=2,
                           cap=10, method=method)
        assert sorted(res.order().tolist()) == [0, 1, 2, 3]
        assert res.bin_cost.max() == 1.0


@settings(max_examples=60, deadline=None)
@given(r=st.integers(1, 40), k=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_merge_rows_keeps_one_cell_per_slot_and_the_spread_of_the_widest_row(r: int, k: int, seed: int) -> None:
    rows = -np.sort(-np.random.default_rng(seed).random((r, k)), axis=1)  # odd r exercises the pass-through
    slots = merge_rows(rows)
    assert slots.shape == (r, k)
    assert all(np.array_equal(np.sort(s), np.arange(k)) for s in slots)
    loads = np.zeros(k)
    for row, s in zip(rows, slots):
        loads[s] += row
    assert loads.max() - loads.min() <= (rows[:, 0] - rows[:, -1]).max() + 1e-9


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.0])
def test_many_small_items_fill_to_within_one_tail_item(sigma: float) -> None:
    """Uncapped greedy on 25k items into 288 bins (the sorted head + multi-pass water-fill path)."""
    costs = np.random.default_rng(2).lognormal(0.0, sigma, 25_000)
    bins = partition(costs, 288)
    loads = _loads(bins, costs, 288)
    mean = costs.sum() / 288
    assert loads.max() <= max(mean, costs.max()) + np.median(costs)  # over by at most a small item
    assert loads.max() <= _heap_lpt(costs, 288) * 1.005


def test_interleaved_cell_sums_equal_the_samples_they_hold() -> None:
    """The (bucket, micro-batch) sums come from the packer's running loads: check them exactly."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(16, 1024, 3000)  # ~80% of 240 × 8192 tokens
    costs = TransformerCost("llama-12b")(tokens)
    res = balance_step(costs, tokens=tokens, num_buckets=6, num_microbatches=40, cap=8192, method="greedy")
    flat = res.bucket * 40 + res.microbatch
    np.testing.assert_array_equal(res.bin_tokens.reshape(-1), np.bincount(flat, weights=tokens, minlength=240))
    np.testing.assert_allclose(res.bin_cost.reshape(-1), np.bincount(flat, weights=costs, minlength=240), rtol=1e-12)
    assert res.bin_tokens.max() <= 8192


def test_first_fit_in_order_cuts_like_the_sample_by_sample_loop() -> None:
    """The cap re-cut of level='inter' searches the running sum once per microbatch; it must put
    every sample where the sample-by-sample first fit does, and refuse the same buckets."""
    from megascale_data_ext.dataplane.balancers.levels import _first_fit_in_order

    def loop(t, cap, m):
        out, j, used = np.empty(len(t), np.int64), 0, 0
        for p in range(len(t)):
            if used + t[p] > cap:
                j, used = j + 1, 0
            if j >= m:
                return None
            out[p], used = j, used + int(t[p])
        return out

    rng, cut = np.random.default_rng(0), 0
    for _ in range(3000):
        t, cap, m = rng.integers(0, 60, size=rng.integers(1, 30)), float(rng.integers(1, 50)), int(rng.integers(1, 12))
        want = loop(t, cap, m)
        if want is None:
            with pytest.raises(PlanError, match="cannot be cut in order"):
                _first_fit_in_order(t, cap, m, 0)
        else:
            np.testing.assert_array_equal(_first_fit_in_order(t, cap, m, 0), want)
            cut += 1
    assert cut > 300  # both branches ran


def test_kk_small_bin_path_equals_the_numpy_merge(monkeypatch):
    """`karmarkar_karp._kk_merge_all_lists` (k <= SMALL_K) gives the numpy merge's bins exactly, ties included."""
    from megascale_data_ext.dataplane.balancers import karmarkar_karp as kk_mod

    rng = np.random.default_rng(7)
    for trial in range(150):
        k, n = int(rng.integers(2, kk_mod.SMALL_K + 1)), int(rng.integers(1, 200))
        costs = [rng.random(n) * 100, rng.integers(1, 4, n).astype(float)][trial % 2]  # the second: many ties
        sizes = np.full(k, n // k) if n >= k and trial % 4 == 1 else None
        if sizes is not None:
            costs = costs[: k * (n // k)]
        monkeypatch.setattr(kk_mod, "SMALL_K", 0)
        ref = kk_mod.kk(costs, k, sizes=sizes)
        monkeypatch.setattr(kk_mod, "SMALL_K", 32)
        assert np.array_equal(kk_mod.kk(costs, k, sizes=sizes), ref), (trial, k, n)


def test_kk_merge_resolving_slots_at_the_end_equals_merging_the_items():
    """The numpy merge keeps only each merge's slot permutation and resolves the leaves' slots at the
    end; the list merge carries items and slots through every merge. Same items, same order (sums over
    them follow it), same slots, at k above SMALL_K, for head tuples (one item each) and BLDM chunks."""
    from megascale_data_ext.dataplane.balancers import karmarkar_karp as kk_mod

    rng = np.random.default_rng(11)
    for trial in range(60):
        k = int(rng.integers(kk_mod.SMALL_K + 1, 160))
        if trial % 2:  # BLDM: sorted chunks of k items
            m = int(rng.integers(1, 30))
            costs = rng.integers(0, 5, k * m).astype(float) if trial % 4 == 1 else rng.random(k * m)
            order = np.argsort(-costs, kind="stable")
            tuples = [(costs[c] - costs[c[-1]], c, np.arange(k)) for c in order.reshape(-1, k)]
        else:  # KK's head: one item per tuple
            costs = rng.random(int(rng.integers(1, 3 * k)))
            tuples = [(np.concatenate(([costs[i]], np.zeros(k - 1))), np.array([i]), np.zeros(1, dtype=np.int64))
                      for i in range(costs.shape[0])]
        item, slot = kk_mod._kk_merge_all(tuples, k)
        want_item, want_slot = kk_mod._kk_merge_all_lists(tuples, k)
        np.testing.assert_array_equal(item, want_item, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(slot, want_slot, err_msg=f"trial {trial}")
