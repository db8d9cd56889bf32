"""RemoteConstructors: a trainer rank's way to the running service's Data Constructors over Ray.

The trainer-side `Client` asks a `MicrobatchSource` for microbatches; this is the one that goes
through Ray (`InProcessService` is the one without). Ray is joined lazily, on the first call,
so ranks that never fetch never connect; actor handles are resolved by the names the
`ServiceTopology` gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megascale_data_ext.runtime.constructor import EncoderImages, merge_encoder_images
from megascale_data_ext.runtime.topology import PLANNER_NAME, ServiceTopology


def join_ray(address: str | None, namespace: str) -> None:
    """Join the service's Ray cluster once per process (no-op when already joined)."""
    import ray

    from megascale_data_ext.runtime.ray_address import check_reachable

    if not ray.is_initialized():
        check_reachable(address)
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)


def fetch_topology(address: str | None, namespace: str) -> ServiceTopology:
    """The topology of the service running in `namespace`, asked of its Planner."""
    import ray

    join_ray(address, namespace)
    return ray.get(ray.get_actor(PLANNER_NAME, namespace=namespace).topology.remote())


class RemoteConstructors:
    """`MicrobatchSource` over the service's constructor actors, a few steps ahead.

    A fetching rank takes a whole step from its constructor in one call (`get_step`), and keeps
    the calls of the next ``prefetch_steps`` steps in flight, so in steady state the trainer
    finds its next step already in this node's object store (read zero-copy). Steps are asked
    for in order, each once; a step behind the current one is refused by the constructor.

    Args:
        topology: The service's topology (from `ServiceHandles` or `fetch_topology`).
        address: Ray address to join; None when Ray is already initialised in this process.
        prefetch_steps: Steps requested ahead of the one being consumed (0 = none).
    """

    def __init__(self, topology: ServiceTopology, address: str | None = None, *, prefetch_steps: int = 2) -> None:
        self.topology = topology
        self.address = address
        self.prefetch_steps = prefetch_steps
        self._handles: dict[int, Any] = {}
        self._planner: Any = None  # resolved on the first loss report
        self._pending: dict[tuple[int, int], Any] = {}  # (rank, step) -> ObjectRef of get_step
        self._current: tuple[int, int, list] | None = None  # (rank, step, microbatches) being consumed

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            import ray

            join_ray(self.address, self.topology.namespace)
            name = self.topology.constructor_names()[index]
            handle = self._handles[index] = ray.get_actor(name, namespace=self.topology.namespace)
        return handle

    def get(self, step: int, microbatch: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        import ray

        if self._current is None or self._current[:2] != (rank, step):
            handle = self._handle(self.topology.constructor_of_rank(rank))
            for ahead in range(step, step + 1 + self.prefetch_steps):
                if (rank, ahead) not in self._pending:
                    self._pending[(rank, ahead)] = handle.get_step.remote(ahead, rank)
            ref = self._pending.pop((rank, step))
            for stale in [k for k in self._pending if k[0] == rank and k[1] < step]:
                del self._pending[stale]  # skipped steps: their microbatches stay with the constructor
            self._current = (rank, step, ray.get(ref))
        return self._current[2][microbatch]

    def report_loss(self, step: int, losses: dict[int, float]) -> None:
        """Hand the Planner the per-source loss of `step` (loss-driven mixing)."""
        import ray

        if self._planner is None:
            join_ray(self.address, self.topology.namespace)
            self._planner = ray.get_actor(PLANNER_NAME, namespace=self.topology.namespace)
        ray.get(self._planner.report_loss.remote(step, losses))

    def get_encoder_images(self, step: int, rank: int) -> EncoderImages:
        import ray

        handles = [self._handle(j) for j in range(self.topology.num_constructors)]
        return merge_encoder_images(ray.get([h.get_encoder_images.remote(step, rank) for h in handles]))
