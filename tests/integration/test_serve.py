"""`megascale-data serve` as a Megatron-LM user runs it: a subprocess the ranks join by its printed environment.

One service (embedded Ray, TP1·DP2) serves, with a validation service for the held-out source:
a second one in its namespace is refused with one line; two torchrun gloo ranks run Megatron's
data path (`tests/dist/megatron_provider_rank.py`: the provider called as ``megatron.training``
calls it) for one step and one evaluation; SIGTERM stops it with exit
code 0, no actor left and its Ray gone.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.launch import REPO_ROOT, run_torchrun, torchrun_env

RANK_SCRIPT = REPO_ROOT / "tests" / "dist" / "megatron_provider_rank.py"
SEQ, MICROBATCHES = 512, 2


def serve_cmd(data_root: Path, namespace: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megascale_data_ext", "serve", f"data.data_root={data_root}",
            f"data.ray.namespace={namespace}", "data.ray.num_cpus=2", "data.samples_per_step=6",
            f"data.seq_length={SEQ}", f"data.num_microbatches={MICROBATCHES}", "--world-size", "2", "--tp", "1",
            "--pp", "1", *extra]


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0]
    return env


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode} before it was up:\n{proc.communicate()[0]}")
        if time.monotonic() > deadline:
            pytest.fail(f"serve was not up after {timeout} s")
        time.sleep(0.5)


def answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_serve_megatron_ranks_refusal_and_sigterm(tmp_path: Path, data_root: Path) -> None:
    namespace, env_file = f"serve-test-{os.getpid()}", tmp_path / "serve.env"
    env = torchrun_env({"PYTHONWARNINGS": "ignore"})
    proc = subprocess.Popen(serve_cmd(data_root, namespace, "train.eval_interval=1", "train.eval_iters=1",
                                      "--status-every", "3", "--env-file", str(env_file)),
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(env_file, proc, timeout=240)
        ranks_env = read_env_file(env_file)
        address = ranks_env["MEGASCALE_RAY_ADDRESS"]
        assert ranks_env["MEGASCALE_NAMESPACE"] == namespace and ranks_env["MEGASCALE_DATA"] == "1"
        assert ranks_env["MEGASCALE_NUM_MICROBATCHES"] == str(MICROBATCHES)
        assert ranks_env["MEGASCALE_VALID_NAMESPACE"] == f"{namespace}-valid"  # the held-out valid-text

        dup = subprocess.run(serve_cmd(data_root, namespace, f"data.ray.address={address}"), cwd=REPO_ROOT,
                             env={**env, **ranks_env}, capture_output=True, text=True, timeout=180)
        errors = [line for line in dup.stderr.splitlines() if line.startswith("error:")]
        assert dup.returncode == 2, dup.stdout + dup.stderr
        assert len(errors) == 1 and f"already runs in Ray namespace {namespace!r}" in errors[0], dup.stderr
        assert "Traceback" not in dup.stderr

        out = tmp_path / "ranks"
        run_torchrun(RANK_SCRIPT, 2, ["--global-batch-size", 2 * MICROBATCHES, "--seq-length", SEQ, "--out", out,
                                      "--eval-interval", 1, "--eval-iters", 1],
                     env={k: v for k, v in ranks_env.items() if k != "MEGASCALE_NUM_MICROBATCHES"}, timeout=300,
                     preloaded=True)
        logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        for log in logs:  # Megatron's calculator agrees with the service: GBS 4 / (MBS 1 * DP 2) = 2
            assert log["num_microbatches"] == MICROBATCHES and len(log["batches"]) == MICROBATCHES
            for shapes, real in zip(log["batches"], log["real_tokens"], strict=True):
                assert shapes["tokens"] == shapes["labels"] == shapes["position_ids"] == shapes["loss_mask"]
                assert shapes["tokens"][0] == 1 and shapes["tokens"][1] <= SEQ  # one packed sequence (MBS 1)
                assert shapes["cu_seqlens"][0] == 1 and 0 < real <= SEQ  # Megatron's collated cu_seqlens
        assert logs[0]["first_tokens"] != logs[1]["first_tokens"]  # DP ranks get their own data
        for log in logs:  # Megatron's evaluate() pulls one step of held-out microbatches, shaped alike
            assert log["has_valid"] and len(log["valid_batches"]) == MICROBATCHES
            assert all(b["tokens"][0] == 1 and b["tokens"][1] <= SEQ for b in log["valid_batches"])
            assert log["valid_first_tokens"] != log["first_tokens"]
        assert logs[0]["valid_first_tokens"] != logs[1]["valid_first_tokens"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            output = proc.communicate(timeout=90)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, output
    assert "[serve] up " in output  # the periodic status line
    assert f"validation:  1 held-out sources (valid-text) in namespace '{namespace}-valid'" in output, output
    assert "--eval-interval 1 --eval-iters 1" in output
    assert f"[serve] stopped; no actors left in namespace {namespace!r} or '{namespace}-valid'" in output, output
    assert "SIGTERM received" not in output  # no C++ stack dump from Ray's signal handler
    assert not answers(address)  # the embedded Ray went with it
