"""Schedule hooks: feed Megatron's pipeline schedule from the data service, installed by one call.

`install(client)` wraps ``get_forward_backward_func`` wherever a loaded module holds it
(megatron-core's own modules, Megatron-LM's training loop, a user's script), so each call of
the returned schedule is one global step served by the service:

* the step's balanced microbatches replace the ``data_iterator`` argument — one iterator per
  virtual-pipeline model chunk; only the first chunk on the first stage and the last chunk on
  the last stage read data, the others get ``None``;
* ``config.variable_seq_lengths`` is set on the model's config for the call, because balanced
  packed microbatches differ in length and pipeline stages must exchange shapes;
* Megatron-LM's TP-rank-0 broadcast (``megatron.training.utils.get_batch_on_this_tp_rank``,
  when that package is present) becomes a plain ``next()``: the client already did
  ``broadcast_at("tp")``, so every TP rank holds the batch.

Evaluation calls (``forward_only=True``, Megatron's ``evaluate``) are fed by ``valid_client``, the
client of the validation service, with its own position; without one they run on the iterators
the caller passed, untouched (the training stream never feeds an evaluation).

With ``report_loss`` (feedback mixing), after each step the last pipeline stage sums the
``"source loss"`` entries its loss function returned (see `trainer.model.loss_func`), reduces
them over data (and context) parallel ranks, and one rank reports the per-source mean loss to
the Planner through the client, which applies it exactly ``delay`` steps later.

Everything it replaces is restored by `Installation.uninstall()`; modules that do not hold
these functions are not touched. The data position (next step) is the client's: each call
serves the client's current step and then moves it to the next one; the installation's
`state_dict()` is the client's, saved with a checkpoint (see `trainer.pretrain`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from megascale_data_ext.errors import ConfigError
from megascale_data_ext.patches.patching import ORIGINAL, Patches, original_of


def _model_configs(model: Any) -> list[Any]:
    chunks = model if isinstance(model, list | tuple) else [model]
    out = []
    for chunk in chunks:
        inner = chunk
        while hasattr(inner, "module") and not hasattr(inner, "config"):
            inner = inner.module
        cfg = getattr(inner, "config", None)
        if cfg is not None and all(cfg is not c for c in out):
            out.append(cfg)
    return out


@contextlib.contextmanager
def _variable_seq_lengths(model: Any) -> Iterator[None]:
    """``config.variable_seq_lengths`` on for the call: packed microbatches differ in length."""
    configs = _model_configs(model)
    saved = [getattr(c, "variable_seq_lengths", False) for c in configs]
    for c in configs:
        c.variable_seq_lengths = True
    try:
        yield
    finally:
        for c, v in zip(configs, saved, strict=True):
            c.variable_seq_lengths = v


class Installation:
    """The hooks of one training run; see the module docstring. Not thread-safe (one per rank).

    Args:
        client: The rank's `runtime.client.Client`.
        num_model_chunks: Virtual pipeline chunks of this rank (1 without VPP).
        start_step: First global step to serve; None keeps the client's position.
        transform: Optional ``(batch, info) -> batch`` applied to each microbatch as the schedule
            pulls it (e.g. `trainer.vlm.VLMFeed` attaching image features).
        report_loss: Report each step's per-source loss to the Planner (feedback mixing).
        valid_client: The validation service's client: feeds ``forward_only`` calls.
    """

    def __init__(
        self, client: Any, *, num_model_chunks: int = 1, start_step: int | None = None, pp_rank: int | None = None,
        pp_size: int | None = None, transform: Callable[[Any, Any], Any] | None = None, report_loss: bool = False,
        valid_client: Any = None,
    ) -> None:
        self.client, self.valid_client = client, valid_client
        self.transform = transform
        self.report_loss = report_loss
        if start_step is not None:
            client.seek(start_step)
        self.num_model_chunks = num_model_chunks
        if num_model_chunks > 1 and (pp_rank is None or pp_size is None):
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self._patches = Patches()  # what `install` replaced (`patches.patching`)
        self.steps_served = 0

    # -- what the schedule sees ----------------------------------------------------
    def iterators(self, step: int, client: Any = None) -> Iterator[Any] | list[Iterator[Any] | None]:
        client = client or self.client
        it = client.step_iterator(step)
        if self.transform is not None:
            it = (self.transform(batch, client.last_info) for batch in it)
        if self.num_model_chunks == 1:
            return it
        # With VPP only chunk 0 of the first pipeline rank and the last chunk of the last
        # pipeline rank hold the embedding / the loss; every other chunk is a middle stage.
        reads = set()
        if self.pp_rank == 0:
            reads.add(0)
        if self.pp_rank == self.pp_size - 1:
            reads.add(self.num_model_chunks - 1)
        return [it if i in reads else None for i in range(self.num_model_chunks)]

    def wrap(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(schedule)
        def fed_by_service(*args: Any, **kwargs: Any) -> Any:
            if args:
                raise ConfigError("call the pipeline schedule with keyword arguments (as megatron does)")
            if kwargs.get("forward_only"):
                return self._evaluate(schedule, kwargs)
            step = self.step
            want = self.client.microbatches(step)  # hybrid CP: this rank's own count this step
            if not self.client.topology.variable_counts and kwargs.get("num_microbatches", want) != want:
                raise ConfigError(
                    f"the schedule was asked for {kwargs['num_microbatches']} microbatches but the data service plans "
                    f"{want} per step: set data.num_microbatches = global_batch_size / (DP * micro_batch_size)"
                )
            kwargs["num_microbatches"] = want
            kwargs["data_iterator"] = self.iterators(step)
            with _variable_seq_lengths(kwargs.get("model", [])):
                out = schedule(**kwargs)
            self.client.end_step(step)
            self.steps_served += 1
            if self.report_loss:
                self._report_source_loss(step, out)
                # Every rank waits until the Planner holds this step's report: a checkpoint any
                # rank takes next (the Planner's state) then includes it, so a resume never waits
                # for a report the trainer already sent.
                import torch.distributed as dist

                dist.barrier()
            return out

        setattr(fed_by_service, ORIGINAL, schedule)
        return fed_by_service

    def _evaluate(self, schedule: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """One forward-only call: the validation client's next step, or the caller's iterators."""
        client = self.valid_client
        if client is None:
            return schedule(**kwargs)
        step = client.step
        kwargs["num_microbatches"] = client.microbatches(step)
        kwargs["data_iterator"] = self.iterators(step, client)
        with _variable_seq_lengths(kwargs.get("model", [])):
            out = schedule(**kwargs)
        client.end_step(step)
        return out

    def _report_source_loss(self, step: int, outputs: Any) -> None:
        """Per-source mean loss of the step, from the last stage's loss reports, to the Planner."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return
        n = self.client.topology.num_sources
        sums = torch.zeros(2, n, dtype=torch.float64)
        for report in outputs or []:
            values = report.get("source loss") if isinstance(report, dict) else None
            if values is not None:
                v = values.detach().double().cpu().view(2, -1)  # CPU sums: gloo reduces them
                sums[:, : v.shape[1]] += v
        dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        if ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0:
            seen = torch.nonzero(sums[1] > 0).view(-1).tolist()
            self.client.report_loss(step, {i: float(sums[0, i] / sums[1, i]) for i in seen})

    # -- install / uninstall -------------------------------------------------------
    def install(self) -> Installation:
        from megatron.core import pipeline_parallel

        original = original_of(pipeline_parallel.get_forward_backward_func)

        def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable[..., Any]:
            return self.wrap(original(*args, **kwargs))

        self._patches.everywhere(original, get_forward_backward_func, ["get_forward_backward_func"])
        utils = sys.modules.get("megatron.training.utils")
        if utils is not None and hasattr(utils, "get_batch_on_this_tp_rank"):
            self._patches.set(utils, "get_batch_on_this_tp_rank", _batch_already_broadcast)
        return self

    def uninstall(self) -> None:
        self._patches.undo()

    @property
    def installed(self) -> bool:
        return len(self._patches) > 0

    # -- state ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The next global step the schedule will be fed."""
        return self.client.step

    def state_dict(self) -> dict[str, Any]:
        """The client's data position (the next step to serve)."""
        return self.client.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.client.load_state_dict(state)


def _batch_already_broadcast(data_iterator: Any, *args: Any, **kwargs: Any) -> Any:
    """Replacement for get_batch_on_this_tp_rank: the client already broadcast over TP."""
    return next(data_iterator) if data_iterator is not None else None


def install(
    client: Any, *, num_model_chunks: int = 1, start_step: int | None = None, pp_rank: int | None = None,
    pp_size: int | None = None, transform: Callable[[Any, Any], Any] | None = None, report_loss: bool = False,
    valid_client: Any = None,
) -> Installation:
    """Install the schedule hooks for this rank; returns the (reversible) installation.

    With VPP (`num_model_chunks` > 1) the pipeline rank decides which chunk reads data; it is
    read from Megatron's `parallel_state` unless `pp_rank`/`pp_size` are given.
    """
    return Installation(client, num_model_chunks=num_model_chunks, start_step=start_step, pp_rank=pp_rank,
                        pp_size=pp_size, transform=transform, report_loss=report_loss,
                        valid_client=valid_client).install()
