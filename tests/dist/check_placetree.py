"""Per-rank check, run under torchrun: ClientPlaceTree.from_megatron() equals Megatron's groups.

Each ``--layout`` (e.g. ``tp=2,pp=2`` or ``cp=2,order=tp-pp-cp-dp``; dp is derived from the
world) is initialised in turn with ``parallel_state.initialize_model_parallel`` on gloo, checked,
and destroyed, so one torchrun covers many layouts without paying the imports again. Every rank
compares its tree's coordinates and group ranks with Megatron's getters and with
``torch.distributed.get_process_group_ranks`` of Megatron's process groups; all ranks then
gather their verdicts and the tree they built, and exit 1 with a message on any mismatch.

    python -m torch.distributed.run --standalone --nproc_per_node 8 \\
        tests/dist/check_placetree.py --layout tp=2,pp=2 --layout tp=2,cp=2
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megascale_data_ext.dataplane.distribution import Distribution
from megascale_data_ext.dataplane.placetree import ClientPlaceTree

_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
         "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
         "vpp": "virtual_pipeline_model_parallel_size", "order": "order"}


def parse_layout(text: str) -> dict[str, Any]:
    """``"tp=2,pp=2,order=tp-pp-dp"`` -> keyword arguments of initialize_model_parallel."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in _KEYS:
            raise SystemExit(f"unknown layout key {key!r} in {text!r}; allowed: {sorted(_KEYS)}")
        out[_KEYS[key]] = value if key == "order" else int(value)
    return out


def megatron_view() -> tuple[dict[str, int], dict[str, list[int]]]:
    """This rank's coordinates and group ranks, as Megatron's public getters report them."""
    coords = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
    }
    pg = dist.get_process_group_ranks
    groups = {
        "tp": pg(ps.get_tensor_model_parallel_group()),
        "cp": pg(ps.get_context_parallel_group()),
        "dp": pg(ps.get_data_parallel_group()),
        "pp": pg(ps.get_pipeline_model_parallel_group()),
        "dp-cp": pg(ps.get_data_parallel_group(with_context_parallel=True)),
        "tp-cp": pg(ps.get_tensor_and_context_parallel_group()),
        "mp": pg(ps.get_model_parallel_group()),
        "tp-dp": pg(ps.get_tensor_and_data_parallel_group()),
        "tp-dp-cp": pg(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        "ep": pg(ps.get_expert_model_parallel_group()),
        "edp": pg(ps.get_expert_data_parallel_group()),
        "etp": pg(ps.get_expert_tensor_parallel_group()),
    }
    return coords, {k: sorted(v) for k, v in groups.items()}


def check_layout(layout: str) -> list[str]:
    """Initialise ``layout``, compare, destroy; returns this rank's problems."""
    rank = dist.get_rank()
    ps.initialize_model_parallel(**parse_layout(layout), create_gloo_process_groups=False)
    try:
        tree = ClientPlaceTree.from_megatron()
        coords, groups = megatron_view()
        problems = []
        if tree.coords(rank) != coords:
            problems.append(f"coords {tree.coords(rank)} != megatron {coords}")
        for name, ranks in groups.items():
            if tree.group(name, rank) != ranks:
                problems.append(f"group {name}: tree {tree.group(name, rank)} != megatron {ranks}")
        if tree.vpp != ps.get_virtual_pipeline_model_parallel_world_size():
            problems.append(f"vpp {tree.vpp} != megatron {ps.get_virtual_pipeline_model_parallel_world_size()}")
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        expect_fetch = (first or last) and coords["tp"] == 0
        megatron_way = Distribution()  # Megatron's get_batch: TP rank 0 of the first and last stage reads
        if megatron_way.fetches(tree, rank) != expect_fetch:
            problems.append(f"fetches {megatron_way.fetches(tree, rank)} but first={first} last={last} "
                            f"tp={coords['tp']}")
        if megatron_way.broadcast_source(tree, rank) != ps.get_tensor_model_parallel_src_rank():
            problems.append(f"broadcast_source {megatron_way.broadcast_source(tree, rank)} != "
                            f"get_tensor_model_parallel_src_rank() {ps.get_tensor_model_parallel_src_rank()}")
        # Every rank must have built the same tree (the inferred order may differ in spelling
        # only if it gives identical groups, so compare the per-rank group tables).
        tables: list[Any] = [None] * dist.get_world_size()
        table = [(r, tree.coords(r), [tree.group(g, r) for g in groups]) for r in range(tree.world_size)]
        dist.all_gather_object(tables, (tree.layout(), table))
        if any(t != tables[0] for t in tables):
            problems.append("ranks built different trees")
        if rank == 0:
            print(f"[{layout}] -> {tree!r}\n{tree.describe(fetching=megatron_way.fetch_ranks(tree))}", flush=True)
        return [f"rank {rank} [{layout}]: {p}" for p in problems]
    finally:
        ps.destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", action="append", required=True, help="e.g. tp=2,pp=2 (repeatable)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    failed = False
    try:
        for layout in args.layout:
            problems = check_layout(layout)
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, problems)
            flat = [p for per_rank in everyone for p in per_rank]
            if flat:
                failed = True
                if dist.get_rank() == 0:
                    print("MISMATCH\n" + "\n".join(flat), file=sys.stderr, flush=True)
            elif dist.get_rank() == 0:
                print(f"OK [{layout}]", flush=True)
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
