"""InProcessService: the same Source Loaders, Planner and Data Constructors wired in one process.

No Ray: every call is a direct method call. It exists for unit tests, debugging a strategy
against real files, and simulating a large world's plans on one machine; the Ray façades in
`runtime.actors` wire exactly these classes, so behaviour is the same apart from concurrency.
"""

from __future__ import annotations

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import DataConstructor, encoder_rows
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.sources.tokenizer import load_tokenizer


class InProcessService:
    """Loaders, planner and constructors of `config` for `tree`, as plain objects.

    Attributes:
        loaders: One `SourceLoader` per source.
        planner: The `Planner`.
        constructors: One `DataConstructor` per `config.constructor_group` DP buckets.
    """

    def __init__(self, config: ServiceConfig, tree: ClientPlaceTree) -> None:
        self.config, self.tree = config, config.service_tree(tree)
        tree = self.tree
        self.loaders = [SourceLoader(i, s, seed=config.seed, shuffle=config.shuffle) for i, s in enumerate(config.sources)]
        self.planner = Planner(config, tree, lambda s, start, n: self.loaders[s].summary_buffer(start, n))
        for ld in self.loaders:
            ld.get_plan = self.planner.loader_plan
        tok = load_tokenizer(config.sources[0].tokenizer)
        image_id = tok.image_id if any(s.image_column for s in config.sources) else None
        self.layout = tree.buckets(config.strategy_args.get("axis", "DP"))
        n, g = self.layout.num_buckets, config.constructor_group
        self.constructors = [
            DataConstructor(
                list(range(i, min(i + g, n))), config, tree,
                get_plan=lambda step, b: self.planner.plan(step).constructor_do_plan(b),
                fetch=lambda s, step, bs: self.loaders[s].fetch(step, bs),
                pad_id=tok.pad_id, image_token_id=image_id,
                get_encoder_plan=lambda step, bs: encoder_rows(self.planner.plan(step), bs),
            )
            for i in range(0, n, g)
        ]

    def constructor_of(self, rank: int) -> DataConstructor:
        return self.constructors[self.layout.bucket_of_rank(rank) // self.config.constructor_group]

    def get(self, step: int, microbatch: int, rank: int):
        """What a fetching client `rank` receives: (batch, info)."""
        return self.constructor_of(rank).get(step, microbatch, rank)
