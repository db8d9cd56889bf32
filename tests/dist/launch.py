"""Launch a script under torchrun with CPU/gloo-friendly settings (shared by multi-process tests).

Usage from a test::

    from tests.dist.launch import run_torchrun
    run_torchrun(Path(__file__).parents[1] / "dist" / "check_x.py", nproc=8, args=["--flag"])

A failing run raises ``TorchrunError`` whose message carries the command and the captured
stdout/stderr of every rank, so a pytest failure shows what each rank said.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LAZY_COMPILE = Path(__file__).resolve().with_name("lazy_compile.py")
TORCHRUN = Path(__file__).resolve().with_name("torchrun.py")  # torchrun's main, ending as the ranks do


class TorchrunError(RuntimeError):
    """A torchrun job exited non-zero or timed out; ``output`` holds what it printed."""

    def __init__(self, message: str, *, output: str, returncode: int | None):
        super().__init__(f"{message}\n---- captured output ----\n{output}")
        self.output, self.returncode = output, returncode


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for CPU gloo ranks: one thread each (the test machine has few cores),
    loopback networking, no GPUs, and the repository importable."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        }
    )
    env.update(extra or {})
    return env


def run_torchrun(
    script: Path,
    nproc: int,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 240.0,
    lazy_compile: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc_per_node N script args`` (through `TORCHRUN`).

    Args:
        script: The per-rank Python script.
        nproc: Number of ranks on this machine.
        args: Arguments passed to every rank.
        env: Extra environment variables (override the defaults).
        timeout: Seconds before the whole job is killed.
        lazy_compile: Start each rank through ``lazy_compile.py`` (megatron's ``torch.compile``
            decorations stop importing Dynamo/Inductor at import time: ~3 s of CPU per rank);
            the script itself runs unchanged.

    Returns:
        The completed process (stdout and stderr merged into ``stdout``).

    Raises:
        TorchrunError: non-zero exit or timeout, with the captured output.
    """
    cmd = [
        sys.executable, str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}",
        *([str(LAZY_COMPILE)] if lazy_compile else []), str(script), *map(str, args),
    ]
    # A new session lets a timeout kill torchrun *and* its worker ranks (our own process group).
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=torchrun_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TorchrunError(f"timed out after {timeout}s: {' '.join(cmd)}", output=out or "", returncode=None) from None
    if proc.returncode != 0:
        raise TorchrunError(f"exit code {proc.returncode}: {' '.join(cmd)}", output=out, returncode=proc.returncode)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def run_example(
    script: str, data_root: Path, log_dir: Path, *overrides: str, nproc: int = 4, timeout: float = 540.0,
    env: Mapping[str, str] | None = None, lazy_compile: bool = False,
) -> tuple[str, dict[int, list[dict]]]:
    """Run ``examples/<script>`` under torchrun on the demo data; returns (output, {rank: step log})."""
    proc = run_torchrun(REPO_ROOT / "examples" / script, nproc,
                        [f"data.data_root={data_root}", f"train.log_dir={log_dir}", "train.record_digests=true",
                         *overrides], env=env, timeout=timeout, lazy_compile=lazy_compile)
    logs = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(log_dir).glob("rank*.json")}
    return proc.stdout, logs
