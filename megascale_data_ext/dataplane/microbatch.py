"""Microbatch transforms of the Data Constructor: pack, slice for CP, select fields per PP stage.

The constructor turns one planned microbatch into exactly what one trainer rank needs:

1. ``pack_microbatch`` (``packing.py``) packs the documents into one THD sequence;
2. ``slice_for_cp`` (``cp_slicing.py``) keeps a CP rank's share, like Megatron's
   ``get_thd_batch_on_this_cp_rank`` (each document padded to ``2 * cp`` and cut zigzag);
   ``reassemble_cp`` inverts it;
3. ``fields_for_stage`` drops the fields a pipeline stage never reads, like Megatron's
   ``get_batch_on_this_tp_rank`` broadcasts only those fields to each stage;
4. ``check_megatron_batch`` validates dtypes and shapes against ``MEGATRON_DTYPES`` before
   the batch crosses into torch, so a mismatch names the field instead of failing in a kernel.

All of it is pure numpy: the constructor runs it for every microbatch of every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.cp_slicing import SEQUENCE_DIMS, pad_for_cp, reassemble_cp, slice_for_cp
from megascale_data_ext.dataplane.packing import pack_microbatch
from megascale_data_ext.errors import ParallelLayoutError, SampleError

__all__ = [
    "FIRST_STAGE_FIELDS",
    "LAST_STAGE_FIELDS",
    "MEGATRON_DTYPES",
    "SEQUENCE_DIMS",
    "check_megatron_batch",
    "fields_for_stage",
    "MIDDLE_STAGE_FIELDS",
    "pack_microbatch",
    "pad_for_cp",
    "reassemble_cp",
    "slice_for_cp",
    "without_patches",
]

MEGATRON_DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {
        "tokens": np.dtype(np.int64),
        "labels": np.dtype(np.int64),
        "loss_mask": np.dtype(np.float32),
        "position_ids": np.dtype(np.int64),
        "attention_mask": np.dtype(np.bool_),
        "cu_seqlens": np.dtype(np.int32),
        "cu_seqlens_padded": np.dtype(np.int32),
        "max_seqlen": np.dtype(np.int32),
        "num_tokens": np.dtype(np.int64),
        "images": np.dtype(np.float32),
        "image_seqlens": np.dtype(np.int32),
        "source_ids": np.dtype(np.int32),
        "local_cp_size": np.dtype(np.int64),
    }
)
"""The dtype Megatron allocates for each field (``get_batch_on_this_tp_rank``'s receive buffers)."""

FIRST_STAGE_FIELDS: frozenset[str] = frozenset(
    {"tokens", "position_ids", "attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "images",
     "image_seqlens", "local_cp_size"}
)
"""Fields the first pipeline stage reads: embedding inputs plus what its attention needs (with
hybrid CP, ``local_cp_size``: the microbatch's group)."""

LAST_STAGE_FIELDS: frozenset[str] = frozenset(
    {"labels", "loss_mask", "attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "source_ids",
     "local_cp_size"}
)
"""Fields the last pipeline stage reads: loss inputs (``source_ids`` splits the loss per source
for feedback mixing) plus what its attention needs."""

MIDDLE_STAGE_FIELDS: frozenset[str] = frozenset({"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
                                                 "local_cp_size"})
"""What a middle stage needs so packed documents do not attend across their boundaries."""


def without_patches(batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` without its image patches (``images``), keeping ``image_seqlens``.

    Under a strategy with an encoder plan every image goes to its encoder rank only
    (`DataConstructor.get_encoder_images`) and the backbone takes the images' features from
    there by the microbatch's ``image_keys``: shipping the patches inside the microbatch too sent
    every image twice. ``image_seqlens`` stays: which placeholders each image's features fill.
    """
    return {k: v for k, v in batch.items() if k != "images"}


def fields_for_stage(
    batch: Mapping[str, Any], *, pp_rank: int, pp_size: int, mtp_on_last_stage: bool = False,
    middle_stage_masks: bool = False,
) -> dict[str, Any]:
    """Keep only the fields pipeline stage ``pp_rank`` consumes.

    Mirrors upstream Megatron-LM's ``megatron.training.utils.get_batch_on_this_tp_rank``:

    * only stage (``pp_size == 1``): everything in ``batch``;
    * first stage (``pp_rank == 0``): tokens, position_ids, attention_mask, cu_seqlens,
      max_seqlen (+ images, image_seqlens for VLM: the vision encoder runs there);
    * last stage (``pp_rank == pp_size - 1``): labels, loss_mask, attention_mask,
      cu_seqlens, max_seqlen;
    * middle stages: nothing (upstream's ``get_batch`` returns all ``None`` there; their
      input is the previous stage's activations) — or, with ``middle_stage_masks``, the
      attention mask and ``cu_seqlens``/``max_seqlen``: without them a middle stage of a
      packed batch falls back to a plain causal mask and documents attend to each other.

    One deliberate difference: upstream broadcasts ``cu_seqlens``/``max_seqlen`` to the first
    stage only, but the last stage's attention layers need them just as much for THD packing,
    so they are kept there. With multi-token prediction on the last stage (upstream's
    ``mtp_on_this_rank``) that stage embeds tokens again and gets everything. Fields absent
    from ``batch`` are simply absent from the result (upstream sends ``None``).

    Args:
        batch: A packed (and possibly CP-sliced) microbatch.
        pp_rank: This rank's pipeline stage.
        pp_size: Pipeline-parallel world size.
        mtp_on_last_stage: Multi-token-prediction layers live on the last stage.
        middle_stage_masks: Give middle stages `MIDDLE_STAGE_FIELDS`.

    Returns:
        A new dict holding the selected fields (same array objects, no copies).

    Raises:
        ParallelLayoutError: ``pp_size < 1`` or ``pp_rank`` out of range.
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ParallelLayoutError(f"`pp_rank` must be in [0, pp_size) with pp_size >= 1, got {pp_rank=} {pp_size=}")
    is_last = pp_rank == pp_size - 1
    if pp_size == 1 or (is_last and mtp_on_last_stage):
        return dict(batch)
    if pp_rank == 0:
        keep = FIRST_STAGE_FIELDS
    elif is_last:
        keep = LAST_STAGE_FIELDS
    elif middle_stage_masks:
        keep = MIDDLE_STAGE_FIELDS
    else:
        return {}
    return {key: value for key, value in batch.items() if key in keep}


def _problems(batch: Mapping[str, Any], cp_size: int) -> list[str]:
    fields = {key: np.asarray(value) for key, value in batch.items() if value is not None}
    problems = [
        f"`{key}` has dtype {fields[key].dtype}, Megatron expects {dtype}"
        for key, dtype in MEGATRON_DTYPES.items()
        if key in fields and fields[key].dtype != dtype
    ]
    seq_shapes = {key: fields[key].shape for key, dim in SEQUENCE_DIMS.items() if dim == 1 and key in fields}
    for key, shape in seq_shapes.items():
        if len(shape) != 2:
            problems.append(f"`{key}` must be [micro_batch, seq], got shape {shape}")
    if len(set(seq_shapes.values())) > 1:
        problems.append(f"sequence fields disagree on shape: {seq_shapes}")
    ref = next((shape for shape in seq_shapes.values() if len(shape) == 2), None)
    if "attention_mask" in fields:
        shape = fields["attention_mask"].shape
        if len(shape) != 4 or shape[1] != 1:
            problems.append(f"`attention_mask` must be [micro_batch, 1, seq_q, seq_kv], got shape {shape}")
        elif ref is not None and (shape[0] != ref[0] or shape[2] != ref[1] or shape[3] != ref[1] * cp_size):
            problems.append(
                f"`attention_mask` shape {shape} does not match sequence fields {ref} with cp_size={cp_size} "
                f"(expected {(ref[0], 1, ref[1], ref[1] * cp_size)})"
            )
    cu, cu_pad = fields.get("cu_seqlens"), fields.get("cu_seqlens_padded")
    bounds = None  # the segments' extent on the (padded) layout
    if cu is not None:
        if cu.ndim != 1 or cu.shape[0] < 2:
            problems.append(f"`cu_seqlens` must be 1-D with >= 2 entries, got shape {cu.shape}")
        elif cu[0] != 0 or np.any(np.diff(cu) < 0):
            problems.append(f"`cu_seqlens` must start at 0 and be non-decreasing, got {cu.tolist()}")
        elif cu_pad is None:
            bounds = cu
        elif cu_pad.shape != cu.shape or cu_pad[0] != 0 or np.any(np.diff(cu_pad) < np.diff(cu)):
            problems.append(f"`cu_seqlens_padded` {cu_pad.tolist()} must have one entry per `cu_seqlens` entry "
                            f"{cu.tolist()}, start at 0 and leave each segment at least its real length")
        elif np.any(np.diff(cu_pad) % (2 * cp_size)):
            problems.append(f"`cu_seqlens_padded` {cu_pad.tolist()} has segments not divisible by 2*cp_size="
                            f"{2 * cp_size} (Megatron's THD CP partition needs them)")
        else:
            bounds = cu_pad
        if bounds is not None and ref is not None and int(bounds[-1]) != ref[1] * cp_size:
            name = "cu_seqlens" if bounds is cu else "cu_seqlens_padded"
            problems.append(f"`{name}[-1]`={int(bounds[-1])} must equal seq length {ref[1]} * cp_size={cp_size}")
    max_seqlen = fields.get("max_seqlen")
    if max_seqlen is not None:
        if max_seqlen.shape != (1,):
            problems.append(f"`max_seqlen` must have shape (1,), got {max_seqlen.shape}")
        elif bounds is not None and int(max_seqlen[0]) < int(np.diff(bounds).max()):
            longest = int(np.diff(bounds).max())
            problems.append(f"`max_seqlen`={int(max_seqlen[0])} is below the longest segment {longest}")
    images, image_seqlens = fields.get("images"), fields.get("image_seqlens")
    if images is not None and images.ndim != 2:
        problems.append(f"`images` must be [total_patches, patch_dim], got shape {images.shape}")
    if image_seqlens is not None and image_seqlens.ndim != 1:
        problems.append(f"`image_seqlens` must be 1-D, got shape {image_seqlens.shape}")
    elif images is not None and image_seqlens is not None and int(image_seqlens.sum()) != images.shape[0]:
        problems.append(f"`image_seqlens` sums to {int(image_seqlens.sum())} but `images` has {images.shape[0]} rows")
    return problems


def check_megatron_batch(batch: Mapping[str, Any], *, cp_size: int = 1) -> None:
    """Validate that ``batch`` has the dtypes and shapes Megatron's ``get_batch`` expects.

    Checks only the fields present, so it accepts stage subsets (``fields_for_stage``) and CP
    slices (pass ``cp_size`` so the attention mask's key dim and ``cu_seqlens[-1]`` are
    compared with the global length). Accepts numpy arrays or anything ``np.asarray``
    converts without changing dtype (CPU torch tensors).

    Args:
        batch: The microbatch about to be handed to Megatron.
        cp_size: Context-parallel size the batch was sliced for (1 = unsliced).

    Raises:
        SampleError: Listing every field with a wrong dtype or shape.
    """
    problems = _problems(batch, cp_size)
    if problems:
        raise SampleError("microbatch does not match Megatron's batch contract: " + "; ".join(problems))
