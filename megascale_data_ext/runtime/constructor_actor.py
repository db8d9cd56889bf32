"""The Data Constructor actor: a thin Ray façade over `DataConstructor` with a prefetch thread.

Clients call `get_step` (a whole step for one rank), `get` and `get_encoder_images`, each with
the step their rank is on (`runtime.held_steps`: data is released when taken, building waits for
the slowest fetcher); every request carries the job id of the service it was started for.
Restarted by Ray with ``max_task_retries=0``: the client decides what to re-send.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from megascale_data_ext.dataplane.plan import ConstructorPlan
from megascale_data_ext.errors import JobMismatchError
from megascale_data_ext.runtime.actors import ACTOR_CONCURRENCY, NO_FAULT_TOLERANCE, reconstructed
from megascale_data_ext.runtime.calls import CallCounter
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.ray_actor import Held, resolve
from megascale_data_ext.runtime.thread_stacks import ThreadStacks
from megascale_data_ext.runtime.constructor import DataConstructor, EncoderRows
from megascale_data_ext.runtime.fault_injection import crash_self
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.malloc import trim_periodically
from megascale_data_ext.runtime.metrics import service_metrics
from megascale_data_ext.runtime.prefetcher import Prefetcher
from megascale_data_ext.runtime.remote import PlannerIn
from megascale_data_ext.runtime.routing import CACHED_STEPS, RoutedFetch
from megascale_data_ext.runtime.topology import ServiceTopology

__all__ = ["DataConstructorActor", "constructor_concurrency"]


def constructor_concurrency(topology: ServiceTopology, buckets: list[int], ft: FaultToleranceConfig,
                            images: bool) -> int:
    """Threads a constructor actor needs so a consumer waiting for a slower one (backpressure)
    never takes the slow one's thread: each fetcher's requests in flight (its step and
    ``client_prefetch`` more), one encoder-image call per rank of the world, and slack."""
    fetchers = sum(len(topology.fetchers(b)) for b in buckets)
    world = topology.tree.world_size if images else 0
    return max(ACTOR_CONCURRENCY, fetchers * (ft.client_prefetch + 1) + world + 4)


class DataConstructorActor(ThreadStacks):
    """A Data Constructor with a `Prefetcher` building `prefetch` steps ahead.

    A constructor Ray restarted starts prefetching at the first step a client asks for and
    rebuilds steps from their plans (loaders re-read what the dead instance had taken); a
    consumer counts for backpressure once it asks for something. Each
    rise of the slowest consumer's step is told to the Planner (it keeps plans until then).
    Threads: `constructor_concurrency` (set by the service through ``.options``). A request that
    presents a ``job`` other than this service's (`ServiceTopology.job`) is refused by name.
    """

    RAY_OPTIONS = {"num_cpus": 0, "max_concurrency": ACTOR_CONCURRENCY}  # `runtime.ray_actor.actor` adds the rest

    def __init__(self, buckets: list[int], config: ServiceConfig | Held, topology: ServiceTopology, planner: Any,
                 pad_id: int, image_token_id: int | None, start_step: int = 0, ft: FaultToleranceConfig | None = None):
        config = resolve(config)  # a large blend's config comes by reference (`runtime.ray_actor.Held`)
        self.ft = ft or NO_FAULT_TOLERANCE
        self.calls = calls = CallCounter()
        self.metrics = service_metrics()  # this actor process's registry, handed to what records
        planner = planner.resolve() if isinstance(planner, PlannerIn) else planner  # see `runtime.wiring`

        def ask(method: str, *args: Any) -> Any:  # a counted call to the Planner, waiting for its answer
            calls.add(f"constructor>planner {method}")
            return ray.get(getattr(planner, method).remote(*args))

        # the Planner says which loader actors (and shadows) hold a step of a source: with the
        # step's plans (`constructor_step`), or asked afresh after a failure (`routes`)
        self._loaders = fetch = RoutedFetch(lambda step, ss: ask("routes", step, ss), self.ft, calls=calls)
        self.restarted = reconstructed()
        self._planner = planner
        self._index = topology.constructor_of_bucket(buckets[0])
        self._job = topology.job
        # steps are built on several threads (prefetch and requests): both fields under this lock
        self._lock = threading.Lock()
        self._floor: int | None = None  # the slowest consumer's step, not yet told to the Planner
        self._encoder: dict[int, EncoderRows] = {}  # step -> the encoder rows its plans came with

        def plans_of(step: int, buckets: list[int]) -> list[ConstructorPlan]:  # the step's one Planner call
            with self._lock:
                floor, self._floor = self._floor, None
            try:
                got = ask("constructor_step", step, buckets, self._index, floor, fetch.token)
            except BaseException:
                if floor is not None:  # not told: the next call carries it
                    self._on_floor(floor, wake=False)
                raise
            fetch.prime(step, got.sources, got.routes, got.fleet, got.replicas)
            if got.encoder is not None:
                with self._lock:
                    self._encoder[step] = got.encoder
                    for old in [s for s in self._encoder if s < step - CACHED_STEPS]:  # a build that failed
                        del self._encoder[old]
            return got.plans

        def encoder_plan_of(step: int, buckets: list[int]) -> EncoderRows | None:
            with self._lock:
                rows = self._encoder.pop(step, None)
            return rows if rows is not None else ask("encoder_plan", step, buckets)

        # before the constructor, whose floor callback wakes it; started once the constructor is ready
        self.prefetcher = Prefetcher(lambda target: self.constructor.prefetch(target), depth=config.prefetch,
                                     first_target=None if self.restarted else start_step + config.prefetch - 1,
                                     name=f"constructor {buckets}")
        self.constructor = DataConstructor(
            buckets,
            config,
            topology,
            get_plans=plans_of,
            fetch=fetch,
            pad_id=pad_id,
            image_token_id=image_token_id,
            get_encoder_plan=encoder_plan_of,
            start_step=None if self.restarted else start_step,
            max_lead=self.ft.max_lead(config.prefetch),
            wait_timeout_s=0.5 * self.ft.recovery_timeout_s,  # named here before the client's deadline
            on_floor=self._on_floor,
        )
        self.constructor.skip_to(start_step)
        self.prefetcher.start()
        trim_periodically()  # packs of varying size leave holes in the heap (`runtime.malloc`)

    def _on_floor(self, step: int, wake: bool = True) -> None:
        with self._lock:  # told with the next `constructor_step` (the build this rise allows)
            self._floor = step if self._floor is None else max(self._floor, step)
        if wake:
            self.prefetcher.wake()  # the lead moved: prefetch may go on

    def _check_job(self, job: str | None) -> None:
        """A string compare per request; None is a caller inside the service (no client)."""
        if job is not None and job != self._job:
            raise JobMismatchError(f"constructor/{self._index} of data service {self._job!r} refuses a request from a "
                                   f"client of {job!r}: that client was given another job's topology or handles; "
                                   "pass each trainer the ServiceHandles its own DataService.start() returned")

    def get(self, step: int, microbatch: int, rank: int, position: int | None = None, *, job: str | None = None):
        self._check_job(job)
        return self._deliver(step, lambda: self.constructor.get(step, microbatch, rank, position))

    def get_step(self, step: int, rank: int, position: int | None = None, *, job: str | None = None):
        """Every microbatch of `step` for `rank` in one reply (the client's step prefetch); the
        rank is on step `position` (default `step`); `job`: the client's `ServiceTopology.job`."""
        self._check_job(job)
        return self._deliver(step, lambda: self.constructor.get_step(step, rank, position))

    def _deliver(self, step: int, take: Any) -> Any:
        self.constructor.skip_to(step)
        self.prefetcher.requested(step)
        out = take()
        buckets = "+".join(map(str, self.constructor.buckets))
        self.metrics.buffered_steps(self.constructor.buffered_steps(), buckets)
        self.metrics.constructor_lead(self.constructor.held.lead(), buckets)
        return out

    def get_encoder_images(self, step: int, rank: int, position: int | None = None, *, job: str | None = None):
        """This constructor's images that global rank `rank` encodes at `step` (hybrid strategies)."""
        self._check_job(job)
        return self.constructor.get_encoder_images(step, rank, position)

    def stats(self) -> dict:
        return {**self.constructor.stats(), "restarted": self.restarted, "prefetch_errors": self.prefetcher.errors,
                "failovers": self._loaders.failovers, "ray_calls": self.calls.snapshot()}

    @ray.method(max_task_retries=0)  # never re-run on the restarted actor
    def crash(self) -> None:
        crash_self()
