"""Routing: a constructor's fetch of a step from the loader actors that hold it.

The Planner's `AutoScaler` knows which actors hold each source's shards at each step (its
layouts); a constructor gets every source's routes with the step's plans
(`PlannerActor.constructor_step`, `prime`) or, after a failure, asks afresh (`PlannerActor.routes`),
then each loader actor once for all the (shards of) sources it holds (`fetch_many`, the actors
concurrently), and merges each source's shards' disjoint results. Each shard is a `Replica`:
with shadow loaders its shadow answers when the primary is down or slow (`runtime.shadows`).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable

from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.failover import raise_unless_recovering
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.fetch_wire import decode_fetch
from megascale_data_ext.runtime.loader_group import merge_fetches
from megascale_data_ext.runtime.retry import Retry
from megascale_data_ext.runtime.shadows import Replica, Suspects, first_answers

__all__ = ["CACHED_STEPS", "HANDLES_KEPT", "RouteBook", "RoutedFetch"]

CACHED_STEPS = 16
"""Steps whose routes a constructor keeps (it builds a few steps ahead; an older one is asked again)."""
HANDLES_KEPT = 4096
"""Loader actors whose handles a constructor keeps; past it, it forgets them all and is sent them again."""

Route = Callable[[int, list[int]], list[list[Replica]]]
"""``(step, sources) -> per source, its shards' replicas (shard k at index k)``."""


class RouteBook:
    """The Planner's record of which loader actors' handles each constructor already holds.

    Routes travel as actor ids (`AutoScaler.route_ids`); an actor's handles (a `Replica`) go to
    a constructor once, not with every step's reply (deserializing them was about a tenth of a
    constructor's Python time per step under a profiler). A constructor names its handle cache by a
    token (`RoutedFetch.token`): a new token (a restarted constructor, a cleared cache) starts its
    record afresh. Ids never repeat within a Planner's fleet (`AutoScaler.fleet`).
    """

    def __init__(self) -> None:
        self._sent: dict[int, tuple[str, set[int]]] = {}
        self._lock = threading.Lock()  # constructors ask from several threads

    def unsent(self, constructor: int, token: str, ids: Iterable[int]) -> list[int]:
        """Which of `ids` the constructor holding cache `token` lacks; they count as sent from now."""
        with self._lock:
            have, sent = self._sent.get(constructor, ("", set()))
            if have != token:
                sent = set()
                self._sent[constructor] = (token, sent)
            new = sorted(set(ids) - sent)
            sent.update(new)
            return new


class RoutedFetch:
    """A constructor's ``fetch(step, sources, buckets)`` over the shards a step routes to.

    A source whose actor (and shadow) failed is asked again — the router afresh, since a
    restarted Planner starts a new fleet — until ``recovery_timeout_s``; a re-sent fetch is
    exact because a loader reads buckets it handed out before again from the plan.
    """

    def __init__(self, route: Route, ft: FaultToleranceConfig | None = None, *,
                 calls: CallCounter | None = None) -> None:
        self.route = route
        self.ft = ft or FaultToleranceConfig(restart=False)
        self.calls = calls
        self.suspects = Suspects(self.ft.suspect_s)
        self.token = uuid.uuid4().hex  # names `handles` for the Planner's `RouteBook`
        self.fleet: str | None = None  # the Planner fleet the handles belong to
        self.handles: dict[int, Replica] = {}  # loader actor id -> its replica, sent once per token
        self._lock = threading.Lock()
        # step -> source -> replicas, for the newest CACHED_STEPS steps asked (each route holds
        # fresh actor handles, a few KiB each: kept for every step they grew a constructor steadily)
        self._cache: OrderedDict[int, dict[int, list[Replica]]] = OrderedDict()

    @property
    def failovers(self) -> int:
        """Calls a primary failed or was out-run by its shadow."""
        return self.suspects.failovers

    def prime(self, step: int, sources: list[int], ids: list[list[int]], fleet: str,
              replicas: dict[int, Replica]) -> None:
        """Take the routes that came with the step's plans (no ``routes`` call): actor ids
        (`RouteBook`), `replicas` being the handles not sent before. A source with an actor whose
        handles this cache lacks (forgotten, or the reply that carried them was lost) is left out:
        its fetch asks for its routes afresh."""
        with self._lock:  # steps are built on several threads
            if fleet != self.fleet:  # a restarted Planner numbers its new fleet from 0 again
                self.handles.clear()
                self.fleet = fleet
            self.handles.update(replicas)
            known, cached = self.handles, self._cache.setdefault(step, {})
            lacking = False
            for s, row in zip(sources, ids, strict=True):
                if all(a in known for a in row):
                    cached[s] = [known[a] for a in row]
                else:
                    lacking = True
            self._trim()
            if len(known) > HANDLES_KEPT:  # actors reclaimed long ago: forget all, be sent what is live
                known.clear()
                lacking = True
            if lacking:  # a new token: the Planner sends every handle a step uses again
                self.token = uuid.uuid4().hex

    def _trim(self) -> None:
        while len(self._cache) > CACHED_STEPS:
            self._cache.popitem(last=False)

    def _replicas(self, step: int, sources: list[int], fresh: bool) -> dict[int, list[Replica]]:
        """Each source's shard replicas at `step`, from the cache unless `fresh`."""
        known = self._cache.setdefault(step, {})
        need = sources if fresh else [s for s in sources if s not in known]
        if need:
            known.update(zip(need, self.route(step, need), strict=True))
        self._trim()
        return {s: known[s] for s in sources}

    def _counted(self) -> None:
        if self.calls is not None:
            self.calls.add("constructor>loader fetch_many")

    def __call__(self, step: int, sources: list[int], buckets: list[int]) -> dict[int, dict[str, list]]:
        retry = Retry(self.ft.recovery_timeout_s)
        out: dict[int, dict[str, list]] = {}
        todo, fresh = list(sources), False
        while True:
            by_actor: dict[Replica, list[int]] = {}
            for s, reps in self._replicas(step, todo, fresh).items():
                for rep in reps:
                    by_actor.setdefault(rep, []).append(s)
            requests = {rep: (rep, lambda h, _ss=ss: h.fetch_many.remote(step, _ss, buckets))
                        for rep, ss in by_actor.items()}
            answers, failures = first_answers(requests, hedge_s=self.ft.hedge_s, timeout_s=self.ft.rpc_timeout_s,
                                              suspects=self.suspects, on_call=self._counted)
            parts: dict[int, list] = {s: [] for s in todo}
            for rep, got in answers.items():
                for s in by_actor[rep]:
                    parts[s].append(decode_fetch(got[s]))
            failed = {s for rep in failures for s in by_actor[rep]}
            out.update({s: merge_fetches(parts[s]) for s in todo if s not in failed})
            if not failed:
                return out
            raise_unless_recovering(failures, sorted(failed), f"deliver step {step}", retry)
            retry.pause()
            todo, fresh = [s for s in todo if s in failed], True
