"""A small `bench chaos`: two double kills from outside (SIGKILL by pid) during 40 steps.

DP 4 x PP 2 with autoscaled loaders on a three-node `ray.cluster_utils.Cluster`; the Planner and a
loader die together, later a constructor and a loader on its node. Every rank's bytes of every
step must equal the fault-free in-process run, no document lost or duplicated, no error reaching
the trainer-side clients, and every victim must come back with a new pid.
"""

from __future__ import annotations

import pytest

from megascale_data_ext.commands.bench_chaos import chaos_schedule, run_chaos
from tests.integration.conftest import own_ray

pytestmark = pytest.mark.slow


def test_chaos_schedule_is_seeded_and_spaced():
    a = chaos_schedule(200, 3, node_loss_at=80)
    assert a == chaos_schedule(200, 3, node_loss_at=80)
    kills = [s for s, f in a if not f.startswith("node")]
    assert all(3 <= b - s <= 10 for s, b in zip(kills, kills[1:], strict=False))
    assert (80, "node-remove") in a and (92, "node-add") in a


def test_two_double_kills_lose_nothing(tmp_path):
    own_ray()  # run_chaos starts a cluster of its own
    result = run_chaos(tmp_path, steps=40, schedule=[(6, "planner+loader"), (18, "constructor+loader")])
    assert result["totals"] == {"lost": 0, "duplicated": 0, "order_mismatches": 0, "errors": 0}, result["errors"]
    assert [len(r["victims"]) for r in result["rows"]] == [2, 2]
    assert all(r["recovered"] for r in result["rows"]), result["rows"]
    assert result["restarts"]["planner"] >= 1
