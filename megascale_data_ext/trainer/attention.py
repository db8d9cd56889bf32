"""The one place the model's attention is chosen: per-document (THD) attention for packed batches.

A packed microbatch holds several documents; attending densely over the pack with an S x S
block-diagonal mask costs the same whatever the documents are, so cost balancing buys nothing.
Per-document attention costs ``sum(n_i^2)``, which is what the planner's cost model assumes.

``GPTModelConfig.attention`` picks the backend (`resolve_attention` checks it):

* ``te``: megatron-core's Transformer Engine layer spec; batches carry ``PackedSeqParams(qkv_format
  ="thd", cu_seqlens...)`` and TE's fused attention (ring attention with CP > 1) runs per document.
* ``flex``: megatron-core's local layer spec with `DocumentAttention` as its ``core_attention``: on
  CUDA torch's flash ``varlen_attn`` (bf16/fp16, CP 1) or compiled ``flex_attention`` with a
  document mask; on CPU scaled-dot-product attention per document (flex_attention has no CPU
  backward). With CP > 1 every rank all-gathers the CP group's keys and values (autograd-aware)
  and attends with its zigzag slice of each document (`dataplane.cp_slicing`).
* ``dense``: megatron-core's local ``DotProductAttention`` over the S x S mask (no CP): the fallback.
* ``auto``: ``te`` when transformer_engine imports and CUDA is present, else ``flex``.

`packed_seq_params` turns a batch's ``cu_seqlens``/``cu_seqlens_padded``/``max_seqlen`` into the
``PackedSeqParams`` megatron's GPTModel passes down to RoPE (per-document positions) and attention.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megascale_data_ext.config.run import ATTENTION_BACKENDS, AttentionBackend  # the config schema owns them
from megascale_data_ext.dataplane.cp_slicing import thd_partition_index
from megascale_data_ext.errors import ConfigError, ParallelLayoutError, SampleError
from megascale_data_ext.trainer.hybrid_cp import microbatch_group

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "DocumentAttention",
    "dense_document_mask",
    "gpt_layer_spec",
    "packed_seq_params",
    "resolve_attention",
    "te_available",
]

Kernel = Literal["sdpa", "flex", "varlen"]


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch extension can be imported (never imports it here)."""
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention(choice: str, *, cp: int = 1, cuda: bool | None = None,
                      half: bool = True) -> Literal["te", "flex", "dense"]:
    """The backend that runs for ``choice`` (`ATTENTION_BACKENDS`), or a named error.

    ``auto`` picks Transformer Engine only for half-precision runs (``half``): TE's packed
    (THD) attention has no fp32 kernel, so an fp32 run gets this project's ``flex``.

    Raises:
        ConfigError: an unknown choice, or ``te`` without Transformer Engine / CUDA.
        ParallelLayoutError: ``dense`` with ``cp > 1`` (megatron's local attention has no CP).
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(f"`model.attention` must be one of {list(ATTENTION_BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "te" if cuda and half and te_available() else "flex"
    if choice == "te" and not (cuda and te_available()):
        why = "transformer_engine is not installed" if cuda else "there is no CUDA device"
        raise ConfigError(f"`model.attention`=te but {why}; use attention=flex (per-document attention of "
                          "this project) or auto")
    if choice == "dense" and cp > 1:
        raise ParallelLayoutError(f"`model.attention`=dense has no context parallelism (cp={cp}); use flex, te or auto")
    return choice  # type: ignore[return-value]


def gpt_layer_spec(backend: str) -> ModuleSpec:
    """megatron-core's GPT layer spec for a resolved backend (``te``, ``flex`` or ``dense``)."""
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec()
    if backend == "flex":
        spec.submodules.self_attention.submodules.core_attention = DocumentAttention
    elif backend != "dense":
        raise ConfigError(f"gpt_layer_spec takes a resolved backend (te, flex, dense), got {backend!r}")
    return spec


def packed_seq_params(batch: Mapping[str, Any], device: torch.device | str, *,
                      host_boundaries: bool = False) -> PackedSeqParams | None:
    """THD ``PackedSeqParams`` from a batch's ``cu_seqlens`` (None when it has none).

    Like Megatron's ``get_thd_batch_on_this_cp_rank``: ``cu_seqlens`` are the real document
    lengths, ``cu_seqlens_padded`` (present after CP slicing) where the padded documents start;
    both global. ``max_seqlen`` bounds the padded documents.

    ``host_boundaries`` keeps the boundaries as CPU tensors, for this module's attention (it
    uploads what its kernels need once per microbatch): Megatron's unfused THD RoPE calls
    ``.tolist()``/``.item()`` on them in every layer, and on CUDA tensors each of those is a
    device sync that drains the launch queue (measured on an H100: the step was launch-bound).
    TE's kernels need them on the device: ``te`` keeps the default.
    """
    cu = batch.get("cu_seqlens")
    if cu is None:
        return None
    place = torch.device("cpu") if host_boundaries else torch.device(device)
    cu_host = _host_ints(cu)
    padded = batch.get("cu_seqlens_padded")
    padded_host = None if padded is None else _host_ints(padded)
    bounds = cu_host if padded_host is None else padded_host
    max_seqlen = batch.get("max_seqlen")
    longest = int(np.diff(bounds).max()) if bounds.size > 1 else 0
    m = max(longest, int(_host_ints(max_seqlen).max())) if max_seqlen is not None else longest
    up = lambda a: torch.from_numpy(a.astype(np.int32)).to(place, non_blocking=True)  # noqa: E731
    cu_t, padded_t = up(cu_host), None if padded_host is None else up(padded_host)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=padded_t,
                             cu_seqlens_kv_padded=padded_t, max_seqlen_q=m, max_seqlen_kv=m)
    local = batch.get("local_cp_size")
    if local is not None:  # hybrid CP: this microbatch's own group (`trainer.hybrid_cp`)
        params.local_cp_size = int(_host_ints(local).reshape(-1)[0])
        params.cp_group = microbatch_group(params.local_cp_size)
    return params


def _host_ints(value: Any) -> np.ndarray:
    """A 1-D int64 host copy (a CUDA tensor is read back: one sync, so batches keep these on the host)."""
    if torch.is_tensor(value):
        value = value.detach().cpu().numpy()
    return np.asarray(value).reshape(-1).astype(np.int64)


def dense_document_mask(cu_seqlens: Any, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``[1, 1, s, s]`` block-diagonal causal mask (True = masked) of a pack's documents."""
    host = _host_ints(cu_seqlens)
    if int(host[-1]) != length:
        raise SampleError(f"`cu_seqlens` ends at {int(host[-1])} but the sequence has {length} positions")
    cu = _upload(host, torch.device(device))
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), torch.diff(cu))
    pos = torch.arange(length, device=device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


class _Layout:
    """Where this rank's queries and the CP group's keys sit in the padded THD pack.

    Built on the host once per microbatch; each kernel uploads only what it reads, on first use
    (flash varlen: the boundaries alone; flex: per-position document and offset indices).
    """

    def __init__(self, params: PackedSeqParams, cp_size: int, cp_rank: int, device: torch.device) -> None:
        cu = _host_ints(params.cu_seqlens_q)  # no sync where packed_seq_params kept them on the host
        pad = params.cu_seqlens_q_padded
        cu_pad = cu if pad is None else _host_ints(pad)
        if cp_size > 1 and pad is None:
            raise SampleError("context parallel attention needs `cu_seqlens_padded` (slice batches with "
                              "dataplane.cp_slicing.slice_for_cp)")
        self.cu, self.cu_pad, self.cp, self.device = cu, cu_pad, cp_size, device
        self.lens, self.padded = np.diff(cu), np.diff(cu_pad)
        self.unpadded = bool(np.array_equal(cu, cu_pad))
        self.total = int(cu_pad[-1])
        if cp_size > 1:
            parts = [thd_partition_index(cu_pad, cp_size, r) for r in range(cp_size)]
            self.q_pos = parts[cp_rank]
            # gathered[r * t + i] holds global position parts[r][i]; reorder it to global order
            self.key_order = _upload(np.argsort(np.concatenate(parts), kind="stable"), device)
        else:
            self.q_pos = np.arange(self.total)
            self.key_order = None
        self.local_cu = cu_pad // cp_size  # each segment's queries are contiguous on this rank
        self.block_mask = None
        self._cu_device: torch.Tensor | None = None
        self._index: tuple[torch.Tensor, ...] | None = None

    @property
    def cu_device(self) -> torch.Tensor:
        """The document boundaries on the device (int32), for flash varlen."""
        if self._cu_device is None:
            self._cu_device = _upload(self.cu.astype(np.int32), self.device)
        return self._cu_device

    def index(self) -> tuple[torch.Tensor, ...]:
        """(doc_q, off_q, doc_k, off_k, len_k) on the device: each query's and key's document,
        offset in it, and the key's document length (flex's mask, sdpa's padded/CP mask)."""
        if self._index is None:
            seg = np.repeat(np.arange(len(self.lens)), self.padded)
            offset = np.arange(self.total) - np.repeat(self.cu_pad[:-1], self.padded)
            t = lambda a: _upload(a, self.device)  # noqa: E731
            self._index = (t(seg[self.q_pos]), t(offset[self.q_pos]), t(seg), t(offset),
                           t(np.repeat(self.lens, self.padded)))
        return self._index


def _upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array to `device` without waiting for the device: from pinned memory on CUDA (a copy
    from pageable memory may first drain the stream, CUDA's API sync behaviour)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums the gradient over the group, keeps ours."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=0)[ctx.rank].contiguous(), None


def _sdpa_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout, scale: float) -> torch.Tensor:
    """Exact per-document attention, one SDPA call per document: [tq, h, d] -> [tq, h, d]."""
    out = torch.zeros_like(q)
    gqa = q.shape[1] != k.shape[1]
    for i, (n, start) in enumerate(zip(lay.lens.tolist(), lay.cu_pad[:-1].tolist(), strict=True)):
        q0, q1 = int(lay.local_cu[i]), int(lay.local_cu[i + 1])
        if n == 0 or q1 == q0:
            continue
        qi = q[q0:q1].transpose(0, 1)[None]
        ki, vi = (x[start:start + n].transpose(0, 1)[None] for x in (k, v))
        if lay.unpadded and lay.cp == 1:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            allowed = torch.arange(n, device=q.device)[None, :] <= lay.index()[1][q0:q1, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout, scale: float) -> torch.Tensor:
    """flex_attention with a document mask (compiled on CUDA; CPU eager runs forward only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc_q, off_q, doc_k, off_k, len_k = lay.index()

    def document_causal(b, h, qi, ki):
        return (doc_q[qi] == doc_k[ki]) & (off_k[ki] <= off_q[qi]) & (off_k[ki] < len_k[ki])

    if lay.block_mask is None:  # once per microbatch: every layer shares the PackedSeqParams
        lay.block_mask = create_block_mask(document_causal, None, None, q.shape[0], k.shape[0], device=q.device)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    o = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=lay.block_mask,
           scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


_COMPILED: dict[str, Any] = {}


def _compiled_flex() -> Any:
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["flex"]


def _varlen_causal_kwargs() -> dict[str, Any] | None:
    """How this torch's ``varlen_attn`` is told "causal" (its signature changed across releases)."""
    if "varlen" not in _COMPILED:
        import inspect

        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _COMPILED["varlen"] = None
        else:
            names = inspect.signature(varlen_attn).parameters
            _COMPILED["varlen"] = ({"window_size": (-1, 0)} if "window_size" in names
                                   else {"is_causal": True} if "is_causal" in names else None)
    return _COMPILED["varlen"]


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout, scale: float) -> torch.Tensor:
    """torch's flash varlen attention (CUDA, fp16/bf16, unpadded documents, CP 1, no GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    m = int(lay.lens.max(initial=1))
    return varlen_attn(q, k, v, lay.cu_device, lay.cu_device, m, m, scale=scale, **_varlen_causal_kwargs())


def _pick_kernel(q: torch.Tensor, k: torch.Tensor, lay: _Layout) -> Kernel:
    if not q.is_cuda:
        return "sdpa"
    if (lay.cp == 1 and lay.unpadded and q.dtype in (torch.bfloat16, torch.float16) and q.shape[1] == k.shape[1]
            and _varlen_causal_kwargs() is not None):
        return "varlen"
    return "flex"


_KERNELS = {"sdpa": _sdpa_per_document, "flex": _flex, "varlen": _varlen}


class DocumentAttention(MegatronModule):
    """megatron-core ``core_attention`` that attends within each document of a THD pack.

    Called by megatron's ``Attention`` with ``[t, heads, dim]`` query/key/value and THD
    ``PackedSeqParams`` (see module docstring for the kernels); without them (SBHD) it is
    megatron's own ``DotProductAttention`` over the given mask (CP 1 only). Stateless: no
    parameters, nothing to checkpoint. ``kernel`` forces one kernel (tests).
    """

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
        attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type: str | None = None,
        pg_collection: Any = None, kernel: Kernel | None = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ConfigError(f"`attention_dropout`={dropout}: attention=flex has no attention dropout; set it to 0 "
                              "or use attention=te")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ConfigError(f"DocumentAttention is causal per document; got attn_mask_type={attn_mask_type}")
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.cp_group = pg_collection.cp if pg_collection is not None else parallel_state.get_context_parallel_group()
        self.cp_size = dist.get_world_size(self.cp_group) if dist.is_initialized() else 1
        self.kernel = kernel
        self.dense = None
        if self.cp_size == 1:
            self.dense = DotProductAttention(config, layer_number, attn_mask_type, attention_type,
                                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                                             pg_collection=pg_collection)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if self.dense is None:
                raise SampleError("context parallel attention needs per-document boundaries: the batch has no "
                                  "`cu_seqlens` (give every stage cu_seqlens: data.middle_stage_masks for PP > 2)")
            return self.dense(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        group, size = self.cp_group, self.cp_size
        if packed_seq_params.local_cp_size is not None:  # hybrid CP: the microbatch's own group
            group, size = packed_seq_params.cp_group, packed_seq_params.local_cp_size
        lay = getattr(packed_seq_params, "_megascale_layout", None)
        if lay is None:  # built once per microbatch and shared by every layer
            rank = dist.get_rank(group) if size > 1 else 0
            lay = _Layout(packed_seq_params, size, rank, query.device)
            packed_seq_params._megascale_layout = lay
        if query.shape[0] != len(lay.q_pos):
            raise SampleError(f"query has {query.shape[0]} positions but cu_seqlens give this CP rank "
                              f"{len(lay.q_pos)}; CP slicing and PackedSeqParams disagree")
        if size > 1:
            key = _GatherSequence.apply(key, group).index_select(0, lay.key_order)
            value = _GatherSequence.apply(value, group).index_select(0, lay.key_order)
        out = _KERNELS[self.kernel or _pick_kernel(query, key, lay)](query, key, value, lay, self.scale)
        return out.reshape(out.shape[0], -1)
