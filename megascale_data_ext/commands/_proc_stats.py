"""CPU seconds and resident memory of processes, read from ``/proc`` (the benchmarks' accounting).

Read directly rather than through psutil, which is not a dependency of this package.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["CpuMeter", "cpu_seconds", "descendants", "private_mib", "rss_mib"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of live processes (those gone count as 0)."""
    total = 0.0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:  # fields[11], fields[12] are utime, stime (stat fields 14, 15)
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def rss_mib(pids: list[int]) -> list[float]:
    """VmRSS of each live process in MiB (from ``/proc/<pid>/status``)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                kib = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
        except OSError:
            continue
        if kib is not None:
            out.append(kib / 1024)
    return out


def private_mib(pid: int) -> float | None:
    """Memory only this process holds (Private_Clean + Private_Dirty of ``/proc/<pid>/smaps_rollup``):
    RSS without the shared pages it touched (Ray's object store, libraries); None when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kib = sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except OSError:
        return None
    return kib / 1024


OBJECT_STORE_MAPPING = "/dev/shm/plasma"
"""Path prefix of the shared-memory file Ray's object store maps into every worker."""


def private_split_mib(pid: int) -> dict[str, float] | None:
    """`private_mib` split by mapping (``/proc/<pid>/smaps``): ``own`` (heap, anonymous memory,
    libraries: what the process itself holds) and ``object_store`` (pages of Ray's object store
    that only this process touched: objects it wrote that no other process has mapped yet; they
    count as private but belong to the store, whose size bounds them); None when it is gone."""
    split = {"own": 0, "object_store": 0}
    kind = "own"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's header: "start-end perms offset dev inode [path]"
                    parts = line.split()
                    kind = "object_store" if len(parts) > 5 and parts[5].startswith(OBJECT_STORE_MAPPING) else "own"
                elif head in ("Private_Clean:", "Private_Dirty:"):
                    split[kind] += int(line.split()[1])
    except OSError:
        return None
    return {k: v / 1024 for k, v in split.items()}


def descendants() -> list[int]:
    """Every live descendant of this process (DataLoader workers; Ray's raylet, GCS, workers)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                parent[int(entry)] = int(fields[1])
    out, frontier = [], [os.getpid()]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier]
        out += kids
        frontier = kids
    return out


class CpuMeter:
    """CPU of a changing set of processes: per-pid deltas from the first time a pid is seen."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self._start: dict[int, float] = {}

    def mark(self) -> None:
        self._start = {pid: cpu_seconds([pid]) for pid in self._pids()}

    def since_mark(self) -> float:
        return sum(cpu_seconds([pid]) - self._start.get(pid, 0.0) for pid in self._pids())
