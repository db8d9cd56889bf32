"""Source profiles: the measured (P, M) costs the AutoScaler partitions sources by.

MegaScale-Data (Sec. 5.1) models a source's loading cost as (P, T, M): P the transformation
latency, T the orchestration/transfer overhead, M the memory, split into the batch buffer
(M_b, here bytes per buffered sample) and the per-source file access state (M_d: open readers,
footers, row-group buffers). `megascale-data profile` measures them on real files; this module
is the data model and its JSON journal, so later runs reuse a profile instead of measuring
again. A profile is keyed by source name and carries a fingerprint of what was measured
(format, paths, file sizes and mtimes, transform settings): when the files change, the
fingerprint changes and the stale entry is reported instead of silently reused.

Plain Python (no numpy, Ray or torch).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from megascale_data_ext.errors import ConfigError

__all__ = ["JOURNAL_VERSION", "ProfileJournal", "SourceProfile", "fingerprint_of"]

JOURNAL_VERSION = 1


@dataclass(slots=True, kw_only=True, frozen=True)
class SourceProfile:
    """Measured costs of one source.

    Attributes:
        name: Source name (as in the config's `sources`).
        fingerprint: `fingerprint_of` the source when it was measured.
        num_samples: Samples in one epoch.
        samples_profiled: Samples read to measure latency and buffer bytes.
        latency_s: Seconds to read and transform one sample on one worker (P).
        overhead_s: Seconds per sample outside the transform (T: planning, transfer).
        access_state_bytes: Memory the open source holds before any sample is read (M_d).
        bytes_per_sample: Memory one buffered, transformed sample holds (M_b per sample).
        throughput: Samples per second one worker sustained while profiling.
    """

    name: str
    fingerprint: str
    num_samples: int
    samples_profiled: int
    latency_s: float
    overhead_s: float = 0.0
    access_state_bytes: int
    bytes_per_sample: int
    throughput: float

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)!r}" for k in ("num_samples", "samples_profiled", "latency_s", "overhead_s",
                                                       "access_state_bytes", "bytes_per_sample", "throughput")
               if not getattr(self, k) >= 0]
        if bad:
            raise ConfigError(f"profile of source {self.name!r}: values must be >= 0, got {', '.join(bad)}; "
                              f"profile the source again (`megascale-data profile`)")

    @property
    def cost_s(self) -> float:
        """Seconds one sample costs a loader worker: P + T."""
        return self.latency_s + self.overhead_s

    def memory_bytes(self, buffered_samples: int) -> int:
        """M = M_d + buffered samples x M_b."""
        return int(self.access_state_bytes + buffered_samples * self.bytes_per_sample)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SourceProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"profile {data.get('name', '?')!r} has unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**dict(data))


def fingerprint_of(settings: Mapping[str, Any], files: Iterable[str]) -> str:
    """Digest of a source's settings and its files' (path, size, mtime): changes when either does."""
    stats = []
    for f in sorted(files):
        try:
            st = os.stat(f)
            stats.append((f, st.st_size, int(st.st_mtime_ns)))
        except OSError:
            stats.append((f, -1, -1))
    blob = json.dumps({"settings": dict(settings), "files": stats}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class ProfileJournal:
    """Profiles by source name, saved as JSON and merged across runs.

    File layout: ``{"version": 1, "profiles": {name: SourceProfile fields}}``. `lookup` answers
    a profile only when its fingerprint matches the source as it is now.
    """

    def __init__(self, profiles: Iterable[SourceProfile] = ()) -> None:
        self.profiles: dict[str, SourceProfile] = {p.name: p for p in profiles}

    @classmethod
    def load(cls, path: str | Path) -> ProfileJournal:
        """The journal at `path`; an empty one when the file does not exist yet."""
        p = Path(path)
        if not p.exists():
            return cls()
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"profile journal {str(p)!r} is not JSON ({exc}); delete it and profile again") from exc
        version = data.get("version") if isinstance(data, dict) else None
        if version != JOURNAL_VERSION:
            raise ConfigError(f"profile journal {str(p)!r} has version {version!r}, "
                              f"expected {JOURNAL_VERSION}; delete it and run `megascale-data profile` again")
        return cls(SourceProfile.from_dict(v) for v in data.get("profiles", {}).values())

    def save(self, path: str | Path) -> None:
        """Write atomically (a reader never sees half a journal)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        body = {"version": JOURNAL_VERSION, "profiles": {n: self.profiles[n].to_dict() for n in sorted(self.profiles)}}
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        os.replace(tmp, p)

    def merge(self, other: ProfileJournal | Iterable[SourceProfile]) -> ProfileJournal:
        """Add or replace profiles (the newer measurement wins); returns self."""
        items = other.profiles.values() if isinstance(other, ProfileJournal) else other
        for prof in items:
            self.profiles[prof.name] = prof
        return self

    def lookup(self, name: str, fingerprint: str) -> SourceProfile | None:
        """The profile of `name` if it was measured on the source as it is now, else None."""
        prof = self.profiles.get(name)
        return prof if prof is not None and prof.fingerprint == fingerprint else None

    def stale(self, current: Mapping[str, str]) -> list[str]:
        """Names (of `current`: name -> fingerprint now) whose saved profile no longer matches."""
        return sorted(n for n, fp in current.items() if n in self.profiles and self.profiles[n].fingerprint != fp)

    def require(self, names: Sequence[str]) -> list[SourceProfile]:
        """Profiles of `names` in order; a ConfigError lists every missing one."""
        missing = [n for n in names if n not in self.profiles]
        if missing:
            raise ConfigError(f"no profile for sources {missing}; run `megascale-data profile <config>` first")
        return [self.profiles[n] for n in names]
