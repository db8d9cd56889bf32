"""Prefetcher: builds ahead of the newest request, retries a failure, waits when restarted."""

from __future__ import annotations

import threading
import time

from megascale_data_ext.runtime.prefetcher import Prefetcher


def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_builds_to_the_first_target_then_depth_past_each_request():
    built: list[int] = []
    p = Prefetcher(built.append, depth=3, first_target=2, name="test").start()
    try:
        _until(lambda: built[-1:] == [2])
        p.requested(1)  # 1 + 3 = 4 > 2: build further
        _until(lambda: built[-1:] == [4])
        p.requested(0)  # behind the target: nothing new
        p.wake()
        _until(lambda: len(built) >= 3)
        assert p.target == 4 and set(built) == {2, 4}
    finally:
        p.close()


def test_a_failure_is_retried_with_backoff_and_counted():
    calls: list[int] = []

    def build(target: int) -> None:
        calls.append(target)
        if len(calls) < 3:
            raise RuntimeError("loader restarting")

    p = Prefetcher(build, depth=1, first_target=5, name="test").start()
    try:
        _until(lambda: len(calls) >= 3)  # two failures, then it builds (no request needed)
        assert calls[:3] == [5, 5, 5] and p.errors == 2
    finally:
        p.close()


def test_a_restarted_builder_waits_for_the_first_request():
    started = threading.Event()
    p = Prefetcher(lambda target: started.set(), depth=2, first_target=None, name="test").start()
    try:
        p.wake()
        assert not started.wait(0.3)  # no target: nothing built
        p.requested(7)
        assert started.wait(60) and p.target == 9
    finally:
        p.close()
    assert not any(t.name == "prefetch" for t in threading.enumerate())  # closed: its thread is gone
