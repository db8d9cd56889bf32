"""`megascale-data bench startup`: time to the first microbatch, Megatron's builder vs this service.

For each ``--prefixes`` count, seeded long-short documents (`sources.demo_data.document_lengths`,
ending with EOD) are written as that many Megatron ``.bin/.idx`` prefixes with megatron-core's
``IndexedDatasetBuilder`` (kept in ``--workdir`` and reused by a later run), and on the same
prefixes, each from start to the first microbatch of DP rank 0 (imports excluded on both sides):

* **megatron cold**: ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` over the equal-weight blend
  with an empty ``path_to_cache`` (what rank 0 does: build and save the indices, C++ helpers),
  then the blended dataset's sample 0. **megatron warm**: the same with the cache present (what
  every other rank does after the barrier).
* **service in-process**: `InProcessService` (no Ray) to constructor output for rank 0.
* **service Ray cold / journal**: `DataService` with ``autoscale.enabled`` (sources profiled
  and partitioned into loader actors) on embedded Ray, through a trainer `Client`; cold = no
  profile journal yet (written at the end of that start), journal = the same start again with
  it present. Each start has a Ray of its own, as each job launch has (`fresh_ray`: Ray's
  prestarted workers free for its actors); ``ray.init`` is reported apart (``ray_init_s``: the
  cold start's).
* **Ray calls per step** (``ray_calls_per_step``): after the journal start's first microbatch,
  every fetching rank takes `CALL_STEPS` steps; the calls the actors made to each other
  (`DataService.ray_calls`: plans, routes, metadata, fetches) over them, per step. The
  trainer's own calls (one ``get_step`` per fetching rank per step) are not in it. By kind:
  the JSON's ``ray_calls_by_kind``.
* **actor memory** (``planner_mib``, ``loaders_mib``, ``constructors_mib``): after those steps,
  the private memory (``smaps_rollup`` Private_Clean + Private_Dirty: no shared libraries or
  object-store pages other processes map) of the Planner, of all loader actors and of all
  constructors, summed per role.

Rows: ``prefixes, documents, megatron_cold_s, megatron_warm_s, service_inproc_s,
service_ray_cold_s, service_ray_journal_s, ray_init_s, ray_calls_per_step, planner_mib, loaders_mib,
constructors_mib``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.commands._plotting import pyplot

NAME = "bench startup"
HELP = "Seconds to the first microbatch vs the number of Megatron prefixes: Megatron's builder vs this service."

ROW_KEYS = ("prefixes", "documents", "megatron_cold_s", "megatron_warm_s", "service_inproc_s", "service_ray_cold_s",
            "service_ray_journal_s", "ray_init_s", "ray_calls_per_step", "planner_mib", "loaders_mib",
            "constructors_mib")
NUM_MICROBATCHES = 4
CALL_STEPS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefixes", type=int, nargs="+", default=[8, 64, 256, 1024],
                        help="Megatron prefixes in the blend, one row each (8 64 256 1024)")
    parser.add_argument("--docs", type=int, default=512, help="documents per prefix (512)")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel ranks the service serves (8)")
    parser.add_argument("--seq-length", type=int, default=4096, help="context length L (4096)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, help="plot seconds vs prefixes here (PNG)")
    parser.add_argument("--workdir", type=Path, help="where the prefixes and caches go (default: a temp dir)")
    parser.add_argument("--prestart-workers", action="store_true",
                        help="let the embedded Ray prestart a worker per CPU (data.ray.prestart_workers=true)")
    parser.add_argument("--skip-ray", action="store_true", help="leave out the Ray service (its columns are null)")


def _progress(msg: str) -> None:
    print(f"[bench startup] {msg}", file=sys.stderr, flush=True)


# -- data --------------------------------------------------------------------------------
def write_prefixes(out: Path, *, prefixes: int, docs: int, seq_length: int, seed: int) -> list[str]:
    """`prefixes` seeded Megatron prefixes of `docs` long-short documents each (reused when present)."""
    from megascale_data_ext.commands.bench_throughput import EOD_ID, TOKEN_OFFSET, VOCAB_SIZE
    from megascale_data_ext.sources.demo_data import document_lengths
    from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

    done = out / "complete.json"
    names = [str(out / f"p{i:05d}" / "text_document") for i in range(prefixes)]
    if done.exists() and json.loads(done.read_text()) == {"prefixes": prefixes, "docs": docs, "seed": seed}:
        return names
    shutil.rmtree(out, ignore_errors=True)
    for child, prefix in zip(np.random.SeedSequence(seed).spawn(prefixes), names, strict=True):
        rng = np.random.default_rng(child)
        lengths = document_lengths(rng, docs, max_len=max(2 * seq_length, 2001))
        tokens = rng.integers(TOKEN_OFFSET, VOCAB_SIZE, int(lengths.sum()) + docs).astype(np.int64)
        ends = np.cumsum(lengths + 1)
        tokens[ends - 1] = EOD_ID
        write_indexed_dataset(prefix, np.split(tokens, ends[:-1]), vocab_size=VOCAB_SIZE)
    done.write_text(json.dumps({"prefixes": prefixes, "docs": docs, "seed": seed}))
    return names


# -- Megatron ----------------------------------------------------------------------------
def time_megatron(prefixes: list[str], *, cache: Path, seq_length: int, samples: int, seed: int) -> float:
    """Seconds for Megatron's blended GPTDataset build (cache at `cache`) plus its first sample."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megascale_data_ext.commands.bench_throughput import _EodTokenizer

    t0 = time.perf_counter()
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, [1.0] * len(prefixes)), split="100,0,0",
        tokenizer=_EodTokenizer(), reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=str(cache))
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()
    first = train[0]
    assert int(first["tokens"].numel()) == seq_length
    return time.perf_counter() - t0


def megatron_times(prefixes: list[str], *, cache: Path, seq_length: int, samples: int, seed: int
                   ) -> tuple[float, float]:
    """(cold, warm) seconds: rank 0's build into an empty cache, then another rank's from the cache."""
    import torch.distributed as dist

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    own_pg = not dist.is_initialized()
    if own_pg:  # BlendedDataset's cache logic asks torch.distributed for the rank
        dist.init_process_group("gloo", init_method=f"file://{cache / 'pg'}", rank=0, world_size=1)
    try:
        cold = time_megatron(prefixes, cache=cache, seq_length=seq_length, samples=samples, seed=seed)
        warm = time_megatron(prefixes, cache=cache, seq_length=seq_length, samples=samples, seed=seed)
    finally:
        if own_pg:
            dist.destroy_process_group()
    return cold, warm


# -- the service -------------------------------------------------------------------------
def service_config(prefixes: list[str], *, dp: int, seq_length: int, seed: int, journal: Path | None,
                   namespace: str, prestart_workers: bool = False) -> Any:
    """`bench throughput`'s token-budget service config over `prefixes`, autoscaled, journal at `journal`."""
    from megascale_data_ext.commands.bench_throughput import service_config as throughput_config

    cfg = throughput_config(prefixes, strategy="llm_balance", seq_length=seq_length, seed=seed,
                            attention_mask=False, dp=dp, autoscale=True)
    return dataclasses.replace(cfg, autoscale=dataclasses.replace(cfg.autoscale, profiles=journal and str(journal)),
                               ray=dataclasses.replace(cfg.ray, namespace=namespace, prestart_workers=prestart_workers))


def _tree(dp: int) -> Any:
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree

    return ClientPlaceTree.from_sizes(dp=dp)


def time_inprocess(config: Any, dp: int) -> float:
    """Seconds from building an `InProcessService` to rank 0's first microbatch."""
    from megascale_data_ext.runtime.inprocess import InProcessService

    t0 = time.perf_counter()
    service = InProcessService(config, _tree(dp))
    service.get(0, 0, service.topology.fetch_ranks()[0])
    return time.perf_counter() - t0


def fresh_ray(config: Any) -> float:
    """A Ray of its own for one service start, as each job launch has: the one before shut down
    (its workers gone), this one started as the service starts it. Returns `ray.init`'s seconds.

    One Ray for every start (as before the thirteenth session) left the later starts without the
    worker processes Ray prestarts (the earlier services' actors had taken them): their actors
    waited for cold processes a job's first service never waits for."""
    import ray

    from megascale_data_ext.runtime.embedded_ray import init_ray

    if ray.is_initialized():
        ray.shutdown()
    t0 = time.perf_counter()
    init_ray(config.ray, log_to_driver=False)  # as the service starts it
    return time.perf_counter() - t0


def time_ray(config: Any, dp: int, *, count_calls: bool = False) -> tuple[float, dict[str, float] | None]:
    """Seconds from constructing a `DataService` (Ray already up) to rank 0's first microbatch via a
    `Client`; with `count_calls`, also the actors' Ray calls per step over `CALL_STEPS` further steps
    of every fetching rank (`runtime.calls.calls_per_step`), else None."""
    from megascale_data_ext.runtime.calls import calls_per_step
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.runtime.service import DataService

    t0 = time.perf_counter()
    service = DataService(config, _tree(dp), progress=_progress)
    try:
        handles = service.start()
        ranks = service.topology.fetch_ranks()
        client = Client.connect(handles, ranks[0], num_microbatches=NUM_MICROBATCHES, broadcast=False)
        client.next_microbatch()
        seconds = time.perf_counter() - t0
        if not count_calls:
            return seconds, None
        clients = [client] + [Client.connect(handles, r, num_microbatches=NUM_MICROBATCHES, broadcast=False)
                              for r in ranks[1:]]
        for c in clients:  # the rest of step 0
            for _ in range(NUM_MICROBATCHES - (c is client)):
                c.next_microbatch()
        before = service.ray_calls()
        for _ in range(CALL_STEPS * NUM_MICROBATCHES):
            for c in clients:
                c.next_microbatch()
        calls = calls_per_step(before, service.ray_calls(), CALL_STEPS)
        return seconds, {**calls, "memory_mib": actor_memory(service.actors())}
    finally:
        service.stop()


def actor_memory(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Private MiB per role (``planner``, ``loaders``, ``constructors``) of the service's actors on this machine."""
    from megascale_data_ext.commands._proc_stats import private_mib

    out = {"planner": 0.0, "loaders": 0.0, "constructors": 0.0}
    role_of = {"planner": "planner", "loader": "loaders", "shadow": "loaders", "constructor": "constructors"}
    for row in rows:
        mib = private_mib(int(row["pid"])) if row.get("pid") else None
        if mib is not None:
            out[role_of[str(row["role"]).split("/")[0]]] += mib
    return out


# -- the run -----------------------------------------------------------------------------
def measure(n: int, args: argparse.Namespace, work: Path, calls_by_kind: dict[int, dict[str, float]] | None = None
            ) -> dict[str, Any]:
    """One row: every loader on `n` generated prefixes (the Ray calls per step by kind go to `calls_by_kind`)."""
    t0 = time.perf_counter()
    prefixes = write_prefixes(work / f"data-{n}", prefixes=n, docs=args.docs, seq_length=args.seq_length,
                              seed=args.seed)
    _progress(f"{n} prefixes x {args.docs} documents ready in {time.perf_counter() - t0:.1f} s")
    samples = 100 * args.dp * NUM_MICROBATCHES  # 100 steps
    megatron_error = None
    try:
        cold, warm = megatron_times(prefixes, cache=work / f"megatron-cache-{n}", seq_length=args.seq_length,
                                    samples=samples, seed=args.seed)
        _progress(f"{n} prefixes: megatron cold {cold:.2f} s, warm {warm:.2f} s")
    except OSError as exc:  # e.g. EMFILE: Megatron's reader keeps descriptors open per prefix
        import gc

        gc.collect()  # its half-built datasets' maps and descriptors, before the service opens the same files
        cold = warm = None
        megatron_error = f"{type(exc).__name__}: {exc}"
        _progress(f"{n} prefixes: megatron's builder failed: {megatron_error}")
    ns = f"bench-startup-{os.getpid()}-{n}"
    inproc = time_inprocess(service_config(prefixes, dp=args.dp, seq_length=args.seq_length, seed=args.seed,
                                           journal=None, namespace=ns), args.dp)
    _progress(f"{n} prefixes: service in-process {inproc:.2f} s")
    row = {"prefixes": n, "documents": n * args.docs, "megatron_cold_s": cold, "megatron_warm_s": warm,
           "service_inproc_s": inproc, "service_ray_cold_s": None, "service_ray_journal_s": None, "ray_init_s": None,
           "ray_calls_per_step": None, "planner_mib": None, "loaders_mib": None, "constructors_mib": None}
    if megatron_error is not None:
        row["megatron_error"] = megatron_error
    if not args.skip_ray:
        journal = work / f"profiles-{n}.json"
        journal.unlink(missing_ok=True)
        configs = [service_config(prefixes, dp=args.dp, seq_length=args.seq_length, seed=args.seed, journal=journal,
                                  namespace=f"{ns}-{kind}", prestart_workers=args.prestart_workers)
                   for kind in ("cold", "journal")]
        row["ray_init_s"] = fresh_ray(configs[0])
        row["service_ray_cold_s"], _ = time_ray(configs[0], args.dp)
        _progress(f"{n} prefixes: Ray service cold {row['service_ray_cold_s']:.2f} s (ray.init {row['ray_init_s']:.2f} s "
                  "apart)")
        ray_init = fresh_ray(configs[1])
        row["service_ray_journal_s"], calls = time_ray(configs[1], args.dp, count_calls=True)
        _progress(f"{n} prefixes: Ray service with journal {row['service_ray_journal_s']:.2f} s (ray.init "
                  f"{ray_init:.2f} s apart)")
        memory = calls.pop("memory_mib")
        row["ray_calls_per_step"] = calls["total"]
        row.update({f"{role}_mib": round(mib, 1) for role, mib in memory.items()})
        _progress(f"{n} prefixes: actor memory (private MiB) " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items()))
        if calls_by_kind is not None:
            calls_by_kind[n] = calls
        _progress(f"{n} prefixes: Ray calls per step {calls['total']:.1f} ("
                  + ", ".join(f"{k} {v:.1f}" for k, v in calls.items() if k != "total") + ")")
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """Both sides per size and the service / Megatron-cold ratios."""
    head = ["prefixes", "documents", "megatron cold", "megatron warm", "in-process", "ray cold", "ray journal",
            "ray.init", "in-proc/mcold", "ray cold/mcold", "ray journal/mcold", "ray calls/step",
            "MiB planner/loaders/constructors"]

    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f} s"

    def ratio(x: float | None, ref: float) -> str:
        return "n/a" if x is None or not ref else f"{x / ref:.2f}x"

    lines = [head]
    for r in rows:
        ref = r["megatron_cold_s"]
        lines.append([str(r["prefixes"]), f"{r['documents']:,}", sec(ref), sec(r["megatron_warm_s"]),
                      sec(r["service_inproc_s"]), sec(r["service_ray_cold_s"]), sec(r["service_ray_journal_s"]),
                      sec(r["ray_init_s"]), ratio(r["service_inproc_s"], ref), ratio(r["service_ray_cold_s"], ref),
                      ratio(r["service_ray_journal_s"], ref),
                      "n/a" if r["ray_calls_per_step"] is None else f"{r['ray_calls_per_step']:.1f}",
                      "n/a" if r["planner_mib"] is None else
                      f"{r['planner_mib']:.0f}/{r['loaders_mib']:.0f}/{r['constructors_mib']:.0f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Seconds to the first microbatch vs prefixes, log-log, one curve per loader."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["prefixes"] for r in rows]
    for key, label, style in (("megatron_cold_s", "Megatron cold build + first batch", "o-"),
                              ("megatron_warm_s", "Megatron warm (cache present)", "o--"),
                              ("service_inproc_s", "service in-process", "s-"),
                              ("service_ray_cold_s", "service on Ray, autoscale, no journal", "^-"),
                              ("service_ray_journal_s", "service on Ray, journal present", "^--")):
        pts = [(xi, r[key]) for xi, r in zip(x, rows, strict=True) if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("Megatron .bin/.idx prefixes in the blend")
    ax.set_ylabel("seconds to the first microbatch")
    ax.set_title("Start-up vs blend size (ray.init excluded)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from megascale_data_ext.errors import ConfigError

    problems = [f"`--{k.replace('_', '-')}` must be a positive integer, got {getattr(args, k)!r}"
                for k in ("docs", "dp", "seq_length") if getattr(args, k) < 1]
    problems += [f"`--prefixes` must be positive integers, got {n!r}" for n in args.prefixes if n < 1]
    if problems:
        raise ConfigError("invalid bench startup arguments:\n  - " + "\n  - ".join(problems))
    import torch  # noqa: F401  # imports are excluded on both sides: the driver of a trainer has torch
    from megatron.core.datasets import blended_megatron_dataset_builder, gpt_dataset  # noqa: F401

    work = args.workdir or Path(tempfile.mkdtemp(prefix="megascale-bench-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    by_kind: dict[int, dict[str, float]] = {}
    try:
        for n in args.prefixes:
            rows.append(measure(n, args, work, by_kind))
            if args.json:  # after every size: a long run interrupted keeps its rows
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items() if not k.startswith("_")},
                                                 "rows": rows, "ray_calls_by_kind": by_kind}, indent=2))
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    print(format_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0
