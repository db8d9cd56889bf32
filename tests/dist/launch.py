"""Launch a script under torchrun with CPU/gloo-friendly settings (shared by multi-process tests).

Usage from a test::

    from tests.dist.launch import run_torchrun
    run_torchrun(Path(__file__).parents[1] / "dist" / "check_x.py", nproc=8, args=["--flag"])

A failing run raises ``TorchrunError`` whose message carries the command and the captured
stdout/stderr of every rank, so a pytest failure shows what each rank said.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LAZY_COMPILE = Path(__file__).resolve().with_name("lazy_compile.py")
TORCHRUN = Path(__file__).resolve().with_name("torchrun.py")  # torchrun's main, ending as the ranks do
ZYGOTE = Path(__file__).resolve().with_name("rank_zygote.py")


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


class ZygoteServer:
    """The session's `rank_zygote` server, started on first use (~3 s of imports, paid once) and
    stopped at interpreter exit. Its environment is `torchrun_env()`'s: what is read at import
    (``OMP_NUM_THREADS``, ``PYTHONWARNINGS``) is the same for every launch."""

    _proc: subprocess.Popen | None = None
    _path: str = ""

    @classmethod
    def address(cls) -> str:
        if cls._proc is not None and cls._proc.poll() is None:
            return cls._path
        cls._path = os.path.join(tempfile.mkdtemp(prefix="rank_zygote_"), "sock")
        cls._proc = subprocess.Popen([sys.executable, str(ZYGOTE), cls._path], cwd=REPO_ROOT, env=torchrun_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        said = []
        for line in cls._proc.stdout:  # "ready" once it imported everything (else its traceback, then EOF)
            if line.strip() == "ready":
                break
            said.append(line)
        else:
            raise RuntimeError(f"rank_zygote did not start (exit code {cls._proc.wait()}):\n{''.join(said)}")
        atexit.register(cls.stop)
        return cls._path

    @classmethod
    def stop(cls) -> None:
        if cls._proc is None or cls._proc.poll() is not None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(cls._path)
                sock.sendall(json.dumps({"stop": True}).encode() + b"\n")
            cls._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            cls._proc.kill()


def run_preloaded(argv: Sequence[str], nproc: int, env: Mapping[str, str] | None = None, timeout: float = 240.0,
                  ) -> subprocess.CompletedProcess[str]:
    """`argv` (``SCRIPT ARGS`` or ``-m MODULE ARGS``, as ``lazy_compile.py`` takes them) as `nproc`
    ranks forked by the session's `rank_zygote`, with torchrun's environment (`torchrun_env`);
    raises `TorchrunError` as `run_torchrun` does."""
    argv = [str(a) for a in argv]
    cmd = [str(ZYGOTE), f"--nproc_per_node={nproc}", *argv]
    return _run_forked(cmd, argv, nproc, torchrun_env(env), timeout)


def _run_forked(cmd: list[str], argv: list[str], nproc: int, env: dict[str, str], timeout: float,
                ) -> subprocess.CompletedProcess[str]:
    """Run `argv` (``lazy_compile.py``'s) as `nproc` ranks forked by the session's `rank_zygote`."""
    read_fd, write_fd = os.pipe()
    chunks: list[bytes] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(ZygoteServer.address())
        request = {"argv": argv, "env": env, "cwd": str(REPO_ROOT), "nproc": nproc}
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [write_fd])
        os.close(write_fd)
        reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_fd, 1 << 16), b"")),
                                  daemon=True)
        reader.start()
        sock.settimeout(timeout)
        replies, deadline = b"", time.monotonic() + timeout
        try:
            while not any(line.startswith(b"rc ") for line in replies.split(b"\n")[:-1]):  # whole lines only
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                more = sock.recv(1024)
                if not more:
                    break
                replies += more
        except TimeoutError:
            pass
    fields = dict(line.split(" ", 1) for line in replies.decode().splitlines() if " " in line)
    if "rc" not in fields:
        if "pid" in fields:
            _kill_group(int(fields["pid"]))
        reader.join(10)
        os.close(read_fd)
        out = b"".join(chunks).decode(errors="replace")
        raise TorchrunError(f"timed out after {timeout}s (or the job vanished): {' '.join(cmd)}", output=out,
                            returncode=None)
    reader.join(timeout)  # EOF once every rank closed its output
    os.close(read_fd)
    out = b"".join(chunks).decode(errors="replace")
    rc = int(fields["rc"])
    if rc != 0:
        raise TorchrunError(f"exit code {rc}: {' '.join(cmd)}", output=out, returncode=rc)
    return subprocess.CompletedProcess(cmd, rc, out, None)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_torchrun(
    script: Path,
    nproc: int,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 240.0,
    lazy_compile: bool = False,
    preloaded: bool = False,
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
        preloaded: Fork the ranks from the session's `rank_zygote` (torch, megatron-core and this
            package imported once; implies `lazy_compile`) instead of starting torchrun: for
            tests of what the ranks do, not of torchrun's own behaviour.

    Returns:
        The completed process (stdout and stderr merged into ``stdout``).

    Raises:
        TorchrunError: non-zero exit or timeout, with the captured output.
    """
    cmd = [
        sys.executable, str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}",
        *([str(LAZY_COMPILE)] if lazy_compile else []), str(script), *map(str, args),
    ]
    if preloaded:
        return run_preloaded([script, *args], nproc, env, timeout)
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
    env: Mapping[str, str] | None = None, lazy_compile: bool = False, preloaded: bool = False,
) -> tuple[str, dict[int, list[dict]]]:
    """Run ``examples/<script>`` under torchrun on the demo data; returns (output, {rank: step log})."""
    proc = run_torchrun(REPO_ROOT / "examples" / script, nproc,
                        [f"data.data_root={data_root}", f"train.log_dir={log_dir}", "train.record_digests=true",
                         *overrides], env=env, timeout=timeout, lazy_compile=lazy_compile, preloaded=preloaded)
    logs = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(log_dir).glob("rank*.json")}
    return proc.stdout, logs
