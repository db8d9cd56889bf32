"""Starting Ray for the service: the environment an embedded Ray's processes inherit, and one ``ray.init``.

The service, `serve` and the benches that measure them (startup, throughput, memory, faults) start
Ray through `init_ray` (`bench chaos` starts a `Cluster` of its own). When it starts Ray
itself (``data.ray.address: null``) the raylet and every worker inherit this process's environment,
so these settings travel that way before ``ray.init``:

* the allocator settings of `runtime.malloc` (malloc arenas, glibc's per-thread caches, pyarrow's
  pool): flat memory in actors with many threads.
* ``RAY_preload_python_modules``: each worker process imports the service's actor modules (numpy,
  pyarrow, the data plane: ~1 s of CPU each on a small box) as it starts. With
  ``data.ray.prestart_workers`` the raylet prestarts one per CPU while ``ray.init`` returns and the
  first actors take them warm; by default (``RayConfig.prestart_workers`` false: on a many-core
  node they would stay idle at ~80 MiB each) each actor's worker starts when the actor is asked
  for, and imports them then. Set the variable yourself to preload something else, or
  ``MEGASCALE_PRELOAD=0`` to preload nothing. A cluster of your own (``ray start``) takes it from
  the shell that started it: ``RAY_preload_python_modules=<SERVICE_MODULES, comma-separated> ray start``
  (the README spells it out).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from megascale_data_ext.runtime.malloc import tune_allocators_for_embedded_ray

__all__ = ["SERVICE_MODULES", "init_ray", "prepare_embedded_ray", "preload_service_modules", "quiet_token_auth_notice"]

# The modules of every actor class the service starts (what a worker unpickles the class from).
SERVICE_MODULES = (
    "megascale_data_ext.runtime.actors",
    "megascale_data_ext.runtime.loader_group",
    "megascale_data_ext.runtime.constructor_actor",
)
PRELOAD_VARIABLE = "RAY_preload_python_modules"


def preload_service_modules(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Put ``RAY_preload_python_modules`` (the service's actor modules) in `environ` unless it is
    set or ``MEGASCALE_PRELOAD=0``; returns what the Ray processes will see."""
    if environ.get("MEGASCALE_PRELOAD", "1") != "0":
        environ.setdefault(PRELOAD_VARIABLE, ",".join(SERVICE_MODULES))
    return environ.get(PRELOAD_VARIABLE)


def prepare_embedded_ray(environ: MutableMapping[str, str] = os.environ) -> None:
    """The environment of a Ray this process is about to start (its processes inherit it)."""
    tune_allocators_for_embedded_ray(environ)
    preload_service_modules(environ)


_TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TOKEN_AUTH_NOTICE)


def quiet_token_auth_notice() -> None:
    """Drop Ray's notice that it turned token auth on for a new local cluster (it stays on).

    Only that one message: the warning that auth is *off* still shows. Setting
    ``RAY_AUTH_MODE=token`` would say the same without the notice, but Ray reads it when it is
    imported, so setting it here, after the import, makes the new cluster refuse its own token.
    """
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropTokenAuthNotice) for f in logger.filters):
        logger.addFilter(_DropTokenAuthNotice())


def init_ray(ray_config: Any, **kwargs: Any) -> None:
    """``ray.init`` from a `RayConfig`: joins ``address`` as given, or starts an embedded Ray with
    `prepare_embedded_ray`'s environment. `kwargs` go to ``ray.init`` (``log_to_driver``, ...).
    Call it before this process starts threads: it writes environment variables."""
    import ray

    if ray_config.address is None:
        prepare_embedded_ray()
    quiet_token_auth_notice()
    ray.init(**ray_config.init_kwargs(), configure_logging=False, **kwargs)
