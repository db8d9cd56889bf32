"""HeldSteps (runtime/held_steps.py): one build per step, release on consumption, backpressure."""

from __future__ import annotations

import threading
import time

import pytest

from megascale_data_ext.errors import PlanError, SourceError
from megascale_data_ext.runtime.held_steps import IMAGES, HeldSteps


def held(**kw) -> HeldSteps:
    args = dict(fetchers=[0, 1], start_step=0, max_lead=2, silent_after=3, wait_timeout_s=30.0)
    args.update(kw)
    return HeldSteps("constructor for buckets [0]", **args)


def build_for(ranks, key=("mb",)):
    return lambda step: (f"step {step}", {r: {key} for r in ranks})


def test_concurrent_requests_share_one_build_and_its_own_error():
    h, calls, gate = held(), [], threading.Event()

    def slow_fail(step):
        calls.append(step)
        gate.wait(5)
        raise SourceError("source 'web': row 3 is corrupt; fix it with data.sources.web.on_bad_rows=skip")

    errors = []

    def ask():
        try:
            h.get_or_build(0, slow_fail)
        except Exception as exc:  # every waiter must see the build's own error
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(10)
    assert calls == [0] and len(errors) == 4
    assert all(isinstance(e, SourceError) and "row 3 is corrupt" in str(e) for e in errors)
    assert h.get_or_build(0, build_for([0, 1])) == "step 0"  # a failed build is not latched: asked again, built


def test_a_step_goes_when_every_taker_took_it_or_moved_past_it():
    h = held()
    h.get_or_build(0, build_for([0, 1]))
    h.take(0, 0, ("mb",))
    assert h.held(0) == "step 0" and h.untaken(0) == {1: [("mb",)]}
    h.arrive(1, 1)  # rank 1 moved on without taking it (a restart skipped it)
    assert h.held(0) is None and h.released(0)
    with pytest.raises(PlanError, match="already taken by every consumer"):
        h.get_or_build(0, build_for([0, 1]))


def test_a_request_its_rank_moved_past_builds_nothing():
    """A client prefetches steps beyond the last one it consumes; when the rank moves on (a new
    run of consumers, the end of training), those requests must not build steps for nobody
    (taking loader data and a constructor thread) nor fail: they get None."""
    h, builds, got = held(), [], []

    def build(step):
        builds.append(step)
        return f"step {step}", {0: {("mb",)}, 1: {("mb",)}}

    waiter = threading.Thread(target=lambda: got.append(h.get_or_build(5, build, for_rank=0)), daemon=True)
    waiter.start()  # step 5 is beyond the lead (floor 0, max_lead 2): it waits
    h.arrive(0, 7)
    h.arrive(1, 7)  # both ranks jump past it
    waiter.join(10)
    assert not waiter.is_alive() and got == [None] and builds == []
    assert h.get_or_build(7, build, for_rank=0) == "step 7" and builds == [7]  # its own step is built
    assert h.get_or_build(6, build, for_rank=1) is None  # asked after the rank passed it: nothing either


def test_a_fast_fetcher_waits_for_a_slow_one_and_a_slow_step_is_no_error():
    h = held(wait_timeout_s=3.0)  # far above the peer's 0.3 s, so a loaded machine's late wake-up is no failure
    done = threading.Event()

    def slow_peer():  # rank 1 advances a step every 0.3 s: slower than the fast rank, never silent 3 s
        for step in range(1, 5):
            time.sleep(0.3)
            h.arrive(1, step)
        done.set()

    h.arrive(0, 4)  # rank 0 is at step 4; rank 1 still at 0: step 4 is 4 ahead, the lead is 2
    threading.Thread(target=slow_peer, daemon=True).start()
    t0 = time.monotonic()
    assert h.get_or_build(4, build_for([0, 1])) == "step 4"
    assert time.monotonic() - t0 >= 0.85  # it waited for rank 1 to reach step 3 (4 < 3 + 2): 3 sleeps of 0.3 s
    assert h.backpressure_waits == 1
    done.wait(5)


def test_a_silent_slow_fetcher_is_named():
    h = held(wait_timeout_s=0.3)
    h.arrive(0, 5)
    with pytest.raises(PlanError, match=r"step 5 is 5 steps ahead of rank 1 \(on step 0.*max_lead_steps"):
        h.get_or_build(5, build_for([0, 1]))


def test_encoder_shares_of_ranks_that_never_asked_go_behind_the_fetchers():
    h = held(max_lead=None, silent_after=2)
    for step in range(6):  # rank 7 (an image-only rank) never asks this constructor for anything
        h.get_or_build(step, lambda s: (s, {0: {("mb",)}, 1: {("mb",)}, 7: {IMAGES}}))
        h.arrive(0, step)
        h.arrive(1, step)
        h.take(step, 0, ("mb",))
        h.take(step, 1, ("mb",))
    assert [s for s in range(6) if h.held(s) is not None] == [3, 4, 5]  # only the newest silent_after + 1
