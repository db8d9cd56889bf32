"""SourceLoader under the actor's threads: steps read concurrently, the source read by one at a time.

A Parquet reader and its row-group cache are not thread-safe: two steps of one source read at
once (a constructor's fetch of step s beside the read-ahead of step s + 1) crashed a loader
actor with a segmentation fault in pyarrow's ``read_row_group``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megascale_data_ext.dataplane.plan import LoaderPlan
from megascale_data_ext.runtime.failover import read_buckets
from megascale_data_ext.runtime.loader import SourceLoader
from megascale_data_ext.sources import SourceSpec


def test_concurrent_steps_never_read_the_source_at_once(tmp_path) -> None:
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 4 for i in range(80)]}), path, row_group_size=5)
    loader = SourceLoader(0, SourceSpec(name="web", format="parquet", paths=[str(path)], row_group_cache=1), seed=1)
    loader.get_plan = lambda step, source: LoaderPlan(
        step=step, source=source, positions=np.arange(step * 8, step * 8 + 8),
        indices=loader.indices_at(np.arange(step * 8, step * 8 + 8)), bucket=np.zeros(8, dtype=np.int64))
    inside, most = [0], [0]
    guard = threading.Lock()
    read = loader.source.read_report

    def probed(indices):  # counts readers inside the source; the sleep widens any overlap
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.01)
            return read(indices)
        finally:
            with guard:
                inside[0] -= 1

    loader.source.read_report = probed
    got: dict[int, list[int]] = {}

    def fetch(step: int) -> None:
        got[step] = [s.index for _, _, s in loader.fetch(step, [0])["samples"]]

    direct: list[int] = []

    def read_direct(step: int) -> None:  # a shadow's or a re-read's path (`failover.read_buckets`)
        out = read_buckets(loader, loader.get_plan(step, 0), [0])
        direct.extend(s.index for _, _, s in out["samples"])

    threads = [threading.Thread(target=fetch, args=(step,)) for step in range(8)]
    threads += [threading.Thread(target=loader.read_ahead, args=(step,)) for step in range(8)]
    threads += [threading.Thread(target=read_direct, args=(step,)) for step in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1  # one step at a time inside the source
    delivered = [i for step in range(8) for i in got[step]]
    assert sorted(delivered) == sorted(loader.indices_at(np.arange(64)).tolist())  # every sample once
    assert sorted(direct) == sorted(delivered)
