"""What reading Parquet through malloc costs a loader: pyarrow's default pool against ``system``.

    python scripts/arrow_pool_cost.py [ROUNDS] [READS]

The service's embedded Ray starts its processes with ``ARROW_DEFAULT_MEMORY_POOL=system``
(`runtime.malloc`): pyarrow's default pool (mimalloc or jemalloc) keeps freed pages per thread and
a loader's memory crept with it. This times what a loader does with that pool: `ParquetSource.read`
of random rows (row-group LRU of 4, as the default spec) from demo image-text and text sources,
on 4 threads as a loader group's workers read, with each pool in turn, ROUNDS alternating rounds
of READS reads of 64 rows. One process; pyarrow's pool is switched with
``pyarrow.set_memory_pool`` (glibc settings are as this process started). Prints each round and
one JSON line: seconds per round (min, median) per pool and their ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from megascale_data_ext.sources.demo_data import make_demo_data
from megascale_data_ext.sources.registry import open_source

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
READS = int(sys.argv[2]) if len(sys.argv) > 2 else 200


def one_round(sources: list, rng: np.random.Generator) -> float:
    picks = [(sources[int(rng.integers(len(sources)))], rng.choice(1 << 30, 64)) for _ in range(READS)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: p[0].read(p[1] % len(p[0])), picks))
    return time.perf_counter() - t0


def main() -> None:
    pools = {"default": pa.default_memory_pool(), "system": pa.system_memory_pool()}
    print("pyarrow", pa.__version__, "default pool:", pools["default"].backend_name, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        specs = make_demo_data(Path(tmp), seed=3, rows=2000, text_sources=2, image_sources=2, megatron_source=False)
        times: dict[str, list[float]] = {name: [] for name in pools}
        rng = np.random.default_rng(0)
        for r in range(ROUNDS):
            for name, pool in (pools.items() if r % 2 == 0 else reversed(pools.items())):
                pa.set_memory_pool(pool)
                sources = [open_source(s) for s in specs]  # fresh caches: every round decodes
                times[name].append(one_round(sources, rng))
                for s in sources:
                    s.close()
                print(f"round {r} {name}: {times[name][-1]:.2f} s", flush=True)
    out = {name: {"min_s": round(min(t), 3), "median_s": round(statistics.median(t), 3)} for name, t in times.items()}
    out["system_over_default_median"] = round(out["system"]["median_s"] / out["default"]["median_s"], 3)
    print(json.dumps({"rounds": ROUNDS, "reads_per_round": READS, "rows_per_read": 64, **out}))


if __name__ == "__main__":
    main()
