"""The command line of the example training scripts, Hydra-style like NeMo's apps.

``examples/pretrain_gpt.py`` and ``examples/pretrain_vlm.py`` are each a train function plus
:func:`run`::

    torchrun --nproc_per_node 4 examples/pretrain_gpt.py --config-dir ./myconf --config-name mytrain \\
        train.train_iters=2 strategy=vanilla +data.ray.resources.loader=1

Flags (everything else is a Hydra override: ``key=value``, ``+key=value``, ``~key``, ``group=option``):

``--config-path PATH`` / ``--config-dir DIR``
    Your own config directory, searched before the package's ``conf/`` (which stays on the
    search path), so your config can take ``defaults: [data: megascale, strategy: llm_balance,
    ray: local, _self_]`` from the package and your own files win. Relative paths are taken from
    the current directory (not from the script's, as ``@hydra.main`` would).
``--config-name NAME``
    The config to compose (default: the script's, e.g. ``train_gpt``).
``--cfg job|hydra|all`` [``--package PKG``] [``--resolve``]
    Print the composed config (or one package of it, e.g. ``data``) as YAML and exit.
``--help``
    Usage, the config groups and their options, the configs found, the search path.

Before torch or megatron-core is imported, :func:`~megascale_data_ext.megatron.preflight.preflight`
checks the parallel layout against the launcher's ``WORLD_SIZE``, the whole ``data`` node and
the Ray address, and reports every problem at once. Training then runs inside
:func:`torch.distributed.elastic.multiprocessing.errors.record`, so torchrun
prints the root cause of a failure (the first failing rank's error file). Our own
:class:`~megascale_data_ext.errors.MegascaleDataError` (a bad config value, a missing source, a
source failing inside the service mid-run: unwrapped from Ray's ``RayTaskError``) is printed as
one line ``error: <Type>: <message> (full log: <path>)`` per rank instead of a traceback, with exit
code 1; the log (``trainer.run_dir.error_log_path``) holds the whole chain, remote tracebacks included.
With ``train.run_dir`` set, rank 0 first writes the composed config and the overrides there
(``.hydra/config.yaml``, ``.hydra/overrides.yaml``, see :mod:`~megascale_data_ext.trainer.run_dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from megascale_data_ext.errors import ConfigError, MegascaleDataError, root_cause
from megascale_data_ext.megatron.preflight import preflight
from megascale_data_ext.trainer import early_start
from megascale_data_ext.trainer.run_dir import error_log_path, resolve_run_paths, write_error_log, write_run_config

TrainFn = Callable[[Any], "list[dict] | None"]


def build_parser(prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """The Hydra-style flags; positional arguments are the overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=False, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides: key=value, +key=value (add a key), ~key (delete), group=option")
    parser.add_argument("-cp", "--config-path", metavar="PATH", default=None,
                        help="your config directory, searched first (the package's conf/ stays on the search path)")
    parser.add_argument("-cd", "--config-dir", metavar="DIR", default=None,
                        help="a config directory searched after --config-path and before the package's conf/")
    parser.add_argument("-cn", "--config-name", metavar="NAME", default=None, help="the config to compose")
    parser.add_argument("-c", "--cfg", choices=("job", "hydra", "all"), default=None,
                        help="print the composed config as YAML and exit (job: without the hydra node)")
    parser.add_argument("-p", "--package", metavar="PKG", default=None,
                        help="with --cfg: print only this package of the config, e.g. data or data.sources")
    parser.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations first")
    parser.add_argument("-h", "--help", action="store_true", help="show this help (config groups included) and exit")
    return parser


def parse_args(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse flags and overrides in any order (argparse exits 2 on an unknown flag)."""
    return (parser or build_parser()).parse_intermixed_args(list(argv))


def search_dirs(args: argparse.Namespace) -> list[Path]:
    """The config directories in search order: --config-path, --config-dir, the package's conf/."""
    from megascale_data_ext.config import conf_dir

    own = [Path(d).expanduser().resolve() for d in (args.config_path, args.config_dir) if d]
    for d in own:
        if not d.is_dir():
            raise ConfigError(f"config directory {str(d)!r} does not exist (--config-path/--config-dir)")
    package = conf_dir()
    return [*[d for d in own if d != package], package]


def compose(args: argparse.Namespace, config_name: str, *, return_hydra_config: bool = False) -> Any:
    """The composed config the arguments name (raises ConfigError naming what Hydra refused)."""
    from megascale_data_ext.config import compose_config

    dirs = search_dirs(args)
    return compose_config(args.overrides, args.config_name or config_name, config_dir=dirs[0],
                          search_path=dirs[1:], return_hydra_config=return_hydra_config)


def format_config_help(args: argparse.Namespace, config_name: str) -> str:
    """The config groups with their options, the top-level configs and the search path."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    from megascale_data_ext.config.hydra import hydra_scope

    dirs = search_dirs(args)
    with hydra_scope(dirs[0], dirs[1:]):
        loader = GlobalHydra.instance().config_loader()

        def groups(parent: str = "") -> list[str]:
            found = []
            for g in loader.list_groups(parent):
                name = f"{parent}/{g}" if parent else g
                if name == "hydra" or name.startswith("hydra/"):
                    continue
                if loader.get_group_options(name, ObjectType.CONFIG):
                    found.append(name)
                found += groups(name)
            return found

        lines = ["config groups (switch with GROUP=OPTION, e.g. strategy=vanilla):"]
        lines += [f"  {g}: {', '.join(sorted(loader.get_group_options(g)))}" for g in sorted(groups())]
        default = args.config_name or config_name
        configs = sorted(c for c in loader.get_group_options("", ObjectType.CONFIG) if not c.startswith("_"))
        lines.append("configs (--config-name): " + ", ".join(f"{c} (default)" if c == default else c for c in configs))
    lines.append("search path: " + ", ".join(str(d) for d in dirs))
    lines.append("print the composed config: --cfg job [--package data] [--resolve]")
    return "\n".join(lines)


def write_step_log(cfg: Any, log: list[dict] | None) -> None:
    """This rank's step log as ``<train.log_dir>/rank<RANK>.json`` when ``train.log_dir`` is set."""
    log_dir = cfg.get("train", {}).get("log_dir")
    if log_dir and log is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(log))


def run(train: TrainFn, argv: Sequence[str] | None = None, *, config_name: str, doc: str | None = None,
        prog: str | None = None, start_service_first: bool = False) -> int:
    """Parse ``argv``, then print help / the config, or compose and ``train(cfg)``; the exit code.

    Args:
        train: ``cfg -> step log`` (a list of per-step dicts, written to ``train.log_dir``).
        argv: Command-line arguments (default ``sys.argv[1:]``).
        config_name: The config composed when ``--config-name`` is not given.
        doc: The script's docstring, shown by ``--help``.
        prog: Program name in the usage line (default: the script's file name).
        start_service_first: Rank 0 asks for the data service before torch and megatron-core are
            imported (`trainer.early_start`), for a `train` that runs a `TrainingSession`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog or Path(sys.argv[0]).name, doc)
    args = parse_args(argv, parser)
    try:
        if args.help:
            print(parser.format_help().rstrip() + "\n\n" + format_config_help(args, config_name))
            return 0
        if args.cfg:
            print(format_config(args, config_name), end="")
            return 0
        # Everything knowable from the config and the launcher's environment, before any rank
        # pays for importing torch and megatron-core.
        cfg = compose(args, config_name)
        preflight(cfg)
        write_run_config(cfg, args.overrides)
        resolve_run_paths(cfg)
    except MegascaleDataError as e:
        write_error_file(e)
        say_error(f"error: {type(e).__name__}: {e}")
        return 1
    quiet_imports()
    # What Megatron-LM's launch scripts export: one CUDA work queue keeps TP communication ordered
    # before compute (megatron-core warns on every TP layer without it; FSDP users set their own).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    log = error_log_path(cfg)
    try:
        if start_service_first:
            early_start.launch(cfg)
        from torch.distributed.elastic.multiprocessing.errors import record

        record(_train, error_handler=_error_handler(log))(train, cfg)
        return 0
    except Exception as e:
        # Ours, raised here or inside a service actor (unwrapped from Ray's layers by the client):
        # one line naming the source or key and the fix, the whole chain in the log it names.
        # record() already wrote the same line to torchrun's error file.
        if not report_error(e, log):
            raise
        return 1
    finally:
        early_start.stop_unclaimed()  # a config refused after the launch: nothing left running


def exit_process(code: int | str | None) -> NoReturn:
    """End a rank's process with `code` about 1.5 s sooner: a training script's last act
    (``exit_process(main())``), never a library call's.

    It leaves Ray first (at interpreter exit Ray's own hook sleeps 0.5 s for driver log lines that
    ``log_to_driver=False`` never prints), then freezes the heap, so that the interpreter's
    exit-time garbage collection skips the objects torch and megatron-core created at import (about
    1 s a process on 2 cores; four ranks pay it on the same cores). Nothing among them needs
    finalizing: the run closed its files, writers and services before returning. After a run that
    succeeded it also destroys the default process group (NCCL warns at exit otherwise, a warning
    the user cannot act on); a failing rank leaves it, since peers may be inside a collective.
    """
    import gc

    dist = sys.modules.get("torch.distributed")
    if code in (0, None) and dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    gc.freeze()
    raise SystemExit(code)


def report_error(e: BaseException, log: Path) -> bool:
    """Say one of our errors once: its line on stderr, the whole chain in `log`; False for another
    kind. A trainer says it before it stops the service it started (`pretrain`): a peer that sees
    the service go ends the job, and torchrun may kill this rank before it gets to say why."""
    cause = root_cause(e)
    if not isinstance(cause, MegascaleDataError):
        return False
    if not getattr(e, "_megascale_reported", False):
        say_error(error_line(cause, write_error_log(log, e)))
        e._megascale_reported = True  # type: ignore[attr-defined]
    return True


def say_error(line: str) -> None:
    """Write `line` and its newline to stderr in one write: the ranks share one terminal, and
    ``print`` writes the newline apart (stderr writes through), so another rank's output could land
    between a line and its end."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def error_line(e: BaseException, log: Path | None = None) -> str:
    """``error: <Type>: <message> (full log: <path>)``: what a rank prints for one of our errors."""
    return f"error: {type(e).__name__}: {e}" + (f" (full log: {log})" if log is not None else "")


def format_config(args: argparse.Namespace, config_name: str) -> str:
    """The composed config (``--cfg``, ``--package``, ``--resolve``) as YAML."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = compose(args, config_name, return_hydra_config=args.cfg != "job")
    node = OmegaConf.masked_copy(cfg, ["hydra"]) if args.cfg == "hydra" else cfg  # keys as in --cfg all
    if args.package:
        absent = object()
        node = OmegaConf.select(node, args.package, default=absent)
        if node is absent:
            raise ConfigError(f"--package {args.package!r}: no such key in the composed config")
    try:
        if isinstance(node, DictConfig) or OmegaConf.is_list(node):
            return OmegaConf.to_yaml(node, resolve=args.resolve)
        return "null\n" if node is None else f"{node}\n"
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot print the composed config: {e}") from e


def quiet_imports() -> None:
    """Hide megatron-core's import-time warnings that no user of these examples can act on.

    The fallbacks it announces when Transformer Engine or Apex is absent (a CPU run, or a GPU
    image without them) are the ones these examples are built to use: ``model.attention``
    picks the backend and says which. (Its ``cuda_graph_scope`` deprecation warning is avoided
    where the config is built: `trainer.model.quiet_config_defaults`.)
    """
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed\. "
                                              r"Falling back to", category=UserWarning)


def write_error_file(e: BaseException, log: Path | None = None) -> None:
    """Record one of our errors in torchrun's error file as its message (no traceback).

    Without ``extraInfo.py_callstack`` torchrun's failure summary shows the message itself
    instead of ``error_file: <N/A>`` under a ``ChildFailedError``. Needs no torch import.
    """
    file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not file:
        return
    info = {"timestamp": str(int(time.time()))}
    message = error_line(e, log).removeprefix("error: ")
    Path(file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))


def _error_handler(log: Path) -> Any:
    """torchrun's error-file writer, which records our own errors (unwrapped from Ray's layers) as
    their message and the log that `run` writes the whole chain to (no traceback)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class MessageErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            cause = root_cause(e)
            if not isinstance(cause, MegascaleDataError) or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
                return super().record_exception(e)
            write_error_file(cause, log)

    return MessageErrorHandler()


def _train(train: TrainFn, cfg: Any) -> None:
    write_step_log(cfg, train(cfg))
