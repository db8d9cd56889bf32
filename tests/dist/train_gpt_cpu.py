"""torchrun script: train a tiny megatron-core GPT on CPU/gloo with packed, variable-length microbatches.

Every rank initialises gloo and megatron's parallel state, applies the CPU shims, builds its
model chunks and runs ``--steps`` optimizer steps through megatron's pipeline schedule.
Microbatches are packed documents with a block-diagonal causal mask; their lengths differ
(as after balancing) and depend only on (dp rank, microbatch index, data step), so TP ranks
of one DP rank get identical batches. With ``--repeat`` the same batch is used every step,
so the loss must fall. Each rank writes ``rank{N}.json`` to ``--out``.

Run: python -m torch.distributed.run --standalone --nproc_per_node 4 tests/dist/train_gpt_cpu.py --tp 2 --pp 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

MICROBATCH_LENGTHS = (64, 40, 56, 48)  # unequal on purpose: PP must exchange shapes.


def make_microbatch(*, dp_rank: int, index: int, step: int, seq_length: int, vocab_size: int) -> dict[str, np.ndarray]:
    """A packed microbatch [1, s] of arithmetic-progression documents (learnable next token)."""
    rng = np.random.default_rng([dp_rank, index, step])
    length = min(MICROBATCH_LENGTHS[index % len(MICROBATCH_LENGTHS)], seq_length)
    docs, doc_ids = [], []
    while sum(map(len, docs)) < length + 1:
        n = int(rng.integers(8, 24))
        start, stride = int(rng.integers(0, vocab_size)), int(rng.integers(1, 5))
        docs.append((start + stride * np.arange(n)) % vocab_size)
        doc_ids.append(np.full(n, len(doc_ids)))
    stream, doc = np.concatenate(docs)[: length + 1], np.concatenate(doc_ids)[: length + 1]
    tokens, labels = stream[:-1], stream[1:]
    loss_mask = (doc[:-1] == doc[1:]).astype(np.float32)  # no loss across a document boundary
    seg = doc[:-1]
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    position_ids = np.arange(length) - np.repeat(starts, np.diff(np.r_[starts, length]))
    causal = np.triu(np.ones((length, length), dtype=bool), k=1)
    attention_mask = causal | (seg[:, None] != seg[None, :])
    return {
        "tokens": tokens[None].astype(np.int64),
        "labels": labels[None].astype(np.int64),
        "loss_mask": loss_mask[None],
        "position_ids": position_ids[None].astype(np.int64),
        "attention_mask": attention_mask[None, None],
    }


def rank_microbatches(*, dp_rank: int, emulate_dp: int, num_microbatches: int, step: int, seq_length: int,
                      vocab_size: int) -> list[dict[str, np.ndarray]]:
    """This DP rank's microbatches; with ``emulate_dp`` = K it also plays K consecutive DP ranks.

    A DP=1 run with ``emulate_dp=2`` and twice the microbatches sees exactly the global batch
    of a DP=2 run, so their losses must agree.
    """
    return [
        make_microbatch(dp_rank=dp_rank * emulate_dp + d, index=i, step=step, seq_length=seq_length,
                        vocab_size=vocab_size)
        for d in range(emulate_dp) for i in range(num_microbatches // emulate_dp)
    ]


def expected_num_tokens(*, dp_size: int, num_microbatches: int, step: int, seq_length: int, vocab_size: int) -> int:
    """Loss tokens of one step summed over every DP rank (what train_step must report)."""
    return int(sum(
        make_microbatch(dp_rank=d, index=i, step=step, seq_length=seq_length, vocab_size=vocab_size)["loss_mask"].sum()
        for d in range(dp_size) for i in range(num_microbatches)
    ))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--repeat", action="store_true", help="use the step-0 batch at every step")
    parser.add_argument("--emulate-dp", type=int, default=1, help="play this many DP ranks' data per rank")
    parser.add_argument("--invariant-init", action="store_true",
                        help="layout-independent weights, so runs of different layouts can be compared")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


def main() -> int:
    args = _parse()
    import torch
    from megatron.core import parallel_state as ps

    from megascale_data_ext.trainer.model import (
        GPTModelConfig, build_model_chunks, init_layout_invariant, initialize_parallel, stage_batch_keys,
    )
    from megascale_data_ext.trainer.step import train_step

    torch.set_num_threads(1)
    cfg = GPTModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4,
                         seq_length=64, tp=args.tp, pp=args.pp, vpp=args.vpp)
    shims = initialize_parallel(cfg)
    chunks = build_model_chunks(cfg)
    if args.invariant_init:
        init_layout_invariant(chunks, seed=cfg.seed)
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=args.lr)
    dp_rank = ps.get_data_parallel_rank()

    def stage_iterator(chunk: torch.nn.Module, data_step: int) -> Iterator[dict[str, np.ndarray]] | None:
        module = chunk.module if hasattr(chunk, "module") else chunk
        keys = stage_batch_keys(pre_process=module.pre_process, post_process=module.post_process)
        batches = rank_microbatches(dp_rank=dp_rank, emulate_dp=args.emulate_dp, num_microbatches=args.num_microbatches,
                                    step=data_step, seq_length=cfg.seq_length, vocab_size=cfg.vocab_size)
        return iter([{k: b[k] for k in keys} for b in batches])

    results = []
    for step in range(args.steps):
        data_step = 0 if args.repeat else step
        out = train_step(chunks, optimizer, [stage_iterator(c, data_step) for c in chunks],
                         num_microbatches=args.num_microbatches, seq_length=cfg.seq_length)
        results.append(out)
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: loss {out['loss']:.4f} tokens {out['num_tokens']:.0f} "
                  f"grad_norm {out['grad_norm']:.4f}", flush=True)
    record = {
        "rank": torch.distributed.get_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": dp_rank,
        "dp_size": ps.get_data_parallel_world_size(),
        "shims": shims,
        "steps": results,
        "finite": all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in results),
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record))
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
