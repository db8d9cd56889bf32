"""Pack one microbatch of documents into a single THD sequence, the way Megatron consumes it.

A Data Constructor receives the samples the Planner put into one microbatch and must hand the
trainer exactly the tensors Megatron's ``pretrain_gpt.get_batch`` expects, with a leading batch
dim of 1 (micro-batch-size 1, packed/THD style):

* ``tokens`` / ``labels`` / ``position_ids`` int64 ``[1, s]``, ``loss_mask`` float32 ``[1, s]``;
* ``cu_seqlens`` int32 ``[ndocs (+1 pad segment) + 1]`` and ``max_seqlen`` int32 ``[1]``;
* optionally ``attention_mask`` bool ``[1, 1, s, s]``, ``True`` = masked (Megatron's
  convention: ``_get_ltor_masks_and_position_ids`` returns ``mask < 0.5``);
* ``num_tokens`` int64 ``[1]``: positions that are not padding;
* in VLM mode (``image_token_id`` given) ``images`` float32 ``[total_patches, patch_dim]`` and
  ``image_seqlens`` int32 ``[num_images]``.

Padding is its own trailing segment in ``cu_seqlens`` (so ``cu_seqlens[-1] == s``): THD
attention kernels then see every position in some segment, padding never attends to real
documents and always has at least itself to attend to (no all-masked softmax row), and the
result equals what Megatron's own ``reset_position_ids``/``reset_attention_mask`` logic
produces for a document ending with EOD followed by non-EOD padding. ``max_seqlen`` covers
the padding segment too, because kernels bound every segment listed in ``cu_seqlens`` by it.

A *split* document (token-budget mode with ``split_documents``) arrives as spans: each span
is its own segment with position ids from 0, as Megatron's GPTDataset restarts them in the
next sample, and a span that does not end its document carries ``next_token`` (the first token
of the rest), which becomes its last position's label, so every next-token prediction of the
document is trained exactly once across its spans. `span_view` cuts such a span from a sample.

Everything runs vectorized over the whole microbatch: this is on the per-step path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megascale_data_ext.errors import ConfigError, PlanError, SampleError

__all__ = ["pack_microbatch", "span_view"]


_ABSENT = object()


def _field(sample: Any, name: str) -> Any:
    """Read ``name`` from a mapping or an attribute-style sample; ``None`` when absent."""
    if type(sample) is dict:  # the common cases first: an ABC check per field was a tenth of a pack
        return sample.get(name)
    value = getattr(sample, name, _ABSENT)
    if value is not _ABSENT:
        return value
    return sample.get(name) if isinstance(sample, Mapping) else None


def _sample_name(sample: Any, index: int) -> str:
    """Name a sample in error messages by its id when it carries one, else by position."""
    for key in ("sample_id", "id"):
        value = _field(sample, key)
        if value is not None:
            return f"sample {index} (id={value!r})"
    return f"sample {index}"


def _read_tokens(sample: Any, index: int) -> np.ndarray:
    tokens = _field(sample, "tokens")
    if tokens is None:
        raise SampleError(f"{_sample_name(sample, index)} has no `tokens` field; every sample needs one")
    tokens = np.asarray(tokens)
    if tokens.ndim == 1 and tokens.size == 0:  # `[]` parses as float64; its length is what matters
        return np.zeros(0, dtype=np.int64)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise SampleError(
            f"{_sample_name(sample, index)}: `tokens` must be a 1-D integer array, "
            f"got dtype={tokens.dtype} shape={tokens.shape}"
        )
    return tokens.astype(np.int64, copy=False)


def _read_images(sample: Any, index: int, image_token_id: int | None) -> list[np.ndarray]:
    images = _field(sample, "images")
    if images is None or len(images) == 0:
        return []
    if image_token_id is None:
        raise ConfigError(
            f"{_sample_name(sample, index)} carries {len(images)} image(s) but `image_token_id` is None; "
            "pass the tokenizer's image placeholder id to pack VLM samples"
        )
    out = []
    for k, image in enumerate(images):
        image = np.asarray(image)
        if image.ndim != 2 or not np.issubdtype(image.dtype, np.floating):
            raise SampleError(
                f"{_sample_name(sample, index)}: image {k} must be a float [num_patches, patch_dim] array, "
                f"got dtype={image.dtype} shape={image.shape}"
            )
        out.append(image.astype(np.float32, copy=False))
    return out


def span_view(sample: Any, start: int, stop: int | None, *, name: str) -> Any:
    """Tokens ``[start, stop)`` of `sample` as a packable sample (the sample itself when whole).

    A span that stops before the document's end carries ``next_token``; images stay with the
    span that starts the document.

    Raises:
        PlanError: The span lies outside the sample (its metadata and payload disagree).
    """
    tokens = _read_tokens(sample, 0)
    end = tokens.shape[0] if stop is None else stop
    if start == 0 and end == tokens.shape[0]:
        return sample
    if not 0 <= start < end <= tokens.shape[0]:
        raise PlanError(f"{name}: planned token span [{start}, {end}) lies outside its {tokens.shape[0]} tokens; "
                        "the source's token-count metadata disagrees with what it reads")
    return {"tokens": tokens[start:end], "images": _field(sample, "images") if start == 0 else None,
            "next_token": int(tokens[end]) if end < tokens.shape[0] else None}


def _check_options(seq_length: int, pad_to_multiple_of: int) -> None:
    problems = []
    if seq_length < 1:
        problems.append(f"`seq_length` must be >= 1, got {seq_length}")
    if pad_to_multiple_of < 1:
        problems.append(f"`pad_to_multiple_of` must be >= 1, got {pad_to_multiple_of}")
    elif seq_length % pad_to_multiple_of:
        problems.append(
            f"`seq_length` ({seq_length}) must be a multiple of `pad_to_multiple_of` ({pad_to_multiple_of}); "
            "for context parallelism use a seq_length divisible by 2*cp_size"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def pack_microbatch(
    samples: Sequence[Any],
    *,
    seq_length: int,
    pad_id: int,
    image_token_id: int | None = None,
    with_attention_mask: bool = False,
    truncate: bool = False,
    pad_to_multiple_of: int = 1,
    variable_length: bool = False,
    source_ids: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """Pack the samples of one microbatch into one sequence with per-document boundaries.

    Each sample becomes one segment: its images' placeholder positions (``image_token_id``,
    one per patch, images in order) followed by its text. Labels are the next token *within
    the same segment*; the last position of every segment, placeholders and padding get label
    ``pad_id`` and loss mask 0 (``labels == pad_id`` wherever ``loss_mask == 0``). Position
    ids restart at 0 for every segment, padding included.

    Args:
        samples: Dicts or objects with ``tokens`` (1-D int array, normally ending with EOD) and
            optionally ``images`` (list of float ``[num_patches, patch_dim]`` arrays) and
            ``sample_id``/``id`` (used to name the sample in errors).
        seq_length: Capacity of the packed sequence (Megatron's ``--seq-length``).
        pad_id: Token used for padding positions and masked labels.
        image_token_id: Placeholder token for image patches; setting it turns on VLM mode,
            which adds ``images`` and ``image_seqlens`` to the output (empty when no images).
        with_attention_mask: Also build the ``[1, 1, s, s]`` block-diagonal causal mask. It
            is O(s^2) memory, so leave it off when the attention kernel uses ``cu_seqlens``.
        truncate: Cut a sample's text that does not fit in ``seq_length`` instead of raising.
            Images are never cut: a sample whose placeholders alone exceed ``seq_length``
            still raises.
        pad_to_multiple_of: The output length must divide by this (use ``2 * cp_size`` for
            context parallelism); ``seq_length`` must be a multiple of it.
        variable_length: Emit ``s = round_up(real positions, pad_to_multiple_of)`` instead of
            ``s = seq_length``. Keep it off when TP ranks receive the batch by broadcast,
            since Megatron's receivers allocate ``[mbs, seq_length]`` buffers.
        source_ids: The source index of each sample; given, the output has ``source_ids``
            ([1, s] int32, -1 on padding) so the loss can be split per source (feedback mixing).

    Returns:
        The Megatron field dict described in the module docstring.

    Raises:
        PlanError: A sample is longer than ``seq_length`` (and ``truncate`` is off or its
            images alone overflow), or the samples together exceed ``seq_length``.
        SampleError: A sample has no/invalid ``tokens``, is empty, or has a malformed image.
        ConfigError: Invalid options, or images given without ``image_token_id``.
    """
    _check_options(seq_length, pad_to_multiple_of)
    vlm = image_token_id is not None

    texts: list[np.ndarray] = []
    images: list[np.ndarray] = []
    patch_counts: list[int] = []  # placeholder positions per sample
    follow: list[tuple[int, int]] = []  # (sample, next_token) of spans that continue elsewhere
    for index, sample in enumerate(samples):
        tokens = _read_tokens(sample, index)
        nxt = _field(sample, "next_token")
        if nxt is not None:
            follow.append((index, int(nxt)))
        sample_images = _read_images(sample, index, image_token_id)
        n_patches = sum(image.shape[0] for image in sample_images)
        length = n_patches + tokens.shape[0]
        if length == 0:
            raise SampleError(f"{_sample_name(sample, index)} is empty (no tokens, no image patches); drop it upstream")
        if length > seq_length:
            if not truncate or n_patches >= seq_length:
                raise PlanError(
                    f"{_sample_name(sample, index)} has {length} positions ({n_patches} image patches + "
                    f"{tokens.shape[0]} tokens) > seq_length={seq_length}; filter or truncate it at the source "
                    "loader, or pass truncate=True (text only)"
                )
            tokens = tokens[: seq_length - n_patches]
        texts.append(tokens)
        images.extend(sample_images)
        patch_counts.append(n_patches)

    if vlm and images:
        patch_dims = {image.shape[1] for image in images}
        if len(patch_dims) > 1:
            raise SampleError(f"images in one microbatch must share patch_dim, got {sorted(patch_dims)}")

    patches = np.asarray(patch_counts, dtype=np.int64)
    text_lens = np.asarray([t.shape[0] for t in texts], dtype=np.int64)
    doc_lens = patches + text_lens
    real = int(doc_lens.sum())
    if real > seq_length:
        raise PlanError(
            f"microbatch of {len(texts)} samples has {real} positions > seq_length={seq_length} "
            f"(per-sample lengths {doc_lens.tolist()}); the planner's per-microbatch token cap must be <= seq_length"
        )
    if variable_length:
        s = max(-(-real // pad_to_multiple_of) * pad_to_multiple_of, pad_to_multiple_of)
    else:
        s = seq_length
    pad_len = s - real

    seg_lens = np.append(doc_lens, pad_len) if pad_len else doc_lens
    n_seg = seg_lens.shape[0]
    cu = np.zeros(n_seg + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=cu[1:])
    seg_starts = cu[:-1]

    # Interleave [placeholders_i, text_i] for every sample, then the padding tail.
    tokens = np.full(s, pad_id, dtype=np.int64)
    is_text = np.zeros(s, dtype=bool)
    if texts:
        text_starts = seg_starts[: len(texts)] + patches
        text_pos = np.repeat(text_starts - np.concatenate(([0], np.cumsum(text_lens)[:-1])), text_lens)
        text_pos += np.arange(int(text_lens.sum()))
        tokens[text_pos] = np.concatenate(texts)
        is_text[text_pos] = True
        if vlm:
            img_pos = np.repeat(seg_starts[: len(texts)] - np.concatenate(([0], np.cumsum(patches)[:-1])), patches)
            img_pos += np.arange(int(patches.sum()))
            tokens[img_pos] = image_token_id

    position_ids = np.arange(s, dtype=np.int64) - np.repeat(seg_starts, seg_lens)
    last_in_seg = np.zeros(s, dtype=bool)
    last_in_seg[cu[1:] - 1] = True
    keep = is_text & ~last_in_seg  # the next position is text of the same document
    labels = np.full(s, pad_id, dtype=np.int64)
    labels[:-1][keep[:-1]] = tokens[1:][keep[:-1]]
    if follow:  # a span's last token predicts the first token of its document's rest
        ends = cu[1:][[i for i, _ in follow]] - 1
        labels[ends] = [t for _, t in follow]
        keep[ends] = True

    batch: dict[str, np.ndarray] = {
        "tokens": tokens[None, :],
        "labels": labels[None, :],
        "loss_mask": keep.astype(np.float32)[None, :],
        "position_ids": position_ids[None, :],
        "cu_seqlens": cu.astype(np.int32),
        "max_seqlen": np.asarray([seg_lens.max(initial=0)], dtype=np.int32),
        "num_tokens": np.asarray([real], dtype=np.int64),
    }
    if source_ids is not None:
        ids = np.asarray(list(source_ids), dtype=np.int32)
        if ids.shape != (len(texts),):
            raise ConfigError(f"`source_ids` must give one source per sample ({len(texts)}), got {ids.shape[0]}")
        batch["source_ids"] = np.repeat(np.append(ids, -1) if pad_len else ids, seg_lens).astype(np.int32)[None, :]
    if with_attention_mask:
        seg_id = np.repeat(np.arange(n_seg), seg_lens)
        same_doc = seg_id[:, None] == seg_id[None, :]
        causal = np.tri(s, dtype=bool)
        batch["attention_mask"] = ~(same_doc & causal)[None, None, :, :]
    if vlm:
        patch_dim = images[0].shape[1] if images else 0
        batch["images"] = np.concatenate(images) if images else np.zeros((0, patch_dim), dtype=np.float32)
        batch["image_seqlens"] = np.asarray([image.shape[0] for image in images], dtype=np.int32)
    return batch
