"""Errors from inside the service come out as our own error (issue 20), the run directory's
files, the TensorBoard scalars and the client's copy-only-when-needed tensors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from omegaconf import OmegaConf

from megascale_data_ext.config.run import load_run_config
from megascale_data_ext.errors import ConfigError, PlanError, SourceError, root_cause
from megascale_data_ext.trainer import run_dir
from megascale_data_ext.runtime.client import raise_service_error, to_torch


def ray_wrapped(exc: BaseException, hops: int) -> BaseException:
    """`exc` as a trainer gets it after `hops` actor hops (Ray's dual RayTaskError instances)."""
    from ray.exceptions import RayTaskError

    for i in range(hops):
        exc = RayTaskError(f"Actor{i}.get_step", f"Traceback (most recent call last):\n  hop {i}\n{exc}",
                           exc).as_instanceof_cause()
    return exc


def test_root_cause_unwraps_every_ray_hop_and_leaves_other_errors_alone():
    cause = SourceError("source 'web': 6 bad samples; allow more with `data.sources.web.max_bad_fraction=0.67`")
    wrapped = ray_wrapped(cause, 2)
    assert "hop 0" in str(wrapped) and "hop 1" in str(wrapped)  # what a rank printed before: every hop
    assert root_cause(wrapped) is cause
    plain = RuntimeError("not from Ray")
    assert root_cause(plain) is plain


def test_raise_service_error_raises_ours_chained_and_keeps_foreign_errors(monkeypatch):
    import os

    import ray._private.worker as ray_worker

    printed: list = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", printed.append)  # Ray's: logs each one
    environ = dict(os.environ)
    cause = PlanError("step 3: item 2 has 900 tokens")
    with pytest.raises(PlanError) as info:
        raise_service_error(ray_wrapped(cause, 1))
    assert info.value is cause and str(info.value) == "step 3: item 2 has 900 tokens"
    assert "hop 0" in str(info.value.__cause__)  # the log still gets the remote traceback
    # the prefetched steps' copies of our error stay quiet when Ray drops them; any other error prints;
    # and nothing was added to the environment (Ray's threads may be reading it)
    ray_worker._unhandled_error_handler(ray_wrapped(cause, 2))
    other = ray_wrapped(KeyError("lost"), 1)
    ray_worker._unhandled_error_handler(other)
    assert printed == [other] and dict(os.environ) == environ
    foreign = ray_wrapped(KeyError("x"), 1)
    with pytest.raises(KeyError) as info:
        raise_service_error(foreign)
    assert info.value is foreign


def test_to_torch_copies_read_only_arrays_once_and_wraps_writable_ones():
    ro = np.arange(6, dtype=np.int64)
    ro.setflags(write=False)
    mask = np.ones(3, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's non-writable-array warning would raise here
        out = to_torch({"tokens": ro, "loss_mask": mask, "cu_seqlens": np.array([0, 3], dtype=np.int64)})
    assert out["tokens"].data_ptr() != ro.ctypes.data and out["tokens"].tolist() == list(range(6))
    assert out["loss_mask"].data_ptr() == mask.ctypes.data  # writable, right dtype: no copy
    assert str(out["cu_seqlens"].dtype) == "torch.int32"


def test_run_dir_writes_config_and_overrides_and_places_relative_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cfg = OmegaConf.create({"data": {"seq_length": 512}, "train": {
        "run_dir": str(tmp_path / "run"), "save": "ckpt", "log_dir": "logs", "tensorboard_dir": "/abs/tb", "load": "old"}})
    root = run_dir.write_run_config(cfg, ["data.seq_length=512", "+train.run_dir=run"])
    assert root == tmp_path / "run"
    assert OmegaConf.load(root / ".hydra" / "config.yaml").train.save == "ckpt"  # as composed
    assert list(OmegaConf.load(root / ".hydra" / "overrides.yaml")) == ["data.seq_length=512", "+train.run_dir=run"]
    run_dir.resolve_run_paths(cfg)
    assert cfg.train.save == str(root / "ckpt") and cfg.train.log_dir == str(root / "logs")
    assert cfg.train.tensorboard_dir == "/abs/tb" and cfg.train.load == "old"
    assert run_dir.error_log_path(cfg) == root / "error_rank0.log"
    monkeypatch.setenv("RANK", "3")
    assert run_dir.write_run_config(cfg, []) is None  # rank 0 alone writes
    assert run_dir.error_log_path(OmegaConf.create({"train": {"log_dir": str(tmp_path)}})) == tmp_path / "error_rank3.log"


def test_new_train_keys_are_validated():
    base = {"train_iters": 2, "lr": 1e-3}
    run = load_run_config({"train": {**base, "run_dir": "r", "tensorboard_dir": "tb", "log_interval": 5}})
    assert run.train.log_interval == 5 and run.train.tensorboard_dir == "tb"
    with pytest.raises(ConfigError) as err:
        load_run_config({"train": {**base, "log_interval": 0, "tensorboard_dri": "tb"}})
    assert "train.log_interval" in str(err.value) and "tensorboard_dir" in str(err.value)


def test_scalar_log_writes_every_interval_and_reads_back(tmp_path):
    pytest.importorskip("tensorboard", reason="the `tensorboard` extra (installed by the test extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megascale_data_ext.trainer.scalar_log import ScalarLog

    log = ScalarLog(tmp_path, interval=2, source_names=["web", "code"])
    for step in range(4):
        if log.due(step):
            log.write(step, {"loss": 5.0 - step, "lr": 1e-3, "grad_norm": 2.0, "num_tokens": 1000, "seconds": 0.5,
                             "data_wait_ms": 3.0},
                      {"max_over_mean": 1.01, "vanilla_max_over_mean": 1.3, "per_source": [5, 3]})
    log.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 2]
    assert acc.Scalars("train/loss_tokens_per_s")[0].value == pytest.approx(2000.0)
    assert acc.Scalars("samples/code")[0].value == 3 and acc.Scalars("balance/max_over_mean")[0].value == pytest.approx(1.01)


def test_scalar_log_to_wandb_offline_one_log_per_step(tmp_path, monkeypatch):
    """A real W&B run in offline mode (no network): each logged step is one `run.log` holding its
    scalars, the evaluation's loss at its own step, the composed config as the run's config."""
    wandb = pytest.importorskip("wandb", reason="the `wandb` extra (not in the test extra: it pulls many packages)")
    from megascale_data_ext.trainer.scalar_log import ScalarLog, WandbSettings

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[tuple[int, dict]] = []
    real_init = wandb.init

    def init(**kwargs):  # the real run, its `log` calls recorded on the way through
        run = real_init(**kwargs)
        real_log = run.log

        def log(data, step=None):
            logged.append((step, dict(data)))
            return real_log(data, step=step)

        run.log = log
        return run

    monkeypatch.setattr(wandb, "init", init)
    log = ScalarLog(None, interval=1, source_names=["web"], wandb=WandbSettings(
        project="megascale-test", name="r1", save_dir=str(tmp_path / "wandb"), config={"train": {"lr": 1e-3}}))
    for step in range(2):
        log.write(step, {"loss": 5.0 - step, "lr": 1e-3, "grad_norm": 2.0, "num_tokens": 1000, "seconds": 0.5,
                         "data_wait_ms": 3.0, "measured_max_over_mean": 1.1},
                  {"max_over_mean": 1.01, "vanilla_max_over_mean": 1.3, "per_source": [5]})
    log.write_valid(2, 4.0)
    run = log.sinks[0].run
    assert dict(run.config)["train"] == {"lr": 1e-3} and run.name == "r1"
    log.close()
    assert [s for s, _ in logged] == [0, 1, 2]
    assert logged[1][1]["train/loss"] == 4.0 and logged[1][1]["samples/web"] == 5.0
    assert logged[1][1]["balance/measured_max_over_mean"] == pytest.approx(1.1)
    assert logged[2][1] == {"valid/loss": 4.0, "valid/ppl": pytest.approx(np.exp(4.0))}
    assert list((tmp_path / "wandb").rglob("*.wandb"))  # the offline run's file, for `wandb sync`


def test_wandb_without_the_package_names_the_key(monkeypatch):
    import sys

    from megascale_data_ext.trainer.scalar_log import ScalarLog, WandbSettings

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match=r"`train.wandb_project`='p' needs the wandb package.*\[wandb\]"):
        ScalarLog(None, interval=1, source_names=[], wandb=WandbSettings(project="p"))
