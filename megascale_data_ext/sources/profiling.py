"""What loading one source costs, measured on its files: the (P, T, M) of the auto-partitioner.

Per source: open it (its file access state M_d: the Python/numpy allocations tracemalloc sees
plus Arrow's memory pool, held after opening and reading the metadata table; memory-mapped file
pages are page cache, not counted), read samples in batches as a Source Loader does (P: seconds
per sample, and one worker's throughput), serialize them as Ray would ship them (T: seconds per
sample), and size the transformed samples (M_b: bytes one buffered sample holds).
`profile_sources` reuses every profile of a `ProfileJournal` whose source is unchanged (same
fingerprint) and profiles only new or changed ones; the `profile` command and a service
started with ``autoscale.enabled`` both use it. No Ray, no torch.

Start-up cost (issue 25): every step is linear in the sources. Memory is accounted with
tracemalloc without a ``gc.collect()`` per source (two collections per source cost 178 s at
1,024 sources once the driver held torch), the journal is written once at the end (and every
30 s), and with ``measure_per_kind`` only a few sources of each kind are read and timed: the
others are opened once for their own sample count, metadata and memory, and take their
kind-mates' per-sample rates.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from glob import glob
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.profiles import ProfileJournal, SourceProfile, fingerprint_of

__all__ = ["access_state_bytes", "process_memory", "profile_source", "profile_sources", "sample_bytes",
           "source_files", "source_fingerprint", "source_kind"]


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


def _settings(spec: Any, leave_out: tuple[str, ...]) -> dict[str, Any]:
    """A spec's fields but `leave_out`, shallow (``asdict``'s deep copy cost ~0.5 ms per source)."""
    return {f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in leave_out}


def source_fingerprint(spec: Any) -> str:
    """Digest of what decides the source's costs: its settings (not the mixing weight) and files."""
    return fingerprint_of(_settings(spec, ("weight",)), source_files(spec))


def sample_bytes(sample: Any) -> int:
    """Bytes a buffered, transformed sample holds (token and patch arrays, raw image bytes)."""
    n = sample.tokens.nbytes + sum(img.nbytes for img in sample.images)
    n += sum(len(b) for b in sample.image_bytes or [])
    return int(n + sys.getsizeof(sample))


def _batches(idx: np.ndarray, batch: int) -> list[list[int]]:
    return [sorted(int(x) for x in idx[i:i + batch]) for i in range(0, len(idx), batch)]


def _sample_batches(n: int, samples: int, batch: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return _batches(rng.choice(n, size=min(samples, n), replace=False) if n else np.zeros(0, np.int64), batch)


@dataclass(slots=True, kw_only=True)
class _Held:
    """What an open source holds (bytes): after opening and reading its metadata table, and after
    reading sample batches too; its sample count and mean tokens per sample (from the metadata)."""

    num_samples: int
    opened: int
    after_reads: int
    mean_tokens: float


def _traced_bytes() -> int:
    return tracemalloc.get_traced_memory()[0] + _arrow_bytes()


def _measure_held(spec: Any, batches: list[list[int]], tokenizer: Any = None) -> _Held:
    """Open `spec`, read its metadata then `batches` (samples dropped at once); tracemalloc must be on.

    No ``gc.collect()``: a collection per source cost seconds each once the driver held torch's
    objects (issue 25). Samples are freed by reference counting as soon as `read` returns; only
    reference cycles a source creates and drops stay counted until the next automatic collection,
    an over-estimate that errs on the safe side of the partition's memory cap.
    """
    from megascale_data_ext.sources.registry import open_source

    base = _traced_bytes()
    src = open_source(spec, tokenizer=tokenizer)
    try:
        meta = src.metadata(None)  # the loader keeps the metadata table
        opened = _traced_bytes() - base
        for b in batches:
            src.read(b)
        after = _traced_bytes() - base
        tokens = meta["text_tokens"]
        mean = float(tokens.mean()) if len(tokens) else 0.0
        n = len(src)
        del meta
    finally:
        src.close()
    return _Held(num_samples=n, opened=max(0, opened), after_reads=max(0, after), mean_tokens=mean)


def access_state_bytes(spec: Any, batches: list[list[int]]) -> int:
    """What an open source retains after its metadata and `batches` were read, samples dropped.

    Counted: Python/numpy allocations (tracemalloc) and Arrow's memory pool: readers, footers,
    the metadata table, cached row groups. Memory-mapped file pages are page cache: not counted.
    Runs inside an active tracemalloc session if there is one (`profile_sources` opens one for a
    whole batch of sources), else in its own.
    """
    with _tracing():
        return _measure_held(spec, batches).after_reads


@dataclass(slots=True, kw_only=True)
class _Timing:
    """Untraced reads of one source: the batches read, seconds to read and to ship them, bytes per sample."""

    num_samples: int
    batches: list[list[int]]
    count: int
    read_s: float
    ship_s: float
    bytes_per_sample: int

    @property
    def latency_s(self) -> float:
        return self.read_s / max(1, self.count)

    @property
    def overhead_s(self) -> float:
        return self.ship_s / max(1, self.count)


def _time_source(spec: Any, *, samples: int, batch: int, seed: int, tokenizer: Any = None) -> _Timing:
    """Read `samples` samples of `spec` in batches of `batch` as a loader does, and ship them."""
    from megascale_data_ext.sources.registry import open_source

    src = open_source(spec, tokenizer=tokenizer)
    try:
        n = len(src)
        batches = _sample_batches(n, samples, batch, seed)
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
    per_sample = int(np.mean([sample_bytes(s) for s in got])) if got else 0
    return _Timing(num_samples=n, batches=batches, count=len(got), read_s=read_s, ship_s=ship_s,
                   bytes_per_sample=per_sample)


def _measured_profile(spec: Any, t: _Timing, held: int, fingerprint: str | None = None) -> SourceProfile:
    return SourceProfile(name=spec.name, fingerprint=fingerprint or source_fingerprint(spec),
                         num_samples=t.num_samples, samples_profiled=t.count, latency_s=t.latency_s,
                         overhead_s=t.overhead_s, access_state_bytes=held, bytes_per_sample=t.bytes_per_sample,
                         throughput=max(1, t.count) / t.read_s if t.read_s > 0 else 0.0)


def profile_source(spec: Any, *, samples: int, batch: int, seed: int = 0) -> SourceProfile:
    """Measure one source on its files (see the module doc): a fresh untraced instance for the
    timings and sample sizes (tracing would slow the reads), a traced one for M_d."""
    timing = _time_source(spec, samples=samples, batch=batch, seed=seed)
    return _measured_profile(spec, timing, access_state_bytes(spec, timing.batches))


def source_kind(spec: Any) -> str:
    """Digest of a source's settings but its name, paths and weight: sources of one kind cost alike
    per sample (same format, tokenizer, transforms), so a few measured ones stand for the rest."""
    return fingerprint_of(_settings(spec, ("name", "paths", "weight")), [])


def _representatives(kinds: Sequence[str], per_kind: int) -> list[bool]:
    """Which sources (of these kinds) to measure: all when ``per_kind <= 0``, else up to `per_kind`
    of each kind, spread evenly over the kind's sources in config order."""
    if per_kind <= 0:
        return [True] * len(kinds)
    by_kind: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(i)
    pick = [False] * len(kinds)
    for members in by_kind.values():
        m = len(members)
        for j in range(min(per_kind, m)):
            pick[members[j * m // min(per_kind, m)]] = True
    return pick


@contextmanager
def _tracing() -> Iterator[None]:
    """tracemalloc on for the block (left as it was when the caller already traces)."""
    own = not tracemalloc.is_tracing()
    if own:
        tracemalloc.start()
    try:
        yield
    finally:
        if own:
            tracemalloc.stop()


class _Progress:
    """``profiling 312/1024 sources ...`` lines, at most one per `every_s` (and the last one)."""

    def __init__(self, report: Callable[[str], Any] | None, total: int, every_s: float) -> None:
        self.report, self.total, self.every_s = report, total, every_s
        self.t0 = self.last = time.monotonic()
        self.done = self.measured = 0

    def step(self, measured: bool, *, final: bool = False) -> None:
        self.done += 1
        self.measured += measured
        now = time.monotonic()
        if self.report is not None and (final or self.done == self.total or now - self.last >= self.every_s):
            self.last = now
            self.report(f"profiling {self.done}/{self.total} sources ({self.measured} measured, "
                        f"{self.done - self.measured} from their metadata + measured ones of their kind; "
                        f"{now - self.t0:.1f} s)")


def profile_sources(specs: Sequence[Any], journal_path: str | Path | None, *, samples: int = 64, batch: int = 16,
                    force: bool = False, measure_per_kind: int = 0, progress: Callable[[str], Any] | None = None,
                    progress_every_s: float = 2.0, save_every_s: float = 30.0
                    ) -> tuple[list[SourceProfile], list[str], list[str]]:
    """Profiles of `specs` in order, profiling only those the journal lacks or has stale.

    A profiled source is either *measured* (its samples read and timed, see `profile_source`)
    or, when ``measure_per_kind`` > 0 and its kind (`source_kind`) has more sources than that,
    *extended*: opened once for its sample count, metadata table and memory held (M_d, plus the
    read-state its measured kind-mates gained from reads); P, T and throughput are the measured
    kind-mates' medians, bytes per sample their median per token times its own mean tokens.
    Extended profiles have ``samples_profiled == 0``. Each step is linear in the sources: one
    tracemalloc session for all of them, no ``gc.collect()``, one tokenizer per kind, and the
    journal written at the end (and every `save_every_s`, so an interrupted run keeps most).

    Args:
        specs: The sources.
        journal_path: The journal file (None: profile everything, keep nothing).
        samples, batch: Samples read per measured source, and per read call.
        force: Profile every source again.
        measure_per_kind: Sources measured per kind; 0 measures every source.
        progress: Called with a ``profiling i/n sources`` line at most every `progress_every_s`.

    Returns:
        ``(profiles, profiled names, stale names)``.
    """
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    journal = ProfileJournal.load(journal_path) if journal_path is not None else ProfileJournal()
    current = {s.name: source_fingerprint(s) for s in specs}
    stale = journal.stale(current)
    todo = [s for s in specs if force or journal.lookup(s.name, current[s.name]) is None]
    if not todo:
        return journal.require([s.name for s in specs]), [], stale
    kinds = [source_kind(s) for s in todo]
    pick = _representatives(kinds, measure_per_kind)
    tokenizers: dict[str, Any] = {}

    def tokenizer(spec: Any, kind: str) -> Any:
        if kind not in tokenizers:
            tokenizers[kind] = load_tokenizer(spec)
        return tokenizers[kind]

    meter = _Progress(progress, len(todo), progress_every_s)
    last_save = time.monotonic()

    def keep(prof: SourceProfile, measured: bool) -> None:
        nonlocal last_save
        journal.merge([prof])
        meter.step(measured)
        if journal_path is not None and time.monotonic() - last_save >= save_every_s:
            journal.save(journal_path)
            last_save = time.monotonic()

    reps: dict[str, list[tuple[_Timing, _Held]]] = {}
    for spec, kind, measure in zip(todo, kinds, pick, strict=True):  # first: the others need their kind's figures
        if measure:
            timing = _time_source(spec, samples=samples, batch=batch, seed=0, tokenizer=tokenizer(spec, kind))
            with _tracing():
                held = _measure_held(spec, timing.batches, tokenizer(spec, kind))
            reps.setdefault(kind, []).append((timing, held))
            keep(_measured_profile(spec, timing, held.after_reads, current[spec.name]), True)
    rates = {kind: _KindRates.of(measured) for kind, measured in reps.items()}
    opened: list[tuple[Any, str]] = []
    for spec, kind, measure in zip(todo, kinds, pick, strict=True):  # from metadata files alone where a format can
        if not measure:
            held = _peeked(spec, tokenizer(spec, kind), rates[kind])
            if held is None:
                opened.append((spec, kind))
            else:
                keep(rates[kind].profile(spec, current[spec.name], held), False)
    with _tracing():  # one session for every extended source that must be opened
        for spec, kind in opened:
            held = _measure_held(spec, [], tokenizer(spec, kind))
            keep(rates[kind].profile(spec, current[spec.name], held), False)
    if journal_path is not None:
        journal.save(journal_path)
    return journal.require([s.name for s in specs]), [s.name for s in todo], stale


def _peeked(spec: Any, tokenizer: Any, rates: _KindRates) -> _Held | None:
    """An extended Megatron source's `_Held` from its ``.idx`` files alone (document count and
    token counts as its metadata table will have them), its memory once open from its measured
    kind-mates' bytes per document: no ``.bin`` mapped, no tracemalloc. None for other formats,
    or where the index cannot be read that way (opening it then names the problem)."""
    if spec.format != "megatron" or rates.opened_per_sample is None:
        return None
    from megascale_data_ext.sources.megatron_indexed import peek_document_lengths
    from megascale_data_ext.sources.transforms import SampleTransform

    lengths = peek_document_lengths(list(spec.paths))
    if lengths is None or not lengths.size:
        return None
    counts = SampleTransform(spec, tokenizer).final_token_counts(lengths, add_eod=spec.append_eod)
    opened = int(rates.opened_per_sample * lengths.size)
    return _Held(num_samples=int(lengths.size), opened=opened, after_reads=opened, mean_tokens=float(counts.mean()))


@dataclass(slots=True, kw_only=True)
class _KindRates:
    """What a kind's measured sources say about the others: medians of P, T, bytes per token
    (or per sample) and the memory reads added to an open source."""

    latency_s: float
    overhead_s: float
    bytes_per_token: float | None
    bytes_per_sample: float
    read_state: float
    opened_per_sample: float | None = None  # what an open source holds per sample (its metadata table)

    @classmethod
    def of(cls, reps: Sequence[tuple[_Timing, _Held]]) -> _KindRates:
        per_token = [t.bytes_per_sample / h.mean_tokens for t, h in reps if h.mean_tokens > 0]
        return cls(latency_s=float(np.median([t.latency_s for t, _ in reps])),
                   overhead_s=float(np.median([t.overhead_s for t, _ in reps])),
                   bytes_per_token=float(np.median(per_token)) if per_token else None,
                   bytes_per_sample=float(np.median([t.bytes_per_sample for t, _ in reps])),
                   read_state=max(0.0, float(np.median([h.after_reads - h.opened for _, h in reps]))),
                   opened_per_sample=float(np.median([h.opened / h.num_samples for _, h in reps if h.num_samples > 0]))
                   if any(h.num_samples > 0 for _, h in reps) else None)

    def profile(self, spec: Any, fingerprint: str, held: _Held) -> SourceProfile:
        """An extended source's profile: its own count, metadata and memory, the kind's rates."""
        per_sample = self.bytes_per_token * held.mean_tokens if self.bytes_per_token is not None \
            else self.bytes_per_sample
        return SourceProfile(name=spec.name, fingerprint=fingerprint, num_samples=held.num_samples,
                             samples_profiled=0, latency_s=self.latency_s, overhead_s=self.overhead_s,
                             access_state_bytes=int(held.opened + self.read_state), bytes_per_sample=int(per_sample),
                             throughput=1 / self.latency_s if self.latency_s > 0 else 0.0)
