"""Allocator settings for the service's processes, so their memory stays flat under load.

A Data Constructor actor runs over 200 threads (Ray's own, and one per concurrent client request:
`constructor_concurrency`), and a loader decodes row groups on a pool of threads. Allocators that
keep memory per thread then grow a process for minutes as more of its threads have served a
request, though the data it holds is bounded (`bench soak`: no allocation site grows with the
steps served, by a heap profile). Three settings travel in the environment of a Ray the service
starts itself:

* ``MALLOC_ARENA_MAX=2``: glibc gives each allocating thread an arena, up to 8 per core, and
  memory freed in one arena is not reused by threads of another. With 256 clients a
  constructor's anonymous memory grew 121 -> 158 MiB in 60 s, against 43 -> 53 MiB in 140 s
  with two arenas.
* ``glibc.malloc.tcache_count=0`` in ``GLIBC_TUNABLES``: glibc's per-thread cache keeps up to 7
  freed chunks per size class in every thread (up to ~230 KiB a thread), filled as each thread
  frees its first chunks: the creep that remained with two arenas.
* ``ARROW_DEFAULT_MEMORY_POOL=system``: pyarrow's default pool (mimalloc or jemalloc) keeps freed
  pages per thread; a loader's decoded row groups then go through malloc instead.

Each must be in place before a process's first threads allocate (``mallopt`` from an actor's
``__init__`` came too late to help), so they travel in the environment: when the service starts
Ray itself, the raylet and every worker inherit it from the driver (this process keeps what it
started with: glibc and pyarrow read them once). A per-actor ``runtime_env`` did the same but cost
3-4 s per service start (each actor then waits for a worker started for that environment). A
cluster started with ``ray start`` takes them from the shell that started it (the README spells
the line out).

Overrides: ``MEGASCALE_MALLOC_ARENAS`` (0: glibc's default), ``MEGASCALE_MALLOC_TCACHE`` (a chunk
count, or ``default`` for glibc's), ``MEGASCALE_ARROW_POOL`` (a pool name, or ``default`` for
pyarrow's). A variable the user already set wins over each.

A Data Constructor also hands freed heap pages back to the system every
``MEGASCALE_MALLOC_TRIM_S`` seconds (10; 0: never) with glibc's ``malloc_trim``
(`trim_periodically`): packs of varying lengths (a dense mask is s² bytes) leave free holes
inside the heap that glibc otherwise keeps; this needs no environment at start and works on any
cluster.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import MutableMapping

__all__ = ["DEFAULT_ARENAS", "DEFAULT_ARROW_POOL", "DEFAULT_TCACHE", "DEFAULT_TRIM_S", "allocator_environment",
           "trim_periodically", "tune_allocators_for_embedded_ray"]

DEFAULT_ARENAS = 2
DEFAULT_TCACHE = "0"
DEFAULT_ARROW_POOL = "system"
DEFAULT_TRIM_S = 10.0
TCACHE_TUNABLE = "glibc.malloc.tcache_count"


def _cap_arenas(environ: MutableMapping[str, str]) -> None:
    arenas = int(environ.get("MEGASCALE_MALLOC_ARENAS", DEFAULT_ARENAS))
    if arenas > 0:
        environ.setdefault("MALLOC_ARENA_MAX", str(arenas))


def _limit_tcache(environ: MutableMapping[str, str]) -> None:
    count = environ.get("MEGASCALE_MALLOC_TCACHE", DEFAULT_TCACHE)
    if count == "default":
        return
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TCACHE_TUNABLE + "=" in tunables:  # the user's own setting wins
        return
    environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, f"{TCACHE_TUNABLE}={int(count)}"]))


def _arrow_pool(environ: MutableMapping[str, str]) -> None:
    pool = environ.get("MEGASCALE_ARROW_POOL", DEFAULT_ARROW_POOL)
    if pool != "default":
        environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", pool)


def tune_allocators_for_embedded_ray(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put the three settings in `environ` (this process's, for the Ray it is about to start)
    unless set or turned off; returns what the Ray processes will see (`allocator_environment`)."""
    _cap_arenas(environ)
    _limit_tcache(environ)
    _arrow_pool(environ)
    return allocator_environment(environ)


def allocator_environment(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The allocator variables set in `environ` (for a process to report what it started with)."""
    return {k: environ[k] for k in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL") if k in environ}


def trim_periodically(environ: MutableMapping[str, str] = os.environ, *, name: str = "malloc-trim",
                      stop: threading.Event | None = None) -> threading.Thread | None:
    """Call glibc's ``malloc_trim(0)`` every ``MEGASCALE_MALLOC_TRIM_S`` seconds on a daemon thread
    (until `stop` is set); None (nothing started) when it is 0 or this C library has no
    ``malloc_trim`` (musl, macOS)."""
    seconds = float(environ.get("MEGASCALE_MALLOC_TRIM_S", DEFAULT_TRIM_S))
    trim = _malloc_trim()
    if seconds <= 0 or trim is None:
        return None
    stop = stop or threading.Event()

    def loop() -> None:
        while not stop.wait(seconds):
            trim(0)

    thread = threading.Thread(target=loop, daemon=True, name=name)
    thread.start()
    return thread


def _malloc_trim():
    path = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(path).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
