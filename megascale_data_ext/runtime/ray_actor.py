"""Every actor of the service is ``ray.remote(cls).options(**options)`` over a plain façade class.

The class's own defaults (``RAY_OPTIONS``: CPUs, concurrency) are extended by the caller's
options (names, restarts, placement); no options are fixed in decorators (`runtime.wiring`
starts the Planner and the constructors, `runtime.loader_group` the loaders).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["actor"]


@functools.cache
def _remote(cls: type) -> Any:
    import ray

    return ray.remote(cls)


def actor(cls: type, **options: Any) -> Any:
    """``ray.remote(cls).options(...)``: `cls`'s ``RAY_OPTIONS`` updated with `options`."""
    return _remote(cls).options(**{**getattr(cls, "RAY_OPTIONS", {}), **options})
