"""One torchrun rank of Megatron-LM's ``pretrain_gpt.py`` up to its first step's data, on CPU/gloo.

Runs what ``megatron.training`` (core_v0.16.1) does with ``--dataloader-type external`` and
``MEGASCALE_DATA=1`` (``patches/pretrain_gpt.patch``) as far as it goes without a GPU, against a
service started by ``megascale-data serve`` (its environment in ``MEGASCALE_*``):
``initialize_model_parallel`` on gloo, the num-microbatches calculator from
``--global-batch-size``/``--micro-batch-size``, Megatron's argument namespace in
``megatron.training.global_vars`` (Megatron-LM itself is not installed here, so the namespace
carries the fields the provider reads), then ``build_train_valid_test_data_iterators``: the
provider called with ``vp_stage`` because it is ``is_distributed``, the returned iterator
wrapped in megatron-core's ``RerunDataIterator``, and one step of ``get_batch`` calls (TP rank 0
of the first and last stage calls ``next()``), then, with ``--eval-iters``, one evaluation of the
validation iterator the provider returned. Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist


def megatron_args(args: argparse.Namespace, dp: int) -> argparse.Namespace:
    """The fields of Megatron-LM's parsed arguments that the data path reads."""
    return argparse.Namespace(
        dataloader_type="external", iteration=0, consumed_train_samples=0, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, context_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        micro_batch_size=1, global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        data_parallel_size=dp, train_iters=1, eval_iters=args.eval_iters, eval_interval=args.eval_interval,
        rampup_batch_size=None,
    )


def install_global_args(namespace: argparse.Namespace) -> None:
    """``megatron.training.global_vars._GLOBAL_ARGS``, as ``megatron.training.initialize`` sets it."""
    training = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = namespace
    training.global_vars = global_vars
    sys.modules.setdefault("megatron.training", training)
    sys.modules.setdefault("megatron.training.global_vars", global_vars)


def build_data_iterators(provider, vp_stage: int | None):
    """``megatron.training.training.build_train_valid_test_data_iterators`` for the external type:
    (train, valid) iterators."""
    from megatron.core import parallel_state as mpu
    from megatron.core.rerun_state_machine import RerunDataIterator

    num_samples = [0, 0, 0]  # get_train_valid_test_num_samples(): the provider ignores them
    if getattr(provider, "is_distributed", False) or mpu.get_tensor_model_parallel_rank() == 0:
        if vp_stage is not None:
            train_ds, valid_ds, _ = provider(num_samples, vp_stage=vp_stage)
        else:
            train_ds, valid_ds, _ = provider(num_samples)
    else:
        train_ds = valid_ds = None
    # build_pretraining_data_loader: `external` returns the dataset itself
    return tuple(RerunDataIterator(ds) if ds is not None else None for ds in (train_ds, valid_ds))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--eval-interval", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator

    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    rank, dp = dist.get_rank(), mpu.get_data_parallel_world_size()
    init_num_microbatches_calculator(rank, None, args.global_batch_size, 1, dp)
    install_global_args(megatron_args(args, dp))

    from megascale_data_ext.megatron.provider import train_valid_test_datasets_provider

    iterator, valid = build_data_iterators(train_valid_test_datasets_provider, vp_stage=None)
    reads = mpu.get_tensor_model_parallel_rank() == 0 and (mpu.is_pipeline_first_stage() or
                                                           mpu.is_pipeline_last_stage())
    batches = [next(iterator) for _ in range(get_num_microbatches())] if reads else []
    # evaluate(): --eval-iters forward-only steps of the validation iterator, num_microbatches each
    held_out = [next(valid) for _ in range(args.eval_iters * get_num_microbatches())] if reads and valid else []
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({
        "num_microbatches": get_num_microbatches(),
        "batches": [{k: list(v.shape) for k, v in b.items()} for b in batches],
        "first_tokens": [b["tokens"][0, :8].tolist() for b in batches],
        "real_tokens": [int(b["loss_mask"].sum()) for b in batches],
        "has_valid": valid is not None,
        "valid_batches": [{k: list(v.shape) for k, v in b.items()} for b in held_out],
        "valid_first_tokens": [b["tokens"][0, :8].tolist() for b in held_out],
    }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
