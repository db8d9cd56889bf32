"""Distribution: which ranks of a trainer mesh read a step's data, and which receive it by broadcast.

A `ClientPlaceTree` is Megatron's layout and nothing else. How a service hands data out on that
layout is a separate, small decision (paper Sec. 4): the axis whose nodes are the consumers
(``distribute(axis)``), the dims along which the trainer broadcasts what one rank fetched
(``("tp",)`` is Megatron's TP-rank-0 broadcast, ``("tp", "cp")`` selective broadcasting, ``()``
every reading rank fetches), and which pipeline stages read at all. The running service owns one
`Distribution` (`ServiceTopology.distribution`); a strategy's `DGraph` derives its plan's fetching
ranks with the same rules, so the two can be compared.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megascale_data_ext.dataplane.placetree import BucketAxis, ClientPlaceTree
from megascale_data_ext.dataplane.rank_order import BROADCAST_DIMS
from megascale_data_ext.errors import ParallelLayoutError

__all__ = ["Distribution", "FetchStages"]


class FetchStages(str, enum.Enum):
    """Which pipeline stages read data: Megatron's GPT reads on the first and last stage only."""

    ENDS = "ends"
    FIRST = "first"
    ALL = "all"


@dataclass(frozen=True, slots=True)
class Distribution:
    """Consumers, broadcasting and reading stages of one service on any tree.

    Attributes:
        axis: The tree level whose nodes consume distinct data (DP, CP or WORLD).
        broadcast: The dims the strategy broadcasts along on the trainer side, as declared.
        stages: Which pipeline stages read.
    """

    axis: BucketAxis = BucketAxis.DP
    broadcast: tuple[str, ...] = ("tp",)
    stages: FetchStages = FetchStages.ENDS

    def __post_init__(self) -> None:
        dims = tuple(self.broadcast) if isinstance(self.broadcast, (tuple, list)) else None
        if dims is None or any(d not in BROADCAST_DIMS for d in dims) or len(set(dims)) != len(dims):
            raise ParallelLayoutError(
                f"broadcast dims must be distinct dims from {list(BROADCAST_DIMS)}, got {self.broadcast!r}")
        object.__setattr__(self, "broadcast", dims)
        object.__setattr__(self, "axis", BucketAxis.parse(self.axis))
        object.__setattr__(self, "stages", FetchStages(self.stages))

    @property
    def broadcast_dims(self) -> tuple[str, ...]:
        """The dims data is actually broadcast along: none over WORLD (every rank is its own
        consumer), and never ``cp`` on the CP axis (every cp rank is its own bucket)."""
        if self.axis is BucketAxis.WORLD:
            return ()
        if self.axis is BucketAxis.CP:
            return tuple(d for d in self.broadcast if d != "cp")
        return self.broadcast

    def reads(self, tree: ClientPlaceTree) -> np.ndarray:
        """Per rank, whether its pipeline stage consumes data (middle stages do not, by default)."""
        return _masks(tree, self)[0]

    def fetch_mask(self, tree: ClientPlaceTree) -> np.ndarray:
        """Per rank, whether it pulls from a Data Constructor itself."""
        return _masks(tree, self)[1]

    def fetch_ranks(self, tree: ClientPlaceTree) -> list[int]:
        """Global ranks that fetch, ascending."""
        return np.flatnonzero(self.fetch_mask(tree)).tolist()

    def fetches(self, tree: ClientPlaceTree, rank: int) -> bool:
        return bool(self.fetch_mask(tree)[tree.check_rank(rank)])

    def needs_data(self, tree: ClientPlaceTree, rank: int) -> bool:
        return bool(self.reads(tree)[tree.check_rank(rank)])

    def broadcast_source(self, tree: ClientPlaceTree, rank: int) -> int:
        """The fetching rank `rank` receives its microbatches from (itself when it fetches)."""
        return tree.broadcast_source(rank, self.broadcast_dims)

    def with_broadcast(self, dims: Sequence[str]) -> Distribution:
        return Distribution(self.axis, tuple(dims), self.stages)


@functools.lru_cache(maxsize=64)
def _masks(tree: ClientPlaceTree, dist: Distribution) -> tuple[np.ndarray, np.ndarray]:
    """(reading, fetching) masks over the world; cached per (tree, distribution): both are values."""
    pp = tree.coord_array("pp")
    if dist.axis is BucketAxis.WORLD or dist.stages is FetchStages.ALL:
        reads = np.ones(tree.world_size, dtype=bool)
    elif dist.stages is FetchStages.FIRST:
        reads = pp == 0
    else:
        reads = (pp == 0) | (pp == tree.pp - 1)
    fetch = reads.copy()
    for dim in dist.broadcast_dims:
        fetch &= tree.coord_array(dim) == 0
    reads.flags.writeable = fetch.flags.writeable = False
    return reads, fetch
