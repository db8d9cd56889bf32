"""`megascale-data serve`: the data service for a Megatron-LM job, up until Ctrl-C or SIGTERM.

Megatron-LM's own ``pretrain_gpt.py`` (with ``patches/pretrain_gpt.patch`` and
``--dataloader-type external``) takes its microbatches from a running service through
`megascale_data_ext.megatron.provider`; this command is that running service. It composes the
training config like the other data commands (`commands._config_args`), starts the Planner,
Source Loaders and Data Constructors for the layout ``--world-size N [--tp --pp --cp --vpp]``
(embedded Ray, or the cluster at ``data.ray.address``), prints what the ranks need to connect
(address, namespace, the environment and Megatron flags), then prints one status line every
``--status-every`` seconds. Ctrl-C or SIGTERM kills every actor (and the embedded Ray) and
exits 0. A second service in the same Ray namespace is refused with one line: the ranks find
the service's actors by name there, so two would collide.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale_data_ext.commands._config_args import (
    add_config_arguments,
    add_layout_arguments,
    compose_from_args,
    fail,
    layout_tree,
)
from megascale_data_ext.errors import ConfigError, MegascaleDataError

NAME = "serve"
HELP = "start the data service for a Megatron-LM job (pretrain_gpt.py --dataloader-type external) until Ctrl-C"



class ServiceExistsError(ConfigError):
    """A service already runs in the namespace this one would use."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_layout_arguments(parser)
    parser.add_argument("--status-every", type=float, default=30.0, metavar="SECONDS",
                        help="seconds between status lines (default 30; 0 = none)")
    parser.add_argument("--env-file", type=Path, default=None, metavar="PATH",
                        help="also write the ranks' environment there as `export` lines (`source PATH`)")


@dataclass(frozen=True, slots=True)
class Validation:
    """The validation service `serve` starts beside the training one (``train.eval_interval`` > 0
    and ``data.validation.sources``), and Megatron-LM's matching ``--eval-interval`` / ``--eval-iters``."""

    config: Any
    interval: int
    iters: int


def build(args: argparse.Namespace) -> tuple[Any, Any, dict[str, int | None], Validation | None]:
    """(ServiceConfig, ClientPlaceTree, layout, validation or None) of the arguments; ConfigError /
    ParallelLayoutError name every problem before Ray starts."""
    from megascale_data_ext.config import load_config
    from megascale_data_ext.config.run import load_run_config

    cfg = compose_from_args(args)
    run = load_run_config(cfg)  # the same overrides go to the trainer: a typo in model/train/parallel fails here too
    tree, sizes = layout_tree(cfg, args, what="serve")
    if "data" not in cfg:
        raise ConfigError("the composed config has no `data` node; add `data: megascale` to its defaults list")
    if cfg.data.get("mixing", {}).get("type") == "feedback":  # before the sources are checked: no use either way
        raise ConfigError("`data.mixing.type` feedback needs each step's per-source loss, which Megatron-LM's "
                          "pretrain_gpt.py does not report to the service: use a static schedule with serve "
                          "(data.mixing.type=constant without data.mixing.params: the sources' weights), or train "
                          "with examples/pretrain_gpt.py, whose hooks report it")
    data = load_config(cfg, context_parallel_size=int(sizes["cp"]))
    service_cfg = data.to_service_config()
    if service_cfg.strategy == "hybrid_cp":
        raise ConfigError("`data.strategy` hybrid_cp is trained by the reference trainer (examples/pretrain_gpt.py); "
                          "Megatron-LM's pretrain_gpt.py does not run a microbatch on its own CP group yet: use "
                          "strategy=llm_balance with serve")
    validation = None
    if run.train is not None and run.train.eval_interval > 0:
        valid_cfg = data.validation_service_config()
        if valid_cfg is None:
            raise ConfigError(f"`train.eval_interval`={run.train.eval_interval} needs held-out sources: list them "
                              "under `data.validation.sources`, or set train.eval_interval=0")
        validation = Validation(valid_cfg, run.train.eval_interval, run.train.eval_iters)
    return service_cfg, tree, sizes, validation


def connect_env(handles: Any, num_microbatches: int) -> dict[str, str]:
    """The environment every rank of ``pretrain_gpt.py`` needs (see `megatron.provider`)."""
    from megascale_data_ext.megatron.provider import ENV_NAMESPACE, ENV_NUM_MICROBATCHES, ENV_RAY_ADDRESS

    return {"MEGASCALE_DATA": "1", ENV_RAY_ADDRESS: handles.address, ENV_NAMESPACE: handles.namespace,
            ENV_NUM_MICROBATCHES: str(num_microbatches), **handles.ray_env}


def megatron_flags(tree: Any, service_cfg: Any, validation: Validation | None = None) -> list[str]:
    """The ``pretrain_gpt.py`` flags that must agree with the service (micro-batch 1: one packed
    sequence of ``seq_length`` tokens per microbatch), and the evaluation schedule it serves."""
    flags = ["--tensor-model-parallel-size", tree.tp, "--pipeline-model-parallel-size", tree.pp,
             "--context-parallel-size", tree.cp, "--dataloader-type", "external", "--micro-batch-size", 1,
             "--global-batch-size", tree.dp * service_cfg.num_microbatches, "--seq-length", service_cfg.seq_length]
    if validation is not None:
        flags += ["--eval-interval", validation.interval, "--eval-iters", validation.iters]
    return [str(f) for f in flags]


def describe(tree: Any, service_cfg: Any, handles: Any, env: dict[str, str], pid: int,
             validation: Validation | None = None) -> str:
    topo = handles.topology
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    vpp = f"·VPP{tree.vpp}" if tree.vpp else ""
    held_out = [] if validation is None else [
        f"  validation:  {len(validation.config.sources)} held-out sources "
        f"({', '.join(s.name for s in validation.config.sources)}) in namespace {validation.config.ray.namespace!r}, "
        f"{validation.iters} steps every {validation.interval}"]
    return "\n".join([
        f"serving TP{tree.tp}·PP{tree.pp}·CP{tree.cp}·DP{tree.dp}{vpp} = {tree.world_size} ranks: "
        f"{len(service_cfg.sources)} sources, strategy {service_cfg.strategy}, "
        f"{topo.num_constructors} data constructors",
        f"  ray address: {handles.address}",
        f"  namespace:   {handles.namespace}",
        f"  service:     actor 'planner' and {', '.join(topo.constructor_names()[:2])}"
        f"{', ...' if topo.num_constructors > 2 else ''} in namespace {handles.namespace!r}",
        *held_out,
        "connect Megatron-LM (patches/pretrain_gpt.patch applied) on every node:",
        f"  export {exports}",
        f"  torchrun --nproc_per_node ... pretrain_gpt.py {' '.join(megatron_flags(tree, service_cfg, validation))} "
        "<model/optimizer flags>",
        "  (own launcher: megascale_data_ext.megatron.provider.train_valid_test_datasets_provider, "
        "same environment)",
        f"actors (role, pid, node, restarts): megascale-data status --address {handles.address} "
        f"--namespace {handles.namespace}",
        f"stop: Ctrl-C or `kill -TERM {pid}` (every actor is killed)",
    ])


def status_line(service: Any, t0: float) -> str:
    """One line: uptime, next planned step, steps built, samples read and skipped."""
    stats = service.stats()
    built = [c["built_steps"] for c in stats["constructors"] if c]
    loaders = [s for s in stats["loaders"] if s]
    read = sum(m["samples_read"] for s in loaders for m in s["members"].values())
    skipped = sum(c["skipped_total"] for c in stats["constructors"] if c)
    dead = len(stats["constructors"]) - len(built) + len(stats["loaders"]) - len(loaders)
    planner = stats["planner"] or {}
    return (f"[serve] up {time.monotonic() - t0:.0f} s: planned up to step {planner.get('next_step', '?')}, "
            f"{sum(built)} steps built by {len(built)} constructors, {read} samples read, {skipped} skipped"
            + (f", {dead} actors down" if dead else ""))


def refuse_duplicate(namespace: str, address: str) -> None:
    """Raise `ServiceExistsError` if a Planner already runs in `namespace` (Ray joined)."""
    from megascale_data_ext.runtime.remote import find_planner

    try:
        find_planner(namespace)
    except ValueError:
        return
    raise ServiceExistsError(f"a data service already runs in Ray namespace {namespace!r} on {address}; stop it "
                             "(Ctrl-C where it runs) or serve another with data.ray.namespace=<other>")


def actors_left(topology: Any) -> list[str]:
    """Names of this service's named actors Ray still finds (waits up to 10 s for kills to land)."""
    from megascale_data_ext.runtime.remote import find_constructor, find_planner

    # the loaders are the Planner's: they die with it
    finders = {"planner": lambda: find_planner(topology.namespace)}
    finders.update({name: (lambda j=j: find_constructor(topology, j)) for j, name in enumerate(topology.constructor_names())})
    deadline = time.monotonic() + 10.0
    while True:
        left = []
        for name, find in finders.items():
            try:
                find()
            except ValueError:  # no actor of that name any more: gone, as it should be
                continue
            left.append(name)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def join_ray(ray_cfg: Any) -> None:
    """Start the embedded Ray or join ``data.ray.address``; a refusal is one `ConfigError` naming the key."""
    from megascale_data_ext.runtime.embedded_ray import init_ray
    from megascale_data_ext.runtime.ray_address import check_reachable

    check_reachable(ray_cfg.address)
    try:
        init_ray(ray_cfg, log_to_driver=True)
    except ConnectionError as exc:
        cause = str(exc.__cause__ or exc).strip().splitlines()[0]
        raise ConfigError(f"`data.ray.address` {ray_cfg.address!r}: cannot join the Ray cluster there ({cause}); "
                          "with token authentication export the RAY_AUTH_* variables its `serve` printed "
                          "(or `ray get-auth-token`), else fix the address") from None


class _Stop(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM. A BaseException, as KeyboardInterrupt is: the
    serving loop's ``except Exception`` around a status line must not swallow a stop that lands
    during it (the handler then ignores further signals, and `serve` would never exit)."""


def _on_signal(signum: int, _frame: Any) -> None:
    # Further signals while stopping are ignored, so the clean-up is never cut short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def _catch_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def check_env_file(path: Path | None) -> None:
    """`--env-file` must be writable before the service starts, not found unwritable once it runs."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        problem = "it is a directory"
    elif not parent.is_dir():
        problem = f"its directory {str(parent)!r} does not exist"
    elif not os.access(path if path.exists() else parent, os.W_OK):
        problem = "it is not writable"
    else:
        return
    raise ConfigError(f"--env-file {str(path)!r}: {problem}; name a file in an existing, writable directory")


def run(args: argparse.Namespace) -> int:
    try:
        service_cfg, tree, _, validation = build(args)
        check_env_file(args.env_file)
    except MegascaleDataError as exc:
        return fail(exc)
    _catch_signals()
    try:
        return _serve(args, service_cfg, tree, validation)
    except _Stop:  # a signal before the service was up: nothing of ours runs any more
        return 0
    except MegascaleDataError as exc:
        return fail(exc)


def _serve(args: argparse.Namespace, service_cfg: Any, tree: Any, validation: Validation | None = None) -> int:
    import ray

    from megascale_data_ext.megatron.provider import ENV_VALID_NAMESPACE, ProviderConfig, service_topology
    from megascale_data_ext.runtime.service import DataService, print_progress

    t0 = time.monotonic()
    service = DataService(service_cfg, tree)
    services = [service]
    if validation is not None:  # its start-up lines are labelled: both services report the same phases
        services.append(DataService(validation.config, tree,
                                    progress=lambda line: print_progress("validation service: " + line)))
    # Megatron's get_batch broadcasts over TP only; a service planned otherwise is refused now, not by every rank.
    service_topology(tree, ProviderConfig(namespace=service.topology.namespace, topology=service.topology))
    rc, handles, held_out = 0, None, None
    try:
        join_ray(service_cfg.ray)
        _catch_signals()  # again: ray.init's SIGTERM handler exits with 15 after a C++ stack dump
        address = ray.get_runtime_context().gcs_address
        for svc in services:
            refuse_duplicate(svc.topology.namespace, address)
        held_out = services[1].start_in_background() if validation is not None else None  # beside the training one
        handles = service.start()
        env = connect_env(handles, service_cfg.num_microbatches)
        if held_out is not None:
            env[ENV_VALID_NAMESPACE] = held_out.result().namespace
        if args.env_file is not None:
            args.env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        print(describe(tree, service_cfg, handles, env, os.getpid(), validation), flush=True)
        while True:
            if args.status_every > 0:
                time.sleep(args.status_every)
                try:
                    print(status_line(service, t0), flush=True)
                except Exception as exc:  # an actor Ray is restarting: say so, keep serving
                    print(f"[serve] status unavailable: {type(exc).__name__}: {exc}", flush=True)
            else:
                signal.pause()
    except _Stop as stop:
        print(f"[serve] {stop}: stopping", flush=True)
    except MegascaleDataError as exc:
        rc = fail(exc)
    finally:
        if held_out is not None:  # its actors are all started (or it failed) before anything is stopped
            with contextlib.suppress(Exception):
                held_out.result()
        if ray.is_initialized():
            namespaces = [svc.topology.namespace for svc in services]
            left = []
            for svc in reversed(services):  # the validation service first
                svc.stop()
                if handles is not None:  # else the names may be another service's
                    left += actors_left(svc.topology)
            if left:
                print(f"error: actors still alive after stop: {left}", file=sys.stderr)
                rc = rc or 1
            ray.shutdown()
            if rc == 0 and handles is not None:
                print(f"[serve] stopped; no actors left in namespace {' or '.join(map(repr, namespaces))}",
                      flush=True)
    return rc
