"""Teardown order for the whole suite: the pytest process starts and stops Ray a dozen times.

A thread still inside a Ray call when `ray.shutdown()` frees the core worker touches freed memory
later, in the next session or at interpreter exit (ray-project/ray#31145): a segfault after every
test passed. So each test must leave no thread of its own inside Ray once it shut Ray down (checked
below, named with its stack), and the session drops its last Ray references and stops Ray before the
interpreter tears C++ extensions down; and the process then exits with pytest's status without finalizing
the interpreter (`pytest_unconfigure`), where Ray's, gRPC's and torch's C++ teardown crashed.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback

import pytest

_JOIN_S = 60.0  # how long a test's leftover Ray thread may take to notice the shutdown


def _in_ray(frame) -> bool:
    """Inside Ray, or inside this package's code (which calls Ray next)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if "/site-packages/ray/" in name or "/megascale_data_ext/" in name:
            return True
        frame = frame.f_back
    return False


def _ray_threads(exclude: set[int]) -> list[threading.Thread]:
    frames = sys._current_frames()
    return [t for t in threading.enumerate()
            if t.ident not in exclude and t is not threading.current_thread() and _in_ray(frames.get(t.ident))]


_BASELINE: set[int] = set()


def pytest_sessionstart(session):
    _BASELINE.update(t.ident for t in threading.enumerate())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's teardown (its module's too, when it was the module's last): if Ray is down,
    no thread may still be inside a Ray call; fail the test that left one, with its stack."""
    yield
    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        return
    end = time.monotonic() + _JOIN_S
    left = _ray_threads(_BASELINE)
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = _ray_threads(_BASELINE)
    if left:
        frames = sys._current_frames()
        stacks = "\n".join(f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident])) for t in left
                           if t.ident in frames)
        pytest.fail(f"{len(left)} thread(s) still inside Ray after ray.shutdown(): {[t.name for t in left]}\n{stacks}")


_AUDIT = os.environ.get("MEGASCALE_TESTS_ENV_AUDIT")  # a file: every variable added while other threads ran
_CURRENT: list[str] = ["(collection)"]


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


if _AUDIT:
    _real_putenv = os.putenv

    def _audited_putenv(key, value):
        """Adding a variable reallocates C's ``environ``: a ``getenv`` on another thread then may read freed memory."""
        name = key.decode() if isinstance(key, bytes) else key
        threads = _native_threads()
        if name not in os.environ and threads > 1:
            stack = "".join(traceback.format_stack(limit=8)[:-1])
            with open(_AUDIT, "a") as f:
                f.write(f"=== {name} added in {_CURRENT[0]} with {threads} threads "
                        f"(python: {[t.name for t in threading.enumerate()]})\n{stack}\n")
        _real_putenv(key, value)

    os.putenv = _audited_putenv


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT[0] = item.nodeid
    yield


_EXIT: list[int] = []  # the session's exit status, for `pytest_unconfigure`


def pytest_sessionfinish(session, exitstatus):
    """Free the last Ray references while a core worker can still take them, then stop Ray, before
    the interpreter finalizes torch, pyarrow and Ray's C++ state in an order nobody chose."""
    _EXIT.append(int(exitstatus))
    if "tests.dist.launch" in sys.modules:  # the rank zygote it started (`pytest_unconfigure` skips atexit)
        sys.modules["tests.dist.launch"].ZygoteServer.stop()
    if "megascale_data_ext.runtime.ray_actor" in sys.modules:  # the ray.remote(cls) classes of the session
        sys.modules["megascale_data_ext.runtime.ray_actor"]._remote.cache_clear()
    gc.collect()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with the session's status once pytest has written everything, skipping interpreter
    finalization. Two clean-clone runs at 2026-11-26's commits passed every test and then died with
    SIGSEGV (rc 139) at exit with no Python stack (faulthandler printed nothing: the crash is in
    native teardown after Python's own, Ray's core worker and gRPC and torch's C++ state being
    destroyed in an order nothing controls). With Ray and torch.distributed already stopped above
    there is nothing left to finalize that a test depends on."""
    if _EXIT and os.environ.get("MEGASCALE_TESTS_NATIVE_EXIT") != "1":  # =1: see the crash (debugging)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT[0])
