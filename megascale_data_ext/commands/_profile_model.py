"""Model step profiling for `megascale-data profile --model` (contract between the `profile`
command and the cost-model calibration; filled in by the calibration work)."""

from __future__ import annotations

import argparse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the model-profiling part of `megascale-data profile`."""
    parser.add_argument("--model", action="store_true",
                        help="also time the project's model on this machine and fit the cost model")


def run_model_profile(args: argparse.Namespace) -> int:
    raise NotImplementedError("profile --model is being built")
