"""`megascale-data demo-data`: write the demo sources that conf/sources/demo_*.yaml point at."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "demo-data"
HELP = ("write the demo sources (long-short text Parquet, coyo-like image-text Parquet, Megatron .bin/.idx, "
        "a held-out text source for validation)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("demo_data"), help="root directory (data.data_root)")
    p.add_argument("--rows", type=int, default=600, help="rows per text source")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-image-patches", type=int, default=256)
    p.add_argument("--validation-rows", type=int, default=None,
                   help="rows of the held-out source valid-text (data.validation.sources; default rows // 4, 0 = none)")


def run(args: argparse.Namespace) -> int:
    from megascale_data_ext.sources.demo_data import make_demo_data, validation_spec

    specs = make_demo_data(args.out, seed=args.seed, rows=args.rows, max_image_patches=args.max_image_patches,
                           validation_rows=args.validation_rows)
    if args.validation_rows != 0:
        specs.append(validation_spec(args.out))
    for s in specs:
        print(f"{s.name:16s} {s.format:9s} {', '.join(s.paths)}")
    return 0
