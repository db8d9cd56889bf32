"""`megascale-data` command line: one subcommand per module in `megascale_data_ext.commands`.

Each command module exposes ``NAME`` (e.g. ``"bench balance"`` or ``"prepare"``), ``HELP`` and
``add_arguments(parser)`` plus ``run(args) -> int``. Multi-word names become nested
subcommands, so ``bench balance`` and ``bench planner`` share a ``bench`` group.
Discovery keeps this file untouched as commands are added.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from megascale_data_ext import commands


def _command_modules() -> list:
    mods = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            mods.append(mod)
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megascale-data", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for mod in _command_modules():
        words = mod.NAME.split()
        if len(words) == 1:
            sub = top.add_parser(words[0], help=mod.HELP, description=mod.HELP)
        else:
            group = groups.get(words[0])
            if group is None:
                gp = top.add_parser(words[0], help=f"{words[0]} commands")
                group = groups[words[0]] = gp.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
            sub = group.add_parser(words[1], help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sub)
        sub.set_defaults(_run=mod.run)
    return parser


OUTPUT_FLAGS = ("json", "plot", "out", "output", "model_out")  # serve checks --env-file itself (`check_env_file`)


def output_path_problem(args: argparse.Namespace) -> str | None:
    """Why an output path among the arguments cannot be written (a file where a directory must be, no
    permission), found before the command works for minutes; None when every one can."""
    for flag in OUTPUT_FLAGS:
        value = getattr(args, flag, None)
        if not isinstance(value, (str, Path)) or not str(value):
            continue
        path = Path(value)
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        option = "--" + flag.replace("_", "-")
        if not parent.is_dir():
            return f"{option} {str(path)!r}: {str(parent)!r} is a file, not a directory; name a path inside a directory"
        if not os.access(parent, os.W_OK):
            return f"{option} {str(path)!r}: {str(parent)!r} is not writable; name a path you can write"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow flags (`serve --world-size 4 data.seq_length=2048`): argparse leaves
    # positionals after an option unparsed, and its intermixed parsing refuses subcommands.
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    args._command_line = "megascale-data " + shlex.join(argv)  # results files name the command that made them
    stray = [a for a in extra if a.startswith("-")]
    if extra and (stray or not isinstance(getattr(args, "config", None), list)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.config += extra
    unwritable = output_path_problem(args)
    if unwritable:  # before the work, not a traceback after it
        print(f"error: {unwritable}", file=sys.stderr)
        return 2
    if getattr(args, "plot", None) or args.command == "heatmap":  # before the work, not after it
        from megascale_data_ext.commands._plotting import pyplot
        from megascale_data_ext.errors import ConfigError

        try:
            pyplot()
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from megascale_data_ext.trainer.app import quiet_imports

    quiet_imports()  # megatron-core's TE/Apex fallback notices (demo-data, profile --model, bench gpu-balance)
    from megascale_data_ext.errors import MegascaleDataError

    try:
        return int(args._run(args) or 0)
    except MegascaleDataError as exc:  # bad input: one line that names it, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
