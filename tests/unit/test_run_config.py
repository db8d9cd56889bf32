"""The `model`, `train` and `parallel` nodes: the same schema walk as `data` (typos, types, ranges)."""

from __future__ import annotations

import pytest

from megascale_data_ext.config import compose_config
from megascale_data_ext.config.run import ATTENTION_BACKENDS, LR_DECAY_STYLES, load_run_config
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.trainer import app
from megascale_data_ext.megatron.preflight import preflight


def problems_of(*overrides: str, config: str = "train_gpt") -> str:
    with pytest.raises(ConfigError) as err:
        load_run_config(compose_config(list(overrides), config))
    return str(err.value)


@pytest.mark.parametrize("config", ["train_gpt", "train_vlm"])
def test_shipped_configs_pass(config: str) -> None:
    run = load_run_config(compose_config([], config))
    assert run.train is not None and run.train.train_iters >= 1 and run.model is not None
    assert run.model.attention in ATTENTION_BACKENDS and run.train.lr_decay_style in LR_DECAY_STYLES


def test_typo_is_rejected_with_did_you_mean() -> None:
    msg = problems_of("+train.trian_iters=2")
    assert "`train.trian_iters`: unknown key; did you mean 'train_iters'?" in msg


def test_zero_train_iters_is_refused_naming_the_key() -> None:
    msg = problems_of("train.train_iters=0")
    assert "`train.train_iters`: must be >= 1" in msg and "got 0" in msg


def test_every_problem_at_once_with_paths_and_allowed_values() -> None:
    msg = problems_of("+train.trian_iters=2", "train.train_iters=0", "model.attention=flexx",
                      "parallel.tensor_model_parallel_size=two", "+model.hiden_size=8", "train.lr_decay_style=cos",
                      "train.save_interval=5")
    assert msg.startswith("invalid run config (7 problems)")
    assert "`model.attention`: got 'flexx'; did you mean 'flex'?" in msg
    assert "`parallel.tensor_model_parallel_size`: must be an integer, got 'two'" in msg
    assert "`model.hiden_size`: unknown key; did you mean 'hidden_size'?" in msg
    assert "`train.lr_decay_style`: got 'cos'" in msg and str(list(LR_DECAY_STYLES)) in msg
    assert "`train.save_interval`: 5 needs a checkpoint directory: set train.save=DIR" in msg


def test_required_fields_and_ranges() -> None:
    msg = problems_of("~model.num_layers", "train.lr=0", "train.min_lr=-1", "+train.adam_beta2=1.0",
                      "parallel.virtual_pipeline_model_parallel_size=1")
    assert "`model.num_layers`: is required" in msg and "`train.lr`: must be > 0" in msg
    assert "`train.min_lr`: must be >= 0" in msg and "`train.adam_beta2`: must be in [0, 1)" in msg
    assert "`parallel.virtual_pipeline_model_parallel_size`: 1 needs a value >= 2" in msg


def test_absent_nodes_are_not_required() -> None:
    run = load_run_config({"data": {}})
    assert run.model is None and run.train is None and run.parallel.tensor_model_parallel_size == 1


def test_preflight_and_the_example_app_refuse_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="train.trian_iters"):
        preflight(compose_config(["+train.trian_iters=2"], "train_gpt"), world_size=4, check_ray=False)
    trained = []
    assert app.run(trained.append, ["+train.trian_iters=2", "train.train_iters=0"], config_name="train_gpt") == 1
    err = capsys.readouterr().err
    assert not trained and err.startswith("error: ConfigError: invalid run config (2 problems)")
