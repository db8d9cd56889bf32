"""Context-parallel slicing of a packed microbatch, exactly like Megatron's.

Megatron's ``megatron.core.utils.get_batch_on_this_cp_rank`` balances causal attention work
across a CP group by cutting the sequence into ``2 * cp`` equal chunks and giving rank ``r``
chunks ``r`` and ``2 * cp - 1 - r`` (an early, cheap chunk paired with a late, expensive one).
Doing the same in the Data Constructor lets each CP rank receive only its share instead of the
whole sequence. ``slice_for_cp`` reproduces that function field for field on numpy arrays;
``reassemble_cp`` inverts it so tests and debugging checks can prove nothing was lost.

Megatron slices *every* key it is given; here only the sequence fields are sliced
(``tokens``, ``labels``, ``loss_mask``, ``position_ids`` on dim 1, ``attention_mask`` on its
query dim 2). ``cu_seqlens`` and ``max_seqlen`` stay global, as Megatron's THD path expects,
and so do ``num_tokens``, ``images`` and ``image_seqlens`` (the vision encoder sees whole
images). Unknown fields pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from megascale_data_ext.errors import ParallelLayoutError, PlanError

__all__ = ["SEQUENCE_DIMS", "reassemble_cp", "slice_for_cp"]

SEQUENCE_DIMS: Mapping[str, int] = {
    "tokens": 1,
    "labels": 1,
    "loss_mask": 1,
    "position_ids": 1,
    "source_ids": 1,
    "attention_mask": 2,
}
"""Fields split along the sequence, and the dim Megatron splits them on."""


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


def slice_for_cp(batch: Mapping[str, np.ndarray], *, cp_size: int, cp_rank: int) -> dict[str, np.ndarray]:
    """Keep this CP rank's two sequence chunks, as ``get_batch_on_this_cp_rank`` does.

    Args:
        batch: A packed microbatch (see ``pack_microbatch``); absent/None fields are skipped.
        cp_size: Context-parallel world size.
        cp_rank: This rank's index in its CP group.

    Returns:
        A new dict: sequence fields have length ``s / cp_size`` on their sequence dim (the
        attention mask keeps its full key dim), other fields are the same objects as in
        ``batch``.

    Raises:
        ParallelLayoutError: ``cp_size < 1`` or ``cp_rank`` out of range.
        PlanError: A sequence field's length does not divide by ``2 * cp_size``.
    """
    _check_layout(cp_size, cp_rank)
    out = dict(batch)
    if cp_size == 1:
        return out
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


def reassemble_cp(slices: Sequence[Mapping[str, np.ndarray]], cp_size: int) -> dict[str, np.ndarray]:
    """Rebuild the full microbatch from every CP rank's slice (the inverse of ``slice_for_cp``).

    Args:
        slices: ``slice_for_cp`` outputs ordered by CP rank.
        cp_size: Context-parallel world size the slices were made for.

    Returns:
        The unsliced batch; non-sequence fields are taken from rank 0.

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
    for key in out:
        if key in SEQUENCE_DIMS or out[key] is None:
            continue
        for rank, piece in enumerate(slices[1:], start=1):
            if not np.array_equal(np.asarray(piece.get(key)), np.asarray(out[key])):
                raise PlanError(f"global field `{key}` differs between CP rank 0 and rank {rank}")
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
