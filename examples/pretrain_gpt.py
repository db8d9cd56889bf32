r"""GPT pretraining with megatron-core, fed by the MegaScale-Data service.

    torchrun --nproc_per_node 4 examples/pretrain_gpt.py data.data_root=demo_data \
        parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=2 train.train_iters=5
    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --config-dir ./myconf --config-name mytrain
    python examples/pretrain_gpt.py --help | --cfg job [overrides]

Arguments are Hydra overrides of conf/train_gpt.yaml (composed with `defaults: [data: megascale, ...]`),
e.g. `strategy=vanilla`, `data.seq_length=2048`, `data.ray.address=auto`, `train.save=ckpt
train.save_interval=2`, `train.load=ckpt`; `--config-dir DIR --config-name NAME` composes your own
config, which can use the package's groups (megascale_data_ext/trainer/app.py has the flags).
Runs on CPU (gloo + the shims in megascale_data_ext/patches/cpu.py) or, where CUDA is present, on
the rank's GPU (cpu:gloo,cuda:nccl; `train.bf16=true` for bf16; run on an H100: docs/benchmarks.md).
"""

from __future__ import annotations

from megascale_data_ext.trainer.app import exit_process, run


def train(cfg):
    from megascale_data_ext.trainer.pretrain import pretrain_gpt

    return pretrain_gpt(cfg)


def main(argv: list[str] | None = None) -> int:
    return run(train, argv, config_name="train_gpt", doc=__doc__, start_service_first=True)


if __name__ == "__main__":
    exit_process(main())
