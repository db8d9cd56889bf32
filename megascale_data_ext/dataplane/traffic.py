"""What one step moves from Data Constructors to fetching clients: the byte model.

Byte model (constructor -> fetching clients, one step, as `DataConstructor.get` ships it):
every DP bucket has m microbatches; microbatch (b, j) with T real tokens is packed to
s = max(ceil(T / u) u, u) positions, u = pad_to_multiple_of (8) x 2 x CP (variable-length
THD packing). With P = sum of s, N samples, M = DP x m microbatches, K of them padded
(s > T), I images with Q patches, patch_dim d = patch_size^2 x 3 (14 for navit's patches),
c copies (c = CP when only TP broadcasts: each CP rank's fetcher gets its CP slice plus the
fields that are not sliced; c = 1 with TP x CP broadcast: one fetcher gets the whole pack) and
R reading stages:

* sequence fields: first stage tokens + position_ids (int64, 16 B/position), last stage
  labels (int64) + loss_mask (float32) = 12 B/position: 28 P; with c > 1 (CP slices, cut per
  document as Megatron's THD path does) P counts every segment (document or padding) rounded
  up to a multiple of 2 CP, which the slices partition; with PP 1 the only stage also gets
  num_tokens (int64, 8 c M);
* THD metadata, every reading stage, every copy: cu_seqlens int32 (N + M + K entries) and
  max_seqlen int32 (M): 4 c R (N + 2M + K); CP slices also carry cu_seqlens_padded
  (4 c R (N + M + K) more);
* images: each goes to its encoder rank only (below), so a first-stage microbatch carries
  image_seqlens alone (int32, which placeholders each image fills), every copy: 4 c I.

bytes_per_step = the sum; ``bytes_per_step_selective`` the same with c = 1. Not modelled: the
attention mask (off here) and a feedback mixing schedule's per-token ``source_ids`` (int32 to
the last stage; the constant schedule simulated here has none). The hybrid
strategy's WORLD encoder delivery (`get_encoder_images`: every image once to its encoder
rank, patches + int32 seqlen + 3 int64 keys) is the same with either broadcast and is
reported apart as ``encoder_bytes_per_step``: the backbone's first stage takes the images'
features from their encoder ranks (`trainer.vlm`), not their patches from its microbatches.
"""

from __future__ import annotations

import numpy as np

from megascale_data_ext.dataplane.plan import StepPlan

__all__ = ["PAD_TO_MULTIPLE_OF", "encoder_bytes", "plan_nbytes", "reading_stages", "step_bytes", "step_totals"]

PAD_TO_MULTIPLE_OF = 8


def step_totals(plan: StepPlan, *, cp: int, pad_to_multiple_of: int = PAD_TO_MULTIPLE_OF) -> dict[str, int]:
    """The counts the byte model needs, from a StepPlan (see the module docstring)."""
    unit = pad_to_multiple_of * 2 * cp
    real = plan.bin_tokens().ravel()
    packed = np.maximum(-(-real // unit) * unit, unit)
    pad = packed - real  # the padding segment of each microbatch (0: none)
    enc = plan.encoder
    return {
        "samples": plan.num_samples,
        "tokens": int(plan.tokens.sum()),
        "positions": int(packed.sum()),
        "cp_positions": int(_round_up(plan.tokens, 2 * cp).sum() + _round_up(pad[pad > 0], 2 * cp).sum()),
        "microbatches": int(real.size),
        "padded_microbatches": int((packed > real).sum()),
        "images": int(len(enc.sample)) if enc is not None else 0,
        "image_patches": int(enc.patches.sum()) if enc is not None else 0,
    }


def _round_up(lengths: np.ndarray, unit: int) -> np.ndarray:
    return -(-np.asarray(lengths, dtype=np.int64) // unit) * unit


def reading_stages(pp: int, middle_stage_masks: bool) -> int:
    return 1 if pp == 1 else (pp if middle_stage_masks and pp > 2 else 2)


def step_bytes(totals: dict[str, int], *, pp: int, copies: int, stages: int, patch_dim: int) -> dict[str, int]:
    """Bytes from constructors to fetching clients for one step (module docstring's model)."""
    n, m, k = totals["samples"], totals["microbatches"], totals["padded_microbatches"]
    sliced = copies > 1  # CP slices: every segment padded to a multiple of 2 CP, + cu_seqlens_padded
    p = totals["cp_positions"] if sliced else totals["positions"]
    sequence = 28 * p + (8 * copies * m if pp == 1 else 0)
    metadata = 4 * copies * stages * (n + 2 * m + k + (n + m + k if sliced else 0))
    images = copies * 4 * totals["images"]  # image_seqlens; the patches go to encoder ranks only
    return {"sequence": sequence, "metadata": metadata, "images": images, "total": sequence + metadata + images}


def encoder_bytes(totals: dict[str, int], *, patch_dim: int) -> int:
    """The WORLD encoder delivery: every image once (float32 patches, int32 seqlen, 3 int64 keys)."""
    return 4 * patch_dim * totals["image_patches"] + (4 + 24) * totals["images"]


def plan_nbytes(plan: StepPlan) -> int:
    """A plan's arrays, and the indexes serving it builds (int32 per row by bucket and by source, per image)."""
    arrays = [v for v in (getattr(plan, f) for f in plan.__dataclass_fields__) if isinstance(v, np.ndarray)]
    indexed = 2 * plan.num_samples
    if plan.encoder is not None:
        arrays += [v for v in (getattr(plan.encoder, f) for f in plan.encoder.__dataclass_fields__)
                   if isinstance(v, np.ndarray)]
        indexed += plan.encoder.sample.shape[0]
    return int(sum(a.nbytes for a in arrays)) + 4 * indexed + 8 * (2 * plan.num_buckets + len(plan.source_names) + 3)
