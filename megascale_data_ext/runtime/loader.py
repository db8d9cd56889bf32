"""Source Loader: owns one source's file state, reports metadata, executes loading plans.

Plain class (unit-testable without Ray); `runtime.actors` wraps it as a threaded Ray actor.
The stream of a source is a sequence of positions: position p is sample
``perm_e[p % n]`` of epoch ``e = p // n``, where ``perm_e`` is a seeded permutation
(`dataplane.epoch_order`: global, or in storage order with ``shuffle_window``; identity without
shuffling). The Planner only ever asks for metadata at positions
(`summary_buffer`); constructors ask for the payloads of a planned step (`fetch`).

Thread contract: `fetch` may be called concurrently by several constructors (the actor runs
with max_concurrency > 1); one lock per step makes a step's plan execute exactly once, and one
read lock lets a single step at a time read the source: a Parquet reader and its row-group cache
are not thread-safe (two steps reading one `ParquetFile` at once crashed a loader in pyarrow's
`read_row_group` with a segmentation fault).

Checkpoint (`StateSchema` "source_loader", version 1): fingerprint = (name, size, seed,
shuffle, and ``shuffle_window`` when set), so a resume over changed files or another shuffle is refused; fields
``next_position`` (one past the furthest stream position read) and the read/skip counters.
The stream itself is a pure function of the position, so nothing else needs saving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.epoch_order import epoch_permutation
from megascale_data_ext.dataplane.plan import LoaderPlan
from megascale_data_ext.dataplane.summary import SourceSummary
from megascale_data_ext.errors import SourceError
from megascale_data_ext.sources.base import Sample, SkippedSample, SourceSpec
from megascale_data_ext.sources.registry import open_source
from megascale_data_ext.state import StateSchema


@dataclass(slots=True)
class _StagedStep:
    """Samples of one executed step, waiting for their constructors (keyed by bucket)."""

    by_bucket: dict[int, list[tuple[int, Sample]]] = field(default_factory=dict)
    skipped: dict[int, list[tuple[int, SkippedSample]]] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)


class SourceLoader:
    """One source's reader, metadata table and read buffer.

    Args:
        source_id: Index of the source in the service config.
        spec: Where and how to read the source.
        seed: Seeds the per-epoch shuffle.
        shuffle: Shuffle sample order per epoch.
        get_plan: Callable ``(step, source_id) -> LoaderPlan`` (the Planner; pull model).
    """

    STATE = StateSchema("source_loader", 1, ("next_position", "samples_read", "skipped"),
                        hint="resume over the same files with the same seed and shuffle")

    def __init__(
        self,
        source_id: int,
        spec: SourceSpec,
        *,
        seed: int,
        shuffle: bool = True,
        get_plan: Callable[[int, int], LoaderPlan] | None = None,
    ) -> None:
        self.source_id = source_id
        self.spec = spec
        self.seed = seed
        self.shuffle = shuffle
        self.get_plan = get_plan
        self.source = open_source(spec)
        self.size = len(self.source)
        if self.size == 0:
            raise SourceError(f"source {spec.name!r} is empty (paths: {spec.paths}); remove it or give it data")
        meta = self.source.metadata(None)
        self._text_tokens = np.asarray(meta["text_tokens"], dtype=np.int64)
        self._img_offsets = np.asarray(meta["image_offsets"], dtype=np.int64)
        self._img_counts = np.asarray(meta["image_patch_counts"], dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}
        self._steps: dict[int, _StagedStep] = {}
        self._step_locks: dict[int, threading.Lock] = {}
        self._finished: set[int] = set()  # steps fully handed out (kept short: see _finish)
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # the source's file handles and cache: one reader at a time
        self.samples_read = 0
        self.skipped_total = 0
        self.next_position = 0

    # -- stream --------------------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            window = self.spec.shuffle_window
            perm = epoch_permutation(self.size, seed=self.seed, source_id=self.source_id, epoch=epoch,
                                     shuffle=self.shuffle, window=window,
                                     blocks=self.source.blocks() if window and hasattr(self.source, "blocks") else None)
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.size
        if len(positions) and epochs.min() == epochs.max():  # one epoch, as in most steps
            return self._perm(int(epochs[0]))[positions - int(epochs[0]) * self.size]
        out = np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self._perm(int(e))[positions[sel] % self.size]
        return out

    def summary_buffer(self, start: int, count: int) -> SourceSummary:
        """Metadata of the samples at stream positions [start, start+count): never payloads."""
        positions = np.arange(start, start + count, dtype=np.int64)
        idx = self.indices_at(positions)
        starts, ends = self._img_offsets[idx], self._img_offsets[idx + 1]
        lens = ends - starts
        flat = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(lens.sum())
        return SourceSummary(
            source=self.source_id,
            name=self.spec.name,
            positions=positions,
            indices=idx,
            text_tokens=self._text_tokens[idx],
            image_offsets=np.concatenate([[0], np.cumsum(lens)]),
            image_patch_counts=self._img_counts[flat] if len(flat) else np.zeros(0, np.int64),
        )

    # -- plans ---------------------------------------------------------------------
    def read(self, indices: list[int]) -> Any:
        """The source's `read_report` of `indices`, one caller at a time (see the thread contract):
        every payload read of this loader goes through here, staged steps and direct reads alike."""
        with self._read_lock:
            return self.source.read_report(indices)

    def execute(self, plan: LoaderPlan) -> None:
        """Read and transform the planned samples of one step and stage them per bucket."""
        expect = self.indices_at(plan.positions)
        if not np.array_equal(expect, plan.indices):
            raise SourceError(
                f"source {self.spec.name!r}: plan for step {plan.step} disagrees with this loader's stream "
                f"(seed/shuffle/source size changed?)"
            )
        result = self.read(plan.indices.tolist())
        staged = _StagedStep()
        by_index = {s.index: s for s in result.samples}
        bad = {s.index: s for s in result.skipped}
        for pos, idx, b in zip(plan.positions.tolist(), plan.indices.tolist(), plan.bucket.tolist(), strict=True):
            if idx in by_index:
                staged.by_bucket.setdefault(b, []).append((pos, by_index[idx]))
            else:
                staged.skipped.setdefault(b, []).append((pos, bad[idx]))
            staged.pending.add(b)
        self.samples_read += len(result.samples)
        self.skipped_total += len(result.skipped)
        if len(plan.positions):
            self.next_position = max(self.next_position, int(plan.positions.max()) + 1)
        if staged.pending:
            self._steps[plan.step] = staged
        else:  # this source has nothing in the step
            self._finish(plan.step)

    def _finish(self, step: int) -> None:
        self._finished.add(step)
        if len(self._finished) > 256:
            self._finished.discard(min(self._finished))

    def read_ahead(self, step: int) -> bool:
        """Refill from storage: execute `step`'s plan now so constructors find it staged.

        Returns False when the step was already read (or handed out) — nothing is read twice.
        """
        if self.get_plan is None:
            return False
        with self._lock:
            lock = self._step_locks.setdefault(step, threading.Lock())
        with lock:
            if step in self._steps or step in self._finished:
                return False
            self.execute(self.get_plan(step, self.source_id))
            return True

    def fetch(self, step: int, buckets: list[int]) -> dict[str, list]:
        """Pop the samples of `step` destined to `buckets` (executing the plan on first call).

        Returns ``{"samples": [(bucket, position, Sample)], "skipped": [(bucket, position, SkippedSample)]}``.
        """
        with self._lock:
            lock = self._step_locks.setdefault(step, threading.Lock())
        with lock:
            if step not in self._steps and step not in self._finished:
                if self.get_plan is None:
                    raise SourceError(f"source {self.spec.name!r}: no planner to ask for step {step}'s plan")
                self.execute(self.get_plan(step, self.source_id))
            staged = self._steps.get(step)
            out: dict[str, list] = {"samples": [], "skipped": []}
            if staged is None:  # nothing of this source in the step
                return out
            for b in buckets:
                out["samples"] += [(b, p, s) for p, s in staged.by_bucket.pop(b, [])]
                out["skipped"] += [(b, p, s) for p, s in staged.skipped.pop(b, [])]
                staged.pending.discard(b)
            if not staged.pending:
                del self._steps[step]
                self._finish(step)
                with self._lock:
                    self._step_locks.pop(step, None)
            return out

    def stats(self) -> dict[str, int]:
        return {"samples_read": self.samples_read, "skipped": self.skipped_total, "staged_steps": len(self._steps),
                "next_position": self.next_position}

    # -- state ---------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        fingerprint = {"name": self.spec.name, "size": self.size, "seed": self.seed, "shuffle": self.shuffle}
        if self.spec.shuffle_window:  # another window is another order (absent when 0: older states load)
            fingerprint["shuffle_window"] = self.spec.shuffle_window
        return fingerprint

    def state_dict(self) -> dict[str, Any]:
        return self.STATE.stamp(self.fingerprint(), next_position=self.next_position,
                                samples_read=self.samples_read, skipped=self.skipped_total)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the stream at the saved position; staged (read, undelivered) steps are dropped
        and read again from their plans."""
        fields = self.STATE.check(state, self.fingerprint())
        with self._lock:
            self.next_position = int(fields["next_position"])
            self.samples_read, self.skipped_total = int(fields["samples_read"]), int(fields["skipped"])
            self._steps.clear()
            self._finished.clear()
            self._step_locks.clear()

    def close(self) -> None:
        self.source.close()
