"""Megatron's rank order: the meshes behind `ClientPlaceTree`, and the layout checks Megatron makes.

For an order string the first token varies fastest (`RankGenerator` in
``megatron/core/parallel_state.py``), so with the default ``"tp-cp-ep-dp-pp"``
``rank = tp + TP * (cp + CP * (dp + DP * pp))``. Two meshes share one world: the decoder mesh
(tp, cp, dp, pp) and the expert mesh (etp, ep, edp, pp). Pure index arithmetic over numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["BROADCAST_DIMS", "DEFAULT_ORDER", "GROUPS", "MEGATRON_TOKENS", "GroupName", "Mesh", "check_layout",
           "full_order", "is_pos_int"]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Megatron appends tokens missing from the order in this sequence (RankGenerator.name_to_size).
MEGATRON_TOKENS = ("tp", "pp", "dp", "ep", "cp")
BROADCAST_DIMS = ("tp", "cp")

GroupName = Literal["tp", "cp", "dp", "pp", "ep", "dp-cp", "tp-cp", "mp", "tp-pp", "tp-dp", "tp-dp-cp", "edp", "etp"]
# group name -> (mesh, tokens); the tokens Megatron passes to RankGenerator.get_ranks.
GROUPS: dict[str, tuple[Literal["decoder", "expert"], tuple[str, ...]]] = {
    **{name: ("decoder", tuple(name.split("-"))) for name in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp",
                                                              "tp-dp", "tp-dp-cp")},
    "mp": ("decoder", ("tp", "pp")),
    **{name: ("expert", (token,)) for name, token in (("ep", "ep"), ("edp", "dp"), ("etp", "tp"))},
}


@dataclass(frozen=True, slots=True)
class Mesh:
    """One Megatron RankGenerator: tokens in order (fastest first), their sizes and strides."""

    tokens: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strides", tuple(math.prod(self.sizes[:i]) for i in range(len(self.sizes))))

    def stride(self, token: str) -> int:
        return self.strides[self.tokens.index(token)]

    def size(self, token: str) -> int:
        return self.sizes[self.tokens.index(token)]

    def coord(self, rank: int | np.ndarray, token: str) -> Any:
        return (rank // self.stride(token)) % self.size(token)

    def group(self, rank: int, tokens: Sequence[str]) -> list[int]:
        """Members of ``rank``'s group over ``tokens``, ascending, as ``get_ranks`` lists them."""
        base, offsets = rank, np.zeros(1, dtype=np.int64)
        for token, size, stride in zip(self.tokens, self.sizes, self.strides):
            if token in tokens:
                base -= int(self.coord(rank, token)) * stride
                # Later tokens have larger strides, so putting them outermost keeps it sorted.
                offsets = (np.arange(size, dtype=np.int64)[:, None] * stride + offsets[None, :]).ravel()
        return (base + offsets).tolist()


def is_pos_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def full_order(order: object, sizes: dict[str, int], mesh: str, problems: list[str]) -> tuple[str, ...]:
    """Megatron's order normalisation: lower-case, size-1 tokens it lacks appended."""
    if not isinstance(order, str) or not order:
        problems.append(f"`order` must be a string like {DEFAULT_ORDER!r}, got {order!r}")
        return tuple(MEGATRON_TOKENS)
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in MEGATRON_TOKENS]
    if unknown:
        problems.append(f"`order` {order!r} has unknown tokens {unknown}; allowed: {list(MEGATRON_TOKENS)}")
    if len(set(tokens)) != len(tokens):
        problems.append(f"`order` {order!r} repeats a token")
    for name in MEGATRON_TOKENS:
        if name not in tokens:
            if sizes[name] != 1:
                problems.append(f"`order` {order!r} lacks {name!r} but the {mesh} {name} size is {sizes[name]}")
            tokens.append(name)
    return tuple(tokens)


def check_layout(
    *, tp: Any, cp: Any, pp: Any, dp: Any, ep: Any, etp: Any, vpp: Any, order: Any
) -> tuple[list[str], tuple[Mesh, Mesh] | None]:
    """Every problem Megatron would raise for these sizes, and the (decoder, expert) meshes."""
    problems = [
        f"`{name}` must be a positive int, got {value!r}"
        for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("ep", ep), ("etp", etp))
        if not is_pos_int(value)
    ]
    if vpp is not None and not is_pos_int(vpp):
        problems.append(f"`vpp` must be None or a positive int, got {vpp!r}")
    if problems:
        return problems, None
    if vpp is not None and pp == 1:
        problems.append(f"`vpp`={vpp} needs pp > 1 (Megatron's interleaved schedule), got pp=1")
    world = tp * cp * pp * dp
    if world % (etp * ep * pp):
        problems.append(
            f"world size {world} (tp*cp*pp*dp) is not divisible by etp*ep*pp = {etp}*{ep}*{pp}; "
            "choose ep (and etp) so that they divide tp*cp*dp"
        )
        return problems, None
    edp = world // (etp * ep * pp)
    dsizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    esizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    dec_order = full_order(order, dsizes, "decoder", problems)
    exp_order = full_order(order, esizes, "expert", problems)
    if problems:
        return problems, None
    dec = Mesh(tokens=dec_order, sizes=tuple(int(dsizes[t]) for t in dec_order))
    exp = Mesh(tokens=exp_order, sizes=tuple(int(esizes[t]) for t in exp_order))
    # Megatron tests the raw string (initialize_model_parallel: ``order.endswith("pp")``).
    if not order.endswith("pp") and pp != 1 and edp != dp:
        problems.append(
            f"order {order!r} does not end in 'pp', so the expert data-parallel size ({edp}) must equal dp ({dp})"
        )
    if pp != 1 and dec.stride("pp") != exp.stride("pp"):
        problems.append(
            f"with order {order!r} the pipeline groups of the dense (stride {dec.stride('pp')}) and expert "
            f"(stride {exp.stride('pp')}) layers differ; Megatron requires them equal"
        )
    return problems, (dec, exp)
