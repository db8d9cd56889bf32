"""The training loop behind `examples/pretrain_vlm.py`: a LLaVA-style VLM fed by the hybrid strategy.

Per step, on every rank (all stages: the encoder is data parallel over WORLD):

1. pull this rank's encoder share from every Data Constructor (`Client.encoder_images`);
2. encode it with the frozen ViT under ``torch.no_grad`` and all-gather the features (gloo);
3. run megatron's schedule through the hooks; `VLMFeed` hands each first-stage microbatch the
   features of its images (packing order, by ``image_keys``) and the trained projector writes
   them into the backbone's ``decoder_input``.

Service start, checkpoints and resume are `pretrain.py`'s (`serve`, `save_checkpoint`, ...).
Rank 0 prints the loss and the balance of both axes: backbone max/mean cost over DP buckets
(vanilla -> balanced) and encoder max/mean cost over WORLD ranks (vanilla -> balanced, where
vanilla gives each rank an equal-count contiguous slice of the step's images).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.megatron.pretrain import latest_step, load_checkpoint, load_data_state, save_checkpoint, serve

__all__ = ["encoder_balance", "pretrain_vlm"]


def encoder_balance(plan: Any) -> dict[str, Any]:
    """Encoder cost spread of a hybrid plan: max/mean over WORLD ranks, balanced and vanilla."""
    enc = plan.encoder
    if enc is None:
        raise ConfigError("the step plan has no EncoderPlan: pretrain_vlm needs strategy=vlm_balance")
    k, n = enc.num_buckets, len(enc.cost)
    costs = enc.bucket_costs()
    vanilla = np.bincount(np.arange(n) * k // max(n, 1), weights=enc.cost, minlength=k) if n else np.zeros(k)
    spread = lambda c: float(c.max() / c.mean()) if c.size and c.mean() > 0 else 1.0  # noqa: E731
    return {
        "encoder_max_over_mean": spread(costs),
        "encoder_vanilla_max_over_mean": spread(vanilla),
        "images_per_rank": np.bincount(enc.bucket, minlength=k).tolist(),
        "patches_per_rank": np.bincount(enc.bucket, weights=enc.patches, minlength=k).astype(np.int64).tolist(),
    }


def pretrain_vlm(cfg: Any) -> list[dict]:
    """Run `cfg.train.train_iters` VLM steps on the service; returns this rank's step log."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    from megascale_data_ext.config import load_config
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.megatron.hooks import install
    from megascale_data_ext.megatron.model import GPTModelConfig, initialize_parallel, train_step
    from megascale_data_ext.megatron.vlm import FrozenViT, ViTConfig, VLMFeed, build_vlm_chunks, exchange_features
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    data = load_config(cfg.data)
    service_cfg = data.to_service_config()
    if service_cfg.strategy != "vlm_balance":
        raise ConfigError(f"`data.strategy.name` is {service_cfg.strategy!r}; pretrain_vlm needs the hybrid "
                          "`vlm_balance` strategy (images balanced over WORLD, sequences over DP)")
    par, mcfg, vcfg, tcfg = cfg.parallel, cfg.model, cfg.vision, cfg.train
    tp = int(par.tensor_model_parallel_size)
    tok = load_tokenizer(service_cfg.sources[0].tokenizer)
    if tok.image_id is None:
        raise ConfigError(f"tokenizer {service_cfg.sources[0].tokenizer!r} has no image placeholder token")
    vocab = max(tok.vocab_size, tok.image_id + 1)
    model_cfg = GPTModelConfig(
        vocab_size=-(-vocab // (64 * tp)) * 64 * tp, hidden_size=int(mcfg.hidden_size), num_layers=int(mcfg.num_layers),
        num_attention_heads=int(mcfg.num_attention_heads), seq_length=service_cfg.seq_length, tp=tp,
        pp=int(par.pipeline_model_parallel_size), cp=int(par.get("context_parallel_size", 1)),
        vpp=par.get("virtual_pipeline_model_parallel_size"), seed=int(tcfg.get("seed", 1234)),
    )
    vit_cfg = ViTConfig(patch_dim=int(vcfg.patch_dim), hidden_size=int(vcfg.hidden_size),
                        num_layers=int(vcfg.num_layers), num_attention_heads=int(vcfg.num_attention_heads),
                        seed=int(vcfg.get("seed", 4321)))
    initialize_parallel(model_cfg)
    rank = dist.get_rank()
    tree = ClientPlaceTree.from_megatron()
    start, state, load_dir = 0, None, tcfg.get("load")
    if load_dir:
        start = latest_step(load_dir)
        state = load_data_state(load_dir, start) if rank == 0 else None
    service, handles = serve(service_cfg, tree, state=state, ray_kwargs=None)
    client = Client(tree, rank, namespace=handles.namespace, address=handles.address,
                    num_microbatches=service_cfg.num_microbatches, constructor_group=handles.constructor_group,
                    tp_group=parallel_state.get_tensor_model_parallel_group())
    vit = FrozenViT(vit_cfg)
    chunks = build_vlm_chunks(model_cfg, vision_hidden=vit_cfg.hidden_size, image_token_id=tok.image_id)
    first = next((get_attr_wrapped_model(c, "projector", return_model_obj=True) for c in chunks
                  if get_attr_wrapped_model(c, "pre_process")), None)
    feed = VLMFeed(client, first, vision_hidden=vit_cfg.hidden_size)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(tcfg.lr), weight_decay=0.0)
    hooks = install(feed, num_model_chunks=len(chunks), start_step=start)
    if load_dir:
        load_checkpoint(load_dir, start, chunks, optimizer, hooks)
    planner = None
    if rank == 0:
        import ray

        planner = ray.get_actor("planner", namespace=handles.namespace)
    log: list[dict] = []
    save_dir, interval = tcfg.get("save"), int(tcfg.get("save_interval") or 0)
    try:
        for step in range(start, int(tcfg.train_iters)):
            t0 = time.perf_counter()
            n0, f0 = len(client.delivered), feed.image_tokens
            patches, seqlens, keys = client.encoder_images(step)
            t_enc = time.perf_counter()
            feed.features = exchange_features(keys, vit.encode(patches, seqlens))
            t_enc = time.perf_counter() - t_enc
            result = train_step(chunks, optimizer, None, num_microbatches=service_cfg.num_microbatches,
                                seq_length=service_cfg.seq_length)
            dt = time.perf_counter() - t0
            entry = {"step": step, "loss": result["loss"], "num_tokens": result["num_tokens"], "seconds": dt,
                     "encoded_keys": keys.tolist(), "encoded_patches": int(seqlens.sum()),
                     "image_tokens_embedded": feed.image_tokens - f0, "encode_seconds": t_enc,
                     "digests": client.digests[n0:],
                     "samples": [np.asarray(i["samples"]).tolist() for i in client.delivered[n0:] if i is not None]}
            if rank == 0:
                import ray

                plan = ray.get(planner.plan.remote(step))
                s, e = plan.summary(), encoder_balance(plan)
                entry.update(balance={**{k: s[k] for k in ("max_over_mean", "vanilla_max_over_mean")}, **e},
                             planned_keys=[[int(plan.source[r]), int(plan.position[r]), int(k)]
                                           for r, k in zip(plan.encoder.sample.tolist(), plan.encoder.image.tolist(),
                                                           strict=True)],
                             planned_ranks=plan.encoder.bucket.tolist())
                print(f"step {step:4d} | loss {result['loss']:.4f} | backbone max/mean vanilla "
                      f"{s['vanilla_max_over_mean']:.3f} -> {s['max_over_mean']:.3f} | encoder max/mean vanilla "
                      f"{e['encoder_vanilla_max_over_mean']:.3f} -> {e['encoder_max_over_mean']:.3f} "
                      f"({len(plan.encoder.sample)} images, patches/rank {e['patches_per_rank']}) | "
                      f"encode+exchange {t_enc:.2f} s | {dt:.2f} s", flush=True)
            log.append(entry)
            if save_dir and interval and (step + 1) % interval == 0:
                save_checkpoint(save_dir, step + 1, chunks, optimizer, hooks, service)
    except BaseException:
        hooks.uninstall()  # no barrier: peers may be blocked in a collective; torchrun tears the job down
        if service is not None:
            service.stop()
        raise
    hooks.uninstall()
    dist.barrier()
    if service is not None:
        service.stop()
    return log
