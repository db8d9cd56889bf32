"""ServiceTopology: who serves whom, computed once from config + tree + strategy.

Every runtime part needs the same answers — along which axis samples are distributed, which
ranks fetch and from which Data Constructor, over which dims the other ranks receive by
broadcast, which pipeline stages read, what the actors are called — and each used to derive
them itself. `ServiceTopology.of(config, tree)` derives them once; the service, the in-process
wiring, the actors, the handles that travel to trainer ranks and the client all read this one
value (plain data: no Ray, no torch, picklable).

It is the one owner of the service's decisions on the trainer's mesh (`distribution`): the
strategy's distribution axis, its broadcast dims (selective broadcasting: ``("tp",)`` is
Megatron's TP-rank-0 broadcast, ``("tp", "cp")`` makes one rank per TP x CP group fetch), and,
with ``middle_stage_masks``, every pipeline stage reading (middle stages get only the masks).
The `tree` it carries is Megatron's layout only. When ``cp`` is among the broadcast dims the
fetcher receives the whole packed microbatch and every rank cuts its own CP slice after the
broadcast (`client_slices_cp`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megascale_data_ext.dataplane.distribution import Distribution, FetchStages
from megascale_data_ext.dataplane.placetree import BucketAxis, BucketLayout, ClientPlaceTree
from megascale_data_ext.dataplane.strategies import build_strategy, strategy_args

DEFAULT_BROADCAST_DIMS: tuple[str, ...] = ("tp",)
"""Broadcast dims of a strategy that declares none: Megatron's TP-rank-0 broadcast."""

PLANNER_NAME = "planner"


def make_strategy(config: Any) -> Callable[..., Any]:
    """The config's strategy, with ``num_microbatches`` and (except vanilla) the token ``cap``
    defaulted from the batch shape."""
    return build_strategy(config.strategy, **strategy_args(config.strategy, config.strategy_args,
                                                           num_microbatches=config.num_microbatches,
                                                           seq_length=config.seq_length))


def strategy_axis(strategy: Any) -> BucketAxis:
    """The axis a strategy distributes samples over: its ``axis`` attribute, else DP."""
    return BucketAxis.parse(getattr(strategy, "axis", None) or "DP")


def strategy_broadcast(strategy: Any) -> tuple[str, ...]:
    """The dims a strategy broadcasts along on the trainer side: its ``broadcast`` attribute."""
    dims = getattr(strategy, "broadcast", None)
    return DEFAULT_BROADCAST_DIMS if dims is None else tuple(dims)


def constructor_name(index: int) -> str:
    return f"constructor/{index}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceTopology:
    """The service's shape for one trainer layout.

    Attributes:
        tree: The trainer's mesh (Megatron's layout).
        distribution: Consumer axis (the strategy's), broadcast dims and reading stages.
        constructor_groups: Buckets served by each Data Constructor, in constructor order.
        num_sources: Sources (their loader actors are the Planner's, found through it).
        namespace: Ray namespace of the named actors (the Planner and the constructors).
        job: Which running service this is (``<namespace>#<random id>``, stamped by
            `DataService`; empty for in-process wiring): clients present it on every request
            and a constructor of another job refuses them (`JobMismatchError`).
        variable_counts: Each consumer runs its own number of microbatches a step (the
            strategy plans them so: hybrid CP); a client learns its count from the constructor.
        report_delay: Feedback mixing: step s is planned only once the trainer reported the
            per-source loss of step s - d; None: nothing to report. Constructors prefetch no step
            that cannot be planned yet; a trainer loop that reports none refuses such a service
            (`provider.find_topology`).
        replay_steps: Replay mode: the steps its saved plans cover (stamped by `DataService`);
            nothing past them is prefetched or asked ahead for. None: planned live, no end.
    """

    tree: ClientPlaceTree
    distribution: Distribution
    constructor_groups: tuple[tuple[int, ...], ...]
    num_sources: int
    namespace: str
    job: str = ""
    variable_counts: bool = False
    report_delay: int | None = None
    replay_steps: int | None = None

    @classmethod
    def of(cls, config: Any, tree: ClientPlaceTree, strategy: Any = None) -> ServiceTopology:
        """Derive the topology of `config` (a `ServiceConfig`) on the trainer mesh `tree`."""
        strategy = make_strategy(config) if strategy is None else strategy
        stages = FetchStages.ALL if config.middle_stage_masks and tree.pp > 2 else FetchStages.ENDS
        dist = Distribution(strategy_axis(strategy), strategy_broadcast(strategy), stages)
        n, g = tree.buckets(dist.axis).num_buckets, config.constructor_group
        groups = tuple(tuple(range(i, min(i + g, n))) for i in range(0, n, g))
        return cls(tree=tree, distribution=dist, constructor_groups=groups, num_sources=len(config.sources),
                   namespace=config.ray.namespace, variable_counts=bool(getattr(strategy, "variable_counts", False)),
                   report_delay=config.report_delay)

    # -- distribution ----------------------------------------------------------------
    @property
    def broadcast_dims(self) -> tuple[str, ...]:
        """The dims fetched microbatches are broadcast along (none over WORLD; never ``cp`` on the CP axis)."""
        return self.distribution.broadcast_dims

    @property
    def client_slices_cp(self) -> bool:
        """Whether fetchers receive whole packs and every rank cuts its own CP slice after the
        broadcast (``cp`` among the broadcast dims); else the constructor slices per CP rank."""
        return self.tree.cp > 1 and "cp" in self.broadcast_dims

    def broadcast_group(self, rank: int) -> list[int]:
        """The ranks `rank` shares one fetched microbatch with (itself alone without broadcasting)."""
        dims = self.broadcast_dims
        return self.tree.group("-".join(d for d in ("tp", "cp") if d in dims), rank) if dims else [rank]

    @property
    def layout(self) -> BucketLayout:
        """The buckets of the distribution axis and the ranks each serves."""
        return self.tree.buckets(self.distribution.axis)

    def fetch_ranks(self) -> list[int]:
        """Ranks that pull from a Data Constructor, ascending."""
        return self.distribution.fetch_ranks(self.tree)

    def fetchers(self, bucket: int) -> list[int]:
        """The fetching ranks bucket `bucket`'s microbatches go to."""
        mask = self.distribution.fetch_mask(self.tree)
        return [r for r in self.layout.bucket_ranks[bucket] if mask[r]]

    def fetches(self, rank: int) -> bool:
        return self.distribution.fetches(self.tree, rank)

    def needs_data(self, rank: int) -> bool:
        """False on pipeline stages that read nothing (middle stages without masks)."""
        return self.distribution.needs_data(self.tree, rank)

    def broadcast_source(self, rank: int) -> int:
        """The fetching rank `rank` receives its microbatches from (itself when it fetches)."""
        return self.distribution.broadcast_source(self.tree, rank)

    def describe(self, *, max_dp: int = 4) -> str:
        """The trainer's tree with this service's fetching ranks marked, and how it distributes."""
        d = self.distribution
        return (self.tree.describe(fetching=self.fetch_ranks(), max_dp=max_dp)
                + f"\nconsumers: {d.axis.value}, broadcast over {list(self.broadcast_dims)}, stages reading: "
                f"{d.stages.value}")

    # -- constructors and actor names ------------------------------------------------
    @property
    def num_constructors(self) -> int:
        return len(self.constructor_groups)

    def constructor_of_bucket(self, bucket: int) -> int:
        size = len(self.constructor_groups[0])
        return bucket // size

    def constructor_of_rank(self, rank: int) -> int:
        return self.constructor_of_bucket(self.layout.bucket_of_rank(rank))

    def constructor_names(self) -> list[str]:
        return [constructor_name(j) for j in range(self.num_constructors)]

