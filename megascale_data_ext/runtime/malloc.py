"""Fewer glibc malloc arenas in the service's processes, so their memory stays flat.

glibc gives each thread that allocates its own arena, up to 8 per core, and memory freed in one
arena is not reused by threads of another. A Data Constructor actor runs over 200 threads (Ray's
own, and one per concurrent client request: `constructor_concurrency`), so its resident memory
crept up for minutes as the arenas fragmented: with 256 clients (`bench soak`) a constructor's
anonymous memory grew 121 -> 158 MiB in 60 s, against 43 -> 53 MiB in 140 s with two arenas
doing the same work (the Python heap itself stays flat under tracemalloc).

The cap must be in place before a process's first threads allocate (``mallopt`` from an actor's
``__init__`` came too late to help), so it travels as ``MALLOC_ARENA_MAX`` in the environment:
when the service starts Ray itself, the raylet and every worker inherit it from the driver. A
per-actor ``runtime_env`` did the same but cost 3-4 s per service start (each actor then waits
for a worker started for that environment). A cluster started with ``ray start`` takes the
variable from the shell that started it (``MALLOC_ARENA_MAX=2 ray start ...``).

``MEGASCALE_MALLOC_ARENAS`` overrides the cap (0: glibc's default); a ``MALLOC_ARENA_MAX``
already set wins. Other C libraries ignore the variable.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["DEFAULT_ARENAS", "cap_arenas_for_embedded_ray"]

DEFAULT_ARENAS = 2


def cap_arenas_for_embedded_ray(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Put ``MALLOC_ARENA_MAX`` in `environ` (this process's, for the Ray it is about to start)
    unless it is set or the cap is off; returns the value the Ray processes will see."""
    arenas = int(environ.get("MEGASCALE_MALLOC_ARENAS", DEFAULT_ARENAS))
    if arenas > 0:
        environ.setdefault("MALLOC_ARENA_MAX", str(arenas))
    return environ.get("MALLOC_ARENA_MAX")
