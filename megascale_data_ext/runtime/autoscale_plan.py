"""What the loaders start as: the offline partition of the sources into loader actors.

`build_autoscale_plan` profiles the sources (journal, metadata, a measured sample per kind),
partitions them over the nodes under the ``autoscale.*`` caps (`dataplane.partitioner`), pins
each actor to its node and sets the scaling policy's capacities: the `AutoscalePlan` the
Planner's `AutoScaler` starts from. `per_source_plan` is ``autoscale.enabled=false``: one loader
per source, never rescaled. Both go through the same loader path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megascale_data_ext.dataplane.partitioner import ShardRef
from megascale_data_ext.dataplane.scaling import ScalingConfig

__all__ = ["AutoscalePlan", "LoaderActorSpec", "build_autoscale_plan", "partition_for", "per_source_plan"]


@dataclass(slots=True, kw_only=True)
class LoaderActorSpec:
    """One loader actor to start: its (shards of) sources, read-ahead workers and Ray options (placement)."""

    shards: list[ShardRef]
    workers: int = 1
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class AutoscalePlan:
    """What the Planner starts and how it scales (built by `DataService` from the partition).

    Attributes:
        actors: The offline partition's loader actors.
        scaling: The policy's thresholds; its capacities are per source.
        online: Act on the policy (create / reclaim shards); False keeps the partition.
        interval_steps, lead_steps: As `AutoScaler`.
        shard_workers: Workers of a shard the scaler creates.
        shard_options: Ray options of a shard the scaler creates, per source (its node).
        restart_options: Ray restart options of every loader actor (fault tolerance).
        shadows: Start a warm shadow beside every loader actor (``fault_tolerance.shadow_loaders``).
    """

    actors: list[LoaderActorSpec]
    scaling: ScalingConfig
    online: bool = True
    interval_steps: int = 4
    lead_steps: int = 2
    shard_workers: int = 1
    shard_options: list[dict[str, Any]] = field(default_factory=list)
    restart_options: dict[str, Any] = field(default_factory=dict)
    shadows: bool = False

    def initial_shards(self, num_sources: int) -> list[int]:
        """Shards per source in the partition (1 for a source no actor names, which then starts alone)."""
        out = [1] * num_sources
        for a in self.actors:
            for sh in a.shards:
                out[sh.source] = sh.num_shards
        return out


def per_source_plan(config: Any, restart_options: dict | None = None) -> AutoscalePlan:
    """``autoscale.enabled=false``: one loader actor per source, one shard each, never rescaled
    (no profiling, no partition): the per-source layout of the paper's Fig. 3."""
    n = len(config.sources)
    return AutoscalePlan(actors=[LoaderActorSpec(shards=[ShardRef(source=s, shard=0, num_shards=1)])
                                 for s in range(n)],
                         scaling=ScalingConfig(capacity=tuple(float("inf") for _ in range(n))), online=False,
                         restart_options=dict(restart_options or {}))


def partition_for(config: Any, profiles: Sequence[Any], nodes: Sequence[Any]) -> Any:
    """The offline partition of ``config``'s sources (pure): their profiles, the mixture's weights at
    step 0 and the ``autoscale.*`` caps, on `nodes` (`NodeResources`).

    Raises ConfigError with the partitioner's message and the ``autoscale.*`` keys to change.
    """
    from megascale_data_ext.dataplane.mixing import build_schedule
    from megascale_data_ext.dataplane.partitioner import MiB, PartitionLimits, partition
    from megascale_data_ext.errors import ConfigError

    auto = config.autoscale
    weights = build_schedule(config.mixing_config(), source_names=config.source_names).weights(0)
    limits = PartitionLimits(samples_per_step=config.samples_per_step, step_seconds=auto.step_seconds,
                             actor_memory_bytes=int(auto.actor_memory_mib * MiB),
                             actor_base_bytes=int(auto.actor_base_mib * MiB), buffer_steps=config.prefetch + 1,
                             max_workers_per_actor=auto.max_workers_per_actor,
                             max_workers_per_source=auto.max_workers_per_source, cpus_per_worker=0.0)
    try:
        return partition(profiles, [float(w) for w in weights], list(nodes), limits)
    except ConfigError as exc:
        raise ConfigError(f"autoscale: the loaders cannot be partitioned: {exc}\n(config keys: "
                          "autoscale.actor_memory_mib, autoscale.max_workers_per_actor, "
                          "autoscale.max_workers_per_source, autoscale.node_memory_fraction, "
                          "placement.trainer_nodes)") from exc


def build_autoscale_plan(config: Any, *, nodes: Any, placement: Any = None, restart_options: dict | None = None,
                         progress: Callable[[str], None] | None = None) -> tuple[AutoscalePlan, Any]:
    """The service's `AutoscalePlan` from ``config.autoscale``: profiles (journal, the rest measured
    now), the offline partition (`partition_for`) on `nodes` (`placement.ClusterNodes`; the trainer
    nodes only when ``placement.trainer_nodes`` names them), node affinity per actor and the
    policy's capacities. Returns ``(plan, partition)``.
    """
    from megascale_data_ext.dataplane.scaling import shard_capacity
    from megascale_data_ext.sources.profiling import profile_sources

    auto = config.autoscale
    profiles, measured, stale = profile_sources(config.sources, auto.profiles, samples=auto.profile_samples,
                                                measure_per_kind=auto.profile_per_kind, progress=progress)
    if progress is not None:
        now = set(measured)
        extended = sum(1 for p in profiles if p.name in now and p.samples_profiled == 0)
        progress(f"profiles: {len(config.sources) - len(measured)} from the journal, {len(measured) - extended} "
                 f"measured now, {extended} from their metadata and measured sources of their kind"
                 + (f" (stale: {', '.join(stale)})" if stale else "")
                 + (f", saved to {auto.profiles}" if auto.profiles and measured else ""))
    trainer_nodes = set(config.placement.trainer_nodes)
    offered = [n for n in nodes.resources if not trainer_nodes or n.name in trainer_nodes]
    parts = partition_for(config, profiles, offered)

    def on_node(name: str) -> dict[str, Any]:
        return placement.on_node(name) if placement is not None else nodes.on_node(name, soft=True)

    actors = [LoaderActorSpec(shards=list(a.shards), workers=a.workers, options=on_node(a.node))
              for a in parts.assignments]
    node_of = {sh.source: a.node for a in parts.assignments for sh in a.shards}
    capacity = tuple(shard_capacity(p.cost_s, config.samples_per_step, auto.step_seconds, auto.max_workers_per_actor)
                     for p in profiles)
    scaling = ScalingConfig(capacity=capacity, window=auto.window, patience=auto.patience,
                            hysteresis=auto.hysteresis, max_shards=auto.max_shards)
    plan = AutoscalePlan(actors=actors, scaling=scaling, online=auto.scaling, interval_steps=auto.interval_steps,
                         lead_steps=auto.lead_steps, shard_workers=1,
                         shard_options=[on_node(node_of[s]) for s in range(len(config.sources))],
                         restart_options=dict(restart_options or {}))
    return plan, parts
