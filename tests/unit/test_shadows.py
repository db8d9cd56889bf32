"""What a caller knows of its loaders (`runtime.shadows.Suspects`): suspects and the hedge delay."""

from __future__ import annotations

from megascale_data_ext.runtime import shadows
from megascale_data_ext.runtime.shadows import Suspects


def test_hedge_waits_the_configured_cap_until_answers_were_seen():
    s = Suspects(suspect_s=5.0)
    assert s.hedge_after(1.0) == 1.0
    for _ in range(Suspects.WARM_ANSWERS - 1):
        s.answered(0.01)
    assert s.hedge_after(1.0) == 1.0  # not yet trusted


def test_hedge_follows_typical_answers_between_floor_and_cap():
    s = Suspects(suspect_s=5.0)
    for _ in range(50):
        s.answered(0.08)
    assert abs(s.hedge_after(1.0) - Suspects.HEDGE_FACTOR * 0.08) < 1e-6  # 4 typical answers late
    assert s.hedge_after(0.2) == 0.2  # hedge_s stays the cap
    fast = Suspects(suspect_s=5.0)
    for _ in range(50):
        fast.answered(0.001)
    assert fast.hedge_after(1.0) == Suspects.HEDGE_FLOOR_S  # never a storm of hedges on tiny calls


def test_a_slow_spell_raises_the_hedge_and_it_comes_back_down():
    s = Suspects(suspect_s=5.0)
    for _ in range(40):
        s.answered(0.05)
    low = s.hedge_after(5.0)
    for _ in range(40):
        s.answered(0.5)
    high = s.hedge_after(5.0)
    for _ in range(80):
        s.answered(0.05)
    assert low < high and s.hedge_after(5.0) < high / 2


def test_a_failed_primary_is_suspect_for_suspect_s_only(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(shadows.time, "monotonic", lambda: now[0])  # a clock the test moves
    s = Suspects(suspect_s=5.0)
    s.mark("loader-a")
    assert "loader-a" in s and "loader-b" not in s and s.failovers == 1
    now[0] += 4.9
    assert "loader-a" in s
    now[0] += 0.2
    assert "loader-a" not in s
