"""``megascale-data profile <config>``: measure each source's (P, T, M) for the auto-partitioner.

Per source, on the real files: open it (the memory that costs is its file access state M_d:
the Python/numpy allocations tracemalloc sees plus Arrow's memory pool, held after opening and
reading the metadata table; memory-mapped file pages are page cache, not counted), read ``--samples`` samples in batches as a Source
Loader does (P: seconds per sample, and the throughput of one worker), serialize them as Ray
would ship them (T: seconds per sample), and size the transformed samples (M_b: bytes one
buffered sample holds). Results are journaled to ``<out>/profiles.json``
(`dataplane.profiles.ProfileJournal`): a later run reuses every profile whose source is
unchanged (same fingerprint) and measures only new or changed sources. ``--model`` also
profiles the model (``commands._profile_model``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import time
import tracemalloc
from glob import glob
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megascale_data_ext.commands import _profile_model
from megascale_data_ext.commands._config_args import add_config_arguments, fail, load_data_config
from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile, fingerprint_of
from megascale_data_ext.errors import MegascaleDataError

NAME = "profile"
HELP = "measure every source's transform latency, access-state and buffer memory (auto-partitioning input)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="profiles", help="directory of profiles.json and profiles.png")
    parser.add_argument("--samples", type=int, default=64, help="samples read per source")
    parser.add_argument("--batch", type=int, default=16, help="samples per read call (as a loader's plan)")
    parser.add_argument("--force", action="store_true", help="measure again even where the journal is current")
    parser.add_argument("--json", action="store_true", help="print the profiles as JSON")
    _profile_model.add_model_arguments(parser)


def process_memory(pid: int | None = None) -> dict[str, int]:
    """RSS, PSS and USS (private clean + dirty) in bytes of a process, from /proc/<pid>/smaps_rollup."""
    path = f"/proc/{pid or os.getpid()}/smaps_rollup"
    vals: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                vals[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"rss": vals.get("Rss", 0), "pss": vals.get("Pss", 0),
            "uss": vals.get("Private_Clean", 0) + vals.get("Private_Dirty", 0)}


def _arrow_bytes() -> int:
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        return 0
    return int(pa.total_allocated_bytes())


def source_files(spec: Any) -> list[str]:
    """The files a spec names (directories walked, globs expanded, Megatron prefixes as .bin/.idx)."""
    out: list[str] = []
    for p in spec.paths:
        path = Path(p)
        if path.is_dir():
            out += [str(f) for f in sorted(path.rglob("*")) if f.is_file()]
        elif any(c in p for c in "*?["):
            out += sorted(glob(p, recursive=True))
        elif spec.format == "megatron":
            out += [f"{p}.bin", f"{p}.idx"]
        else:
            out.append(p)
    return out


def source_fingerprint(spec: Any) -> str:
    """Digest of what decides the source's costs: its settings (not the mixing weight) and files."""
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(spec).items() if k != "weight"}
    return fingerprint_of(settings, source_files(spec))


def sample_bytes(sample: Any) -> int:
    """Bytes a buffered, transformed sample holds (token and patch arrays, raw image bytes)."""
    n = sample.tokens.nbytes + sum(img.nbytes for img in sample.images)
    n += sum(len(b) for b in sample.image_bytes or [])
    return int(n + sys.getsizeof(sample))


def _batches(idx: np.ndarray, batch: int) -> list[list[int]]:
    return [sorted(int(x) for x in idx[i:i + batch]) for i in range(0, len(idx), batch)]


def access_state_bytes(spec: Any, batches: list[list[int]]) -> int:
    """What an open source retains after its metadata and `batches` were read, samples dropped.

    Counted: Python/numpy allocations (tracemalloc) and Arrow's memory pool: readers, footers,
    the metadata table, cached row groups. Memory-mapped file pages are page cache: not counted.
    """
    from megascale_data_ext.sources.registry import open_source

    gc.collect()
    arrow0 = _arrow_bytes()
    tracemalloc.start()
    try:
        src = open_source(spec)
        try:
            meta = src.metadata(None)  # the loader keeps the metadata table
            for b in batches:
                src.read(b)  # samples dropped at once: only what the source keeps stays
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] + _arrow_bytes() - arrow0
            del meta
        finally:
            src.close()
    finally:
        tracemalloc.stop()
    return max(0, int(held))


def profile_source(spec: Any, *, samples: int, batch: int, seed: int = 0) -> SourceProfile:
    """Measure one source on its files (see the module doc): a traced instance for M_d, a fresh
    untraced one for the timings and sample sizes (tracing would slow the reads)."""
    from megascale_data_ext.sources.registry import open_source

    src = open_source(spec)
    try:
        n = len(src)
        rng = np.random.default_rng(seed)
        batches = _batches(rng.choice(n, size=min(samples, n), replace=False) if n else np.zeros(0, np.int64), batch)
        got: list[Any] = []
        t0 = time.perf_counter()
        for b in batches:
            got += src.read(b)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for s in got:
            pickle.loads(pickle.dumps(s, protocol=5))
        ship_s = time.perf_counter() - t0
    finally:
        src.close()
    count = len(got)
    k = max(1, count)
    per_sample = int(np.mean([sample_bytes(s) for s in got])) if got else 0
    del got
    return SourceProfile(name=spec.name, fingerprint=source_fingerprint(spec), num_samples=n,
                         samples_profiled=count, latency_s=read_s / k, overhead_s=ship_s / k,
                         access_state_bytes=access_state_bytes(spec, batches), bytes_per_sample=per_sample,
                         throughput=k / read_s if read_s > 0 else 0.0)


def plot(profiles: list[SourceProfile], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p.name for p in profiles]
    x = np.arange(len(names))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 0.6 * len(names) + 4), 4))
    a.bar(x, [p.latency_s * 1e3 for p in profiles], label="transform (P)")
    a.bar(x, [p.overhead_s * 1e3 for p in profiles], bottom=[p.latency_s * 1e3 for p in profiles],
          label="serialize (T)")
    a.set_ylabel("ms per sample")
    a.legend()
    b.bar(x - 0.2, [p.access_state_bytes / 2**20 for p in profiles], 0.4, label="access state M_d")
    b.bar(x + 0.2, [p.bytes_per_sample / 2**10 for p in profiles], 0.4, label="per buffered sample (KiB)")
    b.set_ylabel("MiB / KiB")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    fig.suptitle("megascale-data profile: per-source loading costs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.samples < 1 or args.batch < 1:
        return fail(ValueError(f"--samples and --batch must be >= 1, got {args.samples}, {args.batch}"))
    try:
        specs = load_data_config(args).to_service_config().sources
        out = Path(args.out)
        journal_path = out / "profiles.json"
        journal = ProfileJournal.load(journal_path)
        current = {s.name: source_fingerprint(s) for s in specs}
        stale = journal.stale(current)
        todo = [s for s in specs if args.force or journal.lookup(s.name, current[s.name]) is None]
        for spec in tqdm(todo, total=len(todo), desc="profile sources", unit="source", file=sys.stderr):
            journal.merge([profile_source(spec, samples=args.samples, batch=args.batch)])
            journal.save(journal_path)  # journaled as it goes: an interrupted run keeps what it measured
        journal.save(journal_path)
    except MegascaleDataError as exc:
        return fail(exc)
    profiles = journal.require([s.name for s in specs])
    plot(profiles, out / "profiles.png")
    reused = len(specs) - len(todo)
    if args.json:
        print(json.dumps({"journal": str(journal_path), "measured": [s.name for s in todo], "stale": stale,
                          "profiles": [p.to_dict() for p in profiles]}, indent=1))
    else:
        print(f"{'source':24} {'P ms':>8} {'T ms':>7} {'M_d MiB':>8} {'KiB/sample':>10} {'samples/s':>10}")
        for p in profiles:
            print(f"{p.name:24} {p.latency_s * 1e3:8.3f} {p.overhead_s * 1e3:7.3f} "
                  f"{p.access_state_bytes / 2**20:8.1f} {p.bytes_per_sample / 2**10:10.1f} {p.throughput:10.0f}")
        print(f"journal {journal_path} ({len(todo)} measured, {reused} reused"
              f"{', stale: ' + ', '.join(stale) if stale else ''}); plot {out / 'profiles.png'}")
    if getattr(args, "model", False):
        return int(_profile_model.run_model_profile(args) or 0)
    return 0
