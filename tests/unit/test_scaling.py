"""The mixture-driven scaling policy: thresholds, patience, hysteresis, bounds, save/load."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.scaling import ScalingConfig, ScalingPolicy, shard_capacity
from megascale_data_ext.errors import ConfigError
from tests.harness import check_save_load, refuses


def ramp(steps: int = 40) -> list[list[float]]:
    """Source 0's weight goes 0.1 -> 0.8 -> 0.1 (triangle); the rest shares what is left."""
    out = []
    for k in range(steps):
        w0 = 0.1 + 0.7 * (1 - abs(2 * k / (steps - 1) - 1))
        out.append([w0, (1 - w0) / 2, (1 - w0) / 2])
    return out


def test_ramp_scales_up_then_down_after_patience() -> None:
    pol = ScalingPolicy(ScalingConfig(capacity=(0.25, 0.5, 0.5), window=3, patience=2, max_shards=4))
    shards = []
    decisions = []
    for w in ramp():
        decisions += pol.observe(w)
        shards.append(pol.shards[0])
    assert max(shards) == 4 and shards[0] == 1 and shards[-1] == 1
    ups = [d for d in decisions if d.source == 0 and d.new > d.old]
    downs = [d for d in decisions if d.source == 0 and d.new < d.old]
    assert ups and downs and max(d.interval for d in ups) < min(d.interval for d in downs)
    # every step of the walk changes the count by what the moving average asked for, never past bounds
    assert all(1 <= d.new <= 4 for d in decisions)
    # patience: no decision on the first interval, and never two for one source in consecutive intervals
    assert all(d.interval >= 1 for d in decisions)
    for s in range(3):
        iv = [d.interval for d in decisions if d.source == s]
        assert all(b - a >= 2 for a, b in zip(iv, iv[1:], strict=False))


def test_noise_around_a_threshold_does_not_thrash() -> None:
    pol = ScalingPolicy(ScalingConfig(capacity=(0.3, 1.0), window=4, patience=3, hysteresis=0.3))
    rng = np.random.default_rng(0)
    changes = 0
    for _ in range(200):
        w0 = 0.3 + rng.uniform(-0.05, 0.05)  # hovers around one shard's capacity
        changes += len(pol.observe([w0, 1 - w0]))
    assert changes <= 1  # at most the first scale-up; the hysteresis band holds it there


def test_capacity_and_config_errors() -> None:
    assert shard_capacity(0.1, 100, 1.0, 4) == pytest.approx(0.4)  # 4 workers x 1 s / (100 x 0.1 s)
    assert shard_capacity(0.0, 100, 1.0, 4) == 1.0
    with pytest.raises(ConfigError, match="(?s)`capacity` of source 1 must be > 0.*`max_shards` \\(1\\) must be >= "):
        ScalingConfig(capacity=(0.5, 0.0), min_shards=2, max_shards=1)


def test_save_load_equivalence() -> None:
    weights = ramp(24)
    cfg = ScalingConfig(capacity=(0.2, 0.5, 0.5), window=3, patience=2, max_shards=5)

    def advance(pol: ScalingPolicy, i: int):
        return [(d.source, d.old, d.new, d.interval) for d in pol.observe(weights[i])], list(pol.shards)

    check_save_load(lambda: ScalingPolicy(cfg), advance, steps=24, resume_at=[0, 5, 11, 17])
    other = ScalingPolicy(ScalingConfig(capacity=(0.2, 0.5, 0.5), window=4))
    refuses(other, ScalingPolicy(cfg).state_dict(), "`config` changed")
