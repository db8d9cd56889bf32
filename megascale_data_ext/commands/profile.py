"""``megascale-data profile <config>``: measure each source's (P, T, M) for the auto-partitioner.

What is measured and how: `sources.profiling`. Results are journaled to ``<out>/profiles.json``
(`dataplane.profiles.ProfileJournal`): a later run reuses every profile whose source is
unchanged (same fingerprint) and measures only new or changed sources; a service with
``autoscale.profiles: <out>/profiles.json`` partitions its loaders from it. ``--model`` also
profiles the model (``commands._profile_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands import _profile_model
from megascale_data_ext.commands._config_args import add_config_arguments, fail, load_data_config
from megascale_data_ext.commands._plotting import pyplot
from megascale_data_ext.dataplane.profiles import SourceProfile
from megascale_data_ext.errors import MegascaleDataError
from megascale_data_ext.sources.profiling import process_memory, profile_source, profile_sources

__all__ = ["add_arguments", "plot", "process_memory", "profile_source", "run"]

NAME = "profile"
HELP = "measure every source's transform latency, access-state and buffer memory (auto-partitioning input)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="profiles", help="directory of profiles.json and profiles.png")
    parser.add_argument("--samples", type=int, default=64, help="samples read per source")
    parser.add_argument("--batch", type=int, default=16, help="samples per read call (as a loader's plan)")
    parser.add_argument("--force", action="store_true", help="measure again even where the journal is current")
    parser.add_argument("--per-kind", type=int, default=0,
                        help="measure this many sources per kind (same format and settings), the rest from their "
                             "metadata and the measured ones' rates (0: measure every source)")
    parser.add_argument("--json", action="store_true", help="print the profiles as JSON")
    _profile_model.add_model_arguments(parser)


def plot(profiles: list[SourceProfile], path: Path) -> None:
    plt = pyplot()

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


def preview_partition(config: Any, profiles: list[SourceProfile]) -> str:
    """What ``autoscale.enabled`` would start with these profiles, this machine as the one node."""
    from megascale_data_ext.dataplane.partitioner import NodeResources
    from megascale_data_ext.runtime.autoscale_plan import partition_for

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * config.autoscale.node_memory_fraction
    node = NodeResources(name="this-machine", memory_bytes=int(memory), cpus=float(os.cpu_count() or 1))
    try:
        parts = partition_for(config, profiles, [node])
    except MegascaleDataError as exc:
        return f"partition (autoscale.*, this machine as one node): {exc}"
    names = config.source_names
    lines = [f"partition (autoscale.*, this machine as one node): {len(names)} sources -> "
             f"{len(parts.assignments)} loader actors"]
    for a in parts.assignments:
        members = ", ".join(names[sh.source] + (f"[{sh.shard}/{sh.num_shards}]" if sh.num_shards > 1 else "")
                            for sh in a.shards)
        lines.append(f"  actor {a.actor}: {a.workers} worker(s), {a.memory_bytes / 2**20:,.0f} MiB, "
                     f"{a.load_s * 1e3:.1f} ms/step: {members}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.samples < 1 or args.batch < 1:
        return fail(ValueError(f"--samples and --batch must be >= 1, got {args.samples}, {args.batch}"))
    try:
        service_config = load_data_config(args).to_service_config()
        specs = service_config.sources
        out = Path(args.out)
        journal_path = out / "profiles.json"
        profiles, measured, stale = profile_sources(
            specs, journal_path, samples=args.samples, batch=args.batch, force=args.force,
            measure_per_kind=max(0, args.per_kind), progress=lambda line: print(line, file=sys.stderr, flush=True))
    except MegascaleDataError as exc:
        return fail(exc)
    plot(profiles, out / "profiles.png")
    reused = len(specs) - len(measured)
    if args.json:
        print(json.dumps({"journal": str(journal_path), "measured": measured, "stale": stale,
                          "profiles": [p.to_dict() for p in profiles]}, indent=1))
    else:
        print(f"{'source':24} {'P ms':>8} {'T ms':>7} {'M_d MiB':>8} {'KiB/sample':>10} {'samples/s':>10}")
        for p in profiles:
            print(f"{p.name:24} {p.latency_s * 1e3:8.3f} {p.overhead_s * 1e3:7.3f} "
                  f"{p.access_state_bytes / 2**20:8.1f} {p.bytes_per_sample / 2**10:10.1f} {p.throughput:10.0f}")
        print(f"journal {journal_path} ({len(measured)} measured, {reused} reused"
              f"{', stale: ' + ', '.join(stale) if stale else ''}); plot {out / 'profiles.png'}")
        print(preview_partition(service_config, profiles))
    if getattr(args, "model", False):
        return int(_profile_model.run_model_profile(args) or 0)
    return 0
