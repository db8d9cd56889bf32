"""DataService: starts (or joins) Ray and launches Planner, Source Loaders and Data Constructors.

Actors are named (``loader/<i>``, ``planner``, ``constructor/<j>``, see `runtime.topology`)
in the Ray namespace of the config, so trainer processes find them by name after
``ray.init(address=...)``: the `ServiceHandles` that travel to torchrun ranks carry the address
and the `ServiceTopology`; a process given only the namespace asks the Planner for it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.actors import DataConstructorActor, PlannerActor, SourceLoaderActor
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.handles import ServiceHandles
from megascale_data_ext.runtime.ray_address import check_reachable
from megascale_data_ext.runtime.topology import PLANNER_NAME, ServiceTopology
from megascale_data_ext.sources.tokenizer import load_tokenizer


def check_sources(specs: list) -> None:
    """Open every source once in the driver so a bad one fails here, named, before any actor starts.

    Reads only what opening reads (Parquet footers, Megatron index headers); raises the
    source's own SourceError (file, source and what to do) or one listing empty sources.
    """
    from megascale_data_ext.errors import SourceError
    from megascale_data_ext.sources.registry import open_source

    empty = []
    for spec in specs:
        src = open_source(spec)
        try:
            if len(src) == 0:
                empty.append(f"{spec.name!r} ({', '.join(spec.paths)})")
        finally:
            src.close()
    if empty:
        raise SourceError(f"empty sources: {', '.join(empty)}; give them data or remove them from `sources`")


class DataService:
    """Owns the actors of one data service; `start()` returns once every actor is ready.

    Ray is started from ``config.ray`` (`RayConfig.init_kwargs`: an embedded local Ray with its
    ``num_cpus`` / ``resources``, or the cluster at ``address``) unless the process already
    joined one.
    """

    def __init__(self, config: ServiceConfig, tree: ClientPlaceTree):
        self.config = config
        self.topology = ServiceTopology.of(config, tree)
        self.tree = self.topology.tree
        self.loaders: list[Any] = []
        self.planner: Any = None
        self.constructors: list[Any] = []
        self.startup_seconds = 0.0
        self._owns_ray = False

    def start(self, *, state: dict | None = None) -> ServiceHandles:
        """Start every actor; `state` (a saved `state_dict`) resumes the planner before prefetch starts."""
        t0 = time.perf_counter()
        cfg, topo = self.config, self.topology
        if not ray.is_initialized():
            check_reachable(cfg.ray.address)  # a named error in seconds, not ray.init retrying for minutes
            ray.init(**cfg.ray.init_kwargs(), include_dashboard=False, log_to_driver=True, configure_logging=False)
            self._owns_ray = True
        ns = topo.namespace
        check_sources(cfg.sources)
        self.loaders = [
            SourceLoaderActor.options(name=name, namespace=ns).remote(i, spec, cfg.seed, cfg.shuffle)
            for i, (name, spec) in enumerate(zip(topo.loader_names(), cfg.sources, strict=True))
        ]
        ray.get([h.size.remote() for h in self.loaders])  # surfaces source errors (missing files...) now
        self.planner = PlannerActor.options(name=PLANNER_NAME, namespace=ns).remote(cfg, topo, self.loaders)
        ray.get([h.set_planner.remote(self.planner) for h in self.loaders])
        start_step = 0
        if state is not None:
            ray.get(self.planner.load_state_dict.remote(state))
            start_step = int(state["step"])
        tok = load_tokenizer(cfg.sources[0].tokenizer)
        image_id = tok.image_id if any(s.image_column for s in cfg.sources) else None
        self.constructors = [
            DataConstructorActor.options(name=name, namespace=ns).remote(
                list(buckets), cfg, topo, self.planner, self.loaders, tok.pad_id, image_id, start_step
            )
            for name, buckets in zip(topo.constructor_names(), topo.constructor_groups, strict=True)
        ]
        ray.get([c.stats.remote() for c in self.constructors])
        self.startup_seconds = time.perf_counter() - t0
        return ServiceHandles(
            address=ray.get_runtime_context().gcs_address,
            topology=topo,
            ray_env={k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH_")},
        )

    def plan_summary(self, step: int) -> dict:
        return ray.get(self.planner.plan_summary.remote(step))

    def state_dict(self, step: int | None = None) -> dict:
        """The Planner's state before `step` (default: its next unplanned step)."""
        return ray.get(self.planner.state_dict.remote(step))

    def load_state_dict(self, state: dict) -> None:
        ray.get(self.planner.load_state_dict.remote(state))

    def stats(self) -> dict:
        return {
            "loaders": ray.get([h.stats.remote() for h in self.loaders]),
            "constructors": ray.get([c.stats.remote() for c in self.constructors]),
            "startup_seconds": self.startup_seconds,
        }

    def stop(self) -> None:
        for h in self.constructors + self.loaders + ([self.planner] if self.planner is not None else []):
            ray.kill(h)
        self.constructors, self.loaders, self.planner = [], [], None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
