"""One training step and one evaluation step through megatron-core's pipeline schedule.

`train_step` runs ``get_forward_backward_func`` over the step's microbatches, clips the global
grad norm, steps the optimizer (and its LR schedule) and returns the token-weighted loss every
rank agrees on; `eval_step` is the same schedule forward-only (Megatron's ``evaluate``). The
installed schedule hooks (`megatron.hooks`) feed both: the training stream and, for evaluations,
the validation service's. `ComputeClock` measures how long each rank computed in a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.trainer.model import device, forward_step


def _grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """Each param's gradient: DDP's ``main_grad`` (already all-reduced over DP), else ``grad``."""
    return [g if (g := getattr(p, "main_grad", None)) is not None else p.grad for p in params]


def _clip_grads(params: Sequence[torch.nn.Parameter], max_norm: float | None) -> float:
    """Global L2 grad norm (TP duplicates counted once, summed over the model-parallel group);
    grads are scaled down in place to ``max_norm`` when it is exceeded, as Megatron's ``--clip-grad``."""
    grads = _grads(params)
    sq = torch.zeros((), dtype=torch.float64, device=device())
    for param, grad in zip(params, grads, strict=True):
        if grad is not None and tensor_parallel.param_is_not_tensor_parallel_duplicate(param):
            sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm is not None and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            if grad is not None:
                grad.mul_(scale)
    return norm


def train_step(
    model_chunks: Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    data_iterators: Iterator[Mapping[str, Any]] | Sequence[Iterator[Mapping[str, Any]] | None] | None,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int = 1,
    clip_grad: float | None = None,
    scheduler: Any = None,
) -> dict[str, float]:
    """One optimizer step through megatron's forward-backward schedule.

    Args:
        model_chunks: From `build_model_chunks` (DDP-wrapped; plain chunks work when DP=1).
        optimizer: A torch optimizer over the chunks' parameters (or `pretrain.build_optimizer`'s).
        data_iterators: One iterator per chunk (a single iterator is used for one chunk).
        num_microbatches: Microbatches this step (each may have its own sequence length).
        seq_length: Nominal sequence length (megatron's shape hint; actual lengths vary).
        micro_batch_size: Samples per microbatch.
        clip_grad: Clip the global grad norm to this (None or 0: no clipping).
        scheduler: Stepped after the optimizer (e.g. `pretrain.build_optimizer`'s warm-up + cosine).

    Returns:
        ``loss`` (token-weighted mean over all microbatches and DP ranks), ``num_tokens``,
        ``grad_norm`` (before clipping) and ``lr``, identical on every rank (broadcast from the
        last PP stage).
    """
    if num_microbatches < 1:
        raise ConfigError(f"`num_microbatches` must be >= 1, got {num_microbatches}")
    if data_iterators is None:
        data_iterators = [None] * len(model_chunks)
    elif isinstance(data_iterators, Iterator):
        if len(model_chunks) != 1:
            raise ConfigError(f"got one data iterator for {len(model_chunks)} model chunks (VPP); "
                              "pass a list with one iterator per chunk")
        data_iterators = [data_iterators]
    if len(data_iterators) != len(model_chunks):
        raise ConfigError(f"got {len(data_iterators)} data iterators for {len(model_chunks)} model chunks; "
                          "pass one per chunk (None for chunks that read no data)")
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)

    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=list(data_iterators),
        model=list(model_chunks),
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    # DDP accumulates into param.main_grad (all-reduced over DP by finalize_model_grads); a plain torch
    # optimizer reads param.grad (an fp32-master one reads main_grad itself: `reads_main_grad`).
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
    grad_norm = _clip_grads(params, clip_grad)
    if not getattr(optimizer, "reads_main_grad", False):
        for param in params:
            if getattr(param, "main_grad", None) is not None:
                param.grad = param.main_grad
    optimizer.step()
    # Drop the aliases: a grad left pointing at main_grad would be accumulated twice next step.
    optimizer.zero_grad(set_to_none=True)
    lr = float(optimizer.param_groups[0]["lr"])
    if scheduler is not None:
        scheduler.step()

    return {**_global_loss(reports), "grad_norm": grad_norm, "lr": lr}


def _global_loss(reports: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``loss`` (token-weighted mean over the step's microbatches and DP×CP ranks) and
    ``num_tokens`` from the last stage's loss reports, the same on every rank."""
    totals = torch.zeros(2, dtype=torch.float64, device=device())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for report in reports:
            totals += report["lm loss"].double()
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    loss_sum, num_tokens = totals.tolist()
    return {"loss": loss_sum / max(num_tokens, 1.0), "num_tokens": float(num_tokens)}


@torch.no_grad()
def eval_step(model_chunks: Sequence[torch.nn.Module], *, num_microbatches: int, seq_length: int,
              micro_batch_size: int = 1) -> dict[str, float]:
    """One forward-only step (Megatron's ``evaluate``): the installed hooks feed it the validation
    service's next step. Returns ``loss`` and ``num_tokens`` as `train_step` does; no gradients."""
    for chunk in model_chunks:
        chunk.eval()
    try:
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[None] * len(model_chunks), model=list(model_chunks),
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    finally:
        for chunk in model_chunks:
            chunk.train()
    return _global_loss(reports)



class ComputeClock:
    """Each rank's seconds from the start of its step until its gradients are ready to reduce.

    megatron-core's schedules call ``config.finalize_model_grads_func`` (the DP gradient
    reduction) once a rank has run all its microbatches; the clock stamps that moment, so a
    rank's reading is the compute (and data wait) balancing spreads, without the wait for the
    slowest rank that the reduction adds. `gather` collects every rank's reading of the step
    (one all-gather); their max/mean is the step's measured imbalance.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        self._t0 = 0.0
        self.ready_s: float | None = None
        self._wrapped: list[tuple[Any, Any]] = []
        for chunk in model_chunks:
            config = get_attr_wrapped_model(chunk, "config")  # megatron-core's own unwrapping of DDP / Float16Module
            original = getattr(config, "finalize_model_grads_func", None)
            if original is None or any(config is c for c, _ in self._wrapped):
                continue
            self._wrapped.append((config, original))
            config.finalize_model_grads_func = self._stamp(original)

    def _stamp(self, original: Any) -> Any:
        def finalize(*args: Any, **kwargs: Any) -> Any:
            if self.ready_s is None:
                self.ready_s = time.perf_counter() - self._t0
            return original(*args, **kwargs)

        return finalize

    def start(self) -> None:
        self._t0, self.ready_s = time.perf_counter(), None

    def gather(self) -> list[float]:
        """Every rank's seconds to its gradient reduction this step (all ranks call it)."""
        mine = torch.tensor([self.ready_s if self.ready_s is not None else 0.0], dtype=torch.float64, device=device())
        out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
        return [float(t.item()) for t in out]

    def close(self) -> None:
        for config, original in self._wrapped:
            config.finalize_model_grads_func = original
        self._wrapped.clear()
