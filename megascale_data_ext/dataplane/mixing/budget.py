"""Token-budget steps: how many documents a step draws and how they fill its microbatches.

A Megatron user thinks of a global batch as GBS x seq_length tokens; a step of documents
packed whole under a token cap is only as full as its balancer packs. In token-budget mode
(``tokens_per_step``) the Planner therefore works on a *pool*: the documents deferred by
earlier steps (its carry, oldest first) followed by this step's fresh draws in mixing order.
The strategy balances a prefix of the pool under the cap; the leftover then fills the rooms
the balancer left (whole documents first-fit, and with ``split`` the next document's head
fills a room while its remainder stays in the pool), and what is still left is carried to
the next step. Every drawn document is placed exactly once, possibly as several token spans.

Pure numpy; the Planner owns the state (the carry) and the mixer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megascale_data_ext.errors import ShortBufferError

__all__ = ["OFFER_FRACTION", "SLACK_MICROBATCHES", "Placement", "Pool", "draw_size", "fill_rooms", "offer_prefix"]

OFFER_FRACTION = 0.96
"""Share of the step's token budget offered to the balancer at once: cost balancers pack
~96% of k·m capped bins reliably (long-short text, L = 2048); the rest is filled afterwards."""

SLACK_MICROBATCHES = 2
"""Microbatches of tokens drawn beyond the budget, so filling the rooms has documents to pick
from (whole-document fill of long-short text at L = 2048: 98.9% with 1, 99.4% with 4); the
unplaced ones are carried, so the carry holds about this much."""


@dataclass(slots=True, kw_only=True)
class Pool:
    """Documents (or document remainders) a token-budget step may place, in priority order.

    Row i is tokens ``[start[i], start[i] + length[i])`` of sample ``index[i]`` at stream
    ``position[i]`` of ``source[i]``; ``patches[i]`` are its image patch counts (a sample with
    images is never split and its text is always whole).
    """

    source: np.ndarray  # int64
    position: np.ndarray  # int64
    index: np.ndarray  # int64
    start: np.ndarray  # int64
    length: np.ndarray  # int64 text tokens of the span
    patches: list[tuple[int, ...]]

    def __len__(self) -> int:
        return int(self.source.shape[0])

    @property
    def seq_len(self) -> np.ndarray:
        """Positions each row takes in a microbatch: its text span plus its image placeholders."""
        return self.length + np.asarray([sum(p) for p in self.patches], dtype=np.int64)

    @property
    def splittable(self) -> np.ndarray:
        return np.asarray([not p for p in self.patches], dtype=bool)

    @classmethod
    def of(cls, rows: Sequence[Sequence]) -> Pool:
        """From ``[source, position, index, start, length, patches]`` rows (the Planner's carry)."""
        cols = list(zip(*rows, strict=True)) if rows else [()] * 6
        return cls(**{k: np.asarray(cols[i], dtype=np.int64) for i, k in
                      enumerate(("source", "position", "index", "start", "length"))},
                   patches=[tuple(int(x) for x in p) for p in cols[5]])

    def rows(self, which: np.ndarray | None = None) -> list[list]:
        """``[source, position, index, start, length, [patches]]`` per row (all, or `which`)."""
        sel = range(len(self)) if which is None else np.asarray(which, dtype=np.int64).tolist()
        return [[int(self.source[i]), int(self.position[i]), int(self.index[i]), int(self.start[i]),
                 int(self.length[i]), list(self.patches[i])] for i in sel]

    def concat(self, other: Pool) -> Pool:
        return Pool(**{k: np.concatenate([getattr(self, k), getattr(other, k)]).astype(np.int64)
                       for k in ("source", "position", "index", "start", "length")},
                    patches=self.patches + other.patches)

    def chop(self, seq_length: int) -> Pool:
        """Cut text-only rows longer than `seq_length` into consecutive spans of at most that
        (Megatron's windows); image samples stay whole."""
        n = np.where(self.splittable, -(-self.length // seq_length), 1).clip(min=1)
        if np.all(n == 1):
            return self
        row = np.repeat(np.arange(len(self)), n)
        k = np.arange(len(row)) - np.repeat(np.cumsum(n) - n, n)  # piece number inside its row
        start = self.start[row] + k * seq_length
        end = np.minimum(start + seq_length, self.start[row] + self.length[row])
        return Pool(source=self.source[row], position=self.position[row], index=self.index[row], start=start,
                    length=np.where(n[row] > 1, end - start, self.length[row]),
                    patches=[self.patches[i] for i in row.tolist()])


@dataclass(slots=True, kw_only=True)
class Placement:
    """A span of pool row `row` put into microbatch bin `bin` (bucket * m + microbatch)."""

    row: int
    bin: int
    start: int
    length: int


def draw_size(preview: Callable[[int], np.ndarray], lengths: Sequence[np.ndarray], need: int) -> int:
    """Fewest fresh documents whose tokens reach `need`, for the mixer's allocation.

    Args:
        preview: ``batch_size -> per-source counts`` (``Mixer.preview`` of the step).
        lengths: Per source, the sequence lengths of its next buffered samples, stream order.
        need: Tokens the fresh draws must bring.

    Raises:
        PlanError: The buffers cannot supply the tokens (raise ``buffer_size``).
    """
    if need <= 0:
        return 0
    sizes = np.fromiter(map(len, lengths), dtype=np.int64, count=len(lengths))
    prefix: dict[int, np.ndarray] = {}  # per source drawn, cumulative lengths (a step draws few of 1,000+)

    def tokens(counts: np.ndarray) -> int:  # what the first counts[s] samples of every source bring
        drawn = np.flatnonzero(counts)
        total = 0
        for s, c in zip(drawn.tolist(), counts[drawn].tolist(), strict=True):
            cum = prefix.get(s)
            if cum is None:
                cum = prefix[s] = np.cumsum(lengths[s], dtype=np.int64)
            total += int(cum[c - 1])
        return total

    # the starting estimate only (the search below finds the smallest n whatever it is): a sample
    # of the next lengths of the sources that have any, not all of them
    head = [lengths[s][:64] for s in np.flatnonzero(sizes).tolist()]
    mean = max(float(np.mean(np.concatenate(head))) if head else 1.0, 1.0)
    n, lo = max(1, int(np.ceil(need / mean))), 0
    while True:
        counts = np.asarray(preview(n))
        short = np.flatnonzero(counts > sizes).tolist()
        if short:
            raise ShortBufferError(f"a token-budget step needs {need} tokens but source(s) {short} buffer only "
                                   f"{sizes[short].tolist()} samples for the mixture: raise `buffer_size`",
                                   {s: int(counts[s]) for s in short})
        got = tokens(counts)
        if got >= need:
            break
        lo = n
        n += max(1, int(np.ceil((need - got) / mean)))
    while n - lo > 1:  # the estimate may overshoot: the smallest n that reaches `need`
        mid = (lo + n) // 2
        counts = preview(mid)
        if tokens(counts) >= need:
            n = mid
        else:
            lo = mid
    return n


def offer_prefix(seq_len: np.ndarray, budget: float) -> int:
    """Length of the longest pool prefix whose positions stay within `budget`."""
    return int(np.searchsorted(np.cumsum(seq_len), budget, side="right"))


def fill_rooms(room: np.ndarray, seq_len: np.ndarray, splittable: np.ndarray, *, budget: int,
               split: bool) -> list[Placement]:
    """Fill the rooms the balancer left with leftover pool rows, in pool order.

    Whole rows go best-fit, largest first (into the bin with the least room that holds them);
    with `split`,
    when no leftover row fits whole, the next splittable one is cut: its head fills the
    fullest-room bin and its remainder stays first in line. At most `budget` positions are
    added.

    Args:
        room: Free positions per bin.
        seq_len: Positions of each leftover row.
        splittable: Rows that may be cut (text only).
        budget: Positions the step may still add.
        split: Cut rows that do not fit whole.

    Returns:
        Placements in order; a split row appears once per span, with increasing `start`.
    """
    room = np.asarray(room, dtype=np.int64).copy()
    left = np.asarray(seq_len, dtype=np.int64).copy()
    taken = np.zeros(len(left), dtype=np.int64)  # positions of each row already placed
    out: list[Placement] = []
    for i in np.argsort(-left, kind="stable").tolist():  # whole rows, largest first, into the tightest room
        fits = np.flatnonzero(room >= left[i])
        if not len(fits) or left[i] > budget:
            continue
        b = int(fits[np.argmin(room[fits])])
        out.append(Placement(row=i, bin=b, start=0, length=int(left[i])))
        room[b] -= left[i]
        budget -= int(left[i])
        left[i] = 0
    if not split:
        return out
    for i in np.flatnonzero((left > 0) & splittable).tolist():  # heads into the remaining rooms
        while left[i] > 0 and budget > 0 and room.max() > 0:
            b = int(np.argmax(room))
            n = int(min(room[b], left[i], budget))
            out.append(Placement(row=i, bin=b, start=int(taken[i]), length=n))
            room[b] -= n
            budget -= n
            left[i] -= n
            taken[i] += n
        if budget <= 0 or room.max() <= 0:
            break
    return out
