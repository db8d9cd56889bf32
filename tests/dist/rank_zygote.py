"""Ranks forked from one process that imported torch and megatron-core once per test session.

Each torchrun rank of a test pays ~3 s of CPU importing torch, megatron-core and this package
(with `lazy_compile`), and torchrun itself ~1.4 s: a 4-rank launch spends ~13 s of CPU before
its first line of training, ~35 launches a suite on 2 cores. This server imports them once;
a launch (`launch.run_torchrun(..., preloaded=True)`) sends it the command, the environment and
the write end of its output pipe, and the server forks a job that forks the ranks, each with
the environment torchrun would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``,
one ``TORCHELASTIC_RUN_ID``), running the target through `lazy_compile.main` as a fresh process
would. What differs from torchrun: no elastic agent (rank 0 hosts the rendezvous store, as with
plain ``env://``), no per-rank error files, and the job stops the other ranks when one fails.
Tests of torchrun's own behaviour (error summaries, error files, ``serve``) keep real torchrun.

Protocol (one Unix-socket connection per job): the client sends one JSON line
``{"argv", "env", "cwd", "nproc"}`` with its pipe's write end (SCM_RIGHTS); the server answers
``pid <job pid>`` (the job leads its own process group: a timeout kills it whole) and the job
later ``rc <exit code>``.

    python tests/dist/rank_zygote.py SOCKET_PATH      # imports, then serves until told to stop or orphaned
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
import traceback
import uuid

PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel", "megascale_data_ext.trainer.pretrain")
STOP_GRACE_S = 10.0  # a failed rank's peers get this long after SIGTERM before SIGKILL


def _run_rank(argv: list[str], env: dict[str, str], cwd: str) -> None:
    """In a forked rank: become the fresh process torchrun would have started, run, never return."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        import numpy as np

        np.random.seed()  # a fresh process seeds numpy's global generator from the OS, not from its parent
        from tests.dist import lazy_compile

        try:
            lazy_compile.main(argv)  # ends in SystemExit (trainer.app.exit_process)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a rank's traceback, as its interpreter would print it
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _run_job(conn: socket.socket, request: dict, out_fd: int) -> None:
    """In a forked job: fork the ranks, wait, stop the rest when one fails, report the exit code."""
    rc = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        nproc = int(request["nproc"])
        base = dict(request["env"])
        base.update({"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                     "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
                     "TORCHELASTIC_RUN_ID": base.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex,
                     "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})
        ranks = {}
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run_rank(list(request["argv"]), env, request["cwd"])
            ranks[pid] = rank
        rc, failed_at = 0, None
        while ranks:
            if failed_at is not None and time.monotonic() - failed_at > STOP_GRACE_S:
                for pid in ranks:
                    _signal(pid, signal.SIGKILL)
            pid, status = os.waitpid(-1, os.WNOHANG if failed_at is not None else 0)
            if pid == 0:
                time.sleep(0.1)
                continue
            if pid not in ranks:
                continue
            rank = ranks.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and failed_at is None:
                rc, failed_at = (code if code > 0 else 128 - code), time.monotonic()
                print(f"[rank_zygote] rank {rank} (pid {pid}) exited with {code}: stopping the others",
                      file=sys.stderr, flush=True)
                for other in ranks:
                    _signal(other, signal.SIGTERM)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        rc = 1
    finally:
        try:
            conn.sendall(f"rc {rc}\n".encode())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(path: str) -> None:
    from tests.dist import lazy_compile

    lazy_compile.install()  # before megatron is imported: its torch.compile decorations stay lazy
    for module in PRELOAD:
        __import__(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs are reaped by the kernel; they report over their socket
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.settimeout(2.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test session ended without stopping it (killed): go too
                return
            continue
        conn.settimeout(None)
        with conn:
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
                while not msg.endswith(b"\n"):  # one JSON line; the fd came with its first bytes
                    more = conn.recv(1 << 16)
                    if not more:
                        break
                    msg += more
                request = json.loads(msg.decode())
            except (OSError, ValueError):
                continue
            if request.get("stop"):
                return
            if not fds:
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                _run_job(conn, request, fds[0])
            os.close(fds[0])
            conn.sendall(f"pid {pid}\n".encode())


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # the repository root (the client starts it there): `tests.dist` importable
    serve(sys.argv[1])
