"""Every actor of the service is ``ray.remote(cls).options(**options)`` over a plain façade class.

The class's own defaults (``RAY_OPTIONS``: CPUs, concurrency) are extended by the caller's
options (names, restarts, placement); no options are fixed in decorators (`runtime.wiring`
starts the Planner and the constructors, `runtime.loader_group` the loaders).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["ActorName", "actor", "resolve"]


@dataclass(frozen=True, slots=True)
class ActorName:
    """A named actor passed by name instead of by handle: a handle among a restartable actor's
    constructor arguments makes Ray log an error line per actor (ray-project/ray#53727) on every
    healthy start; a name is a plain string and is looked up again after a restart."""

    name: str
    namespace: str | None

    def resolve(self) -> Any:
        import ray

        return ray.get_actor(self.name, namespace=self.namespace)


def resolve(handle_or_name: Any) -> Any:
    """The actor handle of an `ActorName`, or the handle itself."""
    return handle_or_name.resolve() if isinstance(handle_or_name, ActorName) else handle_or_name


@functools.cache
def _remote(cls: type) -> Any:
    import ray

    return ray.remote(cls)


def actor(cls: type, **options: Any) -> Any:
    """``ray.remote(cls).options(...)``: `cls`'s ``RAY_OPTIONS`` updated with `options`."""
    return _remote(cls).options(**{**getattr(cls, "RAY_OPTIONS", {}), **options})
