"""Where the service's actors run: loaders per the partition, constructors beside their trainers.

The paper runs Source Loaders and Data Constructors as sidecars on the trainer nodes (their
CPUs and memory are otherwise idle, and a constructor next to its ranks ships batches over
the local network stack), and the Planner anywhere. Ray expresses that with node affinity:
this module maps the partitioner's node names and the trainers' ranks to Ray node ids and
returns the ``.options(...)`` of each actor kind.

Nodes are named by a Ray node label (``msd-node``, started with ``ray start --labels
msd-node=trainer-0``), a custom resource (``msd_node:<name>``, ``ray start
--resources='{"msd_node:trainer-0": 1}'``) or their Ray node id, so a local
``ray.cluster_utils.Cluster`` and a real cluster are addressed the same way.

An actor's node is its *home*. Placement is soft by default: when the home is lost, Ray restarts
the actor on a live node. On a labelled home the preference is the label, not the node id, so a
node that comes back under the same label is the home again; `away_from_home` finds the actors
that ran elsewhere meanwhile and the service restarts them (`DataService.move_home`), which Ray
then schedules at home. A home named by resource or id cannot be recognised when it returns (Ray
gives a returning node a new id): its actors stay where they restarted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import In, NodeAffinitySchedulingStrategy, NodeLabelSchedulingStrategy

from megascale_data_ext.dataplane.partitioner import LoaderAssignment, NodeResources
from megascale_data_ext.errors import ConfigError

__all__ = ["NODE_LABEL", "NODE_RESOURCE_PREFIX", "ClusterNodes", "Placement", "away_from_home", "constructor_homes",
           "home_of", "node_affinity"]

NODE_LABEL = "msd-node"
NODE_RESOURCE_PREFIX = "msd_node:"
AFFINITY_CPUS = 0.01
"""CPUs a placed actor asks for: Ray ignores soft node affinity for an actor that asks for none
(3 of 6 landed on their node in a plain Ray 2.60 test, 6 of 6 with 0.01)."""


def node_affinity(node_id: str, *, soft: bool) -> dict[str, Any]:
    """``.options`` that put an actor on `node_id`; `soft` lets Ray restart it elsewhere when the
    node is gone (hard affinity makes a lost node's actors unschedulable for good)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=soft), "num_cpus": AFFINITY_CPUS}


def label_preference(name: str) -> dict[str, Any]:
    """``.options`` that prefer the node labelled ``msd-node=<name>`` whenever one is alive: at
    start, at every restart, and so again once a lost node returns under that label."""
    return {"scheduling_strategy": NodeLabelSchedulingStrategy({}, soft={NODE_LABEL: In(name)}),
            "num_cpus": AFFINITY_CPUS}


def home_of(options: Mapping[str, Any]) -> str | None:
    """The node name `options` (from `label_preference`) prefer; None for any other placement."""
    strategy = options.get("scheduling_strategy")
    if not isinstance(strategy, NodeLabelSchedulingStrategy):
        return None
    for expr in strategy.soft:
        if expr.key == NODE_LABEL and len(expr.operator.values) == 1:
            return expr.operator.values[0]
    return None


def constructor_homes(trainer_nodes: Sequence[str], ranks_per_node: int, topology: Any) -> list[str | None]:
    """The home node of each constructor of `topology`: the node of the first rank it serves
    (``placement.trainer_nodes``); None everywhere without trainer nodes."""
    if not trainer_nodes:
        return [None] * topology.num_constructors
    homes = []
    for group in topology.constructor_groups:
        i = min(r for b in group for r in topology.fetchers(b)) // ranks_per_node
        homes.append(trainer_nodes[i] if i < len(trainer_nodes) else None)
    return homes


def away_from_home(actors: Sequence[Mapping[str, Any]], nodes: ClusterNodes) -> list[Mapping[str, Any]]:
    """The rows of `actors` (`DataService.actors`) running off a home that is alive and labelled:
    they restarted elsewhere when it was lost, and a restart now brings them back."""
    out = []
    for a in actors:
        home = a.get("home")
        if home is None or home not in nodes.labelled or a.get("state") != "ALIVE":
            continue
        if a.get("node_id") != nodes.ids.get(home):
            out.append(a)
    return out


@dataclass(slots=True, frozen=True)
class ClusterNodes:
    """The alive Ray nodes: name -> node id, and what each offers (for the partitioner)."""

    ids: dict[str, str]
    resources: list[NodeResources]
    labelled: frozenset[str] = frozenset()
    """Names that come from the ``msd-node`` label (a home that is recognised when it returns)."""

    @classmethod
    def discover(cls, *, prefix: str = NODE_RESOURCE_PREFIX, memory_fraction: float = 0.5) -> ClusterNodes:
        """Alive nodes of the connected Ray, named by their ``msd-node`` label, else a ``<prefix><name>``
        resource, else their id.

        `memory_fraction` of each node's Ray memory is offered to loaders (trainers hold the rest).
        """
        ids, res, labelled = {}, [], set()
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            r = node.get("Resources", {})
            label = (node.get("Labels") or {}).get(NODE_LABEL)
            names = [k[len(prefix):] for k in r if k.startswith(prefix)]
            name = label or (names[0] if names else node["NodeID"])
            if label:
                labelled.add(name)
            ids[name] = node["NodeID"]
            res.append(NodeResources(name=name, memory_bytes=int(r.get("memory", 0) * memory_fraction),
                                     cpus=float(r.get("CPU", 0))))
        return cls(ids=ids, resources=sorted(res, key=lambda n: n.name), labelled=frozenset(labelled))

    def name_of(self, node_id: str | None) -> str | None:
        """The name of the alive node `node_id` (None for a node that is gone)."""
        return next((name for name, nid in self.ids.items() if nid == node_id), None)

    def on_node(self, name: str, *, soft: bool = True) -> dict[str, Any]:
        """Options putting an actor on node `name`: a soft label preference on a labelled node
        (the actor comes home when the node returns), else node affinity by id."""
        if soft and name in self.labelled:
            return label_preference(name)
        return node_affinity(self.node_id(name), soft=soft)

    def node_id(self, name: str) -> str:
        nid = self.ids.get(name)
        if nid is None:
            raise ConfigError(f"no alive Ray node named {name!r} (known: {sorted(self.ids)}); start it with "
                              f"`ray start --resources='{{\"{NODE_RESOURCE_PREFIX}{name}\": 1}}'` or re-partition")
        return nid


class Placement:
    """Ray options per actor kind.

    Args:
        nodes: The cluster's nodes.
        trainer_nodes: Node names of the trainers, in rank order: ranks ``[i * ranks_per_node,
            (i + 1) * ranks_per_node)`` run on ``trainer_nodes[i]``.
        ranks_per_node: Trainer ranks (GPUs) per node.
        soft: Let Ray place an actor elsewhere when its node is gone (True) or fail (False: a lost
            node's actors can never restart).
    """

    def __init__(self, nodes: ClusterNodes, trainer_nodes: Sequence[str], ranks_per_node: int, *,
                 soft: bool = True) -> None:
        if ranks_per_node < 1:
            raise ConfigError(f"`ranks_per_node` must be >= 1, got {ranks_per_node!r}")
        for name in trainer_nodes:
            nodes.node_id(name)  # a named error now, not a pending actor later
        self.nodes, self.trainer_nodes = nodes, list(trainer_nodes)
        self.ranks_per_node, self.soft = ranks_per_node, soft

    def on_node(self, name: str) -> dict[str, Any]:
        """Options putting an actor on node `name` (soft by default: it restarts elsewhere if the node goes)."""
        return self.nodes.on_node(name, soft=self.soft)

    def loader(self, assignment: LoaderAssignment) -> dict[str, Any]:
        """A loader actor on the node the partitioner chose."""
        return self.on_node(assignment.node)

    def node_of_rank(self, rank: int) -> str:
        i = rank // self.ranks_per_node
        if i >= len(self.trainer_nodes):
            raise ConfigError(f"rank {rank} is past the trainer nodes ({len(self.trainer_nodes)} x "
                              f"{self.ranks_per_node} ranks); list every trainer node")
        return self.trainer_nodes[i]

    def constructor(self, ranks: Sequence[int]) -> dict[str, Any]:
        """A constructor as a sidecar on the node of (the first of) the ranks it serves."""
        return self.on_node(self.node_of_rank(min(ranks)))

    @staticmethod
    def planner() -> dict[str, Any]:
        """The Planner anywhere Ray likes (it holds no data, only plans)."""
        return {"scheduling_strategy": "DEFAULT"}

    def constructor_ranks(self, topology: Any) -> list[list[int]]:
        """The fetching ranks each constructor of `topology` serves."""
        return [sorted({r for b in group for r in topology.fetchers(b)}) for group in topology.constructor_groups]

    def summary(self, assignments: Sequence[LoaderAssignment]) -> Mapping[str, int]:
        """Loader actors per node name."""
        out: dict[str, int] = {}
        for a in assignments:
            out[a.node] = out.get(a.node, 0) + 1
        return out
