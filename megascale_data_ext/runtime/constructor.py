"""Data Constructor: assembles planned microbatches and cuts them per client.

One constructor serves a group of DP buckets (by default one). For a step it asks the
Planner for its part of the plan, pulls the planned samples from the Source Loaders that hold
them, packs each microbatch (THD with `cu_seqlens`, labels, loss mask, reset position ids,
optional attention mask), and answers each fetching client with its parallelism transform:
CP slice of its cp rank, fields of its PP stage.

Hybrid (VLM, paper Alg. 2) steps also carry an `EncoderPlan`: every image of the step goes
to one encoder rank over WORLD. A constructor keeps the decoded patches of its buckets'
images per encoder rank and hands them out with `get_encoder_images(step, rank)`; every rank
asks every constructor, so the union over constructors is that rank's encoder share.

Thread contract: `get` is called concurrently by clients while a prefetch thread builds the
next steps; built steps live in `_built` until every fetching client has taken every
microbatch, which bounds memory to `prefetch` steps. Encoder images live in `_images` until
every rank took its share, and at most `image_steps_kept` steps of them are kept (older ones
are dropped: a loop that never asks for encoder images does not leak them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.cp_slicing import slice_for_cp
from megascale_data_ext.dataplane.microbatch import fields_for_stage
from megascale_data_ext.dataplane.packing import pack_microbatch, span_view
from megascale_data_ext.dataplane.plan import ConstructorPlan, StepPlan
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.topology import ServiceTopology

FetchFn = Callable[[int, int, list[int]], dict[str, list]]
"""(source_id, step, buckets) -> a loader's `fetch` result."""

EncoderImages = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(patches float32 [P, patch_dim], seqlens int32 [n], keys int64 [n, 3])``; key = (source, position, image)."""


@dataclass(slots=True, kw_only=True)
class EncoderRows:
    """The EncoderPlan rows of some DP buckets' samples, in plan order (one row per image).

    Shipped from the Planner to a constructor; ``rank`` is the encoder bucket, i.e. the
    global rank that encodes the image when the encoder axis is WORLD.
    """

    source: np.ndarray  # int64
    position: np.ndarray  # int64 stream position of the image's sample
    image: np.ndarray  # int64 image number inside its sample
    patches: np.ndarray  # int64 planned patch count
    rank: np.ndarray  # int64 encoder bucket
    num_ranks: int

    def keys(self) -> np.ndarray:
        return np.stack([self.source, self.position, self.image], axis=1).astype(np.int64).reshape(-1, 3)


def encoder_rows(plan: StepPlan, buckets: Sequence[int]) -> EncoderRows | None:
    """The images of `buckets`' samples and their encoder ranks; None for a plan without encoder."""
    enc = plan.encoder
    if enc is None:
        return None
    sel = np.flatnonzero(np.isin(plan.bucket[enc.sample], np.asarray(list(buckets), dtype=np.int64)))
    rows = enc.sample[sel]
    return EncoderRows(
        source=plan.source[rows].astype(np.int64),
        position=plan.position[rows].astype(np.int64),
        image=enc.image[sel].astype(np.int64),
        patches=enc.patches[sel].astype(np.int64),
        rank=enc.bucket[sel].astype(np.int64),
        num_ranks=int(enc.num_buckets),
    )


def _empty_images(patch_dim: int) -> EncoderImages:
    return (np.zeros((0, patch_dim), np.float32), np.zeros(0, np.int32), np.zeros((0, 3), np.int64))


def merge_encoder_images(parts: Sequence[EncoderImages]) -> EncoderImages:
    """One rank's encoder share from every constructor's part, constructors in order."""
    dims = {p.shape[1] for p, seq, _ in parts if len(seq)} or {parts[0][0].shape[1]}
    patch_dim = max(dims)
    return (
        np.concatenate([p.reshape(-1, patch_dim) if len(seq) else np.zeros((0, patch_dim), np.float32)
                        for p, seq, _ in parts]).astype(np.float32, copy=False),
        np.concatenate([seq for _, seq, _ in parts]).astype(np.int32, copy=False),
        np.concatenate([k.reshape(-1, 3) for _, _, k in parts]).astype(np.int64, copy=False),
    )


@dataclass(slots=True)
class _ImageStep:
    per_rank: dict[int, EncoderImages]
    remaining: set[int]
    patch_dim: int


@dataclass(slots=True)
class _BuiltStep:
    batches: dict[tuple[int, int], dict[str, np.ndarray]]
    info: dict[tuple[int, int], dict[str, Any]]
    remaining: set[tuple[int, int, int]] = field(default_factory=set)  # (bucket, microbatch, rank)


class DataConstructor:
    """Builds the microbatches of its buckets.

    Args:
        buckets: DP buckets this constructor serves.
        config: Service config (seq length, microbatches, prefetch, attention mask).
        topology: The service topology (who fetches, CP/PP coordinates of clients).
        get_plan: ``(step, bucket) -> ConstructorPlan`` (the Planner).
        fetch: ``(source_id, step, buckets) -> samples`` (a Source Loader).
        pad_id: Padding / masked-label token.
        image_token_id: Image placeholder token (VLM); None for text-only.
        decode: Optional per-sample transform applied before packing (deferred image decoding).
        get_encoder_plan: ``(step, buckets) -> EncoderRows | None`` (the Planner); given, the
            constructor keeps each step's images per encoder rank for `get_encoder_images`.
        image_steps_kept: Most steps of encoder images kept while some rank has not taken its share.
        history: Most build timings and skipped-sample records kept (older ones are counted only).
    """

    def __init__(
        self,
        buckets: Sequence[int],
        config: ServiceConfig,
        topology: ServiceTopology,
        *,
        get_plan: Callable[[int, int], ConstructorPlan],
        fetch: FetchFn,
        pad_id: int,
        image_token_id: int | None = None,
        decode: Callable[[Any], Any] | None = None,
        get_encoder_plan: Callable[[int, list[int]], EncoderRows | None] | None = None,
        image_steps_kept: int | None = None,
        history: int = 256,
    ) -> None:
        self.buckets = list(buckets)
        self.config = config
        self.topology = topology
        self.tree = topology.tree
        self.get_plan = get_plan
        self.fetch = fetch
        self.pad_id = pad_id
        self.image_token_id = image_token_id
        self.decode = decode
        self.split_loss = config.feedback_mixing  # per-token source ids so the loss splits per source
        self.layout = topology.layout
        self.fetchers = {b: topology.fetchers(b) for b in self.buckets}
        self.get_encoder_plan = get_encoder_plan
        self.image_steps_kept = image_steps_kept or max(4, 2 * config.prefetch + 2)
        self._images: dict[int, _ImageStep] = {}
        self._built: dict[int, _BuiltStep] = {}
        self._building: dict[int, threading.Event] = {}
        self._delivered: deque[int] = deque(maxlen=history)  # steps every fetcher took in full
        self._lock = threading.Lock()
        self._next_prefetch = 0
        self.built_steps = 0
        self.skipped_total = 0
        self.build_seconds: deque[float] = deque(maxlen=history)
        self.skipped: deque[tuple[int, int, int, str]] = deque(maxlen=history)  # (step, source, position, reason)

    # -- assembly ------------------------------------------------------------------
    def _build(self, step: int) -> _BuiltStep:
        t0 = time.perf_counter()
        plans = {b: self.get_plan(step, b) for b in self.buckets}
        sources = sorted({ref.source for p in plans.values() for mb in p.microbatches for ref in mb})
        pool: dict[tuple[int, int], Any] = {}
        for s in sources:
            got = self.fetch(s, step, self.buckets)
            for _b, pos, sample in got["samples"]:
                pool[(s, pos)] = sample
            for _b, pos, bad in got["skipped"]:
                self.skipped.append((step, s, pos, bad.reason))
                self.skipped_total += 1
        if self.decode is not None:
            pool = {key: self.decode(x) for key, x in pool.items()}
        wants_images = self.get_encoder_plan is not None and any(p.encoder for p in plans.values())
        rows = self.get_encoder_plan(step, self.buckets) if wants_images else None  # no round trip for text
        mult = self.config.pad_to_multiple_of * 2 * self.tree.cp
        built = _BuiltStep(batches={}, info={})
        for b, plan in plans.items():
            for j, refs in enumerate(plan.microbatches):
                refs = [r for r in refs if (r.source, r.position) in pool]
                samples = [span_view(pool[(r.source, r.position)], r.start, r.stop,
                                     name=f"step {step} source {r.source} position {r.position}") for r in refs]
                batch = pack_microbatch(
                    samples,
                    seq_length=_packed_length(plan.cap, self.config.seq_length, samples, mult),
                    pad_id=self.pad_id,
                    image_token_id=self.image_token_id,
                    with_attention_mask=self.config.with_attention_mask,
                    pad_to_multiple_of=mult,
                    variable_length=True,
                    source_ids=[r.source for r in refs] if self.split_loss else None,
                )
                built.batches[(b, j)] = batch
                delivered = [(r.source, r.position, r.index) for r in refs]
                built.info[(b, j)] = {
                    "step": step,
                    "bucket": b,
                    "microbatch": j,
                    "samples": np.asarray(delivered, dtype=np.int64).reshape(-1, 3),
                    "tokens": int(batch["num_tokens"][0]),
                }
                if any(r.stop is not None for r in refs):  # token mode: which token span of each sample
                    built.info[(b, j)]["spans"] = np.asarray(
                        [(r.source, r.position, r.start, r.stop) for r in refs], dtype=np.int64).reshape(-1, 4)
                if self.image_token_id is not None:  # packing order of `images`: samples, then their images
                    built.info[(b, j)]["image_keys"] = np.asarray(
                        [(s, p, k) for (s, p, _i), x in zip(delivered, samples, strict=True)
                         for k in range(len(_images_of(x)))], dtype=np.int64).reshape(-1, 3)
                for rank in self.fetchers[b]:
                    built.remaining.add((b, j, rank))
        if rows is not None:
            images = self._encoder_images(step, rows, pool)
            with self._lock:
                self._images[step] = images
                for old in [s for s in self._images if s <= step - self.image_steps_kept]:
                    self._images.pop(old)
        self.build_seconds.append(time.perf_counter() - t0)
        self.built_steps += 1
        return built

    def _encoder_images(self, step: int, rows: EncoderRows, pool: dict[tuple[int, int], Any]) -> _ImageStep:
        """Group the step's images by encoder rank; images of skipped samples are not encoded."""
        per_rank: dict[int, list[tuple[np.ndarray, tuple[int, int, int]]]] = {}
        patch_dim = 0
        for s, pos, k, n, r in zip(rows.source.tolist(), rows.position.tolist(), rows.image.tolist(),
                                   rows.patches.tolist(), rows.rank.tolist(), strict=True):
            sample = pool.get((s, pos))
            if sample is None:
                continue
            images = _images_of(sample)
            if k >= len(images) or np.asarray(images[k]).shape[0] != n:
                got = np.asarray(images[k]).shape[0] if k < len(images) else "no image"
                raise PlanError(
                    f"step {step}: image {k} of (source {s}, position {pos}) was planned with {n} patches but "
                    f"the loader delivered {got}; the source's patch metadata disagrees with its decoder"
                )
            patches = np.asarray(images[k], dtype=np.float32)
            patch_dim = patches.shape[1]
            per_rank.setdefault(r, []).append((patches, (s, pos, k)))
        out: dict[int, EncoderImages] = {}
        for r, items in per_rank.items():
            out[r] = (
                np.concatenate([x for x, _ in items]).astype(np.float32, copy=False),
                np.asarray([x.shape[0] for x, _ in items], dtype=np.int32),
                np.asarray([key for _, key in items], dtype=np.int64).reshape(-1, 3),
            )
        return _ImageStep(per_rank=out, remaining=set(range(rows.num_ranks)), patch_dim=patch_dim)

    def _ensure(self, step: int, *, prefetching: bool = False) -> _BuiltStep | None:
        """The built step, building it once; None when prefetching a step already delivered."""
        with self._lock:
            built = self._built.get(step)
            if built is not None:
                return built
            if step in self._delivered:  # its samples left the loaders: a rebuild would be silently empty
                if prefetching:  # the clients got ahead of the prefetch thread
                    return None
                raise PlanError(f"step {step} of buckets {self.buckets} was already handed to every fetching rank; "
                                "each microbatch is delivered once (a client asked twice, or after a restart "
                                "without restoring its data position)")
            event = self._building.get(step)
            owner = event is None
            if owner:
                event = self._building[step] = threading.Event()
        if owner:
            try:
                built = self._build(step)
                with self._lock:
                    self._built[step] = built
            finally:
                with self._lock:
                    self._building.pop(step, None)
                event.set()
            return built
        event.wait()
        with self._lock:
            if step not in self._built:
                raise RuntimeError(f"constructor for buckets {self.buckets}: building step {step} failed")
            return self._built[step]

    def prefetch(self, upto: int) -> None:
        """Build every step up to `upto` that is not built yet (called from a background thread)."""
        while self._next_prefetch <= upto:
            self._ensure(self._next_prefetch, prefetching=True)
            self._next_prefetch += 1

    # -- client interface ----------------------------------------------------------
    def get_step(self, step: int, rank: int) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        """Every microbatch of `step` for client `rank`, in order: one call per step instead of m."""
        return [self.get(step, j, rank) for j in range(self.config.num_microbatches)]

    def get(self, step: int, microbatch: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The microbatch `microbatch` of `step` as client `rank` needs it (CP slice, PP fields)."""
        bucket = self.layout.bucket_of_rank(rank)
        if bucket not in self.fetchers:
            raise ValueError(f"rank {rank} belongs to bucket {bucket}, not served here ({self.buckets})")
        self._next_prefetch = max(self._next_prefetch, step)
        built = self._ensure(step)
        batch, info = built.batches[(bucket, microbatch)], built.info[(bucket, microbatch)]
        coords = self.tree.coords(rank)
        if self.tree.cp > 1 and not self.topology.client_slices_cp:  # else every rank slices after the broadcast
            batch = slice_for_cp(batch, cp_size=self.tree.cp, cp_rank=coords["cp"])
        batch = fields_for_stage(batch, pp_rank=coords["pp"], pp_size=self.tree.pp,
                                 middle_stage_masks=self.config.middle_stage_masks)
        with self._lock:
            built.remaining.discard((bucket, microbatch, rank))
            if not built.remaining:
                self._built.pop(step, None)
                self._delivered.append(step)
        return batch, info

    def buffered_steps(self) -> int:
        """Steps built and not yet taken by every fetching client."""
        return len(self._built)

    def discard_before(self, step: int) -> int:
        """Drop built steps before `step` that some client will never take (its request went to a
        constructor that died, and was re-sent to a restarted one); returns how many were dropped.
        A dropped step asked for again is rebuilt from its plan."""
        with self._lock:
            old = [s for s in self._built if s < step]
            for s in old:
                del self._built[s]
        return len(old)

    def stats(self) -> dict[str, Any]:
        return {"built_steps": self.built_steps, "build_seconds": list(self.build_seconds),
                "skipped_total": self.skipped_total, "skipped": list(self.skipped)}

    def get_encoder_images(self, step: int, rank: int) -> EncoderImages:
        """The images of this constructor's buckets that encoder rank `rank` encodes at `step`.

        Returns ``(patches float32 [P, patch_dim], seqlens int32 [n], keys int64 [n, 3])`` with
        key = (source, position, image index); empty arrays when `rank` encodes none of them.

        Raises:
            PlanError: No encoder delivery configured, the step's plan has no EncoderPlan, or
                the step's images were already dropped (asked too late).
        """
        if self.get_encoder_plan is None:
            raise PlanError(f"constructor for buckets {self.buckets} was built without `get_encoder_plan`; "
                            "encoder images need a hybrid (vlm_balance) strategy")
        with self._lock:
            images = self._images.get(step)
            built_already = step in self._built or step in self._building
        if images is None:
            if not built_already and step < self._next_prefetch - self.image_steps_kept:
                raise PlanError(f"encoder images of step {step} were dropped (constructor at step "
                                f"{self._next_prefetch}, keeps {self.image_steps_kept}); fetch them before the microbatches")
            self._next_prefetch = max(self._next_prefetch, step)
            self._ensure(step)
            with self._lock:
                images = self._images.get(step)
            if images is None:
                raise PlanError(f"step {step} has no EncoderPlan: use a hybrid strategy (strategy=vlm_balance) "
                                "to balance images over the encoder axis")
        with self._lock:
            images.remaining.discard(rank)
            if not images.remaining:
                self._images.pop(step, None)
        return images.per_rank.get(rank, _empty_images(images.patch_dim))


def _images_of(sample: Any) -> list:
    images = sample.get("images") if isinstance(sample, dict) else getattr(sample, "images", None)
    return list(images) if images is not None else []


def _packed_length(cap: int | None, seq_length: int, samples: list, mult: int) -> int:
    """The packing capacity: the planner's cap, or for an uncapped (vanilla) plan as long as
    the microbatch's samples need (rounded up to `mult`), like Megatron's fixed-count batches."""
    if cap is not None:
        return seq_length
    need = sum(len(x.tokens) + sum(len(im) for im in x.images) for x in samples)
    return max(seq_length, -(-need // mult) * mult)
