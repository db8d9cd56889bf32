"""The service's actors as a table: who runs where, what it serves, where it belongs.

One row per actor — the Planner, every live loader actor and its shadow, every Data Constructor —
with its role, state, pid, node (id and name), home node (`runtime.placement`), what it serves
and how often Ray restarted it. State, pid, node and restarts come from Ray's control store, so
the table answers while an actor restarts. `DataService.actors()` and ``megascale-data status``
(beside a running ``serve``) print it; the service's move-back (`DataService.move_home`) reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from megascale_data_ext.runtime.retry import Retry
from megascale_data_ext.runtime.topology import ServiceTopology

__all__ = ["ActorRow", "actor_rows", "ask_all", "find_service", "format_table"]

ActorRow = dict[str, Any]
"""``role`` (``planner``, ``loader/<k>``, ``shadow/<k>`` (loader k's), ``constructor/<j>``),
``state``, ``pid``, ``node_id``, ``node`` (its name, `placement.ClusterNodes`), ``home`` (the node
it belongs on, None: anywhere), ``serves`` (source ids or buckets), ``restarts``, ``actor_id``."""


def ask_all(handles: Sequence[Any], method: str, *, timeout_s: float) -> list[Any]:
    """Call `method` on every actor, waiting out those Ray is restarting; None for an actor that is
    dead for good (no restarts). Past `timeout_s` of waiting, the restart's error is raised."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    retry = Retry(timeout_s, base_s=0.2, cap_s=0.2)
    out = []
    for h in handles:
        while True:
            try:
                out.append(ray.get(getattr(h, method).remote()))
                break
            except ActorDiedError:
                out.append(None)
                break
            except ActorUnavailableError:
                if retry.expired():
                    raise
                retry.pause()
    return out


def _record(handle: Any) -> dict[str, Any]:
    """State, pid, node and restarts of an actor from Ray's GCS (no call to the actor itself).
    Ray has no public API for this without its dashboard; ``ray._private.state`` is what
    ``ray list actors`` reads."""
    from ray._private import state

    info = state.actors(handle._actor_id.hex()) or {}
    return {"state": info.get("State"), "pid": info.get("Pid"), "node_id": (info.get("Address") or {}).get("NodeID"),
            "restarts": info.get("NumRestarts"), "actor_id": handle._actor_id.hex()}


def actor_rows(planner: Any, constructors: Sequence[Any], topology: ServiceTopology, *,
               timeout_s: float) -> list[tuple[ActorRow, Any]]:
    """Every actor of the service as ``(row, handle)``, the Planner first (nothing without one)."""
    from megascale_data_ext.runtime.placement import ClusterNodes

    if planner is None:
        return []
    homes, shadows = ray.get([planner.homes.remote(), planner.shadow_actors.remote()])
    groups = [h for h, _ in homes["loaders"]]
    served = [(info or {}).get("sources", []) for info in ask_all(groups, "ready", timeout_s=timeout_s)]
    rows: list[tuple[str, Any, list[int], str | None]] = [("planner", planner, [], None)]
    rows += [(f"loader/{k}", h, srcs, home) for k, ((h, home), srcs) in enumerate(zip(homes["loaders"], served,
                                                                                        strict=True))]
    rows += [(f"shadow/{k}", h, srcs, None) for k, (h, srcs) in enumerate(zip(shadows, served, strict=False))]
    rows += [(f"constructor/{j}", h, list(b), home) for j, (h, b, home)
             in enumerate(zip(constructors, topology.constructor_groups, homes["constructors"], strict=True))]
    nodes = ClusterNodes.discover()
    out = []
    for role, h, serves, home in rows:
        rec = _record(h)
        out.append(({"role": role, "serves": serves, "home": home, "node": nodes.name_of(rec["node_id"]), **rec}, h))
    return out


def find_service(namespace: str) -> tuple[Any, list[Any], ServiceTopology]:
    """The Planner, constructors and topology of the service running in `namespace` of the Ray
    this process joined (by the names the topology gives)."""
    from megascale_data_ext.runtime.remote import find_constructor, find_planner

    planner = find_planner(namespace)
    topology = ray.get(planner.topology.remote())
    return planner, [find_constructor(topology, j) for j in range(topology.num_constructors)], topology


def format_table(rows: Sequence[ActorRow]) -> str:
    """`rows` as an aligned text table (one line per actor)."""
    cols = ("role", "state", "pid", "node", "home", "restarts", "serves")

    def cell(r: ActorRow, c: str) -> str:
        v = r.get(c)
        if c == "node" and v is None and r.get("node_id"):
            v = r["node_id"][:12]
        if c == "serves":
            v = ",".join(map(str, v or [])) or "-"
        return "-" if v is None else str(v)

    table = [cols] + [tuple(cell(r, c) for c in cols) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in table)
