"""Megatron-Energon's per-rank loader as `bench memory`'s navit baseline (issue 21).

Multimodal Megatron users load with Energon, not with the project's Parquet reader: each
data-parallel rank streams WebDataset shards sequentially through W DataLoader workers, with a
shuffle buffer, and caches no row groups. Here the navit sources the service reads are written
again as Energon datasets (the same rows: one tar per Parquet row group, ``{key}.jpg`` + ``{key}.txt``
per row), prepared with Energon's own ``energon prepare`` (``CaptioningSample``), blended with the
same weights by a ``MetadatasetV2``, and read per rank as Megatron-LM's multimodal example reads
them (`examples/multimodal/dataloader_provider.py`: shuffle buffer 100, 100 samples per sequence,
virtual epoch 1,000, PIL decoding). A rank's memory is measured as the other baselines' are
(`_colocated_memory.measure_ranks`).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

from megascale_data_ext.commands._colocated_memory import measure_ranks

ENERGON_VERSION = "7.4.1"
"""The release measured (Megatron-Bridge 0.3's)."""

# Megatron-LM's examples/multimodal/dataloader_provider.py
SHUFFLE_BUFFER = 100
SAMPLES_PER_SEQUENCE = 100
VIRTUAL_EPOCH = 1000


def missing() -> str | None:
    """Why the Energon baseline cannot run here (one line, with the fix), or None."""
    try:
        import megatron.energon  # noqa: F401
    except ImportError:
        return (f"the Energon baseline needs megatron-energon: `pip install megatron-energon=={ENERGON_VERSION}`, "
                "or leave it out with `--baselines own_reader`")
    return None


def write_shards(spec: Any, out: Path) -> int:
    """`spec`'s Parquet rows (text + first image) as WebDataset tars in `out`, one per row group;
    returns the rows written."""
    import pyarrow.parquet as pq

    from megascale_data_ext.sources.profiling import source_files

    out.mkdir(parents=True, exist_ok=True)
    key = 0
    for path in source_files(spec):
        pf = pq.ParquetFile(path)
        for rg in range(pf.num_row_groups):
            table = pf.read_row_group(rg, columns=[spec.text_column, spec.image_column])
            with tarfile.open(out / f"{Path(path).stem}-{rg:06d}.tar", "w") as tar:
                for text, images in zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True):
                    for name, data in ((f"{key:09d}.jpg", images[0]), (f"{key:09d}.txt", text.encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                    key += 1
    return key


def prepare(dataset: Path) -> None:
    """Index `dataset`'s tars and write its ``.nv-meta`` (Energon's ``energon prepare``, non-interactive)."""
    from megatron.energon.tools.prepare import command

    args = [str(dataset), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type", "CaptioningSample",
            "--field-map", json.dumps({"image": "jpg", "caption": "txt"}), "--no-progress", "--force-overwrite",
            "--num-workers", "1"]
    with contextlib.redirect_stdout(io.StringIO()):
        command.main(args=args, standalone_mode=False)


def write_blend(path: Path, datasets: list[tuple[Path, float]]) -> Path:
    """A ``MetadatasetV2`` blending `datasets` (path, weight) for training."""
    import yaml

    meta = {"__module__": "megatron.energon", "__class__": "MetadatasetV2",
            "splits": {"train": {"blend": [{"weight": float(w), "path": str(p)} for p, w in datasets]}}}
    path.write_text(yaml.safe_dump(meta))
    return path


def export(specs: list[Any], out: Path) -> list[Path]:
    """Every spec's rows as a prepared Energon dataset under `out` (one directory each)."""
    dirs = []
    for spec in specs:
        d = out / f"{spec.name}-wds"
        write_shards(spec, d)
        prepare(d)
        dirs.append(d)
    return dirs


def _rank_process(conn: Any, rank: int, blend: str, world: int, workers: int, batches: int, cache: str) -> None:
    """One rank: Energon's train dataset over `blend` and its loader with `workers` workers, read
    for `batches` samples (micro-batch 1: variable-size images)."""
    import logging
    import os
    import warnings

    import torch
    import torch.distributed as dist

    from megascale_data_ext.commands._proc_stats import descendants

    warnings.filterwarnings("ignore")  # pin_memory without an accelerator, PIL decoding's deprecation
    logging.getLogger("megatron.energon").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    Path(cache).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{cache}/pg{rank}", rank=0, world_size=1)
    conn.send("before")
    conn.recv()
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    config = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    ds = get_train_dataset(blend, batch_size=1, shuffle_buffer_size=SHUFFLE_BUFFER,
                           max_samples_per_sequence=SAMPLES_PER_SEQUENCE, virtual_epoch_length=VIRTUAL_EPOCH,
                           worker_config=config, image_decode="pil")
    loader = get_loader(ds)
    it = iter(loader)
    for _ in range(batches):
        try:
            batch = next(it)
        except StopIteration:  # a virtual epoch ended: go on, as Megatron's training loop does
            it = iter(loader)
            batch = next(it)
        del batch
    conn.send({"pids": [p for p in descendants() if p != os.getpid()], "info": {"batches": batches}})
    conn.recv()
    del it, loader, ds
    dist.destroy_process_group()


def measure(blend: Path, *, ranks: int, workers: int, batches: int, cache: Path) -> dict[str, Any]:
    """`ranks` real Energon rank processes at once over `blend` (MiB per rank, `measure_ranks`)."""
    return measure_ranks(_rank_process, (str(blend), ranks, workers, batches, str(cache)), ranks)


def measure_points(specs: list[Any], measured: list[int], *, ranks: int, workers: int, batches: int,
                   root: Path) -> dict[int, dict[str, Any]]:
    """The first ``max(measured)`` of `specs` as Energon datasets under `root`, then `ranks` Energon
    ranks measured over the first S of them for each S of `measured` (`batches` samples each; 0:
    40 per source and at least 400, so shuffle buffers are full and every source's reader open)."""
    from tqdm import tqdm

    n = max(measured)
    datasets = [export([sp], root)[0] for sp in tqdm(specs[:n], desc="navit: Energon datasets (energon prepare)",
                                                     file=sys.stderr)]
    points = {}
    for s in tqdm(measured, desc="navit: Energon ranks (measured)", file=sys.stderr):
        blend = write_blend(root / f"blend-{s}.yaml", [(d, sp.weight) for d, sp in zip(datasets[:s], specs[:s],
                                                                                          strict=True)])
        take = batches or max(400, 40 * s)
        points[s] = {**measure(blend, ranks=ranks, workers=workers, batches=take, cache=root / f"cache{s}"),
                     "batches": take}
    return points
