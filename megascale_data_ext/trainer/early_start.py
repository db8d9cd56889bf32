"""Rank 0 asks for the data service before the trainer imports torch and megatron-core.

A rank spends seconds importing torch, megatron-core and Transformer Engine, then builds its
model and loads its checkpoint. `launch` (called by `trainer.app.run` on rank 0, before those
imports) joins or starts Ray, checks the sources and asks for the service's actors without waiting
for any: they start in their own processes behind all of that, not only behind the model build.
No thread of ours runs meanwhile (an import that writes an environment variable would race a
thread's ``getenv``, see `trainer.model.settle_model_environ`); `TrainingSession` then `take`s the
launched service where it would have started one and waits for it after building the model.

What is launched is derived from the run config exactly as the training loop derives it
(`config.load_config`, the parallel sizes and ``WORLD_SIZE``, the data state of ``train.load``);
`take` hands it over only if the loop's own service config, layout and state are equal, and
otherwise stops it and lets the loop start its own. A config the early derivation cannot read
launches nothing: the loop meets the same problem where it reports it. `stop_unclaimed` stops
whatever the run did not take (a config refused after the launch, an exception before the loop).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megascale_data_ext.trainer.checkpoint_dir import latest_step, load_data_state

VALIDATION_LABEL = "validation service: "  # the progress prefix of the validation service's lines


@dataclass
class Launched:
    """One service `launch` asked for: what it was derived from, and its failure if launching failed."""

    service: Any  # runtime.service.DataService
    service_config: Any
    layout: dict
    state: dict | None
    failure: Exception | None = None


_LAUNCHED: dict[str, Launched] = {}  # by progress label: "" (training), VALIDATION_LABEL


def launch(cfg: Any) -> None:
    """On rank 0 (``RANK`` unset or 0), ask for the training service and, when the run evaluates,
    the validation one, as the training loop would start them; return at once."""
    if os.environ.get("RANK", "0") != "0" or _LAUNCHED:
        return
    try:
        services = _derive(cfg)
    except Exception:  # noqa: BLE001 - the training loop derives the same and reports it there
        return
    from megascale_data_ext.runtime.service import DataService, print_progress

    for label, (service_config, tree, state) in services.items():
        service = DataService(service_config, tree,
                              progress=(lambda line, p=label: print_progress(p + line)) if label else print_progress)
        entry = Launched(service, service_config, tree.layout(), state)
        try:
            service.launch(state=state)
        except Exception as exc:  # noqa: BLE001 - every rank learns it where the loop waits for the service
            entry.failure = exc
        _LAUNCHED[label] = entry


def take(label: str, service_config: Any, tree: Any, state: dict | None) -> tuple[Any, Any] | None:
    """The launched service for `label` as ``(service, future of its handles | its exception)``
    (`trainer.pretrain.begin_serve`'s result), if it was launched for this config, layout and
    state; else None (a mismatched one is stopped first)."""
    entry = _LAUNCHED.pop(label, None)
    if entry is None:
        return None
    if not (_equal(entry.service_config, service_config) and entry.layout == tree.layout()
            and entry.state == state):
        if entry.failure is None:
            entry.service.stop()
        return None
    if entry.failure is not None:
        return entry.service, entry.failure
    try:
        return entry.service, entry.service.start_in_background(state=entry.state)
    except Exception as exc:  # noqa: BLE001 - as begin_serve: every rank learns it in finish_serve
        return entry.service, exc


def stop_unclaimed() -> None:
    """Stop every launched service the run did not take."""
    while _LAUNCHED:
        _, entry = _LAUNCHED.popitem()
        if entry.failure is None:
            entry.service.stop()


def _derive(cfg: Any) -> dict[str, tuple[Any, Any, dict | None]]:
    """``{label: (service config, ClientPlaceTree, state)}`` as `TrainingSession` derives them."""
    from megascale_data_ext.config import load_config
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree

    par = cfg.parallel
    cp = int(par.get("context_parallel_size", 1))
    data = load_config(cfg, context_parallel_size=cp)
    vpp = par.get("virtual_pipeline_model_parallel_size")
    tree = ClientPlaceTree.from_sizes(tp=int(par.tensor_model_parallel_size), cp=cp,
                                      pp=int(par.pipeline_model_parallel_size), vpp=None if vpp is None else int(vpp),
                                      world_size=int(os.environ.get("WORLD_SIZE", "1")))
    load = cfg.train.get("load")
    state = load_data_state(load, latest_step(load)) if load else None
    services = {"": (data.to_service_config(), tree, state)}
    valid = data.validation_service_config()
    if int(cfg.train.get("eval_interval") or 0) > 0 and valid is not None:
        services[VALIDATION_LABEL] = (valid, tree, None)
    return services


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a field that does not compare: not known to be the same
        return False
