"""What the service's loader actors hold in their read caches (`bench memory` fills them first).

A Parquet source keeps ``row_group_cache`` decoded row groups, or windows of ``shuffle_window``
rows of them (`sources.parquet`): the bench serves steps until every loader's cache is full, the
state a long run reaches, and reports what they hold.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["cache_state"]


def _group_cache_state(actor: Any) -> tuple[int, int, int]:
    """Inside a LoaderGroupActor: (row groups cached, row groups full caches hold, cached bytes)."""
    held = want = nbytes = 0
    for ld in list(actor.group.loaders.values()):
        src = ld.source
        if not hasattr(src, "cache_stats"):
            continue
        for _ in range(5):  # a read-ahead thread may be filling the cache meanwhile
            try:
                st = src.cache_stats()
                break
            except RuntimeError:
                time.sleep(0.01)
        else:
            st = {"row_groups": 0, "bytes": 0}
        held, nbytes = held + st["row_groups"], nbytes + st["bytes"]
        window = ld.spec.shuffle_window
        units = int(np.sum(-(-np.diff(src.blocks()) // window))) if window else src.num_row_groups
        want += min(ld.spec.row_group_cache, units)  # row groups, or windows of them
    return held, want, nbytes


def cache_state(handles: list[Any]) -> tuple[int, int, int]:
    """(row groups cached, row groups full caches hold, cached bytes) over loader actors."""
    import ray

    got = ray.get([h.__ray_call__.remote(_group_cache_state) for h in handles])
    return sum(g[0] for g in got), sum(g[1] for g in got), sum(g[2] for g in got)
