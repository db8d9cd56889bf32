"""What an epoch of draws costs a Parquet reader: a global shuffle against a window shuffle.

    python scripts/window_read_cost.py [ROW_GROUPS] [ROW_GROUP_MIB] [WINDOW] [DRAWS]

One navit-like image-text source (`bench memory`'s writer: ROW_GROUPS row groups of about
ROW_GROUP_MIB MiB of JPEG bytes and captions) is read the way a Source Loader reads it: DRAWS
positions of epoch 0 in steps of 8, through `ParquetSource` with its default row-group cache (4),
once in the order of a global shuffle and once in the order of ``shuffle_window`` = WINDOW
(`dataplane.epoch_order`). Prints, for each: seconds, how many times a row group was read (whole,
or streamed window by window from its start), the largest cache held (MiB), and one JSON line.
Images are returned undecoded (``decode_images: constructor``): the cost compared is Parquet's,
not JPEG's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from megascale_data_ext.commands._colocated_memory import write_navit_sources
from megascale_data_ext.dataplane.epoch_order import epoch_permutation
from megascale_data_ext.sources.parquet import ParquetSource

ROW_GROUPS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
ROW_GROUP_MIB = float(sys.argv[2]) if len(sys.argv) > 2 else 16.0
WINDOW = int(sys.argv[3]) if len(sys.argv) > 3 else 100
DRAWS = int(sys.argv[4]) if len(sys.argv) > 4 else 4000


def one_order(spec, window: int) -> dict:
    spec = dataclasses.replace(spec, shuffle_window=window, decode_images="constructor")
    with ParquetSource(spec) as src:
        perm = epoch_permutation(len(src), seed=0, source_id=0, epoch=0, window=window,
                                 blocks=src.blocks())[:DRAWS]
        sizes = src.blocks()[1:] - src.blocks()[:-1]
        peak, t0 = 0.0, time.perf_counter()
        for i in range(0, len(perm), 8):
            src.read(perm[i:i + 8])
            peak = max(peak, src.cache_stats()["bytes"] / 2**20)
        seconds = time.perf_counter() - t0
        reads = sum(n for (purpose, _, _), n in src.io_counts.items() if purpose == "read")
    return {"window": window, "seconds": round(seconds, 2), "draws": len(perm), "row_group_reads": reads,
            "row_group_rows": int(sizes.mean()), "cache_peak_mib": round(peak, 1), "rows": len(src)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        specs, written = write_navit_sources(Path(tmp), sources=1, row_group_mib=ROW_GROUP_MIB,
                                             row_groups=ROW_GROUPS, seed=0, weight_sigma=0.0)
        rows = [one_order(specs[0], 0), one_order(specs[0], WINDOW)]
    for r in rows:
        print(f"{'window ' + str(r['window']) if r['window'] else 'global':>10}: {r['seconds']:6.2f} s for "
              f"{r['draws']} draws, row groups read {r['row_group_reads']} (whole, or streamed by window), "
              f"cache peak {r['cache_peak_mib']} MiB")
    print(json.dumps({"row_groups": ROW_GROUPS, "row_group_mib": ROW_GROUP_MIB, "file_mib": written["file_mib"],
                      "orders": rows, "global_over_window_seconds": round(rows[0]["seconds"] / rows[1]["seconds"], 2)}))


if __name__ == "__main__":
    main()
