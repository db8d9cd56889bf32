"""Context-parallel slicing of a packed microbatch, exactly like Megatron's.

A pack with per-document boundaries (``cu_seqlens``) is THD data. Megatron-LM's ``get_batch``
hands it to ``megatron.core.utils.get_thd_batch_on_this_cp_rank``, which keeps, of *every
document*, the chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp`` equal chunks (Transformer
Engine's ``thd_get_partitioned_indices``): each document must therefore be padded to a multiple
of ``2 * cp`` first, and ``cu_seqlens_padded`` says where the padded documents start. That is
what per-document attention with CP needs (TE's ring attention, or `trainer.attention`): every
rank holds an early and a late piece of each document, so causal work stays balanced per
document, not per pack. ``pad_for_cp`` does the padding, ``slice_for_cp`` pads and slices,
``reassemble_cp`` inverts both (so tests can prove nothing was lost).

A sequence without ``cu_seqlens`` is one sequence (SBHD): it is cut like
``megatron.core.utils.get_batch_on_this_cp_rank``, chunks ``r`` and ``2 * cp - 1 - r`` of the
whole sequence.

Padding inside a padded document repeats the document's last token and label, has loss mask 0,
source id -1 and position ids that keep counting (RoPE in THD mode counts positions from
``cu_seqlens_padded`` the same way). Every segment of ``cu_seqlens`` is padded, the pack's own
padding segment included, so a pack grows by fewer than ``2 * cp`` positions per segment.
``cu_seqlens`` (real lengths, what attention uses) and ``max_seqlen`` (of the padded segments,
what RoPE and kernels bound by) stay global; the dense ``attention_mask`` is dropped (it has no
CP form here: attention over a CP slice needs ``cu_seqlens``). ``num_tokens``, ``images`` and
``image_seqlens`` pass through (the vision encoder sees whole images).

Pure numpy: it runs in the Data Constructor for every microbatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from megascale_data_ext.errors import ParallelLayoutError, PlanError

__all__ = ["SEQUENCE_DIMS", "pad_for_cp", "reassemble_cp", "slice_for_cp", "slice_for_group", "thd_padded_length",
           "thd_partition_index"]

SEQUENCE_DIMS: Mapping[str, int] = {
    "tokens": 1,
    "labels": 1,
    "loss_mask": 1,
    "position_ids": 1,
    "source_ids": 1,
    "attention_mask": 2,
}
"""Fields split along the sequence, and the dim Megatron splits them on."""

_GLOBAL_THD = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
_PAD_FILL = {"loss_mask": 0, "source_ids": -1}  # else: the document's last value (position ids count on)


def _check_layout(cp_size: int, cp_rank: int | None = None) -> None:
    if cp_size < 1:
        raise ParallelLayoutError(f"`cp_size` must be >= 1, got {cp_size}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ParallelLayoutError(f"`cp_rank` must be in [0, {cp_size}), got {cp_rank}")


def _chunked(value: np.ndarray, dim: int, n_chunks: int, key: str) -> np.ndarray:
    """View ``value`` with its ``dim`` split into ``[n_chunks, len // n_chunks]``."""
    if value.ndim <= dim:
        raise PlanError(f"field `{key}` has shape {value.shape}; expected a sequence dim at {dim}")
    length = value.shape[dim]
    if length % n_chunks:
        raise PlanError(
            f"field `{key}` has sequence length {length}, not divisible by 2*cp_size={n_chunks}; "
            f"pack with pad_to_multiple_of={n_chunks}"
        )
    return value.reshape(*value.shape[:dim], n_chunks, length // n_chunks, *value.shape[dim + 1 :])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` for each pair, vectorized."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + np.arange(total, dtype=np.int64) - offsets


def thd_partition_index(cu_seqlens_padded: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions of the padded THD pack that CP rank ``cp_rank`` keeps, in order.

    Of each segment ``[cu[i], cu[i+1])`` (length divisible by ``2 * cp_size``) the rank keeps
    chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``: the index Transformer
    Engine's ``thd_get_partitioned_indices`` returns for Megatron's ``get_thd_batch_on_this_cp_rank``.

    Raises:
        ParallelLayoutError: bad ``cp_size``/``cp_rank``.
        PlanError: a segment length is not a multiple of ``2 * cp_size``.
    """
    _check_layout(cp_size, cp_rank)
    cu = np.asarray(cu_seqlens_padded, dtype=np.int64).reshape(-1)
    lens = np.diff(cu)
    n = 2 * cp_size
    if np.any(lens % n):
        raise PlanError(f"`cu_seqlens_padded` {cu.tolist()} has segments not divisible by 2*cp_size={n}; "
                        "pad each document with pad_for_cp first")
    chunk = lens // n
    starts = np.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (n - 1 - cp_rank) * chunk], axis=1).reshape(-1)
    return _ranges(starts, np.repeat(chunk, 2))


def _padded_layout(cu: np.ndarray, cp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(cu_seqlens_padded, destination of each real position in the padded pack)."""
    lens = np.diff(cu)
    n = 2 * cp_size
    padded = -(-lens // n) * n
    cu_pad = np.zeros_like(cu)
    np.cumsum(padded, out=cu_pad[1:])
    return cu_pad, _ranges(cu_pad[:-1], lens)


def thd_padded_length(cu_seqlens: np.ndarray, cp_size: int) -> int:
    """Positions of a THD pack after `pad_for_cp` (what its CP slices hold together): byte models
    and caps count this, not ``cu_seqlens[-1]``."""
    _check_layout(cp_size)
    lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64).reshape(-1))
    return int(lens.sum()) if cp_size == 1 else int((-(-lens // (2 * cp_size)) * 2 * cp_size).sum())


def pad_for_cp(batch: Mapping[str, np.ndarray], *, cp_size: int) -> dict[str, np.ndarray]:
    """Pad every segment of a THD pack to a multiple of ``2 * cp_size`` (not sliced).

    Returns:
        A new dict: sequence fields on the padded layout, ``cu_seqlens`` unchanged (real lengths),
        ``cu_seqlens_padded`` and ``max_seqlen`` of the padded segments; no ``attention_mask``.

    Raises:
        PlanError: ``batch`` has no ``cu_seqlens`` or they do not cover its sequence.
    """
    _check_layout(cp_size)
    if batch.get("cu_seqlens") is None:
        raise PlanError("pad_for_cp needs `cu_seqlens` (document boundaries); a batch without them is one sequence")
    cu = np.asarray(batch["cu_seqlens"], dtype=np.int64).reshape(-1)
    cu_pad, dst = _padded_layout(cu, cp_size)
    last = cu[1:] - 1  # last real position of each segment
    seg_of_padded = np.repeat(np.arange(len(cu) - 1), np.diff(cu_pad))
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    for key, dim in SEQUENCE_DIMS.items():
        value = out.get(key)
        if value is None or key == "attention_mask":
            continue
        value = np.asarray(value)
        if dim != 1 or value.ndim != 2 or value.shape[1] != cu[-1]:
            raise PlanError(f"field `{key}` has shape {value.shape}; THD CP slicing needs [1, {int(cu[-1])}] "
                            "matching `cu_seqlens`")
        if key == "position_ids":
            filled = np.arange(int(cu_pad[-1]), dtype=value.dtype) - np.repeat(cu_pad[:-1], np.diff(cu_pad))
            filled = np.broadcast_to(filled, (value.shape[0], filled.shape[0])).copy()
        elif key in _PAD_FILL:
            filled = np.full((value.shape[0], int(cu_pad[-1])), _PAD_FILL[key], dtype=value.dtype)
        else:
            filled = value[:, last[seg_of_padded]] if len(last) else value[:, :0]
        filled[:, dst] = value
        out[key] = filled
    out["cu_seqlens"] = np.asarray(batch["cu_seqlens"])
    out["cu_seqlens_padded"] = cu_pad.astype(np.int32)
    out["max_seqlen"] = np.asarray([int(np.diff(cu_pad).max(initial=0))], dtype=np.int32)
    return out


def slice_for_cp(batch: Mapping[str, np.ndarray], *, cp_size: int, cp_rank: int) -> dict[str, np.ndarray]:
    """Keep this CP rank's share of a packed microbatch, as Megatron's ``get_batch`` would.

    With ``cu_seqlens``: `pad_for_cp`, then each document's two chunks (`thd_partition_index`),
    like ``get_thd_batch_on_this_cp_rank``. Without: the whole sequence's chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank``, like ``get_batch_on_this_cp_rank`` (the attention mask is cut
    on its query dim and keeps its full key dim).

    Args:
        batch: A packed microbatch (see ``pack_microbatch``); absent/None fields are skipped.
        cp_size: Context-parallel world size (1 returns a copy of ``batch``).
        cp_rank: This rank's index in its CP group.

    Raises:
        ParallelLayoutError: ``cp_size < 1`` or ``cp_rank`` out of range.
        PlanError: A sequence field's length does not divide by ``2 * cp_size`` (SBHD) or does not
            match ``cu_seqlens`` (THD).
    """
    _check_layout(cp_size, cp_rank)
    if cp_size == 1:
        return dict(batch)
    if batch.get("cu_seqlens") is not None:
        out = pad_for_cp(batch, cp_size=cp_size)
        index = thd_partition_index(out["cu_seqlens_padded"], cp_size, cp_rank)
        for key in SEQUENCE_DIMS:
            if out.get(key) is not None:
                out[key] = np.ascontiguousarray(out[key][:, index])
        return out
    out = dict(batch)
    n_chunks = 2 * cp_size
    index = np.array([cp_rank, n_chunks - 1 - cp_rank])
    for key, dim in SEQUENCE_DIMS.items():
        value = out.get(key)
        if value is None:
            continue
        chunks = _chunked(np.asarray(value), dim, n_chunks, key)
        kept = np.take(chunks, index, axis=dim)
        out[key] = kept.reshape(*kept.shape[:dim], -1, *kept.shape[dim + 2 :])
    return out


def slice_for_group(batch: Mapping[str, np.ndarray], *, group_size: int, rank_in_group: int) -> dict[str, np.ndarray]:
    """A hybrid-CP microbatch for one rank of its group (`balancers.hybrid_cp`): the pack's
    THD slice for the rank's place in the group (the whole pack where the group is one rank),
    with ``local_cp_size`` = the group's size, which tells the trainer which group to run it on
    (megatron-core's field of the same name)."""
    if group_size > 1 and batch.get("cu_seqlens") is None:
        raise PlanError("a hybrid-CP microbatch needs per-document boundaries (`cu_seqlens`) to be split over "
                        f"{group_size} ranks")
    out = slice_for_cp(batch, cp_size=group_size, cp_rank=rank_in_group)
    out["local_cp_size"] = np.array(group_size, dtype=np.int64)
    return out


def _check_globals(slices: Sequence[Mapping[str, np.ndarray]]) -> None:
    for key in slices[0]:
        if key in SEQUENCE_DIMS or slices[0][key] is None:
            continue
        for rank, piece in enumerate(slices[1:], start=1):
            if not np.array_equal(np.asarray(piece.get(key)), np.asarray(slices[0][key])):
                raise PlanError(f"global field `{key}` differs between CP rank 0 and rank {rank}")


def reassemble_cp(slices: Sequence[Mapping[str, np.ndarray]], cp_size: int) -> dict[str, np.ndarray]:
    """Rebuild the full microbatch from every CP rank's slice (the inverse of ``slice_for_cp``).

    THD slices come back unpadded (the pack as packed; its dense attention mask, dropped by
    slicing, is not rebuilt).

    Raises:
        ParallelLayoutError: ``len(slices) != cp_size``.
        PlanError: Slices disagree on a field's shape or on a global (non-sequence) field.
    """
    _check_layout(cp_size)
    if len(slices) != cp_size:
        raise ParallelLayoutError(f"reassemble_cp needs one slice per CP rank: got {len(slices)}, cp_size={cp_size}")
    out = dict(slices[0])
    if cp_size == 1:
        return out
    _check_globals(slices)
    if out.get("cu_seqlens_padded") is not None:
        cu = np.asarray(out["cu_seqlens"], dtype=np.int64).reshape(-1)
        cu_pad, dst = _padded_layout(cu, cp_size)
        index = np.concatenate([thd_partition_index(cu_pad, cp_size, r) for r in range(cp_size)])
        for key in SEQUENCE_DIMS:
            if out.get(key) is None:
                continue
            pieces = np.concatenate([np.asarray(piece[key]) for piece in slices], axis=1)
            if pieces.shape[1] != cu_pad[-1]:
                raise PlanError(f"field `{key}`: CP slices hold {pieces.shape[1]} positions, "
                                f"`cu_seqlens_padded` says {int(cu_pad[-1])}")
            full = np.empty_like(pieces)
            full[:, index] = pieces
            out[key] = full[:, dst]
        out.pop("cu_seqlens_padded")
        out["max_seqlen"] = np.asarray([int(np.diff(cu).max(initial=0))], dtype=np.int32)
        return out
    n_chunks = 2 * cp_size
    for key, dim in SEQUENCE_DIMS.items():
        if out.get(key) is None:
            continue
        pieces = [np.asarray(piece[key]) for piece in slices]
        shapes = {p.shape for p in pieces}
        if len(shapes) != 1:
            raise PlanError(f"field `{key}` has different shapes across CP ranks: {sorted(shapes)}")
        # Each rank holds [chunk r, chunk 2cp-1-r] along `dim`; scatter them back into place.
        halves = [_chunked(p, dim, 2, key) for p in pieces]
        ordered: list[np.ndarray | None] = [None] * n_chunks
        for rank, h in enumerate(halves):
            ordered[rank] = np.take(h, 0, axis=dim)
            ordered[n_chunks - 1 - rank] = np.take(h, 1, axis=dim)
        out[key] = np.concatenate(ordered, axis=dim)
    return out
