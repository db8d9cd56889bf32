"""Orchestration strategies: a few lines each over the DGraph primitives (paper Fig. 9).

A strategy is a callable ``strategy(graph) -> graph`` applied to a DGraph that has already
been mixed (the Planner owns the mixing schedule). Strategies are registered by name so a
config can say ``strategy: llm_balance`` or point ``_target_`` at a user class. Cost models
are resolved through `costs.get_cost_model` when a strategy is built, so an unknown model
name fails there (ConfigError naming the known ones), not at the first plan.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from megascale_data_ext.dataplane.balancers.hybrid_cp import CPCost
from megascale_data_ext.dataplane.costs import TransformerConfig, TransformerCost, ViTCost, get_cost_model
from megascale_data_ext.dataplane.dgraph import DGraph
from megascale_data_ext.errors import ConfigError


class Strategy(Protocol):
    """``strategy(graph) -> graph`` over a mixed DGraph.

    Strategies declare `axis`, the distribution axis their buckets follow ("DP" when a
    strategy has none), and `broadcast`, the dims the trainer receives by broadcast (e.g.
    ``("tp",)``); the runtime reads both from the built strategy.
    """

    def __call__(self, g: DGraph) -> DGraph: ...


class _CostsByModel:
    """A strategy whose ``model`` names the transformer cost model it costs samples with."""

    __slots__ = ()

    def __post_init__(self) -> None:
        self._cost = get_cost_model(self.model, kind=TransformerCost)

    @property
    def cost_model(self) -> Callable:
        """The cost model `model` names, as the strategy applies it to samples."""
        return self._cost


@dataclass(slots=True, kw_only=True)
class Vanilla(_CostsByModel):
    """No balancing: Megatron's order, contiguous equal-count slices per DP rank and microbatch.

    `axis`: the distribution axis; `broadcast`: the dims the trainer broadcasts over.
    """

    num_microbatches: int
    axis: str = "DP"
    model: str | TransformerConfig | Callable = "llama-12b"
    broadcast: tuple[str, ...] = ("tp",)
    _cost: Callable = field(init=False, repr=False, compare=False)

    def __call__(self, g: DGraph) -> DGraph:
        g = (
            g.distribute(self.axis)
            .cost(self._cost)
            .balance("greedy", level="none", num_microbatches=self.num_microbatches)
        )
        for dim in self.broadcast:
            g = g.broadcast_at(dim)
        return g


@dataclass(slots=True, kw_only=True)
class LLMBalance(_CostsByModel):
    """Algorithm 1 (LLMBalance): cost-balanced microbatches spread over the distribution axis.

    `level="interleaved"` packs all samples into k·m balanced bins under the token `cap`,
    then gives each bucket m bins; `group_size` balances within subgroups of buckets.
    `axis`: the distribution axis; `broadcast`: the dims the trainer broadcasts over.
    """

    num_microbatches: int
    cap: int | None = None
    model: str | TransformerConfig | Callable = "llama-12b"
    method: str = "kk"
    level: str = "interleaved"
    axis: str = "DP"
    group_size: int | None = None
    keep_order: bool = True
    broadcast: tuple[str, ...] = ("tp",)
    _cost: Callable = field(init=False, repr=False, compare=False)

    def __call__(self, g: DGraph) -> DGraph:
        g = g.distribute(self.axis, group_size=self.group_size).cost(self._cost)
        g = g.balance(
            self.method, level=self.level, num_microbatches=self.num_microbatches, cap=self.cap, keep_order=self.keep_order
        )
        for dim in self.broadcast:
            g = g.broadcast_at(dim)
        return g


@dataclass(slots=True, kw_only=True)
class VLMBalance:
    """Algorithm 2 (hybrid): images balanced over the encoder's axis, the backbone by LLMBalance.

    `axis` and `broadcast` are the backbone's: samples reach the trainer as the backbone
    distributes them.
    """

    backbone: LLMBalance
    encoder_model: str | TransformerConfig | Callable = "vit-2b"
    encoder_axis: str = "WORLD"
    encoder_method: str = "greedy"
    _encoder_cost: Callable = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._encoder_cost = get_cost_model(self.encoder_model, kind=ViTCost)

    @property
    def axis(self) -> str:
        """The backbone's distribution axis."""
        return self.backbone.axis

    @property
    def broadcast(self) -> tuple[str, ...]:
        """The backbone's broadcast dims."""
        return self.backbone.broadcast

    def __call__(self, g: DGraph) -> DGraph:
        (
            g.images()
            .distribute(self.encoder_axis)
            .cost(self._encoder_cost)
            .balance(self.encoder_method, level="inter", num_microbatches=1)
        )
        return self.backbone(g)


@dataclass(slots=True, kw_only=True)
class HybridCPBalance(_CostsByModel):
    """Hybrid context parallelism (issue 26): every document its own power-of-two group of DP×CP
    consumers, short ones whole on one, as many microbatches per consumer as its documents need
    (`balancers.hybrid_cp`). ``cap`` is the longest sequence (``data.seq_length``, what a fixed
    CP job cuts over CP ranks); a consumer holds ``cap / CP`` tokens a microbatch, megatron-core's
    ``max_seqlen_per_dp_cp_rank``. The cost is the `model`'s per sample plus `per_document` and,
    per token a split document exchanges, `cp_comm` (in the model's units; 0: splitting is free).
    Needs a per-token loss (the trainer refuses otherwise, naming the key); with PP > 1 each group
    microbatch sits at one index on all its consumers, fillers in the holes (`HybridPlan.slots`)."""

    num_microbatches: int
    cap: int
    model: str | TransformerConfig | Callable = "llama-12b"
    per_document: float = 0.0
    cp_comm: float = 0.0
    broadcast: tuple[str, ...] = ("tp",)
    axis: ClassVar[str] = "CP"  # every DP x CP rank a consumer, megatron-core's hybrid-group order
    variable_counts: ClassVar[bool] = True  # each consumer its own count (the runtime reads it)
    _cost: Callable = field(init=False, repr=False, compare=False)

    def __call__(self, g: DGraph) -> DGraph:
        per_gpu = max(int(self.cap) // int(g.tree.cp), 1)
        cost = CPCost(per_document=self.per_document, cp_comm=self.cp_comm, model=self._cost)
        # with PP every group at one index on all its consumers: 1F1B orders a rank's microbatches by index
        g = g.distribute(self.axis).balance_hybrid_cp(cap=per_gpu, cost=cost, aligned=g.tree.pp > 1)
        for dim in self.broadcast:
            g = g.broadcast_at(dim)
        return g


STRATEGIES: dict[str, Callable[..., Strategy]] = {}


def register_strategy(name: str, factory: Callable[..., Strategy]) -> None:
    STRATEGIES[str(name)] = factory  # plain names: error messages list them as typed


def build_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build a registered strategy; `vlm_balance` takes the backbone's fields flat."""
    factory = STRATEGIES.get(name)
    if factory is None and "." in name:  # a `_target_` path: importable in every actor process
        import importlib

        module, _, attr = name.rpartition(".")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"strategy {name!r} cannot be imported: {exc}") from exc
    if factory is None:
        raise ConfigError(f"strategy {name!r} is not registered; known strategies: {sorted(STRATEGIES)}")
    return factory(**kwargs)


def _vlm_factory(
    *, encoder_model: Any = "vit-2b", encoder_axis: str = "WORLD", encoder_method: str = "greedy", **backbone: Any
) -> VLMBalance:
    return VLMBalance(
        backbone=LLMBalance(**backbone), encoder_model=encoder_model, encoder_axis=encoder_axis, encoder_method=encoder_method
    )


class StrategyName(enum.StrEnum):
    """The built-in strategies (`register_strategy` adds others by name)."""

    VANILLA = "vanilla"
    LLM_BALANCE = "llm_balance"
    VLM_BALANCE = "vlm_balance"
    HYBRID_CP = "hybrid_cp"


def strategy_args(name: str, args: Mapping[str, Any], *, num_microbatches: int, seq_length: int) -> dict[str, Any]:
    """A strategy's arguments with the batch shape's defaults: ``num_microbatches``, and the token
    ``cap`` (``seq_length``) for every strategy but vanilla, which packs a fixed count without one."""
    out = dict(args)
    out.setdefault("num_microbatches", num_microbatches)
    if name != StrategyName.VANILLA:
        out.setdefault("cap", seq_length)
    return out


register_strategy(StrategyName.VANILLA, Vanilla)
register_strategy(StrategyName.LLM_BALANCE, LLMBalance)
register_strategy(StrategyName.VLM_BALANCE, _vlm_factory)
register_strategy(StrategyName.HYBRID_CP, HybridCPBalance)
