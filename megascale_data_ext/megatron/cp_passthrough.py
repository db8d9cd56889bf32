"""Megatron's CP slicing made a pass-through for batches the service already sliced.

With CP > 1 the service delivers each rank its own slice of every microbatch; Megatron-LM's
``pretrain_gpt`` would slice it again. `install_cp_passthrough` replaces Megatron's slicing
functions, wherever a loaded module holds them (``pretrain_gpt``'s imported names too), with
calls that leave the batch as it is; `remove_cp_passthrough` restores them. Which functions
depends on megatron-core: ``get_thd_batch_on_this_cp_rank`` / ``get_batch_on_this_cp_rank`` up
to 0.17, ``get_sft_batch_on_this_cp_rank`` / ``get_pretrain_batch_on_this_cp_rank`` (what 0.18's
``get_batch_on_this_cp_rank`` dispatches to) in 0.18, their per-document / per-sequence balancing
successors in 0.19.
"""

from __future__ import annotations

import sys
from typing import Any

from megascale_data_ext.patches.patching import Patches, original_of

__all__ = ["install_cp_passthrough", "remove_cp_passthrough"]


def _thd_already_sliced(batch: Any, cu_seqlens: Any, cu_seqlens_padded: Any, max_seqlen: Any,
                        cp_size: int | None = None, cp_rank: int | None = None) -> Any:
    """Megatron's ``get_thd_batch_on_this_cp_rank`` for a batch the service already sliced: its
    PackedSeqParams, no second slicing (the real function with cp_size=1)."""
    from megatron.core import utils

    original = original_of(utils.get_thd_batch_on_this_cp_rank)
    return original(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=1, cp_rank=0)


def _sbhd_already_sliced(batch: Any) -> Any:
    """Megatron's ``get_batch_on_this_cp_rank`` for a batch the service already sliced."""
    return batch


def _sft_already_sliced(batch: Any, cp_group: Any = None) -> Any:
    """megatron-core >= 0.18's ``get_sft_batch_on_this_cp_rank`` (packed THD batches, what its
    ``get_batch_on_this_cp_rank`` dispatches to) for a batch the service already sliced."""
    return batch


def _pretrain_already_sliced(batch: Any, cp_group: Any = None) -> Any:
    """megatron-core >= 0.18's ``get_pretrain_batch_on_this_cp_rank`` (unpacked and hybrid-CP batches)
    for a batch the service already sliced."""
    return batch


_CP_SLICERS = ("get_thd_batch_on_this_cp_rank", "get_batch_on_this_cp_rank")
#: megatron-core >= 0.18: ``get_batch_on_this_cp_rank`` dispatches (packed, hybrid CP, pretraining) to these
_CP_SLICERS_018 = {"get_sft_batch_on_this_cp_rank": _sft_already_sliced,
                   "get_pretrain_batch_on_this_cp_rank": _pretrain_already_sliced}
#: megatron-core 0.19 renamed them: per-document (packed) and per-sequence zigzag
_CP_SLICERS_019 = {"_get_batch_on_this_cp_rank_per_document_balancing": _sft_already_sliced,
                   "_get_batch_on_this_cp_rank_per_sequence_balancing": _pretrain_already_sliced}


def install_cp_passthrough() -> list[str]:
    """Replace Megatron's CP slicing functions wherever a loaded module holds them (idempotent).

    Returns:
        ``module.name`` of every replacement made by this call.
    """
    targets = []
    core = sys.modules.get("megatron.core.utils")
    for slicers in (_CP_SLICERS_019, _CP_SLICERS_018):  # megatron-core 0.19, 0.18
        if core is not None and all(hasattr(core, name) for name in slicers):
            return [done for name, passthrough in slicers.items()
                    for done in _PASSTHROUGH.everywhere(original_of(getattr(core, name)), passthrough, (name,))]
    if core is not None and hasattr(core, "get_thd_batch_on_this_cp_rank"):
        targets.append((original_of(core.get_thd_batch_on_this_cp_rank), _thd_already_sliced))
    for name in ("megatron.core.utils", "megatron.training.utils"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "get_batch_on_this_cp_rank"):
            targets.append((original_of(mod.get_batch_on_this_cp_rank), _sbhd_already_sliced))
    return [done for original, replacement in targets
            for done in _PASSTHROUGH.everywhere(original, replacement, _CP_SLICERS)]


def remove_cp_passthrough() -> None:
    """Restore what `install_cp_passthrough` replaced."""
    _PASSTHROUGH.undo()


_PASSTHROUGH = Patches()  # what install_cp_passthrough replaced (`patches.patching`)
