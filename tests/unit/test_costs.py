"""Cost models: the paper's attention sanity check, monotonicity, MoE top-k, registry errors."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.costs import (
    TokenCost,
    TransformerConfig,
    TransformerCost,
    ViTCost,
    get_cost_model,
    segment_sum,
)
from megascale_data_ext.errors import ConfigError


def test_attention_sanity_check_30_70_vs_50_50() -> None:
    cost = TransformerCost(TransformerConfig.preset("Llama-12B"))
    ratio = cost.attention_flops(np.array([30, 70])).sum() / cost.attention_flops(np.array([50, 50])).sum()
    assert ratio == pytest.approx(1.16, abs=1e-12)
    # Linear terms are identical for equal token totals, so the whole cost differs only by attention.
    diff = cost(np.array([30, 70])).sum() - cost(np.array([50, 50])).sum()
    assert diff == pytest.approx(0.16 * cost.attention_flops(np.array([50, 50])).sum(), rel=1e-9)


def test_gpt_tiny_matches_hand_count() -> None:
    cfg = TransformerConfig.preset("gpt-tiny")  # h=64, 2 layers, ffn=256, vocab=128
    s = 10.0
    h, layers, ffn, vocab = 64, 2, 256, 128
    per_layer = 2 * s * h * 3 * h + 2 * s * h * h + 2 * s * h * ffn * 2 + 4 * s * s * h
    expected = 3 * (layers * per_layer + 2 * s * h * vocab)
    assert TransformerCost(cfg)(np.array([10]))[0] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", TransformerConfig.preset_names())
def test_costs_are_monotone_and_superlinear(name: str) -> None:
    cost = get_cost_model(name)
    s = np.arange(1, 5000, dtype=np.int64)
    f = cost(s)
    assert f.dtype == np.float64 and f.shape == s.shape
    assert np.all(np.diff(f) > 0)
    assert np.all(np.diff(f / s) > 0)  # per-token cost grows: attention is s²


def test_moe_topk_scales_expert_flops() -> None:
    base = dict(hidden=512, layers=4, heads=8, ffn=1024, moe_experts=8)
    s = np.array([100.0])
    c1 = TransformerCost(TransformerConfig(moe_topk=1, **base))(s)[0]
    c2 = TransformerCost(TransformerConfig(moe_topk=2, **base))(s)[0]
    mlp_one_expert = 3 * 4 * (2 * 100 * 512 * 1024 * 2)
    assert c2 - c1 == pytest.approx(mlp_one_expert, rel=1e-12)
    mixtral = TransformerConfig.preset("mixtral-8x7b")
    assert mixtral.moe_topk == 2 and mixtral.num_query_groups == 8


def test_vit_cost_per_image_and_per_sample() -> None:
    vit = ViTCost(TransformerConfig.preset("ViT-2B"))
    counts = np.array([256, 16, 16, 576], dtype=np.int64)
    offsets = np.array([0, 1, 1, 3, 4], dtype=np.int64)  # sample 1 has no image
    per_sample = vit.per_sample(offsets, counts)
    f = vit(counts)
    np.testing.assert_allclose(per_sample, [f[0], 0.0, f[1] + f[2], f[3]])
    # One 32-patch image costs more than two 16-patch images (separate attention sequences).
    assert vit(np.array([32]))[0] > 2 * vit(np.array([16]))[0]
    assert ViTCost("vit-2b", patch_tokens=1)(np.array([16]))[0] == pytest.approx(vit(np.array([17]))[0])


def test_segment_sum_handles_empty_segments() -> None:
    np.testing.assert_allclose(segment_sum(np.array([1.0, 2.0, 3.0]), np.array([0, 0, 2, 2, 3])), [0, 3, 0, 3])


def test_registry_and_errors() -> None:
    np.testing.assert_array_equal(get_cost_model("tokens")(np.array([3, 4])), [3.0, 4.0])
    assert isinstance(get_cost_model("vit-1b"), ViTCost)
    assert isinstance(get_cost_model("LLAMA-12B"), TransformerCost)
    assert isinstance(get_cost_model("tokens"), TokenCost)
    # `kind` costs a preset or config as a backbone or an encoder (the strategies' one path)
    assert isinstance(get_cost_model("llama-12b", kind=ViTCost), ViTCost)
    assert isinstance(get_cost_model("vit-1b", kind=TransformerCost), TransformerCost)
    assert isinstance(get_cost_model(TransformerConfig.preset("gpt-tiny"), kind=ViTCost), ViTCost)
    assert isinstance(get_cost_model("tokens", kind=ViTCost), TokenCost)
    fn = lambda x: x  # noqa: E731
    assert get_cost_model(fn) is fn
    with pytest.raises(ConfigError, match="unknown cost model 'gpt-5'.*tokens"):
        get_cost_model("gpt-5")
    with pytest.raises(ConfigError, match="unknown model preset"):
        TransformerConfig.preset("llama-70b")
    with pytest.raises(ConfigError, match="`hidden` .* divisible by `heads`"):
        TransformerConfig(hidden=100, layers=1, heads=3)
    assert TransformerConfig(hidden=64, layers=1, heads=4).ffn == 256


def test_strategies_take_a_calibrated_model_by_path(tmp_path) -> None:
    from megascale_data_ext.dataplane.calibration import CalibratedCost
    from megascale_data_ext.dataplane.costs import cost_model_names
    from megascale_data_ext.dataplane.strategies import build_strategy

    assert "calibrated:<path>" in cost_model_names()
    path = CalibratedCost(fixed=0.02, linear=1e-5, quadratic=1e-9).save(tmp_path / "Fit.json")  # path keeps its case
    strategy = build_strategy("llm_balance", num_microbatches=2, cap=4096, model=f"calibrated:{path}")
    assert isinstance(strategy.cost_model, CalibratedCost) and strategy.cost_model.fixed == 0.02
    with pytest.raises(ConfigError, match=r"calibration file .*nope\.json.* does not exist"):
        build_strategy("llm_balance", num_microbatches=2, model=f"calibrated:{tmp_path / 'nope.json'}")
