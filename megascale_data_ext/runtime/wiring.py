"""How the service's parts are put together, in one place.

* every actor is `runtime.ray_actor.actor`: ``ray.remote(cls).options(**options)`` over a plain
  façade class (no options fixed in decorators).
* `constructor_tokens(config)`: the pad and image token ids every Data Constructor uses, read
  from the first source's tokenizer the same way on Ray and in-process.
* `start_planner` / `start_constructors`: the Planner actor (which starts the loaders it owns)
  and the Data Constructor actors of a topology, as `DataService` and the benchmarks start them.
* `in_process_parts`: the same plain classes wired by direct calls (`InProcessService`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megascale_data_ext.runtime.ray_actor import actor

__all__ = ["constructor_tokens", "in_process_parts", "start_constructors", "start_planner"]


def constructor_tokens(config: Any) -> tuple[int, int | None]:
    """``(pad_id, image_token_id)`` of the service's microbatches: the first source's tokenizer
    (type and merges included); an image token only when some source has images."""
    from megascale_data_ext.sources.tokenizer import load_tokenizer

    tok = load_tokenizer(config.sources[0])
    return tok.pad_id, (tok.image_id if any(s.image_column for s in config.sources) else None)


def start_planner(config: Any, topology: Any, loaders: Any, ft: Any, checkpoint_dir: str | None = None, *,
                  named: bool = True) -> Any:
    """The Planner actor (restartable per `ft`, retrying calls in flight: it is idempotent); it
    starts the loader actors of `loaders` (`AutoscalePlan`). `named`: under the topology's names,
    where clients joining the running service find it. `config` and `loaders` may be `Held`
    references the caller keeps (a large blend's)."""
    from megascale_data_ext.runtime.actors import PlannerActor
    from megascale_data_ext.runtime.topology import PLANNER_NAME

    names = {"name": PLANNER_NAME, "namespace": topology.namespace} if named else {}
    return actor(PlannerActor, **names, **ft.actor_options(retry_tasks=True)).remote(
        config, topology, loaders, ft, checkpoint_dir)


def start_constructors(config: Any, topology: Any, planner: Any, ft: Any, *, start_step: int = 0,
                       placement: Any = None, groups: Sequence[int] | None = None, named: bool = True,
                       held_config: Any = None) -> list[Any]:
    """The Data Constructor actors of `topology` (`groups`: only these constructor indices), each
    with the concurrency its buckets need and, with `placement`, on its trainer node. `held_config`:
    `config` as a `runtime.ray_actor.Held` the caller keeps (else it travels by value)."""
    from megascale_data_ext.runtime.constructor_actor import DataConstructorActor, constructor_concurrency
    from megascale_data_ext.runtime.remote import PlannerIn

    pad_id, image_id = constructor_tokens(config)
    sidecar = placement.constructor_ranks(topology) if placement is not None else None
    # the Planner by its namespace where it is the named one: no actor handle among restartable
    # actors' arguments (`PlannerIn`)
    planner_arg = PlannerIn(topology.namespace) if _is_named(planner, topology) else planner
    out = []
    for j in range(topology.num_constructors) if groups is None else groups:
        buckets = list(topology.constructor_groups[j])
        names = {"name": topology.constructor_names()[j], "namespace": topology.namespace} if named else {}
        out.append(actor(DataConstructorActor, **names, **ft.actor_options(retry_tasks=False),
                         max_concurrency=constructor_concurrency(topology, buckets, ft, image_id is not None),
                         **(placement.constructor(sidecar[j]) if sidecar else {})).remote(
            buckets, held_config or config, topology, planner_arg, pad_id, image_id, start_step, ft))
    return out


def _is_named(planner: Any, topology: Any) -> bool:
    """Whether `planner` is the actor registered under the topology's Planner name."""
    from megascale_data_ext.runtime.remote import find_planner

    try:
        return find_planner(topology.namespace)._actor_id == planner._actor_id
    except (ValueError, AttributeError):
        return False


def in_process_parts(config: Any, topology: Any, *, max_lead: int | None = None,
                     wait_timeout_s: float = 60.0) -> tuple[list[Any], Any, list[Any]]:
    """``(loaders, planner, constructors)``: one `SourceLoader` per source, the `Planner`, and one
    `DataConstructor` per constructor group, calling each other directly (no Ray)."""
    from megascale_data_ext.runtime.constructor import DataConstructor, encoder_rows
    from megascale_data_ext.runtime.loader import SourceLoader
    from megascale_data_ext.runtime.metrics import service_metrics
    from megascale_data_ext.runtime.planner import Planner

    loaders = [SourceLoader(i, s, seed=config.seed, shuffle=config.shuffle) for i, s in enumerate(config.sources)]
    planner = Planner(config, topology, lambda s, start, n: loaders[s].summary_buffer(start, n),
                      on_planned=service_metrics().record_plan, constructors=topology.num_constructors)
    for loader in loaders:
        loader.get_plan = planner.loader_plan
    pad_id, image_id = constructor_tokens(config)
    constructors = [
        DataConstructor(
            list(buckets), config, topology,
            get_plans=lambda step, bs: [planner.plan(step).constructor_do_plan(b) for b in bs],
            fetch=lambda step, ss, bs: {s: loaders[s].fetch(step, bs) for s in ss},
            pad_id=pad_id, image_token_id=image_id,
            get_encoder_plan=lambda step, bs: encoder_rows(planner.plan(step), bs),
            max_lead=max_lead, wait_timeout_s=wait_timeout_s,
            on_floor=lambda step, j=j: planner.constructor_floor(j, step),
        )
        for j, buckets in enumerate(topology.constructor_groups)
    ]
    return loaders, planner, constructors
