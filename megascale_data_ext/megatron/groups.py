"""The Megatron process group a rank's fetched microbatches are broadcast over.

A strategy's broadcast dims (`ServiceTopology.broadcast_dims`) name a group Megatron already
built in `initialize_model_parallel`: ``("tp",)`` its tensor-parallel group, ``("cp",)`` its
context-parallel group, ``("tp", "cp")`` its tensor-and-context-parallel group. The tree's
`group()` of the same name has the same ranks (tested against Megatron's RankGenerator).
"""

from __future__ import annotations

from typing import Any

from megascale_data_ext.errors import ConfigError

_GETTERS = {
    frozenset({"tp"}): "get_tensor_model_parallel_group",
    frozenset({"cp"}): "get_context_parallel_group",
    frozenset({"tp", "cp"}): "get_tensor_and_context_parallel_group",
}


def broadcast_group(topology: Any) -> Any:
    """Megatron's group for `topology.broadcast_dims` (None when nothing is broadcast)."""
    from megatron.core import parallel_state

    dims = frozenset(topology.broadcast_dims)
    if not dims:
        return None
    name = _GETTERS.get(dims)
    if name is None:
        raise ConfigError(f"no Megatron process group for broadcast dims {sorted(dims)}; use tp, cp or tp+cp")
    return getattr(parallel_state, name)()
