"""Client: the trainer-side end of the service, inside each torchrun rank.

A client knows its coordinates from the ClientPlaceTree. Ranks the tree marks as fetchers
(TP rank 0 of the first and last PP stage, per CP rank) pull their microbatches from their
Data Constructor through Ray; the other ranks of a TP group receive them with
`torch.distributed.broadcast` from that fetcher (`broadcast_at("tp")`); middle PP stages get
nothing (their input is the previous stage's activations). With a hybrid (VLM) strategy
every rank, whatever its stage, also pulls its encoder share with `encoder_images(step)`:
the encoder is data parallel over WORLD, so each rank asks every constructor. Tensors come out in Megatron's
dtypes: tokens/labels/position_ids int64, loss_mask float32, attention_mask bool (True =
masked), cu_seqlens int32.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale_data_ext.dataplane.placetree import ClientPlaceTree, FetchStages

_DTYPES = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.float32,
    "attention_mask": torch.bool,
    "cu_seqlens": torch.int32,
    "max_seqlen": torch.int32,
}


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in batch.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        want = _DTYPES.get(k)
        out[k] = t.to(want) if want is not None and t.dtype != want else t
    return out


def _digest(batch: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(batch[k].contiguous().numpy().tobytes())
    return h.hexdigest()


class Client:
    """Delivers this rank's microbatches, step by step.

    Args:
        tree: The trainer mesh (from `ClientPlaceTree.from_megatron()` in training).
        rank: This process's global rank.
        namespace: Ray namespace of the service's named actors.
        address: Ray address to join (None when Ray is already initialised in-process).
        num_microbatches: Microbatches per step for this DP rank.
        constructor_group: DP buckets per constructor (must match the service).
        axis: Distribution axis of the strategy ("DP" or "CP").
        tp_group: Process group of this rank's TP group, for `broadcast_at("tp")`.
        fetch_stages: The service's `ServiceHandles.fetch_stages` ("ends", or "all" when
            middle pipeline stages fetch their masks); None keeps the tree's own.
    """

    def __init__(
        self,
        tree: ClientPlaceTree,
        rank: int,
        *,
        namespace: str,
        num_microbatches: int,
        address: str | None = None,
        constructor_group: int = 1,
        axis: str = "DP",
        tp_group: Any = None,
        fetch_stages: str | None = None,
    ) -> None:
        if fetch_stages is not None:
            tree = replace(tree, fetch_stages=FetchStages(fetch_stages))
        self.tree = tree
        self.rank = rank
        self.num_microbatches = num_microbatches
        self.axis = axis
        self.tp_group = tp_group
        self.fetches = tree.must_fetch(rank, axis)
        self.needs_data = tree.needs_data(rank, axis)
        self.src = tree.broadcast_source(rank, "tp")
        self.fetch_seconds: list[float] = []
        self.delivered: list[dict[str, Any]] = []
        self.digests: list[str] = []  # one hash of every delivered microbatch (TP-identity checks)
        self.encoder_seconds: list[float] = []
        self.namespace = namespace
        self.address = address
        self.num_constructors = -(-tree.buckets(axis).num_buckets // constructor_group)
        self._handle = None
        self._all_handles: list[Any] | None = None
        if self.fetches:
            import ray

            self._connect()
            bucket = tree.buckets(axis).bucket_of_rank(rank)
            self._handle = ray.get_actor(f"constructor/{bucket // constructor_group}", namespace=namespace)

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False, configure_logging=False)

    def encoder_images(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's encoder share of `step`: images gathered from every constructor.

        Returns ``(patches float32 [P, patch_dim], seqlens int32 [n], keys int64 [n, 3])``, key =
        (source, position, image index), constructors in order. Every rank calls it (all stages).
        """
        import ray

        t0 = time.perf_counter()
        if self._all_handles is None:
            self._connect()
            self._all_handles = [ray.get_actor(f"constructor/{j}", namespace=self.namespace)
                                 for j in range(self.num_constructors)]
        parts = ray.get([h.get_encoder_images.remote(step, self.rank) for h in self._all_handles])
        dims = {p.shape[1] for p, seq, _ in parts if len(seq)} or {parts[0][0].shape[1]}
        patch_dim = max(dims)
        out = (
            np.concatenate([p.reshape(-1, patch_dim) if len(seq) else np.zeros((0, patch_dim), np.float32)
                            for p, seq, _ in parts]).astype(np.float32, copy=False),
            np.concatenate([seq for _, seq, _ in parts]).astype(np.int32, copy=False),
            np.concatenate([k.reshape(-1, 3) for _, _, k in parts]).astype(np.int64, copy=False),
        )
        self.encoder_seconds.append(time.perf_counter() - t0)
        return out

    def fetch(self, step: int, microbatch: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Pull one microbatch from the constructor (fetching ranks only), no TP broadcast.

        For callers that broadcast themselves (Megatron-LM's `get_batch_on_this_tp_rank`).
        """
        import ray

        t0 = time.perf_counter()
        batch, info = ray.get(self._handle.get.remote(step, microbatch, self.rank))
        self.fetch_seconds.append(time.perf_counter() - t0)
        return batch, info

    def _broadcast(self, batch: dict[str, torch.Tensor] | None, info: dict | None):
        """Send (on the fetcher) or receive (elsewhere) one microbatch within the TP group."""
        header = [None]
        if self.fetches:
            header[0] = ({k: (tuple(v.shape), v.dtype) for k, v in batch.items()}, info)
        dist.broadcast_object_list(header, src=self.src, group=self.tp_group)
        shapes, info = header[0]
        if not self.fetches:
            batch = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
        for k in sorted(shapes):
            dist.broadcast(batch[k], src=self.src, group=self.tp_group)
        return batch, info

    def get(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        """Microbatch `microbatch` of `step` for this rank ({} where the stage reads nothing)."""
        if not self.needs_data:
            return {}
        batch = info = None
        if self.fetches:
            raw, info = self.fetch(step, microbatch)
            batch = to_torch(raw)
        if self.tree.tp > 1:
            batch, info = self._broadcast(batch, info)
        self.delivered.append(info)
        self.digests.append(_digest(batch))
        return batch

    def step_iterator(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """One iterator over the step's microbatches, as Megatron's schedule consumes it."""
        for j in range(self.num_microbatches):
            yield self.get(step, j)
