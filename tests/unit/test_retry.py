"""The one retry budget (`runtime.retry`): capped exponential backoff that never sleeps past its deadline."""

from __future__ import annotations

import types

import pytest

from megascale_data_ext.runtime import retry as retry_module
from megascale_data_ext.runtime.retry import Retry, backoff_s


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(k) for k in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert backoff_s(3, base_s=0.1, cap_s=0.5) == 0.5


def test_pauses_count_attempts_and_stop_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = types.SimpleNamespace(now=100.0, slept=[])

    def sleep(s: float) -> None:
        clock.slept.append(round(s, 6))
        clock.now += s

    monkeypatch.setattr(retry_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep))
    retry = Retry(1.0, base_s=0.2, cap_s=10.0)
    while not retry.expired():
        retry.pause()
    assert clock.slept == [0.2, 0.4, 0.4]  # the third pause is cut to what was left of the second
    assert retry.attempts == 3 and retry.left() == 0.0 and retry.elapsed() == pytest.approx(1.0)
    retry.pause()  # past the deadline: no sleep
    assert clock.slept[-1] == 0.0 and retry.attempts == 4
