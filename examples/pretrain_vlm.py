r"""VLM (LLaVA stage-1 style) pretraining with megatron-core, fed by the hybrid (Alg. 2) strategy.

    torchrun --nproc_per_node 4 examples/pretrain_vlm.py data.data_root=demo_data \
        parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=2 train.train_iters=3
    python examples/pretrain_vlm.py --help | --cfg job [overrides]

Images are balanced over WORLD and encoded by a frozen megatron ViT on every rank; sequences
are balanced over DP for the GPT backbone, whose first stage embeds the projected image
features. Arguments are Hydra overrides of conf/train_vlm.yaml; `--config-dir DIR --config-name
NAME` composes your own config (megascale_data_ext/trainer/app.py has the flags). Runs on CPU
(gloo + shims) or on the rank's GPU where CUDA is present (run on an H100 in bf16: docs/benchmarks.md).
"""

from __future__ import annotations

from megascale_data_ext.trainer.app import exit_process, run


def train(cfg):
    from megascale_data_ext.trainer.pretrain_vlm import pretrain_vlm

    return pretrain_vlm(cfg)


def main(argv: list[str] | None = None) -> int:
    return run(train, argv, config_name="train_vlm", doc=__doc__, start_service_first=True)


if __name__ == "__main__":
    exit_process(main())
