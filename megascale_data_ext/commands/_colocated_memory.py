"""The per-rank (colocated) baseline of ``bench memory``: real rank processes, each holding its own
blended dataset over S sources and a torch DataLoader with W forked workers, measured from
``/proc`` (see `commands.bench_memory` for what is counted). ``text``: Megatron's BlendedDataset
over Megatron-indexed sources; ``navit``: image-text Parquet sources blended with Megatron's
blending indices, each worker reading (and caching row groups of) the sources it reads.
"""

from __future__ import annotations

import contextlib

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.sources.profiling import process_memory
from megascale_data_ext.trainer.app import quiet_imports  # megatron-core's TE/Apex notices, hidden as the examples' ranks do

MiB = float(1 << 20)


class _Tokenizer:
    """The fields megatron-core's GPTDataset reads from a tokenizer (no text is tokenized)."""

    def __init__(self) -> None:
        from megascale_data_ext.commands.bench_throughput import EOD_ID, PAD_ID, VOCAB_SIZE

        self.eod, self.pad, self.vocab_size = EOD_ID, PAD_ID, VOCAB_SIZE
        self.unique_identifiers = {"class": "megascale_data_ext.commands._colocated_memory._Tokenizer"}


def _rank_process(conn: Any, rank: int, prefixes: list[str], workers: int, seq_length: int, train_samples: int,
                  seed: int, cache: str) -> None:
    """One colocated trainer rank: Megatron's blended dataset + a DataLoader with `workers` workers."""
    quiet_imports()
    import torch
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megascale_data_ext.commands.bench_throughput import MegatronPretrainingSampler

    torch.set_num_threads(1)
    Path(cache).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{cache}/pg{rank}", rank=0, world_size=1)
    conn.send("before")  # the parent measures what the rank holds anyway (torch, Megatron)
    conn.recv()
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=(prefixes, [1.0] * len(prefixes)),
                              split="100,0,0", tokenizer=_Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                              path_to_cache=f"{cache}/idx{rank}")
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, 0, 0], lambda: True, config).build()
    sampler = MegatronPretrainingSampler(total_samples=train_samples, consumed_samples=0, micro_batch_size=1,
                                         data_parallel_rank=0, data_parallel_size=1)
    # fork, as a torchrun rank's DataLoader does on Linux (this process was spawned, so the
    # default here would be spawn: each worker would import torch again and look far bigger)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=workers, persistent_workers=True,
                                         prefetch_factor=2, multiprocessing_context="fork" if workers else None)
    it = iter(loader)
    for _ in range(8 * max(1, workers)):  # every worker has opened the sources and served batches
        next(it)
    conn.send({"pids": [p.pid for p in it._workers] if workers else [], "info": {}})
    conn.recv()  # measured: exit
    del it, loader
    dist.destroy_process_group()


class _BlendedParquet:
    """A per-rank blended dataset over Parquet sources (a torch map-style Dataset, navit workload).

    ``dataset_index`` / ``dataset_sample_index`` come from Megatron's ``build_blending_indices``;
    sample j of source d is ``order[d][j % len(d)]`` (a seeded per-source shuffle). Each process
    that reads (a DataLoader worker) opens the sources it reads on first use and keeps them open
    (its own readers: footers, schema, ``row_group_cache`` decoded row groups per source).
    """

    def __init__(self, specs: list[Any], lengths: list[int], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray, seed: int) -> None:
        self.specs, self.lengths = specs, lengths
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index
        self.order = [np.random.default_rng([seed, d]).permutation(n).astype(np.int32)
                      for d, n in enumerate(lengths)]
        self._sources: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset_index)

    def _source(self, d: int) -> Any:
        src = self._sources.get(d)
        if src is None:
            from megascale_data_ext.sources.registry import open_source

            src = self._sources[d] = open_source(self.specs[d])
        return src

    def cache_state(self) -> tuple[int, int, int]:
        """(row groups cached, row groups a full cache holds over all S sources, cached bytes)."""
        held = nbytes = 0
        want = 0
        for d, spec in enumerate(self.specs):
            src = self._sources.get(d)
            n_rg = src.num_row_groups if src is not None else spec.row_group_cache
            want += min(spec.row_group_cache, n_rg)
            if src is not None:
                st = src.cache_stats()
                held, nbytes = held + st["row_groups"], nbytes + st["bytes"]
        return held, want, nbytes

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        d = int(self.dataset_index[i])
        j = int(self.order[d][int(self.dataset_sample_index[i]) % self.lengths[d]])
        (sample,) = self._source(d).read([j])
        info = torch.utils.data.get_worker_info()
        held, want, nbytes = self.cache_state()
        return {"tokens": torch.from_numpy(sample.tokens), "images": [torch.from_numpy(x) for x in sample.images],
                "worker": info.id if info is not None else -1, "held": held, "want": want, "bytes": nbytes,
                "opened": len(self._sources)}


def _first(batch: list[Any]) -> Any:
    """collate_fn of micro-batch size 1 (variable-size images do not stack)."""
    return batch[0]


def _navit_rank_process(conn: Any, rank: int, specs: list[Any], workers: int, train_samples: int, seed: int,
                        cache: str) -> None:
    """One colocated rank, navit: blended Parquet dataset + a DataLoader with `workers` forked workers.

    Batches are taken until every worker has filled the row-group cache of every source (the
    steady state of a long run), or the sampler ends.
    """
    quiet_imports()
    import torch
    import torch.distributed as dist
    from megatron.core.datasets import helpers

    from megascale_data_ext.commands.bench_throughput import MegatronPretrainingSampler
    from megascale_data_ext.sources.registry import open_source

    torch.set_num_threads(1)
    Path(cache).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{cache}/pg{rank}", rank=0, world_size=1)
    conn.send("before")
    conn.recv()
    lengths = []
    for spec in specs:  # the rank learns the sizes (footers) and closes: the workers open their own readers
        src = open_source(spec)
        lengths.append(len(src))
        src.close()
    weights = np.asarray([spec.weight for spec in specs], dtype=np.float64)
    weights /= weights.sum()  # the mixture, as Megatron normalizes it
    dataset_index = np.zeros(train_samples, dtype=np.int16)
    dataset_sample_index = np.zeros(train_samples, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(specs), train_samples, False)
    train = _BlendedParquet(specs, lengths, dataset_index, dataset_sample_index, seed)
    sampler = MegatronPretrainingSampler(total_samples=train_samples, consumed_samples=0, micro_batch_size=1,
                                         data_parallel_rank=0, data_parallel_size=1)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=workers, persistent_workers=True,
                                         prefetch_factor=2, multiprocessing_context="fork" if workers else None,
                                         collate_fn=_first)
    state: dict[int, tuple[int, int, int, int]] = {}
    batches = 0
    it = iter(loader)
    for batch in it:
        batches += 1
        state[batch["worker"]] = (batch["held"], batch["want"], batch["bytes"], batch["opened"])
        del batch
        if len(state) == max(1, workers) and all(v[0] >= v[1] for v in state.values()):
            break
    info = {"batches": batches, "workers_full": sum(v[0] >= v[1] for v in state.values()),
            "processes": max(1, workers), "row_groups_held": sum(v[0] for v in state.values()),
            "row_groups_full": sum(v[1] for v in state.values()),
            "row_group_mib": sum(v[2] for v in state.values()) / MiB,
            "sources_opened": [v[3] for _, v in sorted(state.items())]}
    conn.send({"pids": [p.pid for p in it._workers] if workers else [], "info": info})
    conn.recv()
    del it, loader
    dist.destroy_process_group()


def measure_colocated(prefixes: list[str], *, ranks: int, workers: int, seq_length: int, train_samples: int,
                      seed: int, cache: Path) -> dict[str, Any]:
    """`ranks` real rank processes at once over `prefixes` (text workload; see `measure_ranks`)."""
    return measure_ranks(_rank_process, (prefixes, workers, seq_length, train_samples, seed, str(cache)), ranks)


def measure_colocated_navit(specs: list[Any], *, ranks: int, workers: int, train_samples: int, seed: int,
                            cache: Path) -> dict[str, Any]:
    """`ranks` real navit rank processes at once over `specs` (see `measure_ranks`)."""
    return measure_ranks(_navit_rank_process, (specs, workers, train_samples, seed, str(cache)), ranks)


def measure_ranks(target: Any, args: tuple, ranks: int) -> dict[str, Any]:
    """`ranks` real rank processes running ``target(conn, rank, *args)`` at once (MiB, per rank).

    A rank's loader memory (``loader_pss``) is the PSS of its process group (main + DataLoader
    workers) after building the blended dataset and serving batches, minus its main's PSS
    before (torch, Megatron and the process group, which a trainer holds anyway). PSS, because
    forked workers share the parent's pages: only what the dataset and the workers' copies
    add is counted. Every rank is measured at the same point (they wait for the parent), so
    the pages the ranks share split the same way before and after.
    """
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for r in range(ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, r, *args), daemon=False)
        p.start()
        child.close()  # the rank holds its end now: if it dies, recv() here raises EOFError instead of waiting forever
        procs.append(p)
        conns.append(parent)
    try:
        for c in conns:
            c.recv()
        before = [process_memory(p.pid) for p in procs]
        for c in conns:
            c.send("go")
        got = [c.recv() for c in conns]
        pids = [g["pids"] for g in got]
        mains = [process_memory(p.pid) for p in procs]
        wk = [[process_memory(pid) for pid in group] for group in pids]
    except (EOFError, BrokenPipeError) as exc:
        raise RuntimeError(f"a measured rank process ({target.__name__}) died before it was measured; its "
                           "traceback is above") from exc
    finally:
        for c in conns:
            with contextlib.suppress(OSError):
                c.send("exit")
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    flat = [w for group in wk for w in group]
    n_w = max(1, len(flat))
    group_after = [m["pss"] + sum(w["pss"] for w in g) for m, g in zip(mains, wk, strict=True)]
    return {"loader_pss": sum(a - b["pss"] for a, b in zip(group_after, before, strict=True)) / ranks / MiB,
            "main_pss_before": sum(b["pss"] for b in before) / ranks / MiB,
            "main_uss": sum(m["uss"] for m in mains) / ranks / MiB,
            "worker_uss": sum(w["uss"] for w in flat) / n_w / MiB if flat else 0.0,
            "worker_pss": sum(w["pss"] for w in flat) / n_w / MiB if flat else 0.0,
            **({"ranks_info": [g["info"] for g in got]} if any(g["info"] for g in got) else {})}


NAVIT_PATCH = 14  # navit-like: 14 x 14 patches (WORKLOADS.md)
NAVIT_MAX_PATCHES = 1024
IMAGE_POOL = 512  # distinct JPEGs the rows draw from (encoding every row's image would take minutes)


def write_navit_sources(out: Path, *, sources: int, row_group_mib: float, row_groups: int, seed: int,
                        weight_sigma: float = 0.5) -> tuple[list[Any], dict[str, Any]]:
    """Seeded navit-like image-text Parquet sources (the project's writer and demo-data helpers).

    Each row: one variable-size JPEG (raw bytes, ``image_sizes`` at twice coyo's scale) drawn
    from a seeded pool of ``IMAGE_POOL`` real JPEGs, and a text 2-6x a coyo caption (longer
    texts than coyo; the factor varies by source). One file per source of ``row_groups`` row
    groups, each sized to about ``row_group_mib`` MiB of payload (text + image bytes, the
    columns a reader decodes). Mixing weights (``spec.weight``) are seeded lognormal with
    ``weight_sigma`` (0 = equal). Returns the specs and what was written.
    """
    from megascale_data_ext.sources.base import SourceSpec
    from megascale_data_ext.sources.demo_data import _text, _word_pool, caption_lengths, image_sizes
    from megascale_data_ext.sources.images import synthetic_jpeg
    from megascale_data_ext.sources.tokenizer import ByteTokenizer
    from megascale_data_ext.sources.writer import IMAGE_COLUMN, TEXT_COLUMN, PreparedParquetWriter

    seeds = np.random.SeedSequence(seed).spawn(sources + 1)
    rng = np.random.default_rng(seeds[-1])
    sizes = image_sizes(rng, IMAGE_POOL, scale=2.0)
    pool = [synthetic_jpeg(int(w), int(h), seed=int(rng.integers(2**31))) for w, h in sizes]
    pool_bytes = np.asarray([len(b) for b in pool], dtype=np.float64)
    weights = rng.lognormal(0.0, weight_sigma, sources) if weight_sigma > 0 else np.ones(sources)
    tok = ByteTokenizer()
    specs, rows_written, bytes_written = [], 0, 0
    for k in range(sources):
        rng = np.random.default_rng(seeds[k])
        words = _word_pool(rng)
        factor = 2 + k % 5
        texts = caption_lengths(rng, int(4 * row_group_mib * MiB / pool_bytes.mean()) * row_groups + 1) * factor
        picks = rng.integers(0, IMAGE_POOL, len(texts))
        # rows per row group: cumulative payload (image + text bytes) of the rows reaches the size
        rg_rows = max(1, int(np.searchsorted(np.cumsum(pool_bytes[picks] + texts), row_group_mib * MiB)))
        n = min(len(texts), rg_rows * row_groups)
        src_dir = out / f"navit-{k}"
        with PreparedParquetWriter(src_dir, kind="image-text", tokenizer=tok, patch_size=NAVIT_PATCH,
                                   max_image_patches=NAVIT_MAX_PATCHES, row_group_rows=rg_rows,
                                   rows_per_file=n) as w:
            for i in range(n):
                w.add(_text(rng, words, int(texts[i])), [pool[int(picks[i])]])
        rows_written += w.summary.rows
        bytes_written += w.summary.bytes
        specs.append(SourceSpec(name=f"navit{k}", format="parquet", paths=[str(src_dir)], text_column=TEXT_COLUMN,
                                image_column=IMAGE_COLUMN, patch_size=NAVIT_PATCH,
                                max_image_patches=NAVIT_MAX_PATCHES, weight=float(weights[k])))
    return specs, {"rows": rows_written, "file_mib": round(bytes_written / MiB, 1), "image_pool": IMAGE_POOL,
                   "image_pool_mean_bytes": round(float(pool_bytes.mean())), "weight_sigma": weight_sigma,
                   "weights": [round(float(x), 4) for x in weights]}


def row_group_mib_measured(spec: Any) -> float:
    """Decoded size (MiB) of one row group of `spec` (read through the source, as loaders read it)."""
    from megascale_data_ext.sources.registry import open_source

    src = open_source(spec)
    try:
        src.read([0])
        st = src.cache_stats()
        return st["bytes"] / max(1, st["row_groups"]) / MiB
    finally:
        src.close()


def shared_once(mems: list[dict[str, int]]) -> float:
    """Shared pages counted once (MiB): the largest non-private set of any one of the processes."""
    return max((m["rss"] - m["uss"] for m in mems), default=0) / MiB


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x through the measured points (exact for two, least squares beyond)."""
    if len(xs) == 1:  # no slope to measure: flat in S (never grows the baseline beyond what was measured)
        return ys[0], 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)
