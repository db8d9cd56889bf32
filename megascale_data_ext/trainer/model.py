"""A small megatron-core GPTModel with a Megatron-style forward step (the steps: `trainer.step`).

This is the trainer side the data service feeds in tests, examples and benchmarks: real
`megatron.core.models.gpt.GPTModel` chunks whose attention `trainer.attention` chooses
(per-document THD attention from the batch's ``cu_seqlens``: Transformer Engine's, or this
project's over torch kernels; the dense S x S mask as a fallback), megatron's own pipeline
schedules with ``variable_seq_lengths=True`` (each microbatch may have its own length after
balancing; PP stages exchange shapes first), megatron's DistributedDataParallel for the DP
gradient all-reduce, a torch optimizer; batches per stage as Megatron-LM's ``get_batch``.

Devices: with CUDA, each process uses ``cuda:LOCAL_RANK`` (model, batches, loss and norm
buffers), NCCL for CUDA tensors and gloo for CPU ones; ``bf16`` follows Megatron's mixed
precision (bf16 params and activations, ``Float16Module``, fp32 gradient reduction, fp32 master
weights in the optimizer of `pretrain.build_optimizer`). Without CUDA everything runs on CPU/gloo.

Process contract: `initialize_parallel` once per torchrun process before building models."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any, Literal

import os
import re
import zlib

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model

from megascale_data_ext.errors import ConfigError, ParallelLayoutError, SampleError
from megascale_data_ext.trainer.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    dense_document_mask,
    gpt_layer_spec,
    packed_seq_params,
    resolve_attention,
)
from megascale_data_ext.patches import apply_cpu_shims
from megascale_data_ext.trainer.hybrid_cp import init_hybrid_groups, microbatch_cp

__all__ = [
    "BATCH_KEYS",
    "GPTModelConfig",
    "build_gpt_model",
    "build_model_chunks",
    "device",
    "forward_step",
    "init_layout_invariant",
    "initialize_parallel",
    "loss_func",
    "settle_model_environ",
    "set_random_seed",
    "stage_batch_keys",
]

PositionEmbedding = Literal["learned_absolute", "rope"]
BATCH_KEYS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
_FIRST_STAGE_KEYS = ("tokens", "position_ids")
_LAST_STAGE_KEYS = ("labels", "loss_mask")


def quiet_config_defaults() -> dict[str, Any]:
    """Config fields whose megatron-core 0.16 default warns each build (``cuda_graph_scope`` "full" = ``[]``)."""
    return {"cuda_graph_scope": []} if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__ else {}


@dataclass(slots=True, kw_only=True)
class GPTModelConfig:
    """Shape and parallel layout of the GPT trained on the service's batches.

    ``vpp`` is the number of model chunks per pipeline rank (None: no interleaving).
    ``attention`` picks the attention backend (`trainer.attention.resolve_attention`); ``cp``
    > 1 needs a per-document one (``te``/``flex``/``auto``). ``bf16`` trains in Megatron's bf16
    mixed precision. ``per_token_loss`` is Megatron's ``--calculate-per-token-loss``: gradients of
    the global token-mean loss whatever the DP/CP split (else each microbatch and CP slice is
    averaged over its own tokens first). ``hybrid_cp`` sets up a CP group per microbatch
    (`trainer.hybrid_cp`): megatron-core's hybrid DP×CP groups, for batches that carry
    ``local_cp_size``.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    seq_length: int = 64
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int | None = None
    position_embedding_type: PositionEmbedding = "rope"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    seed: int = 1234
    attention: AttentionBackend = "auto"
    bf16: bool = False
    per_token_loss: bool = False
    hybrid_cp: bool = False

    def validate(self, world_size: int | None = None) -> None:
        """Raise one error listing every problem (ParallelLayoutError if the layout is bad)."""
        values = [f"`{k}` must be >= 1, got {v!r}" for k, v in (
            ("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers), ("num_attention_heads", self.num_attention_heads),
            ("seq_length", self.seq_length), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp),
        ) if not (isinstance(v, int) and v >= 1)]
        if self.attention not in ATTENTION_BACKENDS:
            values.append(f"`attention` must be one of {list(ATTENTION_BACKENDS)}, got {self.attention!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            values.append("`position_embedding_type` must be one of ['learned_absolute', 'rope'], "
                          f"got {self.position_embedding_type!r}")
        if values:
            raise ConfigError("invalid GPTModelConfig: " + "; ".join(values))
        layout = []
        chunks = self.pp * (self.vpp or 1)
        if self.num_layers % chunks:
            layout.append(f"`num_layers`={self.num_layers} must divide evenly over pp*vpp={chunks} chunks")
        if self.num_attention_heads % self.tp:
            layout.append(f"`num_attention_heads`={self.num_attention_heads} must be divisible by tp={self.tp}")
        if self.hidden_size % self.num_attention_heads:
            layout.append(f"`hidden_size`={self.hidden_size} must be divisible by "
                          f"num_attention_heads={self.num_attention_heads}")
        if self.vocab_size % self.tp:
            layout.append(f"`vocab_size`={self.vocab_size} must be divisible by tp={self.tp} (pad the vocab)")
        if self.cp > 1 and self.attention == "dense":
            layout.append(f"`cp`={self.cp}: attention=dense has no context parallelism; use attention=flex, te or auto")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            layout.append(f"`vpp`={self.vpp} needs vpp >= 2 and pp >= 2 (pp={self.pp}); use vpp=None otherwise")
        if self.hybrid_cp:
            if not self.per_token_loss:
                layout.append("`hybrid_cp` runs as many microbatches per rank as its documents need, which needs "
                              "`per_token_loss`=True (Megatron's --calculate-per-token-loss)")
            if self.attention == "dense":
                layout.append("`hybrid_cp` needs per-document attention; use attention=flex or auto")
            if self.vpp is not None:
                layout.append(f"`hybrid_cp` with vpp={self.vpp}: the interleaved schedule orders a rank's microbatches "
                              "by its count across model chunks (only 1F1B is aligned for); use vpp=None")
            dp_cp = None if world_size is None else world_size // (self.tp * self.pp)
            if dp_cp is not None and (dp_cp < 2 or dp_cp & (dp_cp - 1)):
                layout.append(f"`hybrid_cp` needs a power of two of DP x CP ranks (>= 2), got {dp_cp}")
        if world_size is not None and world_size % (self.tp * self.pp * self.cp):
            layout.append(f"world size {world_size} is not divisible by tp*pp*cp={self.tp * self.pp * self.cp}")
        if layout:
            raise ParallelLayoutError("invalid parallel layout: " + "; ".join(layout))

    def to_transformer_config(self) -> TransformerConfig:
        """The megatron TransformerConfig: fp32 or bf16, initialised on this process's device, no
        fused kernels, variable lengths."""
        self.validate()
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size or 4 * self.hidden_size, tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp, context_parallel_size=self.cp,
            virtual_pipeline_model_parallel_size=self.vpp, pipeline_dtype=dtype, params_dtype=dtype, bf16=self.bf16,
            calculate_per_token_loss=self.per_token_loss, hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout, init_method_std=self.init_method_std,
            use_cpu_initialization=not torch.cuda.is_available(),
            # Balanced microbatches have different lengths; PP stages must exchange shapes.
            variable_seq_lengths=True,
            # The default "allgather" dispatcher rejects variable_seq_lengths (even without MoE).
            moe_token_dispatcher_type="alltoall",
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
            # VPP sends to both neighbours per call; batch_isend_irecv posts them in the same order on
            # every rank, so with pp=2 (prev == next) receives match the wrong sends. Megatron-LM's VPP
            # default (overlap on, batching off) orders p2p even/odd, one direction per call.
            overlap_p2p_comm=self.vpp is not None,
            batch_p2p_comm=self.vpp is None,
            **quiet_config_defaults(),
        )


def device() -> torch.device:
    """This process's device: the current CUDA device (see `initialize_parallel`), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def initialize_parallel(cfg: GPTModelConfig, *, backend: str | None = None) -> list[str]:
    """Init torch.distributed (from torchrun's env), megatron's parallel state, shims and seeds.

    With CUDA the process takes ``cuda:LOCAL_RANK`` and the default backend is
    ``cpu:gloo,cuda:nccl`` (NCCL for model tensors, gloo for the CPU-side step bookkeeping);
    without CUDA it is gloo.

    Returns:
        Names of the CPU shims applied (empty on a CUDA machine).
    """
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"))
    cfg.validate(world_size=dist.get_world_size())
    shims = apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                             virtual_pipeline_model_parallel_size=cfg.vpp, context_parallel_size=cfg.cp,
                                             hybrid_context_parallel=cfg.hybrid_cp)
    if cfg.hybrid_cp:
        init_hybrid_groups()
    set_random_seed(cfg.seed)
    return shims


def settle_model_environ(cfg: GPTModelConfig) -> None:
    """Write now the environment variables that building the model and its optimizer would write,
    so that doing so later adds none.

    Adding a variable reallocates C's ``environ``; a ``getenv`` on another thread at that moment
    reads freed memory. Rank 0 builds while the data service starts on its thread, and that
    crashed it (SIGSEGV in ``getenv`` under pyarrow). The writers: ``LanguageModule.__init__``
    sets ``NVTE_{FLASH,FUSED,UNFUSED}_ATTN`` from the attention backend (megatron's own function
    sets them here, so they keep its values), and the first torch optimizer imports Dynamo, which
    sets ``TORCHINDUCTOR_CACHE_DIR`` (imported here instead: the same import, earlier). Call it
    before starting any thread.
    """
    import torch._dynamo  # noqa: F401  (torch.optim's first param group would import it)
    from megatron.core.models.common.language_module.language_module import LanguageModule

    set_backend = getattr(LanguageModule, "_set_attention_backend", None)
    if set_backend is not None:
        set_backend(SimpleNamespace(config=cfg.to_transformer_config()))


def set_random_seed(seed: int) -> None:
    """Seed like Megatron-LM: one seed per PP stage (equal over DP/TP), TP-distinct dropout streams."""
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt_model(cfg: GPTModelConfig, *, pre_process: bool, post_process: bool, vp_stage: int | None = None,
                    transformer_config: TransformerConfig | None = None) -> GPTModel:
    """Build one GPTModel chunk on this process's device, untied output weights, the attention
    `cfg.attention` resolves to (usable on one process for benchmarks: call
    `initialize_parallel` first; bf16 params when ``cfg.bf16``).

    Args:
        cfg: Model shape and layout.
        pre_process: Whether the chunk holds the embedding (first pipeline stage).
        post_process: Whether the chunk holds the output layer and loss (last stage).
        vp_stage: Virtual pipeline stage of the chunk (None without interleaving).
        transformer_config: Config shared by all chunks of a rank (the schedule reads
            hooks such as ``no_sync_func`` from the first chunk's config); built if None.
    """
    config = transformer_config or cfg.to_transformer_config()
    backend = resolve_attention(cfg.attention, cp=cfg.cp, half=cfg.bf16)
    model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(backend), vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.seq_length, pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=False, position_embedding_type=cfg.position_embedding_type,
                     vp_stage=vp_stage)
    model.megascale_attention = backend  # forward_step builds THD params or a dense mask from it
    # Norms (torch LayerNorm) are created on the CPU even when megatron initialises on the GPU.
    model.to(device())
    return model.bfloat16() if cfg.bf16 else model


def build_model_chunks(cfg: GPTModelConfig, *, ddp: bool = True) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual stage), wrapped in megatron DDP.

    DDP keeps grads in contiguous ``main_grad`` buffers (fp32 also under bf16, as Megatron's
    ``--accumulate-allreduce-grads-in-fp32``) and all-reduces them over the DP group in
    ``finalize_model_grads`` (installed on the config, as Megatron-LM's training loop does);
    gloo handles that all-reduce on CPU, NCCL on CUDA. Under bf16 each chunk is wrapped in
    megatron's ``Float16Module`` (bf16 inputs on the first stage, fp32 outputs on the last).
    """
    config = cfg.to_transformer_config()
    chunks: list[torch.nn.Module] = []
    for vp in range(cfg.vpp or 1):
        vp_stage = vp if cfg.vpp else None
        model: torch.nn.Module = build_gpt_model(
            cfg,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            transformer_config=config,
        )
        if cfg.bf16:
            model = Float16Module(config, model)
        if ddp:
            ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, grad_reduce_in_fp32=cfg.bf16)
            model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                            disable_bucketing=vp > 0)
            model.broadcast_params()
        chunks.append(model)
    if ddp:
        no_sync = [chunk.no_sync for chunk in chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.finalize_model_grads_func = finalize_model_grads
    return chunks


_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def init_layout_invariant(model_chunks: Sequence[torch.nn.Module], *, seed: int) -> None:
    """Re-initialise every parameter from its global name, independent of TP/PP/VPP/DP.

    Each parameter's full (unsharded) tensor is drawn from a generator seeded by
    ``(seed, crc32(global name))`` and this rank keeps its TP shard, cut the way megatron's
    CPU initialisation cuts master weights (contiguous along ``partition_dim``). Layers are
    named by their global ``layer_number``, so any layout computes the same function: losses
    of a TP2·PP2 run can be compared with a single-process run step by step.
    """
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    for chunk in model_chunks:
        gpt = get_attr_wrapped_model(chunk, "decoder", return_model_obj=True)
        layers = gpt.decoder.layers
        for name, param in gpt.named_parameters():
            global_name = _LOCAL_LAYER.sub(lambda m: f"decoder.layers.{layers[int(m[1])].layer_number - 1}.", name)
            full_shape = list(param.shape)
            sharded = bool(getattr(param, "tensor_model_parallel", False))
            if sharded:
                full_shape[param.partition_dim] *= tp
            if name.endswith(".bias"):
                full = torch.zeros(full_shape)
            elif "norm" in name:
                full = torch.ones(full_shape)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
                full = torch.randn(full_shape, generator=gen) * 0.02
            if sharded:
                full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
            with torch.no_grad():
                param.copy_(full)


def stage_batch_keys(*, pre_process: bool, post_process: bool) -> tuple[str, ...]:
    """Batch keys a model chunk uses: Megatron-LM's get_batch split, plus the mask everywhere.

    First stage: tokens, position_ids; last stage: labels, loss_mask. Megatron-LM gives a middle
    stage nothing, so its attention falls back to plain causal: packed documents would attend
    across boundaries there. The dense ``attention_mask`` is listed for every stage; a THD batch's
    ``cu_seqlens`` fields (read by `forward_step` wherever present) replace it.
    """
    keys = (_FIRST_STAGE_KEYS if pre_process else ()) + (_LAST_STAGE_KEYS if post_process else ())
    return keys + ("attention_mask",)


def _to_tensor(value: Any, where: torch.device | None = None) -> torch.Tensor:
    """A batch value as a tensor on `where`; host data reaches a GPU through pinned memory, so the
    copy queues behind the device's work instead of first waiting for it to drain."""
    t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else torch.as_tensor(value)
    if where is None or t.device == torch.device(where):
        return t
    if t.device.type == "cpu" and torch.device(where).type == "cuda":
        t = t.pin_memory()
    return t.to(where, non_blocking=True)


def _attention_of(model: torch.nn.Module) -> str:
    """The backend `build_gpt_model` recorded on the chunk ("dense" for a GPTModel built elsewhere)."""
    while not hasattr(model, "megascale_attention") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "megascale_attention", "dense")


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor, *, source_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked token-loss sum, Megatron-LM 0.16 style: ``(loss_sum, num_tokens, report)``.

    The schedule divides ``loss_sum`` by ``num_tokens`` and the microbatch count before backward
    (``calculate_per_token_loss=False``); ``report["lm loss"] = [loss_sum, num_tokens]`` gives an
    exact token-weighted mean over microbatches and DP ranks. With per-token ``source_ids``
    (feedback mixing) ``report["source loss"]`` is ``[2, S]`` flattened: loss sum and token count
    per source (S = highest source id + 1).
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}
    if source_ids is not None:
        ids = source_ids.reshape(-1).long().clamp(min=0)  # padding (-1) has mask 0
        per_loss = torch.bincount(ids, weights=(losses * mask).detach().double())
        per_tokens = torch.bincount(ids, weights=mask.double())
        report["source loss"] = torch.cat([per_loss, per_tokens])
    return loss, num_tokens, report


def forward_step(data_iterator: Iterator[Mapping[str, Any]] | None, model: torch.nn.Module) -> tuple[Any, Any]:
    """Megatron forward step: pull one microbatch, run the chunk, return (output, loss fn).

    The batch is a dict of numpy arrays or tensors: ``tokens``, ``position_ids`` ([b, s]
    int) on the first stage, ``labels`` ([b, s] int) and ``loss_mask`` ([b, s]) on the last,
    ``attention_mask`` ([b, 1, s, s] bool, True = masked) wherever given, ``cu_seqlens``
    (+ ``cu_seqlens_padded``, ``max_seqlen`` after CP slicing) for per-document attention. Tensors
    move to the model's device here. With a per-document backend the model gets THD
    ``PackedSeqParams`` and no mask; with ``dense`` the mask (built from ``cu_seqlens`` when the
    batch has none). A middle stage given an iterator pulls one (possibly empty) dict per
    microbatch so the client's count of consumed microbatches stays exact; pass None to pull nothing.

    Raises:
        SampleError: a key this stage needs is missing from the batch.
    """
    pre_process = bool(get_attr_wrapped_model(model, "pre_process"))
    post_process = bool(get_attr_wrapped_model(model, "post_process"))
    batch = dict(next(data_iterator)) if data_iterator is not None else {}
    needed = (_FIRST_STAGE_KEYS if pre_process else ()) + (_LAST_STAGE_KEYS if post_process else ())
    missing = [key for key in needed if key not in batch]
    if missing:
        stage = "first" if pre_process else "last"
        raise SampleError(
            f"microbatch for the {stage} pipeline stage lacks {missing} (has {sorted(batch)}); "
            f"the data client must deliver {list(needed)} to this stage"
        )
    where = next((p.device for p in model.parameters()), device())
    backend = _attention_of(model)
    tensors = {key: _to_tensor(batch[key], where) for key in BATCH_KEYS if batch.get(key) is not None}
    packed = packed_seq_params(batch, where, host_boundaries=backend != "te") if backend != "dense" else None
    attention_mask = None
    if packed is None:
        attention_mask = tensors.get("attention_mask")
        if attention_mask is None and (cu := batch.get("cu_seqlens")) is not None:  # host array or device tensor
            attention_mask = dense_document_mask(cu, int(torch.as_tensor(cu).reshape(-1)[-1]), where)
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
    labels = tensors["labels"].long() if post_process else None
    with microbatch_cp(packed.cp_group if packed is not None and packed.local_cp_size is not None else None):
        output = model(
            tensors["tokens"].long() if pre_process else None,
            tensors["position_ids"].long() if pre_process else None,
            attention_mask,
            labels=labels,
            packed_seq_params=packed,
        )
    source_ids = batch.get("source_ids") if post_process else None
    return output, partial(loss_func, tensors.get("loss_mask"),
                           source_ids=None if source_ids is None else _to_tensor(source_ids, where))
