"""Ray actor façades over the plain runtime classes, and the pull-model wiring between them.

Pull model (paper Sec. 3): a Client asks its Data Constructor, the constructor asks Source
Loaders, a loader asks the Planner for its plan, the Planner asks loaders for metadata.
The Planner -> loader call happens while a loader may be waiting on the Planner, so loaders
and constructors are threaded actors (``max_concurrency`` = `ACTOR_CONCURRENCY`): a loader's
`summary_buffer` is served on another thread while its `fetch` waits. The Planner is threaded
too: with loss-driven mixing, planning a step waits for a trainer's `report_loss`, which must
be served meanwhile (the Planner's lock serialises planning itself). The Planner never
waits on a constructor, so the call graph has no cycle that can exhaust the thread pools.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import ray

from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.constructor import DataConstructor, EncoderRows, encoder_rows
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.runtime.metrics import record_plan, samples_in, service_metrics
from megascale_data_ext.runtime.planner import Planner
from megascale_data_ext.runtime.topology import ServiceTopology

ACTOR_CONCURRENCY = 16
_log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)
class PlannerActor:
    """The Planner in its own process; holds handles to the loaders for `summary_buffer`."""

    def __init__(self, config: ServiceConfig, topology: ServiceTopology, loader_handles: list[Any]):
        self._loaders = loader_handles
        self._topology = topology

        def summarize(source: int, start: int, count: int):
            return ray.get(self._loaders[source].summary_buffer.remote(start, count))

        self.planner = Planner(config, topology, summarize, on_planned=record_plan)

    def topology(self) -> ServiceTopology:
        """The service's topology, for clients that join by namespace alone."""
        return self._topology

    def plan(self, step: int):
        return self.planner.plan(step)

    def loader_plan(self, step: int, source: int):
        return self.planner.loader_plan(step, source)

    def constructor_plan(self, step: int, bucket: int):
        return self.planner.plan(step).constructor_do_plan(bucket)

    def encoder_plan(self, step: int, buckets: list[int]) -> EncoderRows | None:
        """The EncoderPlan rows (images, their (source, position), encoder rank) of `buckets`' samples."""
        return encoder_rows(self.planner.plan(step), buckets)

    def plan_summary(self, step: int) -> dict:
        return self.planner.plan(step).summary()

    def state_dict(self, step: int | None = None) -> dict:
        return self.planner.state_dict(step)

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)

    def report_loss(self, step: int, losses: dict) -> None:
        self.planner.report_loss(step, losses)


@ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)
class SourceLoaderActor:
    """A Source Loader; its plans come from the Planner actor (set after creation)."""

    def __init__(self, source_id: int, spec: Any, seed: int, shuffle: bool, read_ahead: int = 1):
        self.loader = SourceLoader(source_id, spec, seed=seed, shuffle=shuffle)
        self._planner = None
        self.read_ahead = read_ahead
        self._ahead: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ahead_until = -1
        threading.Thread(target=self._read_ahead_loop, daemon=True, name="read-ahead").start()

    def _read_ahead_loop(self) -> None:
        """Refill from storage in the background: read the next planned steps before they are asked for."""
        while True:
            step = self._ahead.get()
            try:
                self.loader.read_ahead(step)
            except Exception as exc:  # the constructor's own fetch raises it again, with its context
                _log.warning("read-ahead of step %d for source %r failed: %s", step, self.loader.spec.name, exc)

    def set_planner(self, planner: Any) -> None:
        self._planner = planner
        self.loader.get_plan = lambda step, source: ray.get(planner.loader_plan.remote(step, source))

    def size(self) -> int:
        return self.loader.size

    def summary_buffer(self, start: int, count: int):
        return self.loader.summary_buffer(start, count)

    def fetch(self, step: int, buckets: list[int]):
        out = self.loader.fetch(step, buckets)
        samples, tokens, skipped = samples_in(out)
        service_metrics().source_read(self.loader.spec.name, samples=samples, tokens=tokens, skipped=skipped)
        for ahead in range(max(step + 1, self._ahead_until + 1), step + 1 + self.read_ahead):
            self._ahead.put(ahead)
            self._ahead_until = ahead
        return out

    def stats(self) -> dict:
        return self.loader.stats()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


@ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)
class DataConstructorActor:
    """A Data Constructor with a background prefetch thread `prefetch` steps ahead."""

    def __init__(self, buckets: list[int], config: ServiceConfig, topology: ServiceTopology, planner: Any,
                 loaders: list[Any], pad_id: int, image_token_id: int | None, start_step: int = 0):
        self.constructor = DataConstructor(
            buckets,
            config,
            topology,
            get_plan=lambda step, b: ray.get(planner.constructor_plan.remote(step, b)),
            fetch=lambda s, step, bs: ray.get(loaders[s].fetch.remote(step, bs)),
            pad_id=pad_id,
            image_token_id=image_token_id,
            get_encoder_plan=lambda step, bs: ray.get(planner.encoder_plan.remote(step, bs)),
        )
        self.constructor._next_prefetch = start_step
        self.prefetch_depth = config.prefetch
        self._wake = threading.Event()
        self._target = start_step + self.prefetch_depth - 1
        self._error: BaseException | None = None
        threading.Thread(target=self._prefetch_loop, daemon=True, name="prefetch").start()
        self._wake.set()

    def _prefetch_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self.constructor.prefetch(self._target)
            except BaseException as exc:  # surfaced to the next client call
                self._error = exc
                return

    def get(self, step: int, microbatch: int, rank: int):
        return self._deliver(step, lambda: self.constructor.get(step, microbatch, rank))

    def get_step(self, step: int, rank: int):
        """Every microbatch of `step` for `rank` in one reply (the client's step prefetch)."""
        return self._deliver(step, lambda: self.constructor.get_step(step, rank))

    def _deliver(self, step: int, take: Any) -> Any:
        if self._error is not None:
            raise self._error
        out = take()
        service_metrics().buffered_steps(len(self.constructor._built), "+".join(map(str, self.constructor.buckets)))
        if step + self.prefetch_depth > self._target:
            self._target = step + self.prefetch_depth
            self._wake.set()
        return out

    def get_encoder_images(self, step: int, rank: int):
        """This constructor's images that global rank `rank` encodes at `step` (hybrid strategies)."""
        if self._error is not None:
            raise self._error
        return self.constructor.get_encoder_images(step, rank)

    def stats(self) -> dict:
        return self.constructor.stats()
