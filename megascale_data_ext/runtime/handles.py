"""ServiceHandles: how a trainer process reaches a running service (no Ray import here).

Trainer ranks receive this object (pickled over torch.distributed) before they import Ray,
so that the Ray auth settings it carries are in the environment when Ray first loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megascale_data_ext.runtime.topology import ServiceTopology


@dataclass(slots=True, kw_only=True)
class ServiceHandles:
    """What a client needs to reach the service: the Ray address and the service's topology."""

    address: str
    topology: ServiceTopology
    """Who fetches from which constructor, actor names, namespace: clients use the service's own."""
    ray_env: dict[str, str] = field(default_factory=dict)
    """RAY_AUTH_* settings a joining process needs (Ray's token auth on the started cluster)."""

    @property
    def namespace(self) -> str:
        return self.topology.namespace

    def apply_env(self) -> None:
        """Set the Ray auth variables in this process before `ray.init(address=...)`."""
        os.environ.update(self.ray_env)
