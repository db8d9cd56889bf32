"""scripts/gpu_check.py's summary of a training run (the GPU check itself needs CUDA; CI has none)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_rows_summarise_a_run_from_its_step_log(tmp_path) -> None:
    (tmp_path / "gpt_flex.meta.json").write_text(json.dumps({"example": "pretrain_gpt.py", "attention": "flex",
                                                             "dtype": "bf16", "hidden": 2048, "seq_length": 4096,
                                                             "exit_code": 0, "command": "torchrun ..."}))
    log = [{"step": i, "loss": 6.0 - 0.1 * i, "num_tokens": 1000.0, "seconds": 2.0 if i < 2 else 0.5} for i in range(6)]
    (tmp_path / "gpt_flex_log").mkdir()
    (tmp_path / "gpt_flex_log" / "rank0.json").write_text(json.dumps(log))
    (tmp_path / "gpt_flex.mem.0").write_text(json.dumps({"rank": 0, "max_allocated_gib": 2.0, "max_reserved_gib": 3.0}))
    out = tmp_path / "gpu_train.json"
    assert _gpu_check().train_rows(str(out), str(tmp_path), "gpt_flex", "never_ran") == 0
    data = json.loads(out.read_text())
    assert data["torch"] and data["device"] and data["command"]
    (row,) = data["rows"]  # a run without its meta file is not invented
    assert row["steps"] == 6 and row["first_loss"] == 6.0 and row["last_loss"] == 5.5
    assert row["tokens_per_s"] == 2000.0 and row["step_s_median"] == 0.5  # warm steps only (first two compile)
    assert row["peak_mem_gb"] == round(2 * 2**30 / 1e9, 3) and row["finite_and_falling"] is True
    assert row["device"] == data["device"]


def test_gpu_check_scripts_parse() -> None:
    for script in ("gpu_check.sh", "megatron_lm_check.sh", "prepare_megatron_lm.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
