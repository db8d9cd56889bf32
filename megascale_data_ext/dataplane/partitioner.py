"""Offline source auto-partitioning: profiles + mixture + cluster -> loader actors.

One loader actor per source costs a process per source (the runtime's default), and a
per-rank DataLoader costs S sources x W workers per rank; both grow where the cluster does
not. The partitioner follows OVERLORD's three steps (Sec. 5.1) with MegaScale-Data's bounds:

1. **Split outliers** (data parallel): a source whose memory M = M_d + M_b does not fit one
   actor under the pod cap, or whose per-step transform load needs more than ``w_actor``
   workers, becomes ``n`` shards; shard ``k`` serves stream positions ``p % n == k``, so it
   buffers 1/n of the source's samples (M_b / n) but keeps the whole access state (M_d).
   The degree is bounded by the source's samples per step (a shard must get samples).
2. **Group** (source parallel): shards sorted by per-sample latency P are packed greedily
   into actors while the actor's memory stays under the cap and its workers under
   ``w_actor``, so many small sources share one process and sources of similar cost sit
   together.
3. **Accelerate** (worker parallel): actor j gets ``w_j = ceil(O_j / O_up)`` workers, O_j the
   worker-seconds its shards' samples of one step cost and O_up the step time budget, so
   every actor keeps up: ``O_j / w_j <= O_up``.

Actors are then placed on nodes (memory and CPUs respected, least-loaded first). Every cap
that cannot be met raises a ConfigError naming the source, actor or node and what to raise.
Pure Python: a 306-source world partitions in milliseconds in one process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megascale_data_ext.dataplane.profiles import SourceProfile
from megascale_data_ext.errors import ConfigError

__all__ = ["LoaderAssignment", "NodeResources", "PartitionLimits", "PartitionPlan", "ShardRef", "partition"]

MiB = 1 << 20


@dataclass(slots=True, kw_only=True, frozen=True)
class NodeResources:
    """What one node offers loader actors (after trainers, constructors and planner took theirs)."""

    name: str
    memory_bytes: int
    cpus: float


@dataclass(slots=True, kw_only=True, frozen=True)
class PartitionLimits:
    """The bounds of the partition.

    Attributes:
        samples_per_step: Samples in one global batch (the mixture splits them among sources).
        step_seconds: O_up: a loader must transform its share of a step within this.
        actor_memory_bytes: M_pod: memory cap of one loader actor.
        actor_base_bytes: Memory of an idle loader actor process (measured, see `bench memory`).
        worker_bytes: Extra memory per worker of an actor.
        buffer_steps: Steps of samples a loader keeps buffered (read-ahead + staged).
        max_workers_per_actor: w_actor.
        max_workers_per_source: w_src (summed over the source's shards).
        cpus_per_worker: CPUs one worker takes on its node.
    """

    samples_per_step: int
    step_seconds: float
    actor_memory_bytes: int
    actor_base_bytes: int = 64 * MiB
    worker_bytes: int = 0
    buffer_steps: int = 2
    max_workers_per_actor: int = 8
    max_workers_per_source: int = 32
    cpus_per_worker: float = 1.0

    def problems(self) -> list[str]:
        out = [f"`{k}` must be > 0, got {getattr(self, k)!r}" for k in
               ("samples_per_step", "step_seconds", "actor_memory_bytes", "buffer_steps", "max_workers_per_actor",
                "max_workers_per_source") if not getattr(self, k) > 0]
        out += [f"`{k}` must be >= 0, got {getattr(self, k)!r}"
                for k in ("actor_base_bytes", "worker_bytes", "cpus_per_worker") if not getattr(self, k) >= 0]
        return out


@dataclass(slots=True, kw_only=True, frozen=True)
class ShardRef:
    """Shard `shard` of `num_shards` of source `source`: its stream positions p with p % num_shards == shard."""

    source: int
    shard: int = 0
    num_shards: int = 1


@dataclass(slots=True, kw_only=True)
class LoaderAssignment:
    """One loader actor of the partition.

    Attributes:
        actor: Index of the actor.
        shards: The (shards of) sources it serves.
        workers: Worker threads/processes transforming its samples.
        node: Name of the node it is placed on.
        memory_bytes: Its estimated memory (base + workers + access states + buffers).
        load_s: O_j: worker-seconds its samples of one step cost.
    """

    actor: int
    shards: tuple[ShardRef, ...]
    workers: int
    node: str = ""
    memory_bytes: int = 0
    load_s: float = 0.0

    @property
    def sources(self) -> list[int]:
        return sorted({s.source for s in self.shards})

    @property
    def per_worker_s(self) -> float:
        return self.load_s / self.workers


@dataclass(slots=True, kw_only=True)
class PartitionPlan:
    """The partition: its actors and what it cost per node."""

    assignments: list[LoaderAssignment]
    nodes: list[NodeResources] = field(default_factory=list)

    def shards_of(self, source: int) -> list[tuple[int, ShardRef]]:
        """(actor, shard) of every shard of `source`, by shard index."""
        got = [(a.actor, s) for a in self.assignments for s in a.shards if s.source == source]
        return sorted(got, key=lambda x: x[1].shard)

    def node_memory(self) -> dict[str, int]:
        out = {n.name: 0 for n in self.nodes}
        for a in self.assignments:
            out[a.node] = out.get(a.node, 0) + a.memory_bytes
        return out

    def summary(self) -> dict[str, float | int]:
        per_worker = [a.per_worker_s for a in self.assignments]
        return {"actors": len(self.assignments), "workers": sum(a.workers for a in self.assignments),
                "split_sources": len({s.source for a in self.assignments for s in a.shards if s.num_shards > 1}),
                "memory_mib": sum(a.memory_bytes for a in self.assignments) / MiB,
                "max_per_worker_s": max(per_worker, default=0.0), "mean_per_worker_s":
                    sum(per_worker) / len(per_worker) if per_worker else 0.0}


@dataclass(slots=True)
class _Unit:
    shard: ShardRef
    cost_s: float  # per-sample latency: the grouping key
    load_s: float  # worker-seconds per step
    memory: int  # access state + buffer of this shard


SHOWN_PROBLEMS = 5
"""Sources a partition error names one by one (the rest are counted)."""


def _split(profiles: Sequence[SourceProfile], weights: Sequence[float], lim: PartitionLimits) -> list[_Unit]:
    """Step 1: every source as shards that fit one actor (memory and w_actor)."""
    total = float(sum(weights))
    fixed = lim.actor_base_bytes + lim.worker_bytes
    problems, units = [], []
    for i, (p, w) in enumerate(zip(profiles, weights, strict=True)):
        per_step = lim.samples_per_step * w / total
        load = per_step * p.cost_s
        buffer = lim.buffer_steps * per_step * p.bytes_per_sample
        room = lim.actor_memory_bytes - fixed - p.access_state_bytes
        need_workers = math.ceil(load / lim.step_seconds - 1e-9)
        if need_workers > lim.max_workers_per_source:
            problems.append(f"source {p.name!r} needs {need_workers} workers to transform its {per_step:.1f} samples "
                            f"per step ({p.cost_s * 1e3:.2f} ms each) within step_seconds={lim.step_seconds}; raise "
                            f"max_workers_per_source (w_src={lim.max_workers_per_source}) or step_seconds")
            continue
        if room <= 0 or (buffer > 0 and room < p.bytes_per_sample):
            problems.append(f"source {p.name!r}: its access state ({p.access_state_bytes / MiB:.1f} MiB) plus an actor "
                            f"({fixed / MiB:.1f} MiB) leaves no room for buffered samples under actor_memory_bytes="
                            f"{lim.actor_memory_bytes / MiB:.0f} MiB; raise the actor memory cap")
            continue
        n = max(1, math.ceil(buffer / room - 1e-9), math.ceil(need_workers / lim.max_workers_per_actor))
        bound = max(1, math.floor(per_step))
        if n > bound:
            problems.append(f"source {p.name!r} would need {n} data-parallel shards but gets only {per_step:.1f} "
                            f"samples per step (a shard needs at least one); raise actor_memory_bytes or "
                            f"max_workers_per_actor, or lower buffer_steps")
            continue
        units += [_Unit(ShardRef(source=i, shard=k, num_shards=n), p.cost_s, load / n,
                        int(p.access_state_bytes + buffer / n)) for k in range(n)]
    if problems:  # a few named, then how many more: a blend of 1,000+ sources fails alike
        shown = problems[:SHOWN_PROBLEMS] + ([f"... and {len(problems) - SHOWN_PROBLEMS} more sources like these"]
                                             if len(problems) > SHOWN_PROBLEMS else [])
        raise ConfigError(f"cannot partition {len(problems)} of {len(profiles)} sources:\n  - " + "\n  - ".join(shown))
    return units


def _workers(load_s: float, lim: PartitionLimits) -> int:
    return max(1, math.ceil(load_s / lim.step_seconds - 1e-9))


def _memory(units: Sequence[_Unit], workers: int, lim: PartitionLimits) -> int:
    return lim.actor_base_bytes + workers * lim.worker_bytes + sum(u.memory for u in units)


def _group(units: list[_Unit], lim: PartitionLimits) -> list[list[_Unit]]:
    """Step 2: pack shards in ascending latency into actors under the memory cap and w_actor."""
    groups: list[list[_Unit]] = []
    current: list[_Unit] = []
    load, memory, sources = 0.0, 0, set()  # of `current`, kept as it grows: linear in the shards
    for u in sorted(units, key=lambda u: (u.cost_s, u.shard.source, u.shard.shard)):
        w = _workers(load + u.load_s, lim)
        fits = (w <= lim.max_workers_per_actor
                and lim.actor_base_bytes + w * lim.worker_bytes + memory + u.memory <= lim.actor_memory_bytes
                and u.shard.source not in sources)
        if current and not fits:
            groups.append(current)
            current, load, memory, sources = [], 0.0, 0, set()
        current.append(u)
        load, memory = load + u.load_s, memory + u.memory
        sources.add(u.shard.source)
    if current:
        groups.append(current)
    return groups


def _place(assignments: list[LoaderAssignment], nodes: Sequence[NodeResources], lim: PartitionLimits) -> None:
    """Step 4: largest actors first, each on the least-loaded node with memory and CPUs left."""
    free_mem = {n.name: n.memory_bytes for n in nodes}
    free_cpu = {n.name: n.cpus for n in nodes}
    load = {n.name: 0.0 for n in nodes}
    cpus = {n.name: max(n.cpus, 1e-9) for n in nodes}
    unplaced = []
    for a in sorted(assignments, key=lambda a: (-a.memory_bytes, a.actor)):
        need_cpu = a.workers * lim.cpus_per_worker
        fit = [n.name for n in nodes if free_mem[n.name] >= a.memory_bytes and free_cpu[n.name] >= need_cpu - 1e-9]
        if not fit:
            unplaced.append(a)
            continue
        node = min(fit, key=lambda n: (load[n] / cpus[n], -free_mem[n], n))
        a.node = node
        free_mem[node] -= a.memory_bytes
        free_cpu[node] -= need_cpu
        load[node] += a.load_s
    if unplaced:
        lines = [f"loader actor {a.actor} (sources {a.sources}, {a.memory_bytes / MiB:.0f} MiB, {a.workers} workers)"
                 for a in unplaced[:10]]
        free = ", ".join(f"{n}: {free_mem[n] / MiB:.0f} MiB / {free_cpu[n]:g} CPUs free" for n in free_mem)
        raise ConfigError(f"{len(unplaced)} loader actors fit no node: " + "; ".join(lines)
                          + f" (after placing the others: {free}); add nodes, raise the nodes' memory or CPUs for "
                            f"loaders, or lower actor_memory_bytes so actors split finer")


def partition(profiles: Sequence[SourceProfile], weights: Sequence[float], nodes: Sequence[NodeResources],
              limits: PartitionLimits) -> PartitionPlan:
    """Loader actors for `profiles` mixed by `weights` on `nodes` under `limits`.

    Raises:
        ConfigError: listing every source, actor or node whose cap cannot be met, and what to raise.
    """
    problems = limits.problems()
    if len(profiles) != len(weights):
        problems.append(f"{len(profiles)} profiles but {len(weights)} weights")
    if not sum(weights) > 0 or any(not w >= 0 for w in weights):
        problems.append(f"`weights` must be non-negative and sum to > 0, got {list(weights)!r}")
    if not nodes:
        problems.append("no nodes to place loader actors on")
    if problems:
        raise ConfigError("invalid partition input:\n  - " + "\n  - ".join(problems))
    groups = _group(_split(profiles, weights, limits), limits)
    out = []
    for j, g in enumerate(groups):
        load = sum(u.load_s for u in g)
        w = _workers(load, limits)
        out.append(LoaderAssignment(actor=j, shards=tuple(u.shard for u in g), workers=w,
                                    memory_bytes=_memory(g, w, limits), load_s=load))
    _place(out, nodes, limits)
    return PartitionPlan(assignments=out, nodes=list(nodes))


def weights_by_name(names: Sequence[str], weights: Mapping[str, float]) -> list[float]:
    """Weights in `names` order from a {name: weight} mapping; a ConfigError names missing sources."""
    missing = [n for n in names if n not in weights]
    if missing:
        raise ConfigError(f"no mixture weight for sources {missing}")
    return [float(weights[n]) for n in names]
