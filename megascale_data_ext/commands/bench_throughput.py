"""`megascale-data bench throughput`: Megatron's own loader vs this service, same data, same run.

One seeded long-short blend of pre-tokenized Megatron ``.bin/.idx`` sources (documents end
with EOD, as ``preprocess_data.py --append-eod`` writes them) is consumed twice:

* **megatron**: ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` exactly as
  ``pretrain_gpt.py`` builds it (index build with the C++ helpers on "rank 0" of a one-process
  gloo group, ``.npy`` cache in the temp dir), then a torch ``DataLoader`` with a
  ``MegatronPretrainingSampler``-style sequential batch sampler and one worker.
* **service (<strategy>)**: a `DataService` on embedded Ray (``num_cpus=2``) over the same
  prefixes (``format="megatron"``, ``append_eod=False``); one consumer process plays every
  fetching rank of a DP tree with the trainer's own path: a `Client` per rank
  (``Client.connect``), whole steps per call with `fault_tolerance.client_prefetch` (4) steps
  prefetched, torch tensors out.
  ``llm_balance`` runs in token-budget mode (``tokens_per_step = dp·m·L``, documents split
  across microbatches as Megatron's windows split them); ``vanilla`` takes one whole document
  (truncated to L) per microbatch.

Both deliver ``steps × dp × m`` microbatches. Megatron's are fixed ``seq_length`` windows
cut across documents (every position a real token); the service's are packed microbatches, so
the token count is the non-pad positions.

Measured per loader: time to first batch (index build or service start included, and for the
service also from after ``ray.init``), delivered tokens/s after the first batch, per-fetch
latency p50/p99, the trainer's wait per (rank, step) (its m microbatches), and CPU seconds
after the first batch: "loader CPU" is the DataLoader worker + main process for Megatron and
the Ray actors (loaders, planner, constructors; pids via ``__ray_call__``) for the service;
"all-in CPU" adds the consumer and every descendant process (raylet, GCS, idle workers).
"actor RSS (MiB)" sums VmRSS over the loading processes (Megatron's DataLoader worker; every
service actor) at the end of the run, shared pages counted in each. ``ray_calls_per_step``: the
Ray calls the service's actors made to each other from the first batch to the last, per step,
by kind (`DataService.ray_calls`; the trainer's own calls are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megascale_data_ext.commands._proc_stats import CpuMeter, cpu_seconds, descendants, rss_mib

NAME = "bench throughput"
HELP = "Tokens/s, fetch latency and CPU of Megatron's GPTDataset loader vs this Ray data service."

EOD_ID, PAD_ID, TOKEN_OFFSET, VOCAB_SIZE = 1, 0, 3, 259  # ByteTokenizer ids: data ids are >= OFFSET
DP, NUM_MICROBATCHES = 2, 4
LARGE = {"sources": 32, "dp": 8, "docs": 1000}  # --large


@dataclass(slots=True, kw_only=True)
class LoaderResult:
    """What one loader delivered and what it cost.

    ``cpu_*`` are CPU seconds (user + system) from the first batch to the last one; the
    ``*_total`` fields include startup (index build / actor start).
    """

    name: str
    batches: int
    tokens: int
    first_batch_s: float
    steady_s: float
    fetch_ms: list[float] = field(repr=False)
    cpu_loader_s: float
    cpu_all_s: float
    cpu_loader_total_s: float
    samples_per_step: int | None = None
    tokens_per_step: int | None = None
    num_microbatches: int = NUM_MICROBATCHES
    step_wait_ms: list[float] = field(default_factory=list, repr=False)
    rss_mib: list[float] = field(default_factory=list)
    first_after_init_s: float = float("nan")
    startup: dict[str, float] = field(default_factory=dict)
    cpu_by_role: dict[str, float] = field(default_factory=dict)
    actors_importing_torch: int = 0
    ray_calls_per_step: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.steady_s if self.steady_s > 0 else float("nan")

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.fetch_ms, q)) if self.fetch_ms else float("nan")

    def metrics(self) -> dict[str, float]:
        per_cpu = self.tokens / self.cpu_loader_s if self.cpu_loader_s > 0 else float("nan")
        per_all = self.tokens / self.cpu_all_s if self.cpu_all_s > 0 else float("nan")
        return {
            "time to first batch (s)": self.first_batch_s,
            "tokens/s (wall)": self.tokens_per_s,
            "tokens per loader CPU-s": per_cpu,
            "tokens per all-in CPU-s": per_all,
            "fetch p50 (ms)": self.percentile_ms(50),
            "fetch p99 (ms)": self.percentile_ms(99),
            "loader CPU s (steady)": self.cpu_loader_s,
            "loader CPU s (incl. startup)": self.cpu_loader_total_s,
            "tokens/microbatch": self.tokens / max(self.batches, 1),
            "actor RSS (MiB)": float(sum(self.rss_mib)) if self.rss_mib else float("nan"),
            "trainer wait per step (ms)": float(np.mean(self.step_wait_ms)) if self.step_wait_ms else float("nan"),
            "first batch after ray.init (s)": self.first_after_init_s,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write both loaders' metrics here")
    parser.add_argument("--quick", action="store_true", help="tiny blend and few steps (smoke test, < 1 min)")
    parser.add_argument("--sources", type=int, default=3, help="Megatron .bin/.idx sources in the blend (3)")
    parser.add_argument("--docs", type=int, default=4000, help="documents per source (4000)")
    parser.add_argument("--seq-length", type=int, default=2048, help="context length L (2048)")
    parser.add_argument("--steps", type=int, default=40, help="global steps of dp × m=4 microbatches (40)")
    parser.add_argument("--dp", type=int, default=DP, help=f"data-parallel ranks the service serves ({DP})")
    parser.add_argument("--no-restart", action="store_true",
                        help="service without fault tolerance (no actor restarts, no per-step planner checkpoint)")
    parser.add_argument("--large", action="store_true",
                        help=f"the larger case: {LARGE['sources']} sources x {LARGE['docs']} docs, DP {LARGE['dp']}")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--autoscale", action="store_true",
                        help="also run each strategy with autoscaled loaders (sources partitioned into loader actors)")
    parser.add_argument("--autoscale-only", action="store_true",
                        help="run the service with autoscaled loaders only (hundreds of sources: one actor per "
                             "source does not fit)")
    parser.add_argument("--strategies", default=None,
                        help="service strategies, comma-separated (default vanilla,llm_balance; --quick: llm_balance)")
    parser.add_argument("--attention-mask", action="store_true", help="build the [s, s] attention mask in both loaders")
    parser.add_argument("--workdir", type=Path, help="where the blend and caches go (default: a temp dir)")


# -- data --------------------------------------------------------------------------------
def write_blend(out: Path, *, sources: int, docs: int, seq_length: int, seed: int) -> list[str]:
    """Seeded long-short documents (ending with EOD) as ``sources`` Megatron prefixes."""
    from megascale_data_ext.sources.demo_data import document_lengths
    from megascale_data_ext.sources.megatron_indexed import write_indexed_dataset

    prefixes = []
    for s, child in enumerate(np.random.SeedSequence(seed).spawn(sources)):
        rng = np.random.default_rng(child)
        lengths = document_lengths(rng, docs, max_len=max(2 * seq_length, 2001))  # long ones span windows
        body = (np.append(rng.integers(TOKEN_OFFSET, VOCAB_SIZE, int(n)), EOD_ID) for n in lengths)
        prefixes.append(write_indexed_dataset(out / f"source{s}" / "text_document", body, vocab_size=VOCAB_SIZE))
    return prefixes


# -- Megatron's path ---------------------------------------------------------------------
class _EodTokenizer:
    """The three fields megatron-core datasets read from a tokenizer (no text is tokenized)."""

    eod, pad, vocab_size = EOD_ID, PAD_ID, VOCAB_SIZE
    unique_identifiers = {"class": "megascale_data_ext.bench_throughput._EodTokenizer"}


class MegatronPretrainingSampler:
    """Megatron-LM's sequential pretraining batch sampler (``megatron/training/datasets/data_samplers.py``).

    Yields this DP rank's ``micro_batch_size`` indices of every ``micro_batch_size × dp``
    consecutive samples, starting at ``consumed_samples``; drops the last partial batch.
    """

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.size)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.size
        lo = self.rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - chunk + 1, chunk):
            yield list(range(start + lo, start + lo + self.micro_batch_size))


def run_megatron(prefixes: list[str], *, seq_length: int, batches: int, seed: int, cache: Path,
                 attention_mask: bool, num_microbatches: int = NUM_MICROBATCHES) -> LoaderResult:
    """Build Megatron's blended GPTDataset and time a one-worker DataLoader over it.

    One loader consumes the whole global stream (dp_size=1 in the sampler), i.e. the work of
    every DP rank's loader, so its tokens and CPU compare with the service serving DP=2.
    """
    import torch
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cache.mkdir(parents=True, exist_ok=True)
    own_pg = not dist.is_initialized()
    if own_pg:  # BlendedDataset's cache logic asks torch.distributed for the rank
        dist.init_process_group("gloo", init_method=f"file://{cache / 'pg'}", rank=0, world_size=1)
    meter = CpuMeter(lambda: [os.getpid(), *descendants()])
    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, blend=(prefixes, [1.0] * len(prefixes)),
            split="100,0,0", tokenizer=_EodTokenizer(), reset_position_ids=True, reset_attention_mask=True,
            eod_mask_loss=False, create_attention_mask=attention_mask, path_to_cache=str(cache),
        )
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [batches, 0, 0], lambda: True, config).build()
        sampler = MegatronPretrainingSampler(total_samples=batches, consumed_samples=0, micro_batch_size=1,
                                             data_parallel_rank=0, data_parallel_size=1)
        loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=1, pin_memory=False)
        it = iter(loader)
        fetch_ms: list[float] = []
        tokens, first = 0, 0.0
        for i in tqdm(range(len(sampler)), desc="megatron", file=sys.stderr, leave=False):
            f0 = time.perf_counter()
            batch = next(it)
            now = time.perf_counter()
            if i == 0:
                first, startup_cpu = now - t0, time.process_time() - cpu0 + cpu_seconds(descendants())
                meter.mark()
                continue
            fetch_ms.append((now - f0) * 1e3)
            tokens += int(batch["tokens"].numel())
        steady = time.perf_counter() - t0 - first
        cpu = meter.since_mark()  # worker still alive: the iterator is not exhausted past len
        rss = rss_mib(descendants())  # the DataLoader worker
        del it, loader
    finally:
        if own_pg:
            dist.destroy_process_group()
    # One rank's step is m consecutive microbatches (the first step holds the startup: left out).
    m = num_microbatches
    waits = [float(np.sum(fetch_ms[g * m - 1:g * m - 1 + m])) for g in range(1, (len(fetch_ms) + 1) // m)]
    return LoaderResult(name="megatron", batches=batches - 1, tokens=tokens, first_batch_s=first, steady_s=steady,
                        fetch_ms=fetch_ms, cpu_loader_s=cpu, cpu_all_s=cpu, cpu_loader_total_s=startup_cpu + cpu,
                        num_microbatches=num_microbatches, step_wait_ms=waits, rss_mib=rss, first_after_init_s=first)


# -- this service ------------------------------------------------------------------------
def _progress(msg: str) -> None:
    print(f"[bench throughput] {msg}", file=sys.stderr, flush=True)


def service_config(prefixes: list[str], *, strategy: str, seq_length: int, seed: int, attention_mask: bool,
                   dp: int = DP, autoscale: bool = False) -> Any:
    """Token-budget steps of dp·m·L tokens, documents split as Megatron's windows (llm_balance), or
    one whole document per microbatch (vanilla); one constructor, as Megatron runs one loader."""
    from megascale_data_ext.runtime.config import AutoscaleConfig, RayConfig, ServiceConfig
    from megascale_data_ext.sources.base import SourceSpec

    tokens = strategy != "vanilla"
    specs = [SourceSpec(name=f"source{i}", format="megatron", paths=[p], append_eod=False, truncate=not tokens,
                        eod_token_id=EOD_ID) for i, p in enumerate(prefixes)]
    return ServiceConfig(
        sources=specs, seed=seed, samples_per_step=dp * NUM_MICROBATCHES, num_microbatches=NUM_MICROBATCHES,
        tokens_per_step=dp * NUM_MICROBATCHES * seq_length if tokens else None, split_documents=tokens,
        seq_length=seq_length, strategy=strategy, strategy_args={"model": "gpt-tiny"}, prefetch=2,
        with_attention_mask=attention_mask, buffer_size=1024,
        constructor_group=dp,
        ray=RayConfig(namespace=f"bench-throughput-{os.getpid()}-{strategy}{'-as' if autoscale else ''}", num_cpus=2),
        autoscale=AutoscaleConfig(enabled=autoscale, profile_samples=16),
    )


_RAY_INIT_S: list[float] = []  # how long this process's ray.init took (it runs once)


def start_ray(config: Any) -> float:
    """Start the embedded Ray once per process (every service of the run shares it, as a job
    would); returns the seconds ``ray.init`` took."""
    import ray

    from megascale_data_ext.runtime.embedded_ray import init_ray

    if not ray.is_initialized():
        _progress("ray.init ...")
        t0 = time.perf_counter()
        init_ray(config.ray, log_to_driver=False)  # as the service starts it
        _RAY_INIT_S[:] = [time.perf_counter() - t0]
        _progress(f"ray.init took {_RAY_INIT_S[0]:.1f} s")
    return _RAY_INIT_S[0] if _RAY_INIT_S else 0.0


def run_service(prefixes: list[str], *, strategy: str, seq_length: int, steps: int, seed: int,
                attention_mask: bool, dp: int = DP, restart: bool = True, autoscale: bool = False) -> LoaderResult:
    """Start a DataService on embedded Ray and consume every step of every fetching rank through
    the trainer's `Client` (whole steps per call, client_prefetch steps ahead)."""
    import ray

    from megascale_data_ext.dataplane.placetree import ClientPlaceTree
    from megascale_data_ext.runtime.calls import calls_per_step
    from megascale_data_ext.runtime.client import Client
    from megascale_data_ext.runtime.service import DataService

    m = NUM_MICROBATCHES
    config = service_config(prefixes, strategy=strategy, seq_length=seq_length, seed=seed,
                            attention_mask=attention_mask, dp=dp, autoscale=autoscale)
    all_meter = CpuMeter(lambda: [os.getpid(), *descendants()])
    init_s = start_ray(config)
    t_init = time.perf_counter()
    t0 = t_init - init_s  # a Ray this process started before counts as started for this service too
    from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig

    service = DataService(config, ClientPlaceTree.from_sizes(dp=dp),
                          fault_tolerance=FaultToleranceConfig(restart=restart))
    startup = {"ray.init (s)": init_s}
    try:
        _progress(f"service {strategy}: starting {len(prefixes)} loaders, planner, "
                  f"{service.topology.num_constructors} constructors ...")
        handles = service.start()
        startup["actors ready (s)"] = time.perf_counter() - t_init
        _progress(f"service {strategy}: actors ready after {startup['actors ready (s)']:.1f} s; first step ...")
        loaders = service.loader_actors()
        actors = [*loaders, service.planner, *service.constructors]
        actor_pids = ray.get([h.__ray_call__.remote(lambda _self: os.getpid()) for h in actors])
        heavy = sum(ray.get([h.__ray_call__.remote(lambda _self: "torch" in sys.modules or "megatron" in sys.modules)
                             for h in actors]))
        nl = len(loaders)
        roles = {"loaders": actor_pids[:nl], "planner": actor_pids[nl:nl + 1], "constructors": actor_pids[nl + 1:]}
        clients = [Client.connect(handles, rank, num_microbatches=m, broadcast=False)
                   for rank in service.topology.fetch_ranks()]
        fetch_ms: list[float] = []
        waits: list[float] = []
        tokens = batches = 0
        first = first_after_init = 0.0
        with tqdm(total=steps * len(clients) * m, desc=f"service {strategy}", file=sys.stderr, leave=False) as bar:
            for step in range(steps):
                for client in clients:
                    w0 = time.perf_counter()
                    for _ in range(m):
                        f0 = time.perf_counter()
                        client.next_microbatch()
                        now = time.perf_counter()
                        bar.update()
                        if first == 0.0:
                            calls0 = service.ray_calls()
                            first, first_after_init = now - t0, now - t_init
                            startup["first batch after actors (s)"] = first_after_init - startup["actors ready (s)"]
                            _progress(f"service {strategy}: first batch {first:.2f} s after start "
                                      f"({first_after_init:.2f} s after ray.init)")
                            startup_cpu = loader_cpu0 = cpu_seconds(actor_pids)
                            role_cpu0 = {k: cpu_seconds(v) for k, v in roles.items()}
                            all_meter.mark()
                            t_first = time.perf_counter()  # after the call count: not in the steady time
                            continue
                        fetch_ms.append((now - f0) * 1e3)
                        tokens += int(client.last_info["tokens"])
                        batches += 1
                    if step > 0:  # step 0 holds the start-up
                        waits.append((time.perf_counter() - w0) * 1e3)
        steady = time.perf_counter() - t_first
        loader_cpu = cpu_seconds(actor_pids) - loader_cpu0
        by_role = {k: cpu_seconds(v) - role_cpu0[k] for k, v in roles.items()}
        all_cpu = all_meter.since_mark()
        rss = rss_mib(actor_pids)
        calls = calls_per_step(calls0, service.ray_calls(), max(steps - 1, 1))
    finally:
        service.stop()
    count_mode = config.tokens_per_step is None
    return LoaderResult(
        name=f"service {strategy}" + (" (autoscale)" if autoscale else "") + ("" if restart else " (no restart)"),
        batches=batches, tokens=tokens,
        first_batch_s=first, steady_s=steady, fetch_ms=fetch_ms, cpu_loader_s=loader_cpu, cpu_all_s=all_cpu,
        cpu_loader_total_s=startup_cpu + loader_cpu, samples_per_step=config.samples_per_step if count_mode else None,
        tokens_per_step=config.tokens_per_step, num_microbatches=m, step_wait_ms=waits, rss_mib=rss,
        first_after_init_s=first_after_init, startup=startup, cpu_by_role=by_role, actors_importing_torch=heavy,
        ray_calls_per_step=calls)


# -- report ------------------------------------------------------------------------------
def format_table(results: list[LoaderResult]) -> str:
    """One row per metric: each loader's value and service / Megatron ratios."""
    base = results[0].metrics()
    others = results[1:]
    head = ["metric", results[0].name, *(r.name for r in others), *(f"{r.name} / megatron" for r in others)]
    rows = [head]
    for key, ref in base.items():
        vals = [r.metrics()[key] for r in others]
        ratios = [v / ref if ref else float("nan") for v in vals]
        rows.append([key, _fmt(ref), *(_fmt(v) for v in vals), *(f"{x:.2f}x" for x in ratios)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def run(args: argparse.Namespace) -> int:
    from megascale_data_ext.errors import ConfigError

    if getattr(args, "large", False):
        args.sources, args.dp, args.docs = LARGE["sources"], LARGE["dp"], min(args.docs, LARGE["docs"])
    if args.quick:  # one Ray start only: on a loaded 2-core box it alone takes ~10-30 s
        args.sources, args.docs, args.seq_length, args.steps = min(args.sources, 2), min(args.docs, 300), 1024, 4
        args.strategies = args.strategies or "llm_balance"
    args.dp = getattr(args, "dp", DP)
    args.strategies = args.strategies or "vanilla,llm_balance"
    problems = [f"`--{k.replace('_', '-')}` must be a positive integer, got {getattr(args, k)!r}"
                for k in ("sources", "docs", "seq_length", "steps", "dp") if getattr(args, k) < 1]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    allowed = ("vanilla", "llm_balance")
    problems += [f"`--strategies`: {s!r} is not one of {allowed} (text-only blend)"
                 for s in strategies if s not in allowed]
    if not os.path.isdir("/proc"):
        problems.append("CPU accounting reads /proc: run this benchmark on Linux")
    if problems:
        raise ConfigError("invalid bench throughput arguments:\n  - " + "\n  - ".join(problems))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="megascale-bench-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prefixes = write_blend(work / "data", sources=args.sources, docs=args.docs, seq_length=args.seq_length,
                           seed=args.seed)
    print(f"[bench throughput] blend: {args.sources} Megatron sources × {args.docs} long-short docs in {work} "
          f"({time.perf_counter() - t0:.1f} s); L={args.seq_length}, DP={args.dp} × m={NUM_MICROBATCHES}, "
          f"{args.steps} steps", file=sys.stderr)
    batches = args.steps * args.dp * NUM_MICROBATCHES
    results = [run_megatron(prefixes, seq_length=args.seq_length, batches=batches, seed=args.seed,
                            cache=work / "megatron-cache", attention_mask=args.attention_mask)]
    try:
        for strategy in strategies:
            for autoscale in ((True,) if getattr(args, "autoscale_only", False)
                              else (False, True) if getattr(args, "autoscale", False) else (False,)):
                results.append(run_service(prefixes, strategy=strategy, seq_length=args.seq_length, steps=args.steps,
                                           seed=args.seed, attention_mask=args.attention_mask, dp=args.dp,
                                           restart=not getattr(args, "no_restart", False), autoscale=autoscale))
    finally:
        import ray

        ray.shutdown()
    print(format_table(results))
    for r in results[1:]:
        per_step = (f"{r.tokens_per_step} tokens per step (documents split as Megatron's windows)"
                    if r.tokens_per_step else f"{r.samples_per_step} documents per step")
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.startup.items())
        roles = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_by_role.items())
        calls = ", ".join(f"{k} {v:.1f}" for k, v in r.ray_calls_per_step.items())
        print(f"{r.name}: {per_step}; start-up: {phases}; steady loader CPU-s by actor: {roles}; "
              f"RSS per actor (MiB): {[round(x) for x in r.rss_mib]}, {r.actors_importing_torch} import torch/megatron; "
              f"Ray calls per step: {calls}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
            "results": [{**{k: v for k, v in asdict(r).items() if k not in ("fetch_ms", "step_wait_ms")},
                         "metrics": r.metrics()} for r in results]}, indent=2, default=str))
    return 0
