"""Data Constructor: assembles planned microbatches and cuts them per client.

One constructor serves a group of DP buckets (by default one). For a step it asks the
Planner for its part of the plan, pulls the planned samples from the Source Loaders that hold
them, packs each microbatch (THD with `cu_seqlens`, labels, loss mask, reset position ids,
optional attention mask), and answers each fetching client with its parallelism transform:
CP slice of its cp rank, fields of its PP stage.

Hybrid (VLM, paper Alg. 2) steps also carry an `EncoderPlan`: every image of the step goes
to one encoder rank over WORLD. A constructor keeps the decoded patches of its buckets'
images per encoder rank and hands them out with `get_encoder_images(step, rank)`; every rank
asks every constructor, so the union over constructors is that rank's encoder share. The
microbatches of such a step carry no patches (`without_patches`): each image travels once, to its
encoder rank, and the backbone takes its features from there by the microbatch's ``image_keys``.

Thread contract: `get` and `get_encoder_images` are called concurrently by clients while a
prefetch thread builds the next steps. A step's data (microbatches and encoder shares) lives
until every consumer has taken its part or moved past the step (`runtime.consumers`); memory is
bounded by backpressure — at most `max_lead` steps built ahead of the slowest consumer — not
by dropping steps a slow consumer still needs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.cp_slicing import slice_for_cp, slice_for_group
from megascale_data_ext.dataplane.microbatch import fields_for_stage, without_patches
from megascale_data_ext.dataplane.packing import pack_microbatch, span_view
from megascale_data_ext.dataplane.plan import ConstructorPlan, StepPlan
from megascale_data_ext.errors import PlanError, SampleError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.held_steps import IMAGES, HeldSteps, Takers
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.sources.transforms import DeferredDecoder

FetchFn = Callable[[int, list[int], list[int]], dict[int, dict[str, list]]]
"""(step, source_ids, buckets) -> {source_id: that loader's `fetch` result}: the step's sources in one
call, so a Ray façade asks each loader actor once for all the sources it holds."""

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
    sel = plan.encoder_images_of(buckets)
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
    num_ranks: int
    patch_dim: int


@dataclass(slots=True)
class _BuiltStep:
    """One built step: its microbatches (by ``(bucket, microbatch)``) and encoder images."""

    batches: dict[tuple[int, int], dict[str, np.ndarray]]
    info: dict[tuple[int, int], dict[str, Any]]
    images: _ImageStep | None = None
    counts: dict[int, int] = field(default_factory=dict)  # microbatches per bucket (hybrid CP: each its own)


class DataConstructor:
    """Builds the microbatches of its buckets.

    A step's data is built once and held (`runtime.held_steps`) until every consumer has taken
    its part or moved past the step, never dropped by a window; every request says which step
    its rank is on (`position`), so building stays within `max_lead` steps of the slowest
    fetcher (a request further ahead waits; if that fetcher makes no progress for
    `wait_timeout_s`, the request fails naming it).

    Args:
        buckets: DP buckets this constructor serves.
        config: Service config (seq length, microbatches, prefetch, attention mask).
        topology: The service topology (who fetches, CP/PP coordinates of clients).
        get_plans: ``(step, buckets) -> [ConstructorPlan per bucket]`` (the Planner: one call a step).
        fetch: ``(step, source_ids, buckets) -> {source_id: samples}`` (the Source Loaders, `FetchFn`).
        pad_id: Padding / masked-label token.
        image_token_id: Image placeholder token (VLM); None for text-only.
        get_encoder_plan: ``(step, buckets) -> EncoderRows | None`` (the Planner); given, the
            constructor keeps each step's images per encoder rank for `get_encoder_images`.
        start_step: The step every consumer starts at; None for a constructor restarted in a
            running service (a consumer counts once it asks for something).
        max_lead: Most steps built ahead of the slowest consumer; None = unbounded (one process
            whose caller paces its consumers).
        wait_timeout_s: Longest a request waits while the slowest fetcher makes no progress.
        on_floor: Called with the slowest consumer's step whenever it moves forward (the Planner
            keeps plans until every constructor is past them); must not raise.
        history: Most build timings and skipped-sample records kept (older ones are counted only).
    """

    def __init__(
        self,
        buckets: Sequence[int],
        config: ServiceConfig,
        topology: ServiceTopology,
        *,
        get_plans: Callable[[int, list[int]], Sequence[ConstructorPlan]],
        fetch: FetchFn,
        pad_id: int,
        image_token_id: int | None = None,
        get_encoder_plan: Callable[[int, list[int]], EncoderRows | None] | None = None,
        start_step: int | None = 0,
        max_lead: int | None = None,
        wait_timeout_s: float = 60.0,
        on_floor: Callable[[int], None] | None = None,
        history: int = 256,
    ) -> None:
        if max_lead is not None and max_lead < 1:
            raise ValueError(f"max_lead must be >= 1 or None, got {max_lead!r}")
        self.buckets, self.config, self.topology = list(buckets), config, topology
        self.get_plans, self.fetch = get_plans, fetch  # where plans and samples come from
        self.pad_id, self.image_token_id = pad_id, image_token_id
        # transformation reordering: images of sources with decode_images="constructor" are decoded here
        self.decode = DeferredDecoder.of(config.sources)
        self.split_loss = config.feedback_mixing  # per-token source ids so the loss splits per source
        self.report_delay = topology.report_delay  # feedback mixing: what can be planned (`plannable`)
        self.layout = topology.layout
        self.fetchers = {b: topology.fetchers(b) for b in self.buckets}
        self.get_encoder_plan = get_encoder_plan
        self.start_step = start_step
        self.max_lead = max_lead
        self.wait_timeout_s = wait_timeout_s
        self.on_floor = on_floor
        ranks = sorted({r for rs in self.fetchers.values() for r in rs})
        self.held: HeldSteps[_BuiltStep] = HeldSteps(
            f"constructor for buckets {self.buckets}", ranks, start_step, max_lead=max_lead,
            silent_after=max_lead or max(4, 2 * config.prefetch + 2), wait_timeout_s=wait_timeout_s,
            on_floor=on_floor, history=history)
        self._prefetch_lock = threading.Lock()
        self._next_prefetch = start_step or 0
        self.built_steps = 0
        self.skipped_total = 0
        self.build_seconds: deque[float] = deque(maxlen=history)
        self.skipped: deque[tuple[int, int, int, str]] = deque(maxlen=history)  # (step, source, position, reason)

    # -- assembly ------------------------------------------------------------------
    def _build(self, step: int) -> tuple[_BuiltStep, Takers]:
        """The step's microbatches and encoder images, and what each consumer has to take of them."""
        t0 = time.perf_counter()
        plans = dict(zip(self.buckets, self.get_plans(step, self.buckets), strict=True))
        sources = sorted({ref.source for p in plans.values() for mb in p.microbatches for ref in mb})
        pool: dict[tuple[int, int], Any] = {}
        fetched = self.fetch(step, sources, self.buckets)
        for s in sources:
            got = fetched[s]
            for _b, pos, sample in got["samples"]:
                pool[(s, pos)] = sample
            for _b, pos, bad in got["skipped"]:
                self.skipped.append((step, s, pos, bad.reason))
                self.skipped_total += 1
        if self.decode is not None:
            pool = self._decoded(step, pool)
        wants_images = self.get_encoder_plan is not None and any(p.encoder for p in plans.values())
        rows = self.get_encoder_plan(step, self.buckets) if wants_images else None  # no round trip for text
        mult = self.config.pad_to_multiple_of * 2 * self.topology.tree.cp
        built, takers = _BuiltStep(batches={}, info={}), {}
        for b, plan in plans.items():
            built.counts[b] = plan.num_microbatches
            for j, refs in enumerate(plan.microbatches):
                refs = [r for r in refs if (r.source, r.position) in pool]
                samples = [span_view(pool[(r.source, r.position)], r.start, r.stop,
                                     name=f"step {step} source {r.source} position {r.position}") for r in refs]
                source_ids = [r.source for r in refs] if self.split_loss else None
                if plan.cp_groups is None:
                    batch = pack_microbatch(
                        samples,
                        seq_length=_packed_length(plan.cap, self.config.seq_length, samples, mult),
                        pad_id=self.pad_id,
                        image_token_id=self.image_token_id,
                        with_attention_mask=self.config.with_attention_mask,
                        pad_to_multiple_of=mult,
                        variable_length=True,
                        source_ids=source_ids,
                    )
                else:  # hybrid CP: this consumer's slice of the pack of its microbatch's group
                    size, place = int(plan.cp_groups[j, 0]), int(plan.cp_groups[j, 1])
                    batch = slice_for_group(self._group_pack(samples, plan.cap, size, source_ids), group_size=size,
                                            rank_in_group=place)
                if rows is not None:  # each image to its encoder rank only; the backbone takes its features
                    batch = without_patches(batch)
                built.batches[(b, j)] = batch
                delivered = [(r.source, r.position, r.index) for r in refs]
                built.info[(b, j)] = {
                    "step": step,
                    "bucket": b,
                    "microbatch": j,
                    "samples": np.asarray(delivered, dtype=np.int64).reshape(-1, 3),
                    "tokens": int(batch["num_tokens"][0]),
                }
                if plan.cp_groups is not None:  # each consumer's own count, and its microbatch's group
                    built.info[(b, j)].update(microbatches=plan.num_microbatches, local_cp_size=size,
                                              rank_in_group=place)
                if any(r.stop is not None for r in refs):  # token mode: which token span of each sample
                    built.info[(b, j)]["spans"] = np.asarray(
                        [(r.source, r.position, r.start, r.stop) for r in refs], dtype=np.int64).reshape(-1, 4)
                if self.image_token_id is not None:  # packing order of `images`: samples, then their images
                    built.info[(b, j)]["image_keys"] = np.asarray(
                        [(s, p, k) for (s, p, _i), x in zip(delivered, samples, strict=True)
                         for k in range(len(_images_of(x)))], dtype=np.int64).reshape(-1, 3)
                for rank in self.fetchers[b]:
                    takers.setdefault(rank, set()).add((b, j))
        if rows is not None:
            built.images = self._encoder_images(step, rows, pool)
            for rank in range(rows.num_ranks):  # every rank takes an encoder share
                takers.setdefault(rank, set()).add(IMAGES)
        self.build_seconds.append(time.perf_counter() - t0)
        self.built_steps += 1
        return built, takers

    def _group_pack(self, samples: list, cap: int, size: int, source_ids: list[int] | None) -> dict[str, np.ndarray]:
        """The whole pack of a hybrid-CP microbatch over `size` consumers (up to `cap` tokens each),
        padded to ``pad_to_multiple_of × 2 × size`` as a fixed-CP pack is to its CP size; every
        member of the group builds the same one and keeps its own slice. Without samples (a
        filler) it is one multiple of padding, no token counted."""
        mult = self.config.pad_to_multiple_of * 2 * size
        # a filler (an index where an aligned plan has nothing for this consumer): the shortest pack
        need = max(cap * size, sum(len(x.tokens) for x in samples)) if samples else mult
        return pack_microbatch(samples, seq_length=-(-need // mult) * mult, pad_id=self.pad_id, variable_length=True,
                               pad_to_multiple_of=mult, source_ids=source_ids)

    def _decoded(self, step: int, pool: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        """`pool` with deferred images decoded; a sample whose image cannot be decoded is left
        out and recorded as skipped, as its loader would have skipped it decoding there."""
        out = {}
        for (s, pos), sample in pool.items():
            try:
                out[(s, pos)] = self.decode(s, sample)
            except SampleError as exc:
                self.skipped.append((step, s, pos, str(exc)))
                self.skipped_total += 1
        return out

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
        return _ImageStep(per_rank=out, num_ranks=rows.num_ranks, patch_dim=patch_dim)

    # -- prefetch ------------------------------------------------------------------
    def prefetch(self, upto: int) -> None:
        """Build every step up to `upto` that is not built yet and within the lead (a background
        thread calls it); stops at the lead and goes on when called again."""
        with self._prefetch_lock:
            while True:
                step = self._next_prefetch
                if step > upto or not self.held.within_lead(step) or not self.plannable(step):
                    return
                self.held.get_or_build(step, self._build, prefetching=True)
                self._next_prefetch = max(self._next_prefetch, step + 1)

    def plannable(self, step: int) -> bool:
        """Whether `step` can be planned without waiting for the trainer. Under feedback mixing of
        delay d a fetcher on step p means the trainer reported step p - 1, so steps up to p + d - 1
        of the most advanced fetcher can; prefetching further would only park a call in the Planner
        (`FaultToleranceConfig.within_report_delay`). Counted from the most advanced fetcher, not the
        slowest: a pipeline's last stage asks for a step only once its first stage has run it.
        In replay mode a step past the saved plans cannot be planned at all."""
        replayed = self.topology.replay_steps
        if replayed is not None and step >= replayed:
            return False
        if self.report_delay is None:
            return True
        leader = self.held.leader()  # None: a restarted constructor no fetcher asked yet
        return leader is not None and step < leader + self.report_delay

    def skip_to(self, step: int) -> None:
        """Prefetch from `step` on (a client asked for it: the steps before are built on request)."""
        self._next_prefetch = max(self._next_prefetch, step)

    # -- client interface ----------------------------------------------------------
    def get_step(self, step: int, rank: int, position: int | None = None
                 ) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        """Every microbatch of `step` for client `rank`, in order: one call per step instead of m.

        `position` is the step the rank is on (default `step`); a client that prefetches asks
        for later steps while still on an earlier one. A request the rank has moved past by the
        time it runs (a prefetch its client abandoned) gets an empty list and builds nothing.
        """
        bucket = self.layout.bucket_of_rank(rank)
        if bucket not in self.fetchers:
            raise ValueError(f"rank {rank} belongs to bucket {bucket}, not served here ({self.buckets})")
        self.held.arrive(rank, _position(step, rank, position))
        self.skip_to(step)
        built = self.held.get_or_build(step, self._build, for_rank=rank)
        if built is None:  # the rank moved past `step` while this request waited: its client left it behind
            return []
        count = built.counts.get(bucket, self.config.num_microbatches)
        try:
            return [self.get(step, j, rank, position) for j in range(count)]
        except PlanError:
            if self.held.passed(rank, step):  # it moved on meanwhile: nobody waits for this reply
                return []
            raise

    def get(self, step: int, microbatch: int, rank: int, position: int | None = None
            ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The microbatch `microbatch` of `step` as client `rank` needs it (CP slice, PP fields)."""
        bucket = self.layout.bucket_of_rank(rank)
        if bucket not in self.fetchers:
            raise ValueError(f"rank {rank} belongs to bucket {bucket}, not served here ({self.buckets})")
        self.held.arrive(rank, _position(step, rank, position))
        self.skip_to(step)
        built = self.held.get_or_build(step, self._build)
        batch, info = built.batches[(bucket, microbatch)], built.info[(bucket, microbatch)]
        coords = self.topology.tree.coords(rank)
        hybrid = "local_cp_size" in batch  # sliced for its own group already
        # else every rank slices after the broadcast (or the plan sliced it for its own group)
        if self.topology.tree.cp > 1 and not self.topology.client_slices_cp and not hybrid:
            batch = slice_for_cp(batch, cp_size=self.topology.tree.cp, cp_rank=coords["cp"])
        batch = fields_for_stage(batch, pp_rank=coords["pp"], pp_size=self.topology.tree.pp,
                                 middle_stage_masks=self.config.middle_stage_masks)
        self.held.take(step, rank, (bucket, microbatch))
        return batch, {**info, "lead": self.held.lead()}  # how far this constructor is ahead of its slowest fetcher

    def get_encoder_images(self, step: int, rank: int, position: int | None = None) -> EncoderImages:
        """The images of this constructor's buckets that encoder rank `rank` encodes at `step`.

        Returns ``(patches float32 [P, patch_dim], seqlens int32 [n], keys int64 [n, 3])`` with
        key = (source, position, image index); empty arrays when `rank` encodes none of them.

        Raises:
            PlanError: No encoder delivery configured, the step's plan has no EncoderPlan, or
                the rank already moved past the step (its share was released).
        """
        if self.get_encoder_plan is None:
            raise PlanError(f"constructor for buckets {self.buckets} was built without `get_encoder_plan`; "
                            "encoder images need a hybrid (vlm_balance) strategy")
        self.held.arrive(rank, _position(step, rank, position))
        built = self.held.held(step)
        if self.held.passed(rank, step) and not (built is not None and self.held.holds_for(step, rank)) \
                or built is None and self.held.released(step):
            raise PlanError(f"encoder images of step {step} for rank {rank} were released: that rank already moved "
                            f"on to step {self.held.position(rank)} (or every rank took its share); take a step's "
                            "encoder images before moving past the step")
        if built is None:  # asked before the microbatches: build it now
            self.skip_to(step)
            built = self.held.get_or_build(step, self._build)
        if built.images is None:
            raise PlanError(f"step {step} has no EncoderPlan: use a hybrid strategy (strategy=vlm_balance) "
                            "to balance images over the encoder axis")
        out = built.images.per_rank.get(rank, _empty_images(built.images.patch_dim))
        self.held.take(step, rank, IMAGES)
        return out

    # -- introspection -------------------------------------------------------------
    def packed(self, step: int, bucket: int, microbatch: int) -> dict[str, np.ndarray]:
        """The whole packed microbatch before any rank's CP slice or PP fields (building the step
        if needed; nothing is taken). For checks and tools."""
        return self.held.get_or_build(step, self._build).batches[(bucket, microbatch)]

    def buffered_steps(self) -> int:
        """Steps built and not yet taken by every consumer."""
        return len(self.held)

    def untaken(self, step: int) -> dict[int, list]:
        """What each rank has yet to take of `step`: ``(bucket, microbatch)`` keys and ``("images",)``
        (empty when the step is not held: released, or not built yet)."""
        return self.held.untaken(step)

    def held_bytes(self) -> int:
        """Bytes of the arrays in the steps held for consumers: memory that comes and goes with
        their pace (bounded by `max_lead`), told apart from what the process keeps."""
        total = 0
        for built in self.held.payloads():
            arrays = [a for batch in built.batches.values() for a in batch.values()]
            if built.images is not None:
                arrays += [a for part in built.images.per_rank.values() for a in part]
            total += sum(int(a.nbytes) for a in arrays if isinstance(a, np.ndarray))
        return total

    def stats(self) -> dict[str, Any]:
        return {"built_steps": self.built_steps, "build_seconds": list(self.build_seconds),
                "skipped_total": self.skipped_total, "skipped": list(self.skipped), "held_bytes": self.held_bytes(),
                **self.held.stats()}


def _position(step: int, rank: int, position: int | None) -> int:
    """The step `rank` is on when it asks for `step` (default: that step)."""
    if position is None:
        return step
    if position > step:
        raise PlanError(f"rank {rank} asks for step {step} while on step {position}: a client asks for a step "
                        "before moving past it")
    return position


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
