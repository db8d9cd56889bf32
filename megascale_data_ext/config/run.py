"""The training run's ``model``, ``train`` and ``parallel`` nodes, checked like ``data``.

The example configs (``conf/train_gpt.yaml``, ``conf/train_vlm.yaml``) carry these nodes beside
``data``; they are plain YAML, so before this schema a typo such as ``+train.trian_iters=2`` was
accepted and ignored, and ``train.train_iters=0`` trained nothing and exited 0.
:func:`load_run_config` walks each node present against its dataclass with the same walk as
``data`` (:func:`~megascale_data_ext.config.coerce.build`: unknown keys with did-you-mean, wrong
types, values outside a field's choices), then checks values, and raises one ``ConfigError``
listing every problem by config path. No torch import: it runs in the pre-launch check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from megascale_data_ext.config.coerce import Rules, build, to_plain
from megascale_data_ext.config.problems import Problems

AttentionBackend = Literal["auto", "te", "flex", "dense"]
"""``model.attention``: TE's THD attention, this project's per-document attention, a dense mask, or auto."""
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
LrDecayStyle = Literal["constant", "linear", "cosine"]
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)


@dataclass(slots=True, kw_only=True)
class ModelConfig:
    """``model``: the GPT backbone's shape (``num_layers``, ``hidden_size``, ``num_attention_heads``
    are required) and attention backend (`trainer.attention.resolve_attention`)."""

    attention: str = "auto"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None


@dataclass(slots=True, kw_only=True)
class ParallelConfig:
    """``parallel``: Megatron's layout; ``virtual_pipeline_model_parallel_size`` is model chunks
    per pipeline rank (None: no interleaving). The world size comes from the launcher."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None


@dataclass(slots=True, kw_only=True)
class TrainConfig:
    """``train``: steps, optimizer recipe (AdamW, warm-up then ``lr_decay_style`` to ``min_lr`` at
    ``lr_decay_iters``, default ``train_iters``), precision, checkpoints and step logs.

    ``train_iters`` and ``lr`` are required; ``save_interval`` > 0 needs ``save``. ``run_dir`` keeps
    the composed config and overrides (``.hydra/``) and holds relative ``save``/``log_dir``/
    ``tensorboard_dir``; ``tensorboard_dir`` and/or the W&B project ``wandb_project`` (run ``wandb_exp_name``, files in
``wandb_save_dir``) get rank 0's scalars every ``log_interval`` steps. Every ``eval_interval``
    steps (0 = never) and after the last, ``eval_iters`` forward-only steps of ``data.validation``'s
    held-out sources are evaluated (Megatron's ``--eval-interval`` / ``--eval-iters``). With
    ``adopt_calibration_after`` = N > 0 the running Planner balances the steps it has not planned
    yet with rank 0's online fit of the step times once N steps are fitted (0 = never).
    """

    train_iters: int | None = None
    lr: float | None = None
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None
    min_lr: float = 0.0
    clip_grad: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    bf16: bool = False
    per_token_loss: bool = False
    seed: int = 1234
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    log_dir: str | None = None
    record_digests: bool = False
    run_dir: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    log_interval: int = 1
    eval_interval: int = 0
    eval_iters: int = 1
    adopt_calibration_after: int = 0


RUN_NODES: dict[str, type] = {"model": ModelConfig, "train": TrainConfig, "parallel": ParallelConfig}


@dataclass(slots=True, kw_only=True)
class RunConfig:
    """The validated run nodes; a node absent from the config is None (``parallel``: its defaults)."""

    model: ModelConfig | None
    train: TrainConfig | None
    parallel: ParallelConfig


def rules() -> Rules:
    return Rules(choices={(ModelConfig, "attention"): lambda: list(ATTENTION_BACKENDS),
                          (TrainConfig, "lr_decay_style"): lambda: list(LR_DECAY_STYLES)})


def _at_least(problems: Problems, path: str, value: Any, minimum: float, what: str) -> None:
    if value is not None and value < minimum:
        problems.add(path, f"must be >= {minimum:g} ({what}), got {value!r}")


def check_values(run: RunConfig, problems: Problems) -> None:
    """Required fields and ranges (the layout against the world size is `megatron.preflight`'s)."""
    par = run.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        _at_least(problems, f"parallel.{name}", getattr(par, name), 1, "ranks")
    vpp = par.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 2 or par.pipeline_model_parallel_size < 2):
        problems.add("parallel.virtual_pipeline_model_parallel_size",
                     f"{vpp} needs a value >= 2 and parallel.pipeline_model_parallel_size >= 2 (it is "
                     f"{par.pipeline_model_parallel_size}); set it to null otherwise")
    if run.model is not None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(run.model, name)
            if value is None:
                problems.add(f"model.{name}", "is required: an integer >= 1")
            _at_least(problems, f"model.{name}", value, 1, "size")
    t = run.train
    if t is None:
        return
    for name, what in (("train_iters", "an integer >= 1: steps to train"), ("lr", "a number > 0")):
        if getattr(t, name) is None:
            problems.add(f"train.{name}", f"is required: {what}")
    _at_least(problems, "train.train_iters", t.train_iters, 1, "steps to train")
    _at_least(problems, "train.log_interval", t.log_interval, 1, "steps between TensorBoard scalars")
    _at_least(problems, "train.eval_interval", t.eval_interval, 0, "steps between evaluations, 0 = never")
    _at_least(problems, "train.eval_iters", t.eval_iters, 1, "validation steps per evaluation")
    _at_least(problems, "train.adopt_calibration_after", t.adopt_calibration_after, 0,
              "fitted steps before the Planner balances with the fit, 0 = never")
    if t.lr is not None and t.lr <= 0:
        problems.add("train.lr", f"must be > 0, got {t.lr!r}")
    for name in ("lr_warmup_iters", "lr_decay_iters", "save_interval", "clip_grad", "weight_decay", "min_lr"):
        _at_least(problems, f"train.{name}", getattr(t, name), 0, "0 = off" if name != "min_lr" else "final lr")
    if t.lr is not None and t.min_lr > t.lr:
        problems.add("train.min_lr", f"must be <= train.lr ({t.lr!r}), got {t.min_lr!r}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, name) < 1:
            problems.add(f"train.{name}", f"must be in [0, 1), got {getattr(t, name)!r}")
    if t.save_interval > 0 and not t.save:
        problems.add("train.save_interval", f"{t.save_interval} needs a checkpoint directory: set train.save=DIR "
                                            "or train.save_interval=0")


def load_run_config(cfg: Any) -> RunConfig:
    """Validate the ``model``, ``train`` and ``parallel`` nodes of a composed config, all at once.

    Raises:
        ConfigError: listing every problem as ``path: message``, with did-you-mean for unknown keys.
    """
    problems = Problems()
    built: dict[str, Any] = {}
    for key, cls in RUN_NODES.items():
        node = cfg.get(key) if isinstance(cfg, Mapping) or hasattr(cfg, "get") else None
        built[key] = None if node is None else build(cls, to_plain(node, key, problems), key, problems, rules())
    run = RunConfig(model=built["model"], train=built["train"], parallel=built["parallel"] or ParallelConfig())
    check_values(run, problems)
    problems.raise_if_any("run config")
    return run
