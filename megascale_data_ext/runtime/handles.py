"""ServiceHandles: how a trainer process reaches a running service (no Ray import here).

Trainer ranks receive this object (pickled over torch.distributed) before they import Ray,
so that the Ray auth settings it carries are in the environment when Ray first loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class ServiceHandles:
    """What a client needs to reach the service: Ray address, namespace, actor layout."""

    address: str
    namespace: str
    num_constructors: int
    constructor_group: int
    fetch_stages: str = "ends"
    """Which pipeline stages fetch (`FetchStages`); clients must use the service's choice."""
    ray_env: dict[str, str] = field(default_factory=dict)
    """RAY_AUTH_* settings a joining process needs (Ray's token auth on the started cluster)."""

    def apply_env(self) -> None:
        """Set the Ray auth variables in this process before `ray.init(address=...)`."""
        os.environ.update(self.ray_env)

    def constructor_for_bucket(self, bucket: int) -> str:
        return f"constructor/{bucket // self.constructor_group}"
