"""Measured Ray round trips of the calls a Planner actor answers for one step (`simulate`).

Per step the Planner actor answers one ``constructor_step`` per constructor (the `ConstructorPlan`
of each of its buckets and the routes of the sources they read) and, per loader actor, a
``loader_plans_ahead`` every `PLANS_AHEAD` steps carrying that many steps' plans (`bench
throughput` counts these calls on a running service). Here
a Ray actor answers with replies of those sizes, from the real step's plan, and the caller's round
trips are timed: the sum over a step's calls, one after another, is an upper bound of the Planner
actor's time answering them (its calls share one Python interpreter; the round trip also holds the
caller's side).
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

CALLS_TIMED = 30
"""Round trips timed per reply size (after 3 warm-up calls); the median is reported."""


class ReplyServer:
    """Answers each call kind with fixed reply bytes, as a Planner actor answers with a plan view."""

    def __init__(self, replies: dict[str, bytes]) -> None:
        self.replies = replies

    def reply(self, kind: str) -> bytes:
        return self.replies[kind]


def rpc_cost(plan: Any, topology: Any, *, loader_actors: int) -> dict[str, Any]:
    """The step's calls and their measured round trips (seconds): ``rpc_call_s`` per kind,
    ``rpc_calls_per_step`` and ``rpc_per_step_s`` (their sum). Needs Ray initialised."""
    import ray

    from megascale_data_ext.runtime.loader_group import PLANS_AHEAD

    group = list(topology.constructor_groups[0])
    sources = list(range(len(plan.source_names)))
    share = max(1, -(-len(sources) // loader_actors))
    replies = {
        "constructor_step": pickle.dumps(([plan.constructor_do_plan(b) for b in group], sources, [[0]] * len(sources)),
                                         protocol=pickle.HIGHEST_PROTOCOL),  # routes: a handle per source, here 0
        # PLANS_AHEAD steps of a loader actor's plans (this step's, as a stand-in for the next ones)
        "loader_plans": pickle.dumps({plan.step + k: plan.loader_do_plans(sources[:share]) for k in range(PLANS_AHEAD)},
                                     protocol=pickle.HIGHEST_PROTOCOL),
    }
    server = ray.remote(ReplyServer).options(num_cpus=0).remote(replies)
    try:
        call_s = {}
        for kind in replies:
            for _ in range(3):
                ray.get(server.reply.remote(kind))
            times = []
            for _ in range(CALLS_TIMED):
                t0 = time.perf_counter()
                ray.get(server.reply.remote(kind))
                times.append(time.perf_counter() - t0)
            call_s[kind] = statistics.median(times)
    finally:
        ray.kill(server)
    calls = {"constructor_step": topology.num_constructors, "loader_plans": loader_actors / PLANS_AHEAD}
    return {"rpc_call_s": call_s, "rpc_reply_bytes": {k: len(v) for k, v in replies.items()},
            "rpc_calls_per_step": calls, "rpc_per_step_s": sum(calls[k] * call_s[k] for k in calls)}


def start_ray() -> Any:
    """A local Ray for the measurement (the one already running, if any); the caller shuts it down."""
    import ray

    from megascale_data_ext.runtime.config import INLINE_OBJECT_BYTES

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _system_config={"max_direct_call_object_size": INLINE_OBJECT_BYTES})  # as a service's Ray
    return ray
