"""Where the service's actors run: loaders per the partition, constructors beside their trainers.

The paper runs Source Loaders and Data Constructors as sidecars on the trainer nodes (their
CPUs and memory are otherwise idle, and a constructor next to its ranks ships batches over
the local network stack), and the Planner anywhere. Ray expresses that with node affinity:
this module maps the partitioner's node names and the trainers' ranks to Ray node ids and
returns the ``.options(...)`` of each actor kind.

Nodes are named by a custom resource (``msd_node:<name>`` by default, e.g. started with
``ray start --resources='{"msd_node:trainer-0": 1}'``) or by their Ray node id, so a local
``ray.cluster_utils.Cluster`` and a real cluster are addressed the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megascale_data_ext.dataplane.partitioner import LoaderAssignment, NodeResources
from megascale_data_ext.errors import ConfigError

__all__ = ["NODE_RESOURCE_PREFIX", "ClusterNodes", "Placement", "node_affinity"]

NODE_RESOURCE_PREFIX = "msd_node:"
AFFINITY_CPUS = 0.01
"""CPUs a placed actor asks for: Ray ignores soft node affinity for an actor that asks for none
(3 of 6 landed on their node in a plain Ray 2.60 test, 6 of 6 with 0.01)."""


def node_affinity(node_id: str, *, soft: bool) -> dict[str, Any]:
    """``.options`` that put an actor on `node_id`; `soft` lets Ray restart it elsewhere when the
    node is gone (hard affinity makes a lost node's actors unschedulable for good)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=soft), "num_cpus": AFFINITY_CPUS}


@dataclass(slots=True, frozen=True)
class ClusterNodes:
    """The alive Ray nodes: name -> node id, and what each offers (for the partitioner)."""

    ids: dict[str, str]
    resources: list[NodeResources]

    @classmethod
    def discover(cls, *, prefix: str = NODE_RESOURCE_PREFIX, memory_fraction: float = 0.5) -> ClusterNodes:
        """Alive nodes of the connected Ray; a node without a ``<prefix><name>`` resource is named by its id.

        `memory_fraction` of each node's Ray memory is offered to loaders (trainers hold the rest).
        """
        ids, res = {}, []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            r = node.get("Resources", {})
            names = [k[len(prefix):] for k in r if k.startswith(prefix)]
            name = names[0] if names else node["NodeID"]
            ids[name] = node["NodeID"]
            res.append(NodeResources(name=name, memory_bytes=int(r.get("memory", 0) * memory_fraction),
                                     cpus=float(r.get("CPU", 0))))
        return cls(ids=ids, resources=sorted(res, key=lambda n: n.name))

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
        return node_affinity(self.nodes.node_id(name), soft=self.soft)

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
