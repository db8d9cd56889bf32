"""The reference trainer's optimizer recipe: AdamW, linear warm-up then decay, bf16 master weights.

`build_optimizer` reads the run's ``train`` node (``lr``, ``lr_warmup_iters``, ``lr_decay_style``,
``lr_decay_iters``, ``min_lr``, ``weight_decay``, Adam betas); with bf16 parameters the optimizer
steps fp32 master copies (`Fp32MasterOptimizer`), as Megatron's mixed-precision optimizer does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megascale_data_ext.config.run import LR_DECAY_STYLES
from megascale_data_ext.errors import ConfigError


class Fp32MasterOptimizer:
    """Megatron's mixed-precision optimizer shape for bf16 params: fp32 master copies stepped by
    a torch optimizer from DDP's fp32 ``main_grad``, then copied back into the bf16 params.

    ``param_groups`` are the inner optimizer's (the LR scheduler drives them). Checkpoint schema:
    ``{"inner": inner.state_dict(), "masters": [fp32 tensors]}``. One per rank, single-threaded.
    """

    reads_main_grad = True  # train_step leaves param.grad alone

    def __init__(self, params: Iterable[torch.nn.Parameter], make: Callable[[list], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = make(self.masters)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            m.grad = None if grad is None else grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"], strict=True):
                m.copy_(saved)
                p.copy_(saved)


def lr_factor(step: int, *, warmup: int, decay: int, min_ratio: float, style: str) -> float:
    """Megatron-style LR multiplier: linear warm-up over `warmup` steps, then `style` decay
    ("cosine", "linear" or "constant") to `min_ratio` at step `decay`, flat after it."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if style == "constant" or decay <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (decay - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if style == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


def build_optimizer(chunks: list, train: Any, *, bf16: bool = False) -> tuple[Any, Any]:
    """AdamW + warm-up/decay schedule from the run's ``train`` node; returns (optimizer, scheduler).

    Keys (all optional but ``lr``): ``weight_decay`` (0), ``adam_beta1``/``adam_beta2`` (0.9/0.999),
    ``lr_warmup_iters`` (0), ``lr_decay_style`` (constant|linear|cosine; constant), ``lr_decay_iters``
    (``train_iters``), ``min_lr`` (0). Grad clipping is ``train.clip_grad``, applied by `train_step`.
    """
    lr, iters = float(train.lr), int(train.train_iters)
    warmup, style = int(train.get("lr_warmup_iters", 0) or 0), str(train.get("lr_decay_style", "constant"))
    decay, min_lr = int(train.get("lr_decay_iters") or iters), float(train.get("min_lr", 0.0) or 0.0)
    problems = []
    if style not in LR_DECAY_STYLES:
        problems.append(f"`train.lr_decay_style` must be one of {list(LR_DECAY_STYLES)}, got {style!r}")
    if warmup < 0 or decay < 0:
        problems.append(f"`train.lr_warmup_iters`={warmup} and `train.lr_decay_iters`={decay} must be >= 0")
    if not 0 <= min_lr <= lr:
        problems.append(f"`train.min_lr`={min_lr} must be in [0, train.lr={lr}]")
    if problems:
        raise ConfigError("optimizer recipe: " + "; ".join(problems))

    def make(params: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=float(train.get("weight_decay", 0.0) or 0.0),
                                 betas=(float(train.get("adam_beta1", 0.9)), float(train.get("adam_beta2", 0.999))))

    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = Fp32MasterOptimizer(params, make) if bf16 else make(params)
    inner = optimizer.inner if bf16 else optimizer
    ratio = min_lr / lr if lr > 0 else 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: lr_factor(s, warmup=warmup, decay=decay, min_ratio=ratio, style=style))
    return optimizer, scheduler
