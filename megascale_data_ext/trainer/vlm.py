"""A LLaVA-style VLM on megatron-core for the hybrid (Alg. 2) data strategy.

The data service balances *images* over WORLD (every rank is an encoder rank) and the packed
*sequences* over DP (the backbone). The model follows that split:

* `FrozenViT`: a Linear patch embedding plus a megatron `TransformerBlock` (local ViT spec,
  no attention mask) run per image over its variable-resolution patches. Each rank holds a full,
  identical copy (built on singleton process groups, so TP/PP never shard it) and encodes only
  the images the plan gave it. It is FROZEN (LLaVA stage 1): it runs under ``torch.no_grad``
  and no gradient crosses the cross-rank exchange, which is what lets the encoder's data
  parallelism differ from the backbone's.
* `exchange_features`: ``all_gather_object`` over WORLD (gloo-friendly) so that every rank
  holds the features of every image of the step, keyed by (source, position, image).
* `VLMChunk`: a GPT chunk (from `model.build_gpt_model`) with a trained megatron
  `MultimodalProjector` on the first stage. Its ``decoder_input`` is the word embedding of the
  tokens with each ``image_token_id`` position replaced by the projected patch features of its
  image, images in packing order (the constructor's ``image_keys`` say which).
* `VLMFeed`: the per-microbatch transform of `hooks.install`; as Megatron's ``forward_step``
  pulls a microbatch it hands that microbatch's features to the first-stage chunk, so megatron's own
  ``forward_step``/``train_step`` run unchanged.

Devices: encoder, projector, features and backbone live on `model.device()` (``cuda:LOCAL_RANK``
with CUDA); features cross ranks through the CPU (``all_gather_object``). Under ``cfg.bf16`` each
chunk (backbone and projector) is wrapped in megatron's ``Float16Module``; the frozen ViT stays fp32.
"""

from __future__ import annotations

import collections
import functools
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megascale_data_ext.errors import ConfigError, SampleError
from megascale_data_ext.trainer.model import GPTModelConfig, build_gpt_model, device, quiet_config_defaults

__all__ = ["FrozenViT", "ViTConfig", "VLMChunk", "VLMFeed", "build_vlm_chunks", "exchange_features"]

ImageKey = tuple[int, int, int]


@dataclass(slots=True, kw_only=True)
class ViTConfig:
    """Shape of the frozen vision encoder; `seed` makes every rank's copy identical."""

    patch_dim: int = 768
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    seed: int = 4321

    def validate(self) -> None:
        problems = [f"`vision.{k}` must be >= 1, got {v!r}" for k, v in (
            ("patch_dim", self.patch_dim), ("hidden_size", self.hidden_size), ("num_layers", self.num_layers),
            ("num_attention_heads", self.num_attention_heads)) if not (isinstance(v, int) and v >= 1)]
        if not problems and self.hidden_size % self.num_attention_heads:
            problems.append(f"`vision.hidden_size`={self.hidden_size} must be divisible by "
                            f"`vision.num_attention_heads`={self.num_attention_heads}")
        if problems:
            raise ConfigError("invalid ViTConfig: " + "; ".join(problems))


def _own_group() -> Any:
    """This rank's singleton process group (every rank must create every group, in order)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


class FrozenViT(torch.nn.Module):
    """Linear patch embedding + megatron TransformerBlock, frozen, one image at a time.

    Images are encoded one by one (no block-diagonal mask needed: attention stays within an
    image and costs sum(n_i^2), not (sum n_i)^2). No position embedding: the demo images are
    variable-resolution and this encoder is a stand-in for a pretrained one.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        config = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            use_cpu_initialization=not torch.cuda.is_available(), params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, **quiet_config_defaults(),
        )
        spec = get_vit_layer_with_local_spec()
        spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
        group = _own_group()
        self.patch_embed = torch.nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.block = TransformerBlock(config, spec, pg_collection=ProcessGroupCollection(tp=group, pp=group, cp=group))
        for name, param in self.named_parameters():  # identical on every rank, whatever the layout
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
            with torch.no_grad():
                if name.endswith("bias"):
                    param.zero_()
                elif "norm" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            param.requires_grad_(False)
        self.to(device())
        self.eval()

    @torch.no_grad()
    def encode(self, patches: np.ndarray | torch.Tensor, seqlens: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
        """Features ``[n_i, hidden]`` of each image of ``patches`` ``[sum n_i, patch_dim]``."""
        x = torch.as_tensor(np.asarray(patches, dtype=np.float32)).to(device())
        if x.ndim != 2 or (x.shape[0] and x.shape[1] != self.cfg.patch_dim):
            raise SampleError(f"encoder input must be [patches, {self.cfg.patch_dim}], got {tuple(x.shape)}; "
                              "set vision.patch_dim to the sources' patch_size**2 * 3")
        out = []
        for image in torch.split(x, [int(n) for n in np.asarray(seqlens).tolist()]):
            h = self.block(self.patch_embed(image)[:, None, :], attention_mask=None)
            out.append(h[:, 0, :].contiguous())
        return out


def exchange_features(keys: np.ndarray, features: list[torch.Tensor]) -> dict[ImageKey, torch.Tensor]:
    """All-gather every rank's encoded images over WORLD: ``{(source, position, image): [n, hidden]}``.

    No gradient crosses this exchange (the encoder is frozen). Every rank receives every image,
    O(world x step images); an all-to-all sending only to the first-stage ranks of the DP rank
    that packed each image would cut it to what each rank needs.
    """
    mine = (np.asarray(keys, dtype=np.int64).reshape(-1, 3), [f.detach().float().cpu().numpy() for f in features])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[ImageKey, torch.Tensor] = {}
    for rank_keys, feats in gathered:
        for key, f in zip(map(tuple, rank_keys.tolist()), feats, strict=True):
            if key in out:
                raise SampleError(f"image {key} was encoded by two ranks; the EncoderPlan must give each image one rank")
            out[key] = torch.from_numpy(f).to(device())
    return out


def _local_mlp_submodules() -> Any:
    """The local spec's MLP submodules for the projector: a `ModuleSpec`'s ``submodules`` up to
    megatron-core 0.17, a ``functools.partial``'s ``submodules`` keyword from 0.18."""
    mlp = get_gpt_layer_local_spec().submodules.mlp
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


class VLMChunk(MegatronModule):
    """A GPT chunk whose first stage embeds images through a trained MultimodalProjector.

    ``module`` is the GPTModel (so megatron's `get_attr_wrapped_model` unwraps to it);
    ``projector`` exists on the chunk with ``pre_process`` only. Features for each microbatch
    are queued by `VLMFeed` right before Megatron's ``forward_step`` calls this chunk.
    """

    def __init__(self, gpt: torch.nn.Module, *, vision_hidden: int, image_token_id: int) -> None:
        super().__init__(config=gpt.config)
        self.module = gpt
        self.pre_process, self.post_process = gpt.pre_process, gpt.post_process
        self.image_token_id = image_token_id
        self.projector = None
        if gpt.pre_process:
            mlp = _local_mlp_submodules()
            self.projector = MultimodalProjector(gpt.config, mlp, "mlp", vision_hidden,
                                                 tp_group=parallel_state.get_tensor_model_parallel_group())
            self.projector.to(device())
        self._pending: collections.deque[torch.Tensor] = collections.deque()

    def __getattr__(self, name: str) -> Any:
        # megatron's finalize_model_grads and schedules read GPTModel attributes off the object that
        # has `pre_process` (this one): share_embeddings_and_output_weights, embedding, ...
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def push_features(self, features: torch.Tensor) -> None:
        self._pending.append(features)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.module.set_input_tensor(input_tensor)

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Word embeddings ``[s, b, h]`` with image placeholders replaced by projected features."""
        emb = self.module.embedding(input_ids=tokens, position_ids=position_ids)
        slots = (tokens == self.image_token_id).transpose(0, 1)  # [s, b], packing order for b == 1
        if int(slots.sum()) != features.shape[0]:
            raise SampleError(f"microbatch has {int(slots.sum())} image placeholder tokens but {features.shape[0]} "
                              "patch features; image_keys and the packed tokens disagree")
        dtype = next(self.projector.parameters()).dtype
        projected = self.projector(features.to(emb.device, dtype)[:, None, :]).reshape(-1, emb.shape[-1])
        return emb.masked_scatter(slots[..., None], projected.to(emb.dtype))

    def forward(self, input_ids: Any, position_ids: Any, attention_mask: Any, labels: Any = None, **kwargs: Any) -> Any:
        decoder_input = None
        if self.pre_process:
            if not self._pending:
                raise SampleError("first-stage VLM chunk called without image features; feed it through VLMFeed")
            decoder_input = self.embed(input_ids, position_ids, self._pending.popleft())
        return self.module(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                           **kwargs)


def build_vlm_chunks(cfg: GPTModelConfig, *, vision_hidden: int, image_token_id: int) -> list[torch.nn.Module]:
    """This rank's VLM chunks (one per virtual stage), wrapped in megatron DDP like `build_model_chunks`."""
    config = cfg.to_transformer_config()
    chunks: list[torch.nn.Module] = []
    for vp in range(cfg.vpp or 1):
        vp_stage = vp if cfg.vpp else None
        gpt = build_gpt_model(
            cfg,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, transformer_config=config,
        )
        module: torch.nn.Module = VLMChunk(gpt, vision_hidden=vision_hidden, image_token_id=image_token_id)
        if cfg.bf16:
            module = Float16Module(config, module)
        chunk = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False,
                                                                    grad_reduce_in_fp32=cfg.bf16),
            module=module, disable_bucketing=vp > 0,
        )
        chunk.broadcast_params()
        chunks.append(chunk)
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


class VLMFeed:
    """The per-microbatch transform `hooks.install` applies on VLM runs: attach image features.

    Called with each microbatch the client delivers and its delivery info; on the first stage
    it queues the features of the microbatch's images (packing order, by ``image_keys``) on the
    chunk holding the embedding. Other stages pass batches through.

    Args:
        first_chunk: The unwrapped `VLMChunk` holding the embedding (None off the first stage).
        vision_hidden: Encoder width (shape of the empty feature tensor of text-only microbatches).
    """

    def __init__(self, first_chunk: VLMChunk | None, *, vision_hidden: int) -> None:
        self.first_chunk = first_chunk
        self.vision_hidden = vision_hidden
        self.features: Mapping[ImageKey, torch.Tensor] = {}
        self.image_tokens = 0

    def __call__(self, batch: dict[str, torch.Tensor] | None, info: Mapping[str, Any] | None):
        if self.first_chunk is None or batch is None:
            return batch
        keys = (info or {}).get("image_keys", np.zeros((0, 3), np.int64))
        missing = [k for k in map(tuple, np.asarray(keys).tolist()) if k not in self.features]
        if missing:
            where = f"step {info['step']} microbatch {info['microbatch']}" if info else "a microbatch"
            raise SampleError(f"{where}: no encoder features for images {missing[:3]} "
                              f"(of {len(missing)}); every image must be encoded by some rank")
        feats = [self.features[k] for k in map(tuple, np.asarray(keys).tolist())]
        merged = torch.cat(feats) if feats else torch.zeros(0, self.vision_hidden, device=device())
        self.image_tokens += merged.shape[0]
        self.first_chunk.push_features(merged)
        return batch
