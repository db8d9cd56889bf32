"""Hybrid context parallelism on the trainer side: each microbatch runs on its own CP group (issue 26).

The planner (`dataplane.balancers.hybrid_cp`) gives every document the smallest power-of-two
group of DP×CP ranks its length needs; a rank's data for a group microbatch is the pack's THD
slice for its place in the group, marked with ``local_cp_size`` (`cp_slicing.slice_for_group`).
Every rank runs its own number of microbatches, which megatron-core's non-pipelined schedule
allows: the ranks meet only in each group's collectives (in the plan's one global order) and in
the gradient reduction over DP×CP at the end of the step, where a per-token loss
(``--calculate-per-token-loss``, Megatron's condition for its own scheduler) weighs every token
the same whoever ran it.

What this module adds to megatron-core:

* `init_hybrid_groups` — megatron-core's hybrid DP×CP groups (an aligned group of every power of
  two, ``initialize_model_parallel(hybrid_context_parallel=True)``) and a group of one per rank:
  megatron's THD RoPE needs a group even for a whole document.
* `microbatch_group(size)` — the group this rank runs a microbatch of that size on; the
  attention (`trainer.attention`) takes it from ``PackedSeqParams.cp_group`` as megatron-core's
  Transformer Engine attention does.
* `microbatch_cp(group)` — megatron-core's ``Attention`` applies THD RoPE with the layer's fixed
  CP group (its ``pg_collection.cp``); inside this context the RoPE of a microbatch uses the
  microbatch's group instead (`forward_step` enters it around the model call). megatron-core's own
  hybrid CP never meets this: it runs every sequence alone, in SBHD.

With pipeline parallelism megatron-core's 1F1B schedule runs a rank's forward of its microbatch
i before its backward of microbatch j exactly when ``i <= j + warmup``, the warm-up being the
stage's; so the plan puts every group microbatch at the same index on all its ranks
(`HybridPlan.slots`, a filler pack where a rank has nothing), and every member meets the group's
collectives in the same order. Every stage of a pipeline runs its DP×CP position's microbatches;
the groups are megatron-core's, one set per stage.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

from megascale_data_ext.errors import ParallelLayoutError
from megascale_data_ext.patches.patching import Patches

__all__ = ["init_hybrid_groups", "microbatch_cp", "microbatch_group"]

_SINGLE: list[Any] = []  # this rank's group of one
_ROPE = Patches()
_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("megascale_microbatch_cp_group", default=None)


def init_hybrid_groups() -> None:
    """After ``initialize_model_parallel(hybrid_context_parallel=True)`` on every rank: the groups
    of one, and megatron's THD RoPE routed through `microbatch_cp`. Collective (every rank)."""
    _SINGLE.clear()
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            _SINGLE.append(group)
    if not len(_ROPE):
        import megatron.core.transformer.attention  # noqa: F401  (binds the function by name: patched below)
        from megatron.core.models.common.embeddings import rope_utils

        original = rope_utils.apply_rotary_pos_emb

        def apply_rotary_pos_emb(t: Any, freqs: Any, config: Any, cu_seqlens: Any = None, mscale: float = 1.0,
                                 cp_group: Any = None) -> Any:
            group = _GROUP.get()
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                            cp_group=cp_group if group is None else group)

        _ROPE.everywhere(original, apply_rotary_pos_emb, ["apply_rotary_pos_emb"])


def microbatch_group(size: int) -> Any:
    """The process group of `size` ranks this rank runs a microbatch of that ``local_cp_size`` on.

    Raises:
        ParallelLayoutError: hybrid groups were not set up, or no aligned group of that size exists.
    """
    if not _SINGLE:
        raise ParallelLayoutError("a microbatch carries `local_cp_size` but hybrid CP groups were not set up: "
                                  "build the model with hybrid_cp=True (parallel.hybrid_cp)")
    if size == 1:
        return _SINGLE[0]
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if size > dp_cp or size & (size - 1):
        raise ParallelLayoutError(f"a microbatch asks for a CP group of {size} ranks; the {dp_cp} DP x CP ranks "
                                  "form aligned groups of powers of two up to their number")
    return parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)


@contextlib.contextmanager
def microbatch_cp(group: Any) -> Iterator[None]:
    """Megatron's THD RoPE uses `group` (None: the layer's own CP group) while inside."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)
