"""RemoteConstructors: a trainer rank's way to the running service's Data Constructors over Ray.

The trainer-side `Client` asks a `MicrobatchSource` for microbatches; this is the one that goes
through Ray (`InProcessService` is the one without). Ray is joined lazily, on the first call,
so ranks that never fetch never connect; actor handles are resolved by the names the
`ServiceTopology` gives.

Failures: a step's request to a constructor that died (or stopped answering) is re-sent to the
constructor Ray restarted, found again by name, within bounded retries and a recovery
deadline (`FaultToleranceConfig`, asked of the Planner); the restarted constructor rebuilds the
step from its plan. Past the budget the client raises `ServiceUnavailableError` naming the
constructor. The first fetching rank also fires the fault-injection schedule, if any. Every
request carries the topology's ``job``; a constructor of another service refuses it
(`JobMismatchError`, not retried).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError, ReportTimeoutError, ServiceUnavailableError
from megascale_data_ext.runtime.constructor import EncoderImages, merge_encoder_images
from megascale_data_ext.runtime.fault_injection import FaultInjector
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.loss_feedback import REPORT_EVERY_STEP
from megascale_data_ext.runtime.retry import Retry
from megascale_data_ext.runtime.topology import PLANNER_NAME, ServiceTopology


def join_ray(address: str | None, namespace: str, *, key: str = "data.ray.address",
             probe_seconds: float | None = None) -> None:
    """Join the service's Ray cluster once per process (no-op when already joined); an unreachable
    address is a `ConfigError` naming `key`, where the address came from."""
    import ray

    from megascale_data_ext.runtime.ray_address import PROBE_SECONDS, check_reachable

    if not ray.is_initialized():
        check_reachable(address, seconds=PROBE_SECONDS if probe_seconds is None else probe_seconds, key=key)
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
        _exit_quietly_on_sigterm()


def _exit_quietly_on_sigterm() -> None:
    """Exit at once on SIGTERM, as a process does without Ray. torchrun stops the other ranks with
    SIGTERM when one fails; the handler ``ray.init`` installs then dumps the C++ stacks of Ray's
    shutdown on the terminal, burying the failing rank's one error line."""
    import signal
    import sys
    import threading

    def handler(signum: int, frame: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        signal.signal(signal.SIGTERM, handler)


def find_planner(namespace: str) -> Any:
    """The Planner of the service running in `namespace` of the joined Ray (ValueError: none runs).

    With `find_constructor`, the one place a process finds the service's actors by name: a process
    that joins a running service has only its namespace (the Planner) and topology (constructors),
    and the restartable constructors are handed `PlannerIn`; everything else is handed over as
    handles.
    """
    import ray

    return ray.get_actor(PLANNER_NAME, namespace=namespace)


@dataclass(frozen=True, slots=True)
class PlannerIn:
    """The Planner of a namespace, handed to the restartable constructors instead of its handle:
    an actor handle among a restartable actor's constructor arguments makes Ray log an error line
    per actor on every healthy start (ray-project/ray#53727); a restarted constructor finds the
    Planner again through `find_planner`."""

    namespace: str

    def resolve(self) -> Any:
        return find_planner(self.namespace)


def find_constructor(topology: ServiceTopology, index: int) -> Any:
    """Data Constructor `index` of the running service `topology` (ValueError: not (yet) there)."""
    import ray

    return ray.get_actor(topology.constructor_names()[index], namespace=topology.namespace)


def fetch_topology(address: str | None, namespace: str) -> ServiceTopology:
    """The topology of the service running in `namespace`, asked of its Planner."""
    import ray

    join_ray(address, namespace)
    return ray.get(find_planner(namespace).topology.remote())


def actor_crasher(topology: ServiceTopology) -> Any:
    """``(component, index) -> None`` that makes an actor SIGKILL itself (fault injection): the
    Planner, constructor `index`, or the loader actors serving source `index` now."""
    import ray

    def crash(component: str, index: int) -> None:
        planner = find_planner(topology.namespace)
        if component == "planner":
            planner.crash.remote()
        elif component == "loader":
            for handle in ray.get(planner.loaders_of.remote(index)):
                handle.crash.remote()
        else:
            find_constructor(topology, index).crash.remote()

    return crash


class RemoteConstructors:
    """`MicrobatchSource` over the service's constructor actors, a few steps ahead.

    A fetching rank takes a whole step from its constructor in one call (`get_step`), and keeps
    the calls of the next ``prefetch_steps`` steps in flight, so in steady state the trainer
    finds its next step already in this node's object store (read zero-copy). Steps are asked
    for in order, each once; a step behind the current one is refused by the constructor.

    Args:
        topology: The service's topology (from `ServiceHandles` or `fetch_topology`).
        address: Ray address to join; None when Ray is already initialised in this process.
        prefetch_steps: Steps requested ahead of the one being consumed (0 = none; None = the
            service's ``fault_tolerance.client_prefetch``).
        fault_tolerance: Retry budget and timeouts; None = the service's (asked of the Planner).
    """

    def __init__(self, topology: ServiceTopology, address: str | None = None, *, prefetch_steps: int | None = None,
                 fault_tolerance: FaultToleranceConfig | None = None) -> None:
        self.topology = topology
        self.address = address
        self._prefetch_steps = prefetch_steps
        self.ft = fault_tolerance
        self._handles: dict[int, Any] = {}
        self._planner: Any = None
        self._pending: dict[tuple[int, int], Any] = {}  # (rank, step) -> ObjectRef of get_step
        self._current: tuple[int, int, list] | None = None  # (rank, step, microbatches) being consumed
        self.injector: FaultInjector | None = None
        self.recoveries: list[dict[str, Any]] = []  # one per re-sent request: step, constructor, seconds, error

    # -- joining -------------------------------------------------------------------
    def _join(self) -> None:
        import ray

        if self.ft is not None and self._planner is not None:
            return
        join_ray(self.address, self.topology.namespace)
        try:
            self._planner = find_planner(self.topology.namespace)
        except ValueError as gone:
            raise self._gone("the Planner", "was asked for") from gone
        service_ft = ray.get(self._planner.fault_tolerance.remote())
        if self.ft is None:
            self.ft = service_ft
        elif self.ft.client_prefetch > service_ft.client_prefetch:  # what its constructors are sized for, and
            self.ft = replace(self.ft, client_prefetch=service_ft.client_prefetch)  # what can be planned
        specs = self.ft.schedule()
        fetch_ranks = self.topology.fetch_ranks()
        if specs and self.injector is None:
            self.injector = FaultInjector(specs, actor_crasher(self.topology))
            self._injecting_rank = fetch_ranks[0]

    @property
    def prefetch_steps(self) -> int:
        """Steps kept requested ahead: at most the service's ``client_prefetch``, which its
        constructors' threads are sized for (more would let one rank's waiting requests take
        every thread and starve the slow rank that they wait for)."""
        self._join()
        if self._prefetch_steps is None:
            self._prefetch_steps = self.ft.client_prefetch
        elif self._prefetch_steps > self.ft.client_prefetch:
            raise ConfigError(f"client prefetch {self._prefetch_steps} exceeds the service's "
                              f"fault_tolerance.client_prefetch={self.ft.client_prefetch} (its constructors' threads "
                              f"are sized for it): start the service with "
                              f"data.fault_tolerance.client_prefetch={self._prefetch_steps} (with feedback mixing, "
                              "a delay above it), or prefetch less")
        return self._prefetch_steps

    def _handle(self, index: int, *, fresh: bool = False, step: int | None = None) -> Any:
        handle = None if fresh else self._handles.get(index)
        if handle is None:
            self._join()
            try:
                handle = self._handles[index] = find_constructor(self.topology, index)
            except ValueError as gone:  # no actor of that name: the service was stopped, not restarted
                raise self._gone(f"constructor/{index}", "was asked for" if step is None else
                                 f"step {step} was asked for") from gone
        return handle

    def _gone(self, actor: str, when: str) -> ServiceUnavailableError:
        """A service actor that Ray no longer knows by name: the service was stopped (a restarting
        one keeps its name), typically by the rank that started it failing first."""
        return ServiceUnavailableError(
            f"{actor} is gone from Ray namespace {self.topology.namespace!r}: the data service was stopped while "
            f"{when} (when a rank that started it failed, that rank's error line says why)")

    # -- delivery ------------------------------------------------------------------
    def get(self, step: int, microbatch: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self._current is None or self._current[:2] != (rank, step):
            self._join()
            if self.injector is not None and rank == self._injecting_rank:
                self.injector.on_step(step)
            index = self.topology.constructor_of_rank(rank)
            handle = self._handle(index, step=step)
            last = step + self.prefetch_steps
            if self.topology.replay_steps is not None:  # nothing to ask for past the replayed plans
                last = max(step, min(last, self.topology.replay_steps - 1))
            for ahead in range(step, last + 1):  # `step` is where this rank is
                if (rank, ahead) not in self._pending:
                    self._pending[(rank, ahead)] = handle.get_step.remote(ahead, rank, step, job=self.topology.job)
            ref = self._pending.pop((rank, step))
            for stale in [k for k in self._pending if k[0] == rank and k[1] < step]:
                del self._pending[stale]  # skipped steps: released once this rank is past them
            self._current = (rank, step, self._take(ref, index, step, rank))
        return self._current[2][microbatch]

    def _take(self, ref: Any, index: int, step: int, rank: int) -> list:
        """Wait for `step`'s reply; re-send it (and the prefetched steps) to a restarted constructor,
        and once when it was sent ahead and timed out waiting for a loss report (`ReportTimeoutError`:
        a trainer loop that reports later than ``report_timeout_s``; nothing is asked for before it
        can be planned, `FaultToleranceConfig.within_report_delay`).
        A live constructor that delivered nothing by the deadline because a report was never sent
        is named by that report (the Planner says which it waits for)."""
        import ray

        from megascale_data_ext.runtime.failover import ACTOR_FAILURES
        from megascale_data_ext.runtime.thread_stacks import note_thread_stacks

        ft = self.ft
        retry, last, report_wait = Retry(ft.recovery_timeout_s), None, None
        while True:
            try:
                out = ray.get(ref, timeout=max(0.01, min(ft.rpc_timeout_s, retry.left())))
                if retry.attempts or report_wait is not None:
                    error = last or report_wait
                    self.recoveries.append({"step": step, "constructor": index, "rank": rank,
                                            "attempts": retry.attempts, "seconds": retry.elapsed(),
                                            "error": type(getattr(error, "cause", error)).__name__})
                return out
            except ReportTimeoutError as exc:
                if report_wait is not None:  # asked again now that the rank needs it: the report is missing
                    raise self._report_missing(exc, rank, step, retry) from exc
                report_wait = exc
                ref = self._handle(index, step=step).get_step.remote(step, rank, step, job=self.topology.job)
            except ACTOR_FAILURES as exc:
                last = exc
                timed_out = isinstance(exc, ray.exceptions.GetTimeoutError)
                if report_wait is not None and timed_out and retry.expired():
                    raise self._report_missing(report_wait, rank, step, retry) from report_wait
                if retry.attempts + (not timed_out) > ft.retries or retry.expired():
                    if timed_out and (missing := self._missing_report(step)) is not None:
                        raise ReportTimeoutError(
                            f"step {step} cannot be planned: the per-source loss of step {missing} was never "
                            f"reported (feedback mixing; rank {rank} waited {retry.elapsed():.0f} s, "
                            f"fault_tolerance.recovery_timeout_s={ft.recovery_timeout_s:g}): {REPORT_EVERY_STEP}"
                        ) from exc
                    error = ServiceUnavailableError(
                        f"constructor/{index} (serving rank {rank}) did not deliver step {step} after "
                        f"{retry.attempts + (not timed_out)} re-sends within {retry.elapsed():.1f} s "
                        f"(fault_tolerance.retries={ft.retries}, recovery_timeout_s={ft.recovery_timeout_s:g}): "
                        f"last error {exc!r}. Check the actor's log (`ray logs` / the dashboard); resume the job "
                        "from its last checkpoint")
                    if timed_out and index in self._handles:  # alive but silent: where its threads wait
                        note_thread_stacks(error, self._handles[index], f"constructor/{index}")
                    raise error from exc
                if timed_out:  # alive but slow (a rebuild, a loader failover): keep waiting on the same call
                    continue
                retry.pause()
                handle = self._handle(index, fresh=True, step=step)  # the restarted actor, by name
                ref = handle.get_step.remote(step, rank, step, job=self.topology.job)
                self._resend_failed(handle, rank, step)

    def _missing_report(self, step: int) -> int | None:
        """The report the Planner still waits for to plan `step` (None: none, or no answer): why a
        live constructor delivered nothing when the trainer never reported a step."""
        import ray

        try:
            return ray.get(self._planner.missing_report.remote(step), timeout=min(5.0, self.ft.rpc_timeout_s))
        except Exception:  # noqa: BLE001 - the Planner gone or silent: the constructor's error says the rest
            return None

    @staticmethod
    def _report_missing(exc: BaseException, rank: int, step: int, retry: Retry) -> ReportTimeoutError:
        """`exc` (a `ReportTimeoutError` from the constructor) as one line, once the re-sent request
        failed too: the report is missing, not late."""
        cause = getattr(exc, "cause", exc)  # without Ray's task header
        return ReportTimeoutError(f"{cause} (asked again when rank {rank} took step {step}: still none after "
                                  f"{retry.elapsed():.0f} s)")

    def _resend_failed(self, handle: Any, rank: int, step: int) -> None:
        """Re-send the prefetched requests after `step` that already failed; a reply that came
        before the death is kept (it lives in the object store), one still in flight is re-sent
        when it is taken and fails."""
        import ray

        from megascale_data_ext.runtime.failover import ACTOR_FAILURES

        keys = [k for k in self._pending if k[0] == rank and k[1] > step]
        ready, _ = ray.wait([self._pending[k] for k in keys], num_returns=len(keys), timeout=0) if keys else ([], [])
        ready_ids = {r.hex() for r in ready}
        for key in keys:
            if self._pending[key].hex() in ready_ids:
                try:
                    ray.get(self._pending[key], timeout=0)
                except ACTOR_FAILURES:
                    self._pending[key] = handle.get_step.remote(key[1], rank, step, job=self.topology.job)

    def report_loss(self, step: int, losses: dict[int, float]) -> None:
        """Hand the Planner the per-source loss of `step` (loss-driven mixing)."""
        import ray

        self._join()
        ray.get(self._planner.report_loss.remote(step, losses))

    def get_encoder_images(self, step: int, rank: int) -> EncoderImages:
        import ray

        handles = [self._handle(j) for j in range(self.topology.num_constructors)]
        job = self.topology.job
        return merge_encoder_images(ray.get([h.get_encoder_images.remote(step, rank, step, job=job) for h in handles]))
