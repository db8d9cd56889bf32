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

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.trainer.optimizer import build_optimizer
from megascale_data_ext.trainer.pretrain import TrainingSession, gpt_model_config, step_counts

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
    from megatron.core.utils import get_attr_wrapped_model

    from megascale_data_ext.config import load_config
    from megascale_data_ext.trainer.vlm import FrozenViT, ViTConfig, VLMFeed, build_vlm_chunks, exchange_features
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    cp = int(cfg.parallel.get("context_parallel_size", 1))
    if cp > 1:  # VLMFeed hands a chunk every patch feature of its pack, a CP slice holds only some placeholders
        raise ConfigError(f"`parallel.context_parallel_size`={cp}: the VLM example does not split image features "
                          "per CP slice yet; use parallel.context_parallel_size=1 (GPT pretraining supports CP)")
    if int(cfg.train.get("eval_interval") or 0) > 0:  # the encoder feed reads images of the training stream
        raise ConfigError(f"`train.eval_interval`={cfg.train.eval_interval}: the VLM example does not evaluate yet "
                          "(its image encoder feed serves the training service only); set train.eval_interval=0 "
                          "(GPT pretraining evaluates data.validation.sources)")
    service_cfg = load_config(cfg, context_parallel_size=cp).to_service_config()
    if service_cfg.strategy != "vlm_balance":
        raise ConfigError(f"`data.strategy.name` is {service_cfg.strategy!r}; pretrain_vlm needs the hybrid "
                          "`vlm_balance` strategy (images balanced over WORLD, sequences over DP)")
    tok = load_tokenizer(service_cfg.sources[0].tokenizer)
    if tok.image_id is None:
        raise ConfigError(f"tokenizer {service_cfg.sources[0].tokenizer!r} has no image placeholder token")
    model_cfg = gpt_model_config(cfg, service_cfg, max(tok.vocab_size, tok.image_id + 1))
    vcfg = cfg.vision
    vit_cfg = ViTConfig(patch_dim=int(vcfg.patch_dim), hidden_size=int(vcfg.hidden_size),
                        num_layers=int(vcfg.num_layers), num_attention_heads=int(vcfg.num_attention_heads),
                        seed=int(vcfg.get("seed", 4321)))
    session = TrainingSession(cfg, service_cfg, model_cfg)  # the service starts while the models are built
    vit = FrozenViT(vit_cfg)
    chunks = build_vlm_chunks(model_cfg, vision_hidden=vit_cfg.hidden_size, image_token_id=tok.image_id)
    first = next((get_attr_wrapped_model(c, "projector", return_model_obj=True) for c in chunks
                  if get_attr_wrapped_model(c, "pre_process")), None)
    feed = VLMFeed(first, vision_hidden=vit_cfg.hidden_size)
    optimizer, scheduler = build_optimizer(chunks, cfg.train, bf16=model_cfg.bf16)
    client = session.connect()

    def encode(step: int) -> dict:
        """Encode this rank's WORLD-balanced images and share the features (frozen ViT)."""
        f0 = feed.image_tokens
        patches, seqlens, keys = client.encoder_images(step)
        t0 = time.perf_counter()
        feed.features = exchange_features(keys, vit.encode(patches, seqlens))
        return {"encoded_keys": keys.tolist(), "encoded_patches": int(seqlens.sum()),
                "encode_seconds": time.perf_counter() - t0, "_image_tokens_before": f0}

    def report(step: int, entry: dict) -> None:
        plan = session.plan(step)
        s, e = plan.summary(), encoder_balance(plan)
        entry.update(balance={**{k: s[k] for k in ("max_over_mean", "vanilla_max_over_mean")}, **e},
                     planned_keys=[[int(plan.source[r]), int(plan.position[r]), int(k)]
                                   for r, k in zip(plan.encoder.sample.tolist(), plan.encoder.image.tolist(),
                                                   strict=True)],
                     planned_ranks=plan.encoder.bucket.tolist())
        counts = step_counts(s, session.service_cfg)
        print(f"step {step:4d} | loss {entry['loss']:.4f} | {counts} | backbone max/mean vanilla "
              f"{s['vanilla_max_over_mean']:.3f} -> {s['max_over_mean']:.3f} | encoder max/mean vanilla "
              f"{e['encoder_vanilla_max_over_mean']:.3f} -> {e['encoder_max_over_mean']:.3f} "
              f"({len(plan.encoder.sample)} images, patches/rank {e['patches_per_rank']}) | "
              f"encode+exchange {entry['encode_seconds']:.2f} s | received {entry['data_bytes'] / 2**20:.2f} MiB "
              f"({entry['patch_bytes'] / 2**20:.2f} of patches) | {entry['seconds']:.2f} s", flush=True)

    log = session.run(chunks, optimizer, scheduler=scheduler, transform=feed, before_step=encode, report=report)
    # image tokens embedded during each step (VLMFeed counts cumulatively)
    totals = [e.pop("_image_tokens_before") for e in log] + [feed.image_tokens]
    for e, a, b in zip(log, totals, totals[1:], strict=False):
        e["image_tokens_embedded"] = b - a
    return log
