"""What loading one source costs, measured on its files: the (P, T, M) of the auto-partitioner.

Per source: open it (its file access state M_d: the Python/numpy allocations tracemalloc sees
plus Arrow's memory pool, held after opening and reading the metadata table; memory-mapped file
pages are page cache, not counted), read samples in batches as a Source Loader does (P: seconds
per sample, and one worker's throughput), serialize them as Ray would ship them (T: seconds per
sample), and size the transformed samples (M_b: bytes one buffered sample holds).
`profile_sources` reuses every profile of a `ProfileJournal` whose source is unchanged (same
fingerprint) and measures only new or changed ones; the `profile` command and a service
started with ``autoscale.enabled`` both use it. No Ray, no torch.
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from glob import glob
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile, fingerprint_of

__all__ = ["access_state_bytes", "process_memory", "profile_source", "profile_sources", "sample_bytes",
           "source_files", "source_fingerprint"]


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


def profile_sources(specs: Sequence[Any], journal_path: str | Path | None, *, samples: int = 64, batch: int = 16,
                    force: bool = False, progress: Callable[[Any], Any] | None = None
                    ) -> tuple[list[SourceProfile], list[str], list[str]]:
    """Profiles of `specs` in order, measuring only those the journal lacks or has stale.

    Args:
        specs: The sources.
        journal_path: The journal file (None: measure everything, keep nothing).
        samples, batch: Samples read per source, and per read call.
        force: Measure every source again.
        progress: Wraps the list of sources to measure (e.g. ``tqdm``).

    Returns:
        ``(profiles, measured names, stale names)``; the journal is saved after each source,
        so an interrupted run keeps what it measured.
    """
    journal = ProfileJournal.load(journal_path) if journal_path is not None else ProfileJournal()
    current = {s.name: source_fingerprint(s) for s in specs}
    stale = journal.stale(current)
    todo = [s for s in specs if force or journal.lookup(s.name, current[s.name]) is None]
    for spec in (progress(todo) if progress is not None else todo):
        journal.merge([profile_source(spec, samples=samples, batch=batch)])
        if journal_path is not None:
            journal.save(journal_path)
    return journal.require([s.name for s in specs]), [s.name for s in todo], stale
