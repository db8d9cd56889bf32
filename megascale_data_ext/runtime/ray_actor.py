"""Every actor of the service is ``ray.remote(cls).options(**options)`` over a plain façade class.

The class's own defaults (``RAY_OPTIONS``: CPUs, concurrency; ``CONCURRENCY_GROUPS``, which Ray takes
only in ``ray.remote``, plus one thread for `thread_stacks` where the class has it) are extended by the caller's
options (names, restarts, placement); no options are fixed in decorators (`runtime.wiring`
starts the Planner and the constructors, `runtime.loader_group` the loaders). Large constructor
arguments travel as `Held` references.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["Held", "actor", "resolve"]


@functools.cache
def _remote(cls: type) -> Any:
    import ray

    from megascale_data_ext.runtime.thread_stacks import DIAGNOSTICS_GROUP

    groups = dict(getattr(cls, "CONCURRENCY_GROUPS", None) or {})  # Ray takes these in ray.remote only
    if hasattr(cls, "thread_stacks"):  # answered beside threads that all wait (`runtime.thread_stacks`)
        groups[DIAGNOSTICS_GROUP] = 1
    return ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)


def actor(cls: type, **options: Any) -> Any:
    """``ray.remote(cls).options(...)``: `cls`'s ``RAY_OPTIONS`` updated with `options`."""
    return _remote(cls).options(**{**getattr(cls, "RAY_OPTIONS", {}), **options})


@dataclass(frozen=True, slots=True)
class Held:
    """A large constructor argument of a restartable actor, kept in Ray's key-value store.

    Ray puts any argument over 100 KiB (a config of ~700 sources) in the object store, and for a
    restartable actor whose arguments live there logs an error line on the driver's console at
    every healthy start, since it does not keep them for a restart (ray-project/ray#53727; an
    object reference inside the arguments counts too). A `Held` is a key: the value sits in the
    GCS's key-value store, which outlives every actor restart, until it is released: each value is
    put under its service's job (`ServiceTopology.job`), and `DataService.stop` releases them all,
    the Planner's for its loaders included. The actor takes the value with `resolve`.
    """

    key: str

    @classmethod
    def put(cls, value: Any, *, owner: str) -> Held:
        """`value` in the store under `owner` (the service's job)."""
        import uuid

        from ray import cloudpickle  # what Ray itself would have pickled the argument with
        from ray.experimental.internal_kv import _internal_kv_put

        held = cls(f"{_prefix(owner)}{uuid.uuid4().hex}")
        _internal_kv_put(held.key, cloudpickle.dumps(value), namespace=_KV_NAMESPACE)
        return held

    def get(self) -> Any:
        from ray import cloudpickle
        from ray.experimental.internal_kv import _internal_kv_get

        data = _internal_kv_get(self.key, namespace=_KV_NAMESPACE)
        if data is None:
            raise RuntimeError(f"{self.key} is gone from Ray's key-value store: its service was stopped")
        return cloudpickle.loads(data)

    def release(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(self.key, namespace=_KV_NAMESPACE)

    @staticmethod
    def release_all(owner: str) -> None:
        """Every value put under `owner`."""
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(_prefix(owner), del_by_prefix=True, namespace=_KV_NAMESPACE)


_KV_NAMESPACE = "megascale_data"


def _prefix(owner: str) -> str:
    return f"held/{owner}/"


def resolve(value: Any) -> Any:
    """`value`, or what the `Held` it is refers to."""
    return value.get() if isinstance(value, Held) else value
