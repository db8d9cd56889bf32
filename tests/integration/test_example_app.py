"""The examples' Hydra-style command line (megascale_data_ext/trainer/app.py): --help, --cfg job,
a user's own --config-dir whose config uses the package's groups, trained for real under torchrun
on the user's own JSONL sources, and a bad config value reported in one line, not a traceback flood."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.trainer import app
from tests.dist import launch

pytestmark = pytest.mark.slow

REPO = launch.REPO_ROOT
GPT = REPO / "examples" / "pretrain_gpt.py"
VLM = REPO / "examples" / "pretrain_vlm.py"
SOURCES = {"web": 40, "code": 24}  # the user's JSONL files and their line counts
HELD_OUT = {"held": 16}  # and the held-out one (data.validation.sources)


def cli(script: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=launch.torchrun_env(),
                          capture_output=True, text=True, timeout=300)


def write_user_config(root: Path, **layout: int) -> Path:
    """A user's own directory: two JSONL sources and myconf/mytrain.yaml on the package's groups."""
    rng = np.random.default_rng(0)
    words = "the service packs documents of different lengths into balanced microbatches".split()
    (root / "mydata").mkdir(parents=True, exist_ok=True)
    for name, n in {**SOURCES, **HELD_OUT}.items():
        lines = [json.dumps({"text": f"{name} {i}: " + " ".join(rng.choice(words, rng.integers(3, 60)))})
                 for i in range(n)]
        (root / "mydata" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    conf = root / "myconf"
    conf.mkdir(exist_ok=True)
    par = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, **layout}
    (conf / "mytrain.yaml").write_text(f"""\
defaults:
  - data: megascale
  - strategy: llm_balance
  - ray: local
  - _self_
data:
  data_root: {root / 'mydata'}
  sources:
    - {{name: web, format: jsonl, paths: [web.jsonl], weight: 2.0, truncate: true}}
    - {{name: code, format: jsonl, paths: [code.jsonl], weight: 1.0, truncate: true}}
  validation:
    sources:
      - {{name: held, format: jsonl, paths: [held.jsonl], truncate: true}}
  samples_per_step: 8
  num_microbatches: 2
  seq_length: 512
  strategy:
    args:
      model: gpt-tiny
  ray:
    num_cpus: 2
model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
parallel:
  tensor_model_parallel_size: {par['tensor_model_parallel_size']}
  pipeline_model_parallel_size: {par['pipeline_model_parallel_size']}
  context_parallel_size: 1
  virtual_pipeline_model_parallel_size: null
train:
  train_iters: 2
  lr: 1.0e-3
  seed: 1234
  save: null
  save_interval: 0
  load: null
  log_dir: {root / 'logs'}
  record_digests: false
""")
    return conf


# -- fast: no torchrun ---------------------------------------------------------------------------

def test_help_lists_the_config_groups_and_exits_0():
    proc = cli(GPT, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--config-dir" in out and "--config-name" in out and "--cfg" in out
    strategy_line = next(line for line in out.splitlines() if line.strip().startswith("strategy:"))
    for option in sorted(p.stem for p in (REPO / "conf" / "strategy").glob("*.yaml")):
        assert option in strategy_line
    assert "train_gpt (default)" in out


def test_cfg_job_prints_the_composed_config_with_overrides_and_starts_nothing(tmp_path):
    proc = cli(GPT, "data.seq_length=2048", "--cfg", "job", "strategy=vanilla", "+train.note=from-the-cli",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.data.seq_length == 2048 and cfg.train.note == "from-the-cli"
    assert cfg.data.strategy._target_.endswith(".Vanilla") and "hydra" not in cfg
    assert not any(tmp_path.iterdir())  # nothing written, no Ray started
    vlm = cli(VLM, "--cfg", "job", "--package", "data.strategy")
    assert vlm.returncode == 0, vlm.stderr
    assert OmegaConf.create(vlm.stdout).name == "vlm_balance"  # the VLM example composes conf/train_vlm.yaml


def test_own_config_dir_uses_the_package_groups_and_its_own_files_win(tmp_path):
    conf = write_user_config(tmp_path)
    (conf / "ray").mkdir()
    (conf / "ray" / "local.yaml").write_text("# @package data.ray\naddress: null\nnamespace: mine\n")
    proc = cli(GPT, "--config-dir", str(conf), "--config-name", "mytrain", "--cfg", "job", "data.seq_length=256")
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert [s.name for s in cfg.data.sources] == ["web", "code"] and cfg.data.seq_length == 256
    assert cfg.data.strategy._target_.endswith(".LLMBalance")  # from the package's conf/strategy
    assert cfg.data.mixing.type == "constant"                    # from the package's conf/data/megascale.yaml
    assert cfg.data.ray.namespace == "mine"                      # the user's ray/local.yaml wins
    helped = cli(GPT, "--config-path", str(conf), "--help")
    assert helped.returncode == 0 and "mytrain" in helped.stdout and str(conf) in helped.stdout
    missing = cli(GPT, "--config-dir", str(tmp_path / "nope"), "--cfg", "job")
    assert missing.returncode == 1 and "error: ConfigError" in missing.stderr and "nope" in missing.stderr


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # capsys has no fileno
def test_megascale_errors_are_one_line_and_go_to_torchruns_error_file(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def train(cfg):
        raise ConfigError(f"`data.seq_length`: bad {cfg.data.seq_length}")

    one_rank = ["--config-dir", str(write_user_config(tmp_path, pipeline_model_parallel_size=1)),
                "--config-name", "mytrain"]  # passes the preflight checks on one process
    assert app.run(train, [*one_rank, "data.seq_length=64"], config_name="train_gpt") == 1
    err = capsys.readouterr().err  # one line, with where the whole chain was logged
    assert re.fullmatch(r"error: ConfigError: `data\.seq_length`: bad 64 \(full log: \S+error_rank0\.log\)", err.strip())
    assert "Traceback" not in err
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"].startswith("ConfigError: `data.seq_length`: bad 64 (full log: ")
    assert "py_callstack" not in recorded["extraInfo"]  # torchrun's summary then shows the message

    def crash(cfg):
        raise RuntimeError("not ours")

    with pytest.raises(RuntimeError):  # anything else keeps its traceback (and torchrun's error file)
        app.run(crash, one_rank, config_name="train_gpt")
    assert "py_callstack" in json.loads(error_file.read_text())["message"]["extraInfo"]


def test_a_bad_layout_is_reported_before_torch_or_megatron_is_imported(tmp_path):
    conf = write_user_config(tmp_path, tensor_model_parallel_size=2)  # tp2 x pp2 on 3 ranks
    env = {**launch.torchrun_env(), "WORLD_SIZE": "3", "RANK": "0", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "e.json")}
    proc = subprocess.run([sys.executable, "-X", "importtime", str(GPT), "--config-dir", str(conf),
                           "--config-name", "mytrain"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert "world size 3 is not divisible by tp*pp*cp = 2*2*1 = 4" in error
    assert "parallel.tensor_model_parallel_size" in error and "4 or 8" not in error  # 3 ranks: suggest 4
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "megatron.core" not in imported and "ray" not in imported
    assert "ParallelLayoutError" in json.loads((tmp_path / "e.json").read_text())["message"]["message"]


# -- torchrun ------------------------------------------------------------------------------------

def test_own_config_trains_under_torchrun_on_the_users_jsonl_sources(tmp_path):
    conf = write_user_config(tmp_path)  # TP1 x PP2 on 2 processes
    launch.run_torchrun(GPT, 2, ["--config-dir", str(conf), "--config-name", "mytrain"], timeout=540)
    logs = {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp_path / "logs").glob("rank*.json")}
    assert sorted(logs) == [0, 1]
    seen = set()
    for log in logs.values():
        assert [s["step"] for s in log] == [0, 1]
        assert all(np.isfinite(s["loss"]) for s in log)
        for step in log:
            for microbatch in step["samples"]:
                for source, _position, index in microbatch:
                    assert source in (0, 1) and 0 <= index < list(SOURCES.values())[source]
                    seen.add(source)
    assert seen == {0, 1}  # both of the user's sources were delivered
    assert logs[0][0]["samples"] == logs[1][0]["samples"]  # first and last stage saw the same samples


def test_bad_config_value_exits_nonzero_with_one_line_per_rank(tmp_path):
    conf = write_user_config(tmp_path)
    with pytest.raises(launch.TorchrunError) as err:
        launch.run_torchrun(GPT, 2, ["--config-dir", str(conf), "--config-name", "mytrain", "data.seq_length=-1"],
                            timeout=540)
    out = err.value.output
    assert err.value.returncode not in (0, None)
    assert "error: ConfigError" in out and "`data.seq_length`" in out
    assert 'megascale_data_ext/trainer/app.py", line' not in out  # no rank printed its traceback
    assert out.count("Traceback (most recent call last)") <= 1     # torchrun's own launcher traceback only
    assert not (tmp_path / "logs").exists()


# -- issue 20: a quiet healthy run with its run directory, one line per rank for a service error ---

RAY_ELINE = "has constructor arguments in the object store and max_restarts > 0"
"""Ray's core_worker E-line (ray-project/ray#53727) for restartable actors with an actor handle among
their constructor arguments; the constructors now get the Planner by namespace (`runtime.remote.PlannerIn`)."""


def warning_lines(output: str) -> list[str]:
    """Lines a user would read as a warning or an error, whatever printed them."""
    marks = ("Warning:", "warnings.warn", "WARNING", "Token authentication", "] W ", " E ", "Unhandled error",
             "prefetch up to step")
    return [line for line in output.splitlines() if any(m in line for m in marks)]


def test_healthy_run_prints_no_warning_and_keeps_its_config_and_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the `tensorboard` extra (installed by the test extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # TP2 on 2 processes (every TP layer of megatron-core could warn), evaluating the held-out source
    conf = write_user_config(tmp_path, tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    run = tmp_path / "run"
    proc = launch.run_torchrun(GPT, 2, ["--config-dir", str(conf), "--config-name", "mytrain", f"+train.run_dir={run}",
                                        "+train.tensorboard_dir=tb", "+train.log_interval=1", "train.train_iters=3",
                                        "+train.eval_interval=2", "+train.eval_iters=2"],
                               env={"PYTHONWARNINGS": ""}, timeout=400)  # Python's own defaults, as a user runs it
    warned = warning_lines(proc.stdout)
    assert warned == [], "\n".join(warned)
    assert RAY_ELINE not in proc.stdout
    # rank 0 asked for both services before importing torch (trainer.early_start), and the loop took them
    assert "of the trainer's own start-up (imports, model construction)" in proc.stdout
    assert "[megascale-data] validation service: constructors up" in proc.stdout
    evaluations = [line for line in proc.stdout.splitlines() if line.startswith("validation after")]
    assert [line.split(" | ")[0] for line in evaluations] == ["validation after 2 steps", "validation after 3 steps"]
    assert "validation steps 0..1" in evaluations[0] and "validation steps 2..3" in evaluations[1]
    logs = json.loads((tmp_path / "logs" / "rank0.json").read_text())
    held = [s for e in logs if "valid" in e for mb in e["valid"]["samples"] for s in np.asarray(mb).reshape(-1, 3)]
    assert held and {int(s[0]) for s in held} == {0}  # source 0 of the validation service: "held"
    composed = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert composed.train.tensorboard_dir == "tb" and composed.data.seq_length == 512
    assert list(OmegaConf.load(run / ".hydra" / "overrides.yaml"))[-1] == "+train.eval_iters=2"
    acc = EventAccumulator(str(run / "tb"))  # relative tensorboard_dir: inside the run directory
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/loss_tokens_per_s", "data/wait_ms",
            "balance/max_over_mean", "balance/vanilla_max_over_mean", "balance/measured_max_over_mean", "samples/web",
            "samples/code"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2]
    assert all(np.isfinite(e.value) for e in acc.Scalars("train/loss"))
    assert [e.step for e in acc.Scalars("valid/loss")] == [2, 3]
    assert all(np.isfinite(e.value) for e in acc.Scalars("valid/loss"))


def test_a_source_failing_mid_run_is_one_error_line_per_rank_with_its_log(tmp_path):
    conf = write_user_config(tmp_path, pipeline_model_parallel_size=1)  # DP2: both ranks fetch
    rng = np.random.default_rng(1)
    words = "the service packs documents of different lengths".split()
    lines = [json.dumps({"text": " ".join(rng.choice(words, 700 if i % 2 else 20))}) for i in range(SOURCES["web"])]
    (tmp_path / "mydata" / "web.jsonl").write_text("\n".join(lines) + "\n")  # every other row over 512 tokens
    run = tmp_path / "run"
    with pytest.raises(launch.TorchrunError) as err:  # 50% over-long passes the start-up check, trips mid-run
        launch.run_torchrun(GPT, 2, ["--config-dir", str(conf), "--config-name", "mytrain", f"+train.run_dir={run}",
                                     "data.sources.web.truncate=false", "data.sources.web.max_bad_fraction=0.5",
                                     "train.train_iters=6"], env={"PYTHONWARNINGS": ""}, timeout=400)
    out = err.value.output
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors, out
    logs = [line.rsplit("(full log: ", 1)[1].rstrip(")") for line in errors]
    assert len(set(logs)) == len(logs)  # one line per rank: each names its own rank's log
    causes = [(line, log) for line, log in zip(errors, logs, strict=True) if line.startswith("error: SourceError")]
    assert causes, errors
    for line, log in causes:
        assert line.startswith("error: SourceError: source 'web'") and "data.sources.web.truncate=true" in line
        assert "data.sources.web.max_bad_fraction=" in line
        assert "ray::" in Path(log).read_text()  # the whole chain, remote tracebacks included, is in the log
    # a rank that asks for a step after the failing rank stopped the service (before the launcher ends it)
    # says that in one line too, never a traceback (clean-clone run 38)
    assert all(line.startswith("error: SourceError") or ("ServiceUnavailableError" in line and "is gone" in line)
               for line in errors), errors
    assert "ray::" not in out.replace(RAY_ELINE, "")  # no Ray traceback on the terminal
    assert out.count("Traceback (most recent call last)") <= 1  # torchrun's own launcher traceback only
