"""InProcessService: the same Source Loaders, Planner and Data Constructors wired in one process.

No Ray: every call is a direct method call (`runtime.wiring.in_process_parts`). It exists for
unit tests, debugging a strategy against real files, and simulating a large world's plans on one
machine; the Ray façades in `runtime.actors` wrap exactly these classes from the same
`ServiceTopology` (`runtime.wiring`), so behaviour is the same apart from concurrency. It is
also a `MicrobatchSource`, so a trainer-side `Client` can be driven by it without Ray.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import DataConstructor, EncoderImages, merge_encoder_images
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.runtime.wiring import in_process_parts


class InProcessService:
    """Loaders, planner and constructors of `config` for `tree`, as plain objects.

    Consumers in one process: `max_lead` None (default) builds any step asked for, however far
    ahead of the slowest consumer (one thread cannot wait for another); given, consumers in
    threads are held to it as on Ray.

    Attributes:
        topology: The service topology derived from `config` and `tree`.
        loaders: One `SourceLoader` per source.
        planner: The `Planner`.
        constructors: One `DataConstructor` per constructor group of the topology.
    """

    def __init__(self, config: ServiceConfig, tree: ClientPlaceTree, *, max_lead: int | None = None,
                 wait_timeout_s: float = 60.0) -> None:
        self.config = config
        self.topology = topo = ServiceTopology.of(config, tree)
        self.tree = topo.tree
        self.loaders, self.planner, self.constructors = in_process_parts(config, topo, max_lead=max_lead,
                                                                         wait_timeout_s=wait_timeout_s)

    def constructor_of(self, rank: int) -> DataConstructor:
        return self.constructors[self.topology.constructor_of_rank(rank)]

    def get(self, step: int, microbatch: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """What a fetching client `rank` receives: (batch, info)."""
        return self.constructor_of(rank).get(step, microbatch, rank)

    def get_encoder_images(self, step: int, rank: int) -> EncoderImages:
        """Rank `rank`'s encoder share of `step`, gathered from every constructor."""
        return merge_encoder_images([c.get_encoder_images(step, rank) for c in self.constructors])

    def report_loss(self, step: int, losses: dict[int, float]) -> None:
        """Hand the Planner the per-source loss of `step` (loss-driven mixing)."""
        self.planner.report_loss(step, losses)
