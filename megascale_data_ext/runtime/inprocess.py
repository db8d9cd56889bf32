"""InProcessService: the same Source Loaders, Planner and Data Constructors wired in one process.

No Ray: every call is a direct method call. It exists for unit tests, debugging a strategy
against real files, and simulating a large world's plans on one machine; the Ray façades in
`runtime.actors` wire exactly these classes from the same `ServiceTopology`, so behaviour is
the same apart from concurrency. It is also a `MicrobatchSource`, so a trainer-side `Client`
can be driven by it without Ray.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import DataConstructor, EncoderImages, encoder_rows, merge_encoder_images
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.runtime.metrics import record_plan
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.runtime.wiring import constructor_tokens


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
        self.loaders = [SourceLoader(i, s, seed=config.seed, shuffle=config.shuffle) for i, s in enumerate(config.sources)]
        self.planner = Planner(config, topo, lambda s, start, n: self.loaders[s].summary_buffer(start, n),
                               on_planned=record_plan, constructors=topo.num_constructors)
        for ld in self.loaders:
            ld.get_plan = self.planner.loader_plan
        pad_id, image_id = constructor_tokens(config)  # as on Ray (`runtime.wiring`)
        self.constructors = [
            DataConstructor(
                list(buckets), config, topo,
                get_plan=lambda step, b: self.planner.plan(step).constructor_do_plan(b),
                fetch=lambda step, ss, bs: {s: self.loaders[s].fetch(step, bs) for s in ss},
                pad_id=pad_id, image_token_id=image_id,
                get_encoder_plan=lambda step, bs: encoder_rows(self.planner.plan(step), bs),
                max_lead=max_lead, wait_timeout_s=wait_timeout_s,
                on_floor=lambda step, j=j: self.planner.constructor_floor(j, step),
            )
            for j, buckets in enumerate(topo.constructor_groups)
        ]

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
