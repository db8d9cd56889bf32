"""Client: the trainer-side end of the service, inside each torchrun rank.

One client per rank serves every trainer-side consumer — the schedule hooks
(`megatron.hooks.install`), Megatron-LM's external dataloader (`megatron.provider`) and the
example loops — and holds the rank's one data position (next step and microbatch), which is
what a checkpoint saves.

Who does what comes from the service's `ServiceTopology`: fetching ranks (rank 0 along the
strategy's broadcast dims, on the reading pipeline stages, per bucket of the strategy's axis)
pull their microbatches from their Data Constructor through a `MicrobatchSource`
(`RemoteConstructors` over Ray, or an `InProcessService`); with ``broadcast`` the other ranks of
the broadcast group (TP, CP or TP x CP: selective broadcasting) receive them by
`torch.distributed.broadcast` from that fetcher, and when ``cp`` is among the dims every rank
then cuts its own CP slice; stages that read nothing get ``{}``. Without ``broadcast``
(Megatron-LM's own `get_batch` broadcasts over TP) non-fetching ranks get None. With a hybrid
(VLM) strategy every rank also pulls its encoder share with `encoder_images(step)`.
Tensors come out in Megatron's dtypes: tokens/labels/position_ids int64, loss_mask float32,
attention_mask bool (True = masked), cu_seqlens int32.

Hot path: one object-store round trip per microbatch, no hashing (``record_digests`` turns on
a SHA-1 per delivered microbatch for identity checks), and bounded records (``history``);
loops take the records of a step with `drain()`.

Checkpoint (`StateSchema` "data_position", version 2): fingerprint ``num_microbatches``;
fields ``step`` and ``microbatch`` of the next microbatch to deliver.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from megascale_data_ext.dataplane.cp_slicing import slice_for_cp
from megascale_data_ext.errors import ConfigError, MegascaleDataError, ResumeError, root_cause
from megascale_data_ext.runtime.constructor import EncoderImages
from megascale_data_ext.runtime.metrics import ServiceMetrics, service_metrics
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.state import StateSchema

_DTYPES = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.float32,
    "attention_mask": torch.bool,
    "cu_seqlens": torch.int32,
    "max_seqlen": torch.int32,
    "source_ids": torch.int32,
}


class MicrobatchSource(Protocol):
    """Where a fetching rank's microbatches come from (`RemoteConstructors`, `InProcessService`)."""

    def get(self, step: int, microbatch: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Microbatch `microbatch` of `step` as rank `rank` needs it, and its delivery info."""
        ...

    def get_encoder_images(self, step: int, rank: int) -> EncoderImages:
        """Rank `rank`'s encoder share of `step` from every constructor."""
        ...

    def report_loss(self, step: int, losses: dict[int, float]) -> None:
        """Hand the Planner the per-source loss of `step` (loss-driven mixing)."""
        ...


_NUMPY_DTYPES = {k: torch.empty(0, dtype=v).numpy().dtype for k, v in _DTYPES.items()}


def to_torch(batch: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Megatron's tensors of a microbatch, each made with at most one copy.

    Arrays read from the object store are read-only views of its shared memory, which a torch
    tensor must not wrap (an in-place op would write into Ray's buffer); they are copied, with
    the dtype conversion in the same copy. Writable arrays of the right dtype are wrapped as they are.
    """
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        want = _NUMPY_DTYPES.get(k, v.dtype)
        if v.dtype != want or not v.flags.writeable or not v.flags.c_contiguous:
            v = np.array(v, dtype=want, order="C")
        out[k] = torch.from_numpy(v)
    return out


def raise_service_error(exc: BaseException) -> None:
    """Re-raise an error from inside the service as the error the service raised.

    Ray wraps an actor's error once per hop (loader -> constructor -> client), each layer
    printing the remote traceback again; our own errors (`SourceError`, `PlanError`, ...) come
    out unwrapped, chained to the Ray error (``__cause__``) so a full log still shows where they
    were raised. The steps this rank prefetched fail with the same cause: Ray would print each
    one's traceback when it is dropped, so its handler of unhandled errors skips ours from then on
    (`quiet_repeats_of_our_errors`).
    """
    cause = root_cause(exc)
    if cause is exc or not isinstance(cause, MegascaleDataError):
        raise exc
    quiet_repeats_of_our_errors()
    raise cause from exc


def quiet_repeats_of_our_errors() -> None:
    """Make Ray's handler of dropped, never-read errors skip ours (other errors still print).

    Not ``RAY_IGNORE_UNHANDLED_ERRORS``, which would silence every error, and which this would
    add to the environment while Ray's threads run: adding a variable reallocates C's
    ``environ`` under a concurrent ``getenv`` (see `trainer.model.settle_model_environ`).
    """
    import ray._private.worker as ray_worker

    previous = getattr(ray_worker, "_unhandled_error_handler", None)
    if previous is None or getattr(previous, "skips_megascale_errors", False):
        return

    def handler(error: BaseException) -> None:
        if not isinstance(root_cause(error), MegascaleDataError):
            previous(error)

    handler.skips_megascale_errors = True  # type: ignore[attr-defined]
    ray_worker._unhandled_error_handler = handler


def digest(batch: Mapping[str, torch.Tensor]) -> str:
    """SHA-1 of a microbatch's fields (identity checks across ranks and runs)."""
    h = hashlib.sha1()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(batch[k].contiguous().numpy().tobytes())
    return h.hexdigest()


class Client:
    """Delivers this rank's microbatches in (step, microbatch) order. Not thread-safe (one per rank).

    Args:
        topology: The service's topology (`ServiceHandles.topology`).
        rank: This process's global rank.
        source: Where fetching ranks pull from; None on ranks that never fetch or need images.
        num_microbatches: Microbatches per step for this rank's bucket.
        broadcast_group: Process group of `topology.broadcast_group(rank)` (Megatron's TP, CP or
            TP-CP group, see `megatron.groups.broadcast_group`), for the broadcast.
        broadcast: Broadcast each microbatch over the broadcast group (False when the caller
            broadcasts itself, as Megatron-LM's `get_batch` does over TP).
        record_digests: Keep a SHA-1 of every delivered microbatch (tests, debugging).
        history: Most records (delivery infos, fetch latencies, digests) kept between drains.
        metrics: Where fetch latencies are recorded (default: this process's `service_metrics()`).
        cp_slice: With whole packs broadcast over CP (``cp`` among the broadcast dims), cut this
            rank's CP slice; False hands the whole pack on, for a trainer that slices itself
            (Megatron-Bridge's ``get_batch``).
    """

    STATE = StateSchema("data_position", 2, ("step", "microbatch"),
                        hint="resume with the global batch size (data.num_microbatches) of the saved run")

    def __init__(
        self,
        topology: ServiceTopology,
        rank: int,
        *,
        source: MicrobatchSource | None,
        num_microbatches: int,
        broadcast_group: Any = None,
        broadcast: bool = True,
        record_digests: bool = False,
        history: int = 1024,
        metrics: ServiceMetrics | None = None,
        cp_slice: bool = True,
    ) -> None:
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ConfigError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        self.topology, self.rank, self.source, self.num_microbatches = topology, rank, source, num_microbatches
        self.broadcast_group, self.broadcast, self.record_digests = broadcast_group, broadcast, record_digests
        self.metrics = service_metrics() if metrics is None else metrics
        self.cp_slice = cp_slice and topology.client_slices_cp
        # this rank's part in the service's distribution: fetches, or receives from `src` over `group_size` ranks
        self.fetches, self.needs_data = topology.fetches(rank), topology.needs_data(rank)
        self.src, self.group_size = topology.broadcast_source(rank), len(topology.broadcast_group(rank))
        self.cp_rank = topology.tree.coords(rank)["cp"]
        self.step, self.microbatch = 0, 0
        self._counts: dict[int, int] = {}  # variable counts: microbatches of each step this rank was told of
        self._ahead: dict[tuple[int, int], dict[str, torch.Tensor] | None] = {}  # fetched to learn a count
        self.last_info: dict[str, Any] | None = None
        """Delivery info (step, bucket, samples, tokens...) of the last microbatch delivered."""
        self.delivered: deque[dict[str, Any]] = deque(maxlen=history)
        self.fetch_seconds: deque[float] = deque(maxlen=history)
        self.digests: deque[str] = deque(maxlen=history)
        self.encoder_seconds: deque[float] = deque(maxlen=history)
        self.received = {"bytes": 0, "patch_bytes": 0}  # from the service since the last drain (image patches apart)

    @classmethod
    def connect(cls, handles: Any, rank: int, *, num_microbatches: int, **kwargs: Any) -> Client:
        """A client of the running service `handles` (`ServiceHandles`) over Ray."""
        from megascale_data_ext.runtime.remote import RemoteConstructors

        handles.apply_env()
        return cls(handles.topology, rank, source=RemoteConstructors(handles.topology, handles.address),
                   num_microbatches=num_microbatches, **kwargs)

    # -- delivery ------------------------------------------------------------------
    def fetch(self, step: int, microbatch: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Pull one microbatch from the constructor (fetching ranks only), no TP broadcast."""
        if not self.fetches or self.source is None:
            raise ConfigError(f"rank {self.rank} does not fetch here (it receives from rank {self.src}, reads "
                              "nothing, or was given no source)")
        t0 = time.perf_counter()
        try:
            batch, info = self.source.get(step, microbatch, self.rank)
        except Exception as exc:
            raise_service_error(exc)
        seconds = time.perf_counter() - t0
        self.fetch_seconds.append(seconds)
        self.metrics.fetch_latency(seconds, self.rank)
        self._count(batch.values(), batch.get("images"))
        return batch, info

    def _count(self, arrays: Any, patches: np.ndarray | None) -> None:
        self.received["bytes"] += sum(int(np.asarray(a).nbytes) for a in arrays)
        self.received["patch_bytes"] += 0 if patches is None else int(np.asarray(patches).nbytes)

    def _broadcast(self, batch: dict[str, torch.Tensor] | None, info: dict | None):
        """Send (on the fetcher) or receive (elsewhere) one microbatch within the broadcast group."""
        header = [None]
        if self.fetches:
            header[0] = ({k: (tuple(v.shape), v.dtype) for k, v in batch.items()}, info)
        dist.broadcast_object_list(header, src=self.src, group=self.broadcast_group)
        shapes, info = header[0]
        if not self.fetches:
            batch = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
        for k in sorted(shapes):
            dist.broadcast(batch[k], src=self.src, group=self.broadcast_group)
        return batch, info

    def _own_cp_slice(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's CP slice of a whole pack (selective broadcasting over cp)."""
        return to_torch(slice_for_cp({k: v.numpy() for k, v in batch.items()}, cp_size=self.topology.tree.cp,
                                     cp_rank=self.cp_rank))

    def microbatches(self, step: int) -> int:
        """How many microbatches this rank runs at `step`: ``num_microbatches``, or where the
        strategy plans a count per consumer (hybrid CP) what its constructor says (the first
        microbatch is fetched for it and kept for `get`; collective over the broadcast group)."""
        if not self.topology.variable_counts:
            return self.num_microbatches
        if step not in self._counts:
            self._ahead[(step, 0)] = self.get(step, 0)
        return self._counts[step]

    def get(self, step: int, microbatch: int) -> dict[str, torch.Tensor] | None:
        """Microbatch `microbatch` of `step` for this rank, without moving the data position.

        ``{}`` where the stage reads nothing; None on non-fetching ranks without ``broadcast``.
        """
        if (step, microbatch) in self._ahead:
            return self._ahead.pop((step, microbatch))
        if not self.needs_data:
            return {} if self.broadcast else None
        broadcast = self.broadcast and self.group_size > 1
        if not self.fetches and not broadcast:
            return None
        batch = info = None
        if self.fetches:
            raw, info = self.fetch(step, microbatch)
            batch = to_torch(raw)
        if broadcast:
            batch, info = self._broadcast(batch, info)
        if self.cp_slice:
            batch = self._own_cp_slice(batch)
        if info is not None and "microbatches" in info:
            self._counts[step] = int(info["microbatches"])
            for old in [s for s in self._counts if s < step - 8]:
                del self._counts[old]
        self.last_info = info
        self.delivered.append(info)
        if self.record_digests:
            self.digests.append(digest(batch))
        return batch

    def next_microbatch(self) -> dict[str, torch.Tensor] | None:
        """The microbatch at the data position; the position moves one on."""
        batch = self.get(self.step, self.microbatch)
        self.skip()
        return batch

    def skip(self) -> None:
        """Move the data position one microbatch on without delivering it (chunks that read nothing)."""
        self.microbatch += 1
        if self.microbatch >= self._counts.get(self.step, self.num_microbatches):
            self.step, self.microbatch = self.step + 1, 0

    def step_iterator(self, step: int | None = None) -> Iterator[dict[str, torch.Tensor] | None]:
        """The rest of a step's microbatches, as Megatron's schedule consumes them.

        Given `step`, the position first moves to its start (callers that drive steps
        explicitly); the position advances as the iterator is consumed.
        """
        if step is not None and (step, 0) != (self.step, self.microbatch):
            self.seek(step)
        current = self.step
        while self.step == current:
            yield self.next_microbatch()

    def end_step(self, step: int) -> None:
        """Mark `step` done: the position moves to the next step's start even where the schedule
        did not consume this rank's iterator (model chunks that read no data)."""
        self.seek(step + 1)

    def seek(self, step: int, microbatch: int = 0) -> None:
        if step < 0 or microbatch < 0 or (not self.topology.variable_counts and microbatch >= self.num_microbatches):
            raise ResumeError(f"data position (step {step}, microbatch {microbatch}) is out of range "
                              f"(steps >= 0, microbatches in [0, {self.num_microbatches}))")
        self.step, self.microbatch = int(step), int(microbatch)

    def encoder_images(self, step: int) -> EncoderImages:
        """This rank's encoder share of `step`: images gathered from every constructor.

        Returns ``(patches float32 [P, patch_dim], seqlens int32 [n], keys int64 [n, 3])``, key =
        (source, position, image index), constructors in order. Every rank calls it (all stages).
        """
        if self.source is None:
            raise ConfigError(f"rank {self.rank} has no source to pull encoder images from")
        t0 = time.perf_counter()
        try:
            out = self.source.get_encoder_images(step, self.rank)
        except Exception as exc:
            raise_service_error(exc)
        self.encoder_seconds.append(time.perf_counter() - t0)
        self._count(out, out[0])
        return out

    def report_loss(self, step: int, losses: Mapping[int, float]) -> None:
        """Report `step`'s per-source training loss to the Planner (feedback mixing)."""
        if self.source is None:
            raise ConfigError(f"rank {self.rank} has no source to report losses through")
        try:
            self.source.report_loss(step, dict(losses))
        except Exception as exc:
            raise_service_error(exc)

    def drain(self) -> dict[str, Any]:
        """The records since the last drain (``delivered``, ``fetch_seconds``, ``digests``, and
        the ``bytes`` received from the service, ``patch_bytes`` of them image patches), cleared."""
        out = {"delivered": list(self.delivered), "fetch_seconds": list(self.fetch_seconds),
               "digests": list(self.digests), **self.received}
        self.delivered.clear()
        self.fetch_seconds.clear()
        self.digests.clear()
        self.received = {"bytes": 0, "patch_bytes": 0}
        return out

    # -- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data position to save with a checkpoint: the next microbatch the trainer consumes."""
        return self.STATE.stamp({"num_microbatches": self.num_microbatches}, step=self.step,
                                microbatch=self.microbatch)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fields = self.STATE.check(state, {"num_microbatches": self.num_microbatches})
        self.seek(int(fields["step"]), int(fields["microbatch"]))
