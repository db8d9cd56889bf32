"""`megascale-data plan`: run the real Planner ahead of time and write its plans for replay mode.

The training config (``conf/train_gpt.yaml`` with overrides by default, a YAML file, or
``--config-dir/--config-name``; see `commands._config_args`) gives the data node and the
parallel layout (``--tp/--pp/--cp/--vpp`` override it); ``--world-size`` gives the number of
ranks. A service started with ``data.replay_dir=DIR`` then serves exactly these plans without planning.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megascale_data_ext.commands._config_args import (
    add_config_arguments,
    add_layout_arguments,
    compose_from_args,
    fail,
    layout_tree,
)
from megascale_data_ext.errors import ConfigError, MegascaleDataError

NAME = "plan"
HELP = "Write the step plans of a training config to a directory (replay mode: data.replay_dir)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, required=True, help="steps to plan (0 .. steps-1)")
    parser.add_argument("--out", type=Path, required=True, help="directory for manifest.json and step_*.npz")
    add_layout_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from megascale_data_ext.config import load_config
    from megascale_data_ext.dataplane.plan_store import PlanStore
    from megascale_data_ext.runtime.inprocess import InProcessService

    if args.steps < 1:
        return fail(ConfigError(f"--steps must be >= 1, got {args.steps}"))
    try:
        cfg = compose_from_args(args)
        tree, sizes = layout_tree(cfg, args, what="plan")
        service_cfg = load_config(cfg, context_parallel_size=int(sizes["cp"])).to_service_config()
    except MegascaleDataError as exc:
        return fail(exc)
    if service_cfg.replay_dir is not None:
        return fail(ConfigError("data.replay_dir is set: plan from the live configuration (drop the override)"))
    t0 = time.perf_counter()
    try:
        planner = InProcessService(service_cfg, tree).planner
        store = PlanStore.create(args.out, planner.fingerprint())
    except MegascaleDataError as exc:
        return fail(exc)
    for step in tqdm(range(args.steps), total=args.steps, desc="planning", unit="step", file=sys.stderr):
        store.write(planner.plan(step))
    print(f"wrote {store.num_steps} plans for {tree!r} to {args.out} in {time.perf_counter() - t0:.1f} s; "
          f"replay them with data.replay_dir={args.out}")
    return 0
