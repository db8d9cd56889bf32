"""Routes by actor id (`runtime.routing`): each loader actor's handles reach a constructor once."""

from __future__ import annotations

from megascale_data_ext.runtime.routing import RouteBook, RoutedFetch
from megascale_data_ext.runtime.shadows import Replica


def test_routes_by_id_send_each_handle_once_per_cache_and_recover_a_lost_one():
    """`RouteBook` + `RoutedFetch.prime`: handles travel once per constructor cache; a source
    whose handles the cache lacks is routed afresh, and the next reply re-sends everything."""
    book, asked = RouteBook(), []
    fetch = RoutedFetch(lambda step, ss: asked.append((step, ss)) or [[Replica(f"fresh{s}")] for s in ss])
    reps = {a: Replica(f"actor{a}") for a in range(4)}
    send = book.unsent(0, fetch.token, {0, 1})
    assert send == [0, 1]
    fetch.prime(0, [10, 11], [[0], [1]], "fleet-a", {a: reps[a] for a in send})
    assert book.unsent(0, fetch.token, {0, 1}) == []  # the same cache: nothing again
    assert book.unsent(1, "other", {0}) == [0]  # another constructor has its own record
    fetch.prime(1, [10, 11], [[0], [1]], "fleet-a", {})
    assert fetch._replicas(1, [10, 11], fresh=False) == {10: [reps[0]], 11: [reps[1]]} and not asked
    # the reply that carried actor 2's handles was lost: the source is asked afresh, the token renewed
    token = fetch.token
    assert book.unsent(0, token, {2}) == [2]
    fetch.prime(2, [12], [[2]], "fleet-a", {})
    assert fetch.token != token
    assert fetch._replicas(2, [12], fresh=False) == {12: [Replica("fresh12")]} and asked == [(2, [12])]
    assert book.unsent(0, fetch.token, {0, 2}) == [0, 2]  # the new token: sent again
    # a restarted Planner (another fleet) numbers its actors from 0 again: old handles are dropped
    fetch.prime(3, [10], [[0]], "fleet-b", {0: Replica("new0")})
    assert fetch._replicas(3, [10], fresh=False) == {10: [Replica("new0")]}
    assert set(fetch.handles) == {0}
