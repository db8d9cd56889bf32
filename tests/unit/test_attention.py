"""Per-document attention (trainer/attention.py) against the dense block-diagonal path, on CPU.

The kernel tests compare `DocumentAttention` on THD inputs with torch SDPA under the dense
S x S document mask (forward and every input gradient); the model tests build the real
megatron-core GPTModel twice from one set of weights, once with attention=flex (THD
PackedSeqParams, per-document RoPE) and once with attention=dense (the mask), and compare the
per-token loss and every parameter gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megascale_data_ext.dataplane.packing import pack_microbatch
from megascale_data_ext.errors import ConfigError, ParallelLayoutError
from megascale_data_ext.trainer.attention import (
    DocumentAttention,
    dense_document_mask,
    gpt_layer_spec,
    packed_seq_params,
    resolve_attention,
)

LENS = [5, 7, 1, 3, 8]  # a one-token document included


@pytest.fixture(scope="module")
def megatron_1proc():
    """One gloo process with megatron's parallel state (TP=PP=CP=1) and the CPU shims."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megascale_data_ext.trainer.model import GPTModelConfig, initialize_parallel
    from megascale_data_ext.patches import remove_cpu_shims
    from tests.dist.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    initialize_parallel(GPTModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4))
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    remove_cpu_shims()


def _reference(q, k, v, cu) -> torch.Tensor:
    """SDPA over the whole pack with the dense document mask: [t, h, d]."""
    mask = ~dense_document_mask(cu, q.shape[0])[0, 0]
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def _qkv(heads: int, groups: int, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return [torch.randn(t, h, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for h in (heads, groups, groups)]


@pytest.mark.parametrize("groups", [4, 2])  # MHA and grouped-query attention
def test_document_attention_forward_and_backward_equal_dense(megatron_1proc, groups):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                               use_cpu_initialization=True, attention_dropout=0.0)
    attn = DocumentAttention(config, 1, AttnMaskType.causal, "self", kernel="sdpa")
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    params = packed_seq_params({"cu_seqlens": cu, "max_seqlen": np.array([max(LENS)], np.int32)}, "cpu")
    q, k, v = _qkv(4, groups)
    got = attn(q, k, v, None, packed_seq_params=params)
    assert got.shape == (sum(LENS), 4 * 8)
    want = _reference(q, k, v, cu).reshape(sum(LENS), -1) * 1.0
    torch.testing.assert_close(got, want)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_flex_attention_forward_matches_dense_on_cpu(megatron_1proc):
    """The CUDA kernel's mask, run by flex_attention's eager CPU path (forward only there)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               attention_dropout=0.0)
    attn = DocumentAttention(config, 1, AttnMaskType.causal, "self", kernel="flex")
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    q, k, v = (x.detach().float() for x in _qkv(4, 4, seed=1))
    got = attn(q, k, v, None, packed_seq_params=packed_seq_params({"cu_seqlens": cu}, "cpu"))
    torch.testing.assert_close(got, _reference(q, k, v, cu).reshape(sum(LENS), -1), atol=1e-5, rtol=1e-5)


def _batch(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [{"tokens": rng.integers(3, 120, size=n)} for n in (9, 4, 14, 1, 6)]
    return pack_microbatch(docs, seq_length=40, pad_id=0, pad_to_multiple_of=8, variable_length=True)


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
def test_gpt_with_document_attention_equals_dense_mask(megatron_1proc, position):
    """Same weights, same pack: THD per-document attention == dense block-diagonal mask (loss and grads)."""
    from megascale_data_ext.trainer.model import GPTModelConfig, build_gpt_model, forward_step

    losses, grads, state = {}, {}, {}
    for backend in ("flex", "dense"):
        cfg = GPTModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=64,
                             attention=backend, position_embedding_type=position)
        torch.manual_seed(0)
        model = build_gpt_model(cfg, pre_process=True, post_process=True)
        if state:  # the dense model gets the flex model's weights
            model.load_state_dict(state)
        state = state or model.state_dict()
        output, loss_fn = forward_step(iter([_batch()]), model)
        loss, _, _ = loss_fn(output)
        loss.backward()
        losses[backend] = output.detach()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    modules = {type(m).__name__ for m in build_gpt_model(
        GPTModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4, attention="flex"),
        pre_process=True, post_process=True).modules()}
    assert "DocumentAttention" in modules
    torch.testing.assert_close(losses["flex"], losses["dense"], atol=1e-5, rtol=1e-5)
    for name, g in grads["flex"].items():
        torch.testing.assert_close(g, grads["dense"][name], atol=1e-5, rtol=1e-4, msg=name)


def test_dense_backend_builds_the_mask_from_cu_seqlens(megatron_1proc):
    """A batch sent without the O(s^2) mask still attends per document on the dense path."""
    from megascale_data_ext.trainer.model import GPTModelConfig, build_gpt_model, forward_step

    cfg = GPTModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4, attention="dense")
    model = build_gpt_model(cfg, pre_process=True, post_process=True)
    model.eval()
    batch = _batch()
    with_mask = pack_microbatch([{"tokens": t} for t in np.split(batch["tokens"][0, :34], [9, 13, 27, 28])],
                                seq_length=40, pad_id=0, pad_to_multiple_of=8, variable_length=True,
                                with_attention_mask=True)
    a, _ = forward_step(iter([batch]), model)
    b, _ = forward_step(iter([with_mask]), model)
    torch.testing.assert_close(a, b)


def test_backend_choice_is_honoured_or_refused():
    assert resolve_attention("auto", cuda=False) == "flex"
    assert resolve_attention("dense") == "dense"
    with pytest.raises(ConfigError, match="attention.*must be one of"):
        resolve_attention("sdpa")
    with pytest.raises(ConfigError, match="attention`=te but"):
        resolve_attention("te", cuda=False)
    with pytest.raises(ParallelLayoutError, match="dense has no context parallelism"):
        resolve_attention("dense", cp=2)
    spec = gpt_layer_spec("flex")
    assert spec.submodules.self_attention.submodules.core_attention is DocumentAttention
    assert gpt_layer_spec("dense").submodules.self_attention.submodules.core_attention is not DocumentAttention


def test_auto_picks_transformer_engine_only_in_half_precision(monkeypatch):
    """TE's packed (THD) attention has no fp32 kernel: an fp32 run with TE installed gets flex."""
    import megascale_data_ext.trainer.attention as attention

    monkeypatch.setattr(attention, "te_available", lambda: True)
    assert resolve_attention("auto", cuda=True) == "te"
    assert resolve_attention("auto", cuda=True, half=False) == "flex"


def test_packed_seq_params_takes_batch_tensors_as_well_as_arrays():
    """A batch moved to the device carries cu_seqlens and max_seqlen as tensors (CUDA ones on a GPU)."""
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    from_arrays = packed_seq_params({"cu_seqlens": cu, "max_seqlen": np.array([8], np.int32)}, "cpu")
    from_tensors = packed_seq_params({"cu_seqlens": torch.as_tensor(cu), "max_seqlen": torch.tensor([11])}, "cpu")
    assert from_arrays.max_seqlen_q == 8 and from_tensors.max_seqlen_q == 11
    torch.testing.assert_close(from_arrays.cu_seqlens_q, from_tensors.cu_seqlens_q)


def test_per_document_backends_get_host_boundaries_and_te_gets_device_ones():
    """Megatron's unfused THD RoPE reads cu_seqlens with .tolist()/.item() in every layer: on device
    tensors each read is a sync that drains the launch queue (the H100 run was launch-bound), so the
    per-document backends get the boundaries on the host; TE's kernels need them on the device."""
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    batch = {"cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": np.array([8], np.int32)}
    host = packed_seq_params(batch, "meta", host_boundaries=True)
    device = packed_seq_params(batch, "meta")
    assert {host.cu_seqlens_q.device.type, host.cu_seqlens_kv_padded.device.type} == {"cpu"}
    assert {device.cu_seqlens_q.device.type, device.cu_seqlens_kv_padded.device.type} == {"meta"}
    assert host.cu_seqlens_q.tolist() == cu.tolist() and host.max_seqlen_q == device.max_seqlen_q == max(8, *LENS)


def test_model_build_adds_no_environment_variable_once_settled(megatron_1proc, monkeypatch):
    """Rank 0 builds its models while the data service starts on another thread: a variable the
    build adds (C ``setenv`` reallocating ``environ``) races that thread's ``getenv`` (a SIGSEGV in
    CI). Unsettled, megatron's GPTModel adds NVTE_*; after `settle_model_environ` the GPT and VLM
    builds, DDP and the optimizer leave the environment exactly as it was."""
    import os

    from omegaconf import OmegaConf

    from megascale_data_ext.trainer.model import (GPTModelConfig, build_gpt_model, build_model_chunks,
                                                  settle_model_environ)
    from megascale_data_ext.trainer.optimizer import build_optimizer
    from megascale_data_ext.trainer.vlm import FrozenViT, ViTConfig, build_vlm_chunks

    written = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    cfg = GPTModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=64)
    for name in written:
        monkeypatch.delenv(name, raising=False)
    build_gpt_model(cfg, pre_process=True, post_process=True)
    assert all(name in os.environ for name in written)  # what the settling is for

    for name in written:
        monkeypatch.delenv(name)
    settle_model_environ(cfg)
    before = dict(os.environ)
    chunks = build_model_chunks(cfg)
    build_optimizer(chunks, OmegaConf.create({"lr": 1e-3, "train_iters": 4}))
    build_vlm_chunks(cfg, vision_hidden=16, image_token_id=127)
    FrozenViT(ViTConfig(patch_dim=12, hidden_size=16, num_layers=1, num_attention_heads=2))
    assert dict(os.environ) == before
