"""ClientPlaceTree: the trainer device mesh as the data plane sees it.

The tree answers, for every global rank, which (tp, cp, dp, pp, ep) coordinates it has, which
Megatron process groups it belongs to and which consumer bucket of an axis it belongs to. It
describes Megatron's layout only: which ranks fetch and which receive by broadcast is the
service's decision (`dataplane.distribution.Distribution`, owned by `ServiceTopology`). Rank order is Megatron's own
(`RankGenerator` in ``megatron/core/parallel_state.py``): for an order string the first token
varies fastest, so with the default ``"tp-cp-ep-dp-pp"``
``rank = tp + TP * (cp + CP * (dp + DP * pp))``.

Like Megatron, two meshes share one world: the *decoder* mesh (tp, cp, dp, pp; its ``dp``
already contains the expert-parallel ranks) and the *expert* mesh (etp, ep, edp, pp; cp = 1).
``group("dp")`` is therefore exactly ``get_data_parallel_group()`` and the ``ep`` coordinate
is the rank's index in ``get_expert_model_parallel_group()``.

Everything is index arithmetic over ``numpy.arange(world_size)``, so a 4,096-rank world is
built and queried in milliseconds; the planner simulates whole worlds in one process. Only
``from_megatron`` touches Megatron, importing ``parallel_state`` lazily.
"""

from __future__ import annotations

import enum
import importlib
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.rank_order import (
    BROADCAST_DIMS,
    DEFAULT_ORDER,
    GROUPS,
    GroupName,
    Mesh,
    check_layout,
    is_pos_int,
)
from megascale_data_ext.errors import ParallelLayoutError

__all__ = ["DEFAULT_ORDER", "BucketAxis", "BucketLayout", "ClientPlaceTree", "GroupName"]


class BucketAxis(str, enum.Enum):
    """Tree level whose nodes are the consumers of ``distribute(axis)`` (paper Sec. 4)."""

    DP = "DP"  # one bucket per data-parallel replica
    CP = "CP"  # DP x CP uniform consumers (hybrid data/context parallelism)
    WORLD = "WORLD"  # one bucket per global rank (e.g. a VLM encoder data parallel over WORLD)

    @classmethod
    def parse(cls, value: str | BucketAxis) -> BucketAxis:
        try:
            return cls(value.upper() if isinstance(value, str) else value)
        except ValueError:
            allowed = [a.value for a in cls]
            msg = f"bucket axis must be one of {allowed} (case-insensitive), got {value!r}"
            raise ParallelLayoutError(msg) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketLayout:
    """Consumers of one ``distribute(axis, group_size)``: bucket ids, their ranks, balancing groups.

    Attributes:
        axis: The tree level the buckets sit at.
        num_buckets: Number of consumers n.
        bucket_coords: Per bucket, the coordinates that identify it (``{"dp": 1}``, ...).
        bucket_ranks: Per bucket, every global rank that consumes that bucket's data, ascending.
        groups: ``ceil(n / group_size)`` contiguous runs of bucket ids balanced independently
            (one run of all buckets without a group size).
        rank_to_bucket: Bucket id of every global rank.
    """

    axis: BucketAxis
    num_buckets: int
    bucket_coords: tuple[dict[str, int], ...]
    bucket_ranks: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    rank_to_bucket: tuple[int, ...] = field(repr=False)

    def bucket_of_rank(self, rank: int) -> int:
        """Bucket whose data ``rank`` consumes."""
        if not 0 <= rank < len(self.rank_to_bucket):
            raise ParallelLayoutError(f"rank {rank} is outside the world [0, {len(self.rank_to_bucket)})")
        return self.rank_to_bucket[rank]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientPlaceTree:
    """The trainer device mesh: WORLD -> DP -> CP -> TP leaves, PP stages alongside.

    An immutable value object (safe to share between threads and to ship to Ray actors);
    derived arrays are cached per instance. Build it with ``from_sizes`` or ``from_megatron``.

    Attributes:
        tp, cp, pp, dp: Dense-layer parallel sizes (``dp`` includes the expert-parallel ranks).
        ep, etp: Expert model / expert tensor parallel sizes (etp defaults to tp).
        vpp: Virtual pipeline size (interleaved schedule) or None.
        order: Megatron's rank order string.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    order: str = DEFAULT_ORDER
    _decoder: Mesh = field(init=False, repr=False, compare=False)
    _expert: Mesh = field(init=False, repr=False, compare=False)
    _cache: dict[Any, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        etp = self.tp if self.etp is None else self.etp
        problems, meshes = check_layout(
            tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep, etp=etp, vpp=self.vpp, order=self.order
        )
        if problems or meshes is None:
            raise ParallelLayoutError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
        for name, value in (("etp", int(etp)), ("order", self.order.lower()), ("_decoder", meshes[0]),
                            ("_expert", meshes[1]), ("_cache", {})):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sizes(
        cls,
        *,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        ep: int = 1,
        etp: int | None = None,
        vpp: int | None = None,
        world_size: int | None = None,
        order: str = DEFAULT_ORDER,
    ) -> ClientPlaceTree:
        """Tree for explicit sizes, with ``dp`` derived from ``world_size`` when not given.

        Raises:
            ParallelLayoutError: listing every problem (non-positive sizes, a world not divisible
                by tp*cp*pp or etp*ep*pp, an order Megatron would reject, dp inconsistent with
                world_size).
        """
        problems: list[str] = []
        model = tp * cp * pp if all(is_pos_int(v) for v in (tp, cp, pp)) else None
        if dp is None and world_size is None:
            problems.append("give `dp` or `world_size` (dp = world_size // (tp*cp*pp))")
        elif world_size is not None and not is_pos_int(world_size):
            problems.append(f"`world_size` must be a positive int, got {world_size!r}")
        elif world_size is not None and model is not None:
            if world_size % model:
                problems.append(f"world_size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {model}")
            elif dp is None:
                dp = world_size // model
            elif is_pos_int(dp) and dp * model != world_size:
                problems.append(f"dp={dp} with tp*cp*pp={model} gives {dp * model} ranks, not world_size={world_size}")
        sizes_known = dp is not None or not problems
        layout, _ = check_layout(
            tp=tp, cp=cp, pp=pp, dp=dp if dp is not None else 1, ep=ep, etp=tp if etp is None else etp,
            vpp=vpp, order=order,
        ) if sizes_known else ([], None)
        problems += [p for p in layout if p not in problems]
        if problems:
            raise ParallelLayoutError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
        return cls(tp=tp, cp=cp, pp=pp, dp=int(dp), ep=ep, etp=etp, vpp=vpp, order=order)  # type: ignore[arg-type]

    @classmethod
    def from_megatron(cls, *, order: str | None = None) -> ClientPlaceTree:
        """Tree of the running job, read from ``megatron.core.parallel_state``.

        Call after ``initialize_model_parallel``. Megatron does not store the order string it
        used, so it is inferred: the first candidate (the default first, then every
        permutation) whose groups for this rank equal Megatron's. The result is verified
        against Megatron's coordinates and group ranks for this rank.

        Args:
            order: Skip inference and verify this order instead.

        Raises:
            ParallelLayoutError: parallel_state is not initialised, or no order reproduces
                Megatron's groups (the message shows Megatron's groups and the first mismatch).
        """
        state = _read_parallel_state(importlib.import_module("megatron.core.parallel_state"))
        sizes = state["sizes"]
        candidates = [order] if order is not None else _candidate_orders(sizes)
        first_mismatch: str | None = None
        for candidate in candidates:
            try:
                tree = cls(order=candidate, **sizes)
            except ParallelLayoutError as err:
                first_mismatch = first_mismatch or f"order {candidate!r}: {err}"
                continue
            mismatch = tree._mismatch(state["rank"], state["coords"], state["groups"])
            if mismatch is None:
                return tree
            first_mismatch = first_mismatch or f"order {candidate!r}: {mismatch}"
        raise ParallelLayoutError(
            f"no rank order reproduces Megatron's parallel groups for global rank {state['rank']} "
            f"(sizes {sizes}); first mismatch: {first_mismatch}. Megatron's groups: {state['groups']}. "
            "Pass order=... if Megatron was initialised with a custom order."
        )

    def _mismatch(self, rank: int, coords: dict[str, int], groups: dict[str, list[int]]) -> str | None:
        if not 0 <= rank < self.world_size:
            return f"rank {rank} outside world {self.world_size}"
        mine = self.coords(rank)
        for key, value in coords.items():
            if mine[key] != value:
                return f"{key} coordinate {mine[key]} != Megatron's {value}"
        for name, ranks in groups.items():
            if self.group(name, rank) != sorted(ranks):
                return f"group {name!r} {self.group(name, rank)} != Megatron's {sorted(ranks)}"
        return None

    # ------------------------------------------------------------------ coordinates and groups
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size (``get_expert_data_parallel_world_size()``)."""
        return self.world_size // (int(self.etp) * self.ep * self.pp)  # type: ignore[arg-type]

    def check_rank(self, rank: int) -> int:
        """`rank` as an int, or a ParallelLayoutError naming the world."""
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ParallelLayoutError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return int(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tp", "cp", "dp", "pp", "ep"}`` coordinates of a global rank, as Megatron's get_*_rank."""
        r = self.check_rank(rank)
        out = {t: int(self._decoder.coord(r, t)) for t in ("tp", "cp", "dp", "pp")}
        out["ep"] = int(self._expert.coord(r, "ep"))
        return out

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given dense-layer coordinates."""
        given = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        bad = [f"{k}={v} not in [0, {self._decoder.size(k)})" for k, v in given.items()
               if not isinstance(v, (int, np.integer)) or not 0 <= v < self._decoder.size(k)]
        if bad:
            raise ParallelLayoutError("rank_of: " + "; ".join(bad))
        return sum(int(v) * self._decoder.stride(k) for k, v in given.items())

    def group(self, axis: GroupName | str, rank: int) -> list[int]:
        """Sorted global ranks of ``rank``'s group, equal to Megatron's ``get_*_group()`` ranks.

        ``"mp"`` is the tp-pp model-parallel group; ``"ep"``/``"edp"``/``"etp"`` are the expert
        model / expert data / expert tensor parallel groups.
        """
        if axis not in GROUPS:
            raise ParallelLayoutError(f"group axis must be one of {sorted(GROUPS)}, got {axis!r}")
        mesh_name, tokens = GROUPS[axis]
        mesh = self._decoder if mesh_name == "decoder" else self._expert
        return mesh.group(self.check_rank(rank), tokens)

    def coord_array(self, token: str) -> np.ndarray:
        """Every rank's coordinate along `token` (``tp``, ``cp``, ``dp``, ``pp``, ``ep``), cached."""
        key = ("coord", token)
        if key not in self._cache:
            mesh = self._expert if token == "ep" else self._decoder
            self._cache[key] = mesh.coord(np.arange(self.world_size, dtype=np.int64), token)
        return self._cache[key]

    # ------------------------------------------------------------------ consumer buckets
    def buckets(self, axis: str | BucketAxis, group_size: int | None = None) -> BucketLayout:
        """Buckets created by ``distribute(axis, group_size)`` (paper Sec. 4).

        ``"DP"``: bucket d serves every rank with dp coordinate d. ``"CP"``: bucket
        ``dp * CP + cp`` serves the tp/pp ranks of that (dp, cp). ``"WORLD"``: bucket r is rank r.
        """
        ax = BucketAxis.parse(axis)
        if group_size is not None and not is_pos_int(group_size):
            raise ParallelLayoutError(f"`group_size` must be None or a positive int, got {group_size!r}")
        key = ("buckets", ax, group_size)
        if key in self._cache:
            return self._cache[key]
        world = np.arange(self.world_size, dtype=np.int64)
        if ax is BucketAxis.DP:
            ids, n = self.coord_array("dp"), self.dp
            coords = tuple({"dp": d} for d in range(n))
        elif ax is BucketAxis.CP:
            ids, n = self.coord_array("dp") * self.cp + self.coord_array("cp"), self.dp * self.cp
            coords = tuple({"dp": b // self.cp, "cp": b % self.cp} for b in range(n))
        else:
            ids, n = world, self.world_size
            arrays = [(t, self.coord_array(t).tolist()) for t in ("tp", "cp", "dp", "pp", "ep")]
            coords = tuple({t: a[r] for t, a in arrays} for r in range(n))
        order = np.argsort(ids, kind="stable")
        members = np.split(world[order], np.cumsum(np.bincount(ids, minlength=n))[:-1])
        g = n if group_size is None else int(group_size)
        layout = BucketLayout(
            axis=ax, num_buckets=n, bucket_coords=coords, bucket_ranks=tuple(tuple(m.tolist()) for m in members),
            groups=tuple(tuple(range(s, min(s + g, n))) for s in range(0, n, g)), rank_to_bucket=tuple(ids.tolist()),
        )
        self._cache[key] = layout
        return layout

    # ------------------------------------------------------------------ broadcasting
    def broadcast_source(self, rank: int, dim: str | Sequence[str]) -> int:
        """Rank that ``rank`` receives its data from when broadcasting along `dim`: its coordinate 0
        there (``"tp"``, ``"cp"``, ``"tp-cp"`` or a sequence of them; ``()``: itself)."""
        r = self.check_rank(rank)
        dims = dim.split("-") if isinstance(dim, str) else tuple(dim)
        bad = [d for d in dims if d not in BROADCAST_DIMS]
        if bad:
            raise ParallelLayoutError(f"broadcast dim must be among {list(BROADCAST_DIMS)}, got {dim!r}")
        return r - sum(int(self._decoder.coord(r, d)) * self._decoder.stride(d) for d in set(dims))

    # ------------------------------------------------------------------ inspection
    def layout(self) -> dict[str, Any]:
        """Sizes and order as plain data (for fingerprints and resharding decisions)."""
        return {"world_size": self.world_size, "tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
                "ep": self.ep, "etp": self.etp, "vpp": self.vpp, "order": self.order}

    def __repr__(self) -> str:
        return (
            f"ClientPlaceTree(world={self.world_size}, tp={self.tp}, cp={self.cp}, pp={self.pp}, dp={self.dp}, "
            f"ep={self.ep}, etp={self.etp}, vpp={self.vpp}, order={self.order!r})"
        )

    def describe(self, *, fetching: Collection[int] = (), max_dp: int = 4) -> str:
        """Readable tree: WORLD -> DP -> CP -> TP leaves per PP stage; ``*`` marks the `fetching` ranks
        (`ServiceTopology.describe` passes the service's)."""
        fetch = frozenset(int(r) for r in fetching)
        lines = [repr(self), f"WORLD ({self.world_size} ranks; * = fetches, [ ] = TP group per PP stage)"]
        shown = min(self.dp, max_dp)
        for d in range(shown):
            last_dp = d == shown - 1 and shown == self.dp
            lines.append(f"{'└─' if last_dp else '├─'} DP {d}")
            for c in range(self.cp):
                stages = []
                for p in range(self.pp):
                    ranks = [self.rank_of(tp=t, cp=c, dp=d, pp=p) for t in range(self.tp)]
                    stages.append(f"pp{p}: [" + " ".join(f"{r}{'*' if r in fetch else ''}" for r in ranks) + "]")
                lines.append(f"{'   ' if last_dp else '│  '}{'└─' if c == self.cp - 1 else '├─'} CP {c}  "
                             + "  ".join(stages))
        if shown < self.dp:
            lines.append(f"└─ ... {self.dp - shown} more DP replicas")
        return "\n".join(lines)


# Megatron's module-level rank lists for the calling rank (pure Python lists, so reading them
# needs no torch.distributed call); group name -> attribute name in parallel_state 0.16.1.
_MEGATRON_RANK_LISTS = {
    "tp": "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "pp": "_PIPELINE_GLOBAL_RANKS", "dp": "_DATA_PARALLEL_GLOBAL_RANKS",
    "dp-cp": "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "cp": "_CONTEXT_PARALLEL_GLOBAL_RANKS",
    "mp": "_MODEL_PARALLEL_GLOBAL_RANKS", "ep": "_EXPERT_MODEL_PARALLEL_RANKS",
}


def _read_parallel_state(ps: Any) -> dict[str, Any]:
    """Sizes, this rank's coordinates and group ranks from an initialised ``parallel_state``."""
    if not ps.model_parallel_is_initialized():
        raise ParallelLayoutError(
            "megatron parallel_state is not initialised: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) before ClientPlaceTree.from_megatron()"
        )
    tp = int(ps.get_tensor_model_parallel_world_size())
    etp = ps.get_expert_tensor_parallel_world_size()
    sizes = {"tp": tp, "pp": int(ps.get_pipeline_model_parallel_world_size()),
             "cp": int(ps.get_context_parallel_world_size()), "dp": int(ps.get_data_parallel_world_size()),
             "ep": int(ps.get_expert_model_parallel_world_size()), "etp": tp if etp is None else int(etp),
             "vpp": ps.get_virtual_pipeline_model_parallel_world_size()}
    coords = {"tp": int(ps.get_tensor_model_parallel_rank()), "pp": int(ps.get_pipeline_model_parallel_rank()),
              "cp": int(ps.get_context_parallel_rank()), "dp": int(ps.get_data_parallel_rank()),
              "ep": int(ps.get_expert_model_parallel_rank())}
    groups: dict[str, list[int]] = {}
    for name, attr in _MEGATRON_RANK_LISTS.items():
        ranks = getattr(ps, attr, None)
        if ranks is None:
            continue
        # A rank in several pipeline groups (rare custom layouts) stores a list of lists.
        groups[name] = [int(r) for r in (ranks[0] if ranks and isinstance(ranks[0], list) else ranks)]
    if "tp" not in groups:
        raise ParallelLayoutError("megatron parallel_state has no _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS; this "
                                  "megatron-core version is not supported by ClientPlaceTree.from_megatron()")
    return {"sizes": sizes, "coords": coords, "groups": groups, "rank": groups["tp"][coords["tp"]]}


def _candidate_orders(sizes: dict[str, Any]) -> list[str]:
    """Default order first, then every order of the tokens whose size exceeds 1.

    Size-1 tokens do not move any rank, so these candidates cover every distinct layout and
    the inferred order is spelled as a user would write it (``"tp-pp-dp"``).
    """
    world = sizes["tp"] * sizes["cp"] * sizes["pp"] * sizes["dp"]
    edp = world // max(1, sizes["etp"] * sizes["ep"] * sizes["pp"])
    big = [t for t in ("tp", "cp", "ep", "dp", "pp")
           if max(sizes[t], sizes["etp"] if t == "tp" else 1, edp if t == "dp" else 1) > 1]
    perms = ["-".join(p) for p in itertools.permutations(big)] if big else []
    return [DEFAULT_ORDER] + [p for p in perms if p != DEFAULT_ORDER]
