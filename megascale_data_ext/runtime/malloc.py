"""Fewer glibc malloc arenas in the service's actor processes, so their memory stays flat.

glibc gives each thread that allocates its own arena, up to 8 per core, and memory freed in one
arena is not reused by threads of another. A Data Constructor actor runs over 200 threads (Ray's
own, and one per concurrent client request: `constructor_concurrency`), so its resident memory
crept up for minutes as the arenas fragmented: with 256 clients (`bench soak`) a constructor's
anonymous memory grew 121 -> 158 MiB in 60 s, against 43 -> 47 MiB with two arenas doing the same
work (the Python heap itself stays flat under tracemalloc). The cap must be in place before the
process's first threads allocate, so it travels as ``MALLOC_ARENA_MAX`` in the actors'
``runtime_env`` (capping from inside ``__init__`` with ``mallopt`` came too late to help).

``MEGASCALE_MALLOC_ARENAS`` in the driver's environment overrides the cap (0: glibc's default).
Other C libraries ignore the variable.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["DEFAULT_ARENAS", "actor_process_options"]

DEFAULT_ARENAS = 2


def actor_process_options(arenas: int | None = None) -> dict[str, Any]:
    """Ray actor options that start the actor's process with at most `arenas` malloc arenas
    (default ``MEGASCALE_MALLOC_ARENAS`` or 2); empty when the cap is off."""
    if arenas is None:
        arenas = int(os.environ.get("MEGASCALE_MALLOC_ARENAS", DEFAULT_ARENAS))
    if arenas <= 0:
        return {}
    return {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": str(arenas)}}}
