"""ServiceConfig: everything the runtime needs to start loaders, planner and constructors.

Plain dataclasses (no Hydra import) so actors can receive them. The batch shape
(:class:`BatchConfig`) and where Ray runs (:class:`RayConfig`) are defined here once: the
``data`` config group's schema (`megascale_data_ext.config`) inherits / embeds them, and their
checks (``problems()``: ``(field, message)`` pairs) serve both, the config re-addressing each
field to its config path.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from megascale_data_ext.dataplane.mixing import MixMode, build_schedule
from megascale_data_ext.dataplane.strategies import StrategyName
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.sources.base import FieldProblem, SourceSpec

__all__ = ["DEFAULT_STRATEGY", "INLINE_OBJECT_BYTES", "MIX_MODES", "OVERFLOW_MODES", "AutoscaleConfig", "Overflow",
           "BatchConfig", "FieldProblem", "PlacementConfig", "RayConfig", "ServiceConfig", "choice_problems",
           "render_problems"]

DEFAULT_STRATEGY = StrategyName.LLM_BALANCE.value
INLINE_OBJECT_BYTES = 1 << 20
"""`RayConfig.inline_object_bytes` of an embedded Ray when unset."""
MIX_MODES: tuple[str, ...] = tuple(m.value for m in MixMode)


class Overflow(enum.StrEnum):
    """What a step whose samples do not fit its microbatches does (``overflow``)."""

    DEFER = "defer"
    ERROR = "error"


OVERFLOW_MODES: tuple[str, ...] = tuple(m.value for m in Overflow)
#: BatchConfig fields that must be integers >= 1, in the order problems are reported.
_POSITIVE = ("samples_per_step", "num_microbatches", "seq_length", "pad_to_multiple_of", "prefetch", "buffer_size",
             "constructor_group")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choice_problems(key: str, value: Any, allowed: Sequence[str]) -> list[FieldProblem]:
    """``[(key, message)]`` when ``value`` is not one of ``allowed``, else ``[]``."""
    return [] if value in allowed else [(key, f"must be one of {list(allowed)}, got {value!r}")]


def render_problems(what: str, problems: Sequence[FieldProblem]) -> str:
    """One error text listing every ``(field, message)`` problem of ``what``."""
    return f"invalid {what}:\n  - " + "\n  - ".join(f"`{key}`: {msg}" for key, msg in problems)


@dataclass(slots=True, kw_only=True)
class RayConfig:
    """Where the service's actors run.

    Attributes:
        address: None = an embedded local Ray started by the service; "auto" or "ray://..."
            joins a cluster.
        namespace: Ray namespace of the named actors.
        num_cpus: CPUs of an embedded Ray (None = all cores); a cluster owns its CPUs.
        resources: Custom resources of an embedded Ray.
        dashboard: Start the Ray dashboard with an embedded Ray (needs the ``metrics`` extra,
            ``ray[default]``); a cluster's is its head's (``ray start --head --dashboard-port``).
        dashboard_port: Its port (None = Ray's 8265, the next free one if taken).
        metrics_export_port: Port of the Prometheus metrics an embedded Ray exports (the
            service's ``megascale_*`` series, `runtime.metrics`); None = a free port Ray picks.
        inline_object_bytes: Largest call argument or reply an embedded Ray sends inline with
            the call rather than through its object store (Ray's ``max_direct_call_object_size``,
            100 KiB by default). None = `INLINE_OBJECT_BYTES` (1 MiB): a step of a few microbatches
            (~250 KiB of text) then costs its constructor and its trainer rank half the CPU per
            call. A cluster's is its own (``ray start --head --system-config=...``).
        prestart_workers: Let an embedded Ray prestart its idle worker processes when the first
            driver joins (Ray's ``prestart_worker_first_driver``): one per CPU (min(cores,
            ``num_cpus``)), each ~80 MiB with the service's modules preloaded, idle for as long as
            Ray runs (a 128-core node: ~10 GiB). Off: each actor's worker starts when the actor is
            asked for and no idle one stays. A cluster's is its own.
    """

    address: str | None = None
    namespace: str = "megascale"
    num_cpus: int | None = None
    resources: dict[str, float] = field(default_factory=dict)
    dashboard: bool = False
    dashboard_port: int | None = None
    metrics_export_port: int | None = None
    inline_object_bytes: int | None = None
    prestart_workers: bool = False

    def init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.init`` (``num_cpus``/``resources`` only for an embedded Ray).

        An embedded Ray is ``address="local"``: a new instance, never the latest ``ray start``
        cluster on the machine (which ``address=None`` would join, refusing ``num_cpus``).
        """
        if self.address is not None:
            return {"address": self.address, "namespace": self.namespace}
        local = {"num_cpus": self.num_cpus, "resources": dict(self.resources) or None,
                 "dashboard_port": self.dashboard_port, "_metrics_export_port": self.metrics_export_port}
        embedded = {k: v for k, v in local.items() if v is not None}
        inline = INLINE_OBJECT_BYTES if self.inline_object_bytes is None else self.inline_object_bytes
        return {"address": "local", "namespace": self.namespace, "include_dashboard": self.dashboard, **embedded,
                "_system_config": {"max_direct_call_object_size": inline,
                                   "prestart_worker_first_driver": bool(self.prestart_workers)}}

    def problems(self) -> list[FieldProblem]:
        """What is wrong with the fields, as ``(field, message)``."""
        out: list[FieldProblem] = []
        if self.num_cpus is not None and (not _is_int(self.num_cpus) or self.num_cpus < 1):
            out.append(("num_cpus", f"must be an integer >= 1 or null, got {self.num_cpus!r}"))
        out += [(f"resources.{k}", f"must be >= 0, got {a!r}") for k, a in self.resources.items() if not a >= 0]
        if self.inline_object_bytes is not None and (not _is_int(self.inline_object_bytes)
                                                     or self.inline_object_bytes < 0):
            out.append(("inline_object_bytes", f"must be an integer >= 0 (bytes) or null, got "
                                               f"{self.inline_object_bytes!r}"))
        for key in ("dashboard_port", "metrics_export_port"):
            port = getattr(self, key)
            if port is not None and (not _is_int(port) or not 1 <= port <= 65535):
                out.append((key, f"must be a port in 1..65535 or null, got {port!r}"))
        if self.address is not None:  # ray.init ignores them when it joins a cluster: refuse, not ignore
            out += [(key, f"applies to an embedded Ray only (data.ray.address=null); a cluster's is set by "
                          f"`ray start --head --{key.replace('_', '-')}`, so drop data.ray.{key}")
                    for key in ("dashboard", "dashboard_port", "metrics_export_port")
                    if getattr(self, key) not in (None, False)]
            if self.inline_object_bytes is not None:
                out.append(("inline_object_bytes", "applies to an embedded Ray only (data.ray.address=null); a "
                                                   "cluster's is set by `ray start --head --system-config="
                                                   "'{\"max_direct_call_object_size\": 1048576}'`, so drop "
                                                   "data.ray.inline_object_bytes"))
            if self.prestart_workers:
                out.append(("prestart_workers", "applies to an embedded Ray only (data.ray.address=null); a "
                                                "cluster prestarts as its head was started "
                                                "(`RAY_prestart_worker_first_driver=0 ray start ...` turns it "
                                                "off), so drop data.ray.prestart_workers"))
        elif self.dashboard and importlib.util.find_spec("aiohttp") is None:
            out.append(("dashboard", "needs Ray's dashboard packages: pip install 'megascale-data-ext[metrics]' "
                                     "(ray[default]), or set data.ray.dashboard=false"))
        return out


@dataclass(slots=True, kw_only=True)
class AutoscaleConfig:
    """Loader actors from the offline partition and the mixture (MegaScale-Data Sec. 5, docs/autoscaler.md).

    Off (default): one Source Loader actor per source. On: the sources' profiles (P, T, M)
    are partitioned into loader actors — small sources share one actor, heavy ones are split
    into data-parallel shards, each actor gets the workers its load needs, placed on nodes under
    their memory — and, with ``scaling``, the Planner adds and reclaims shards as a source's
    share of the mixture moves.

    Attributes:
        enabled: Partition the loaders instead of one actor per source.
        profiles: The profile journal (`megascale-data profile <config> --out DIR` writes
            ``DIR/profiles.json``); sources missing or stale there are profiled at start and
            added. None: profile every source at start, keep nothing.
        profile_samples: Samples read per source when profiling at start.
        profile_per_kind: Sources measured at start per kind (same format and settings but
            paths); the others of the kind get profiles from their own metadata and memory plus
            the measured ones' rates (`sources.profiling.profile_sources`). 0 measures each one.
        actor_memory_mib: M_pod: memory cap of one loader actor.
        actor_base_mib: Memory of an idle loader actor process (interpreter, numpy, pyarrow).
        step_seconds: O_up: seconds a loader may take to transform its share of one step.
        max_workers_per_actor: w_actor: read-ahead workers of one actor.
        max_workers_per_source: w_src: workers of one source over all its shards.
        node_memory_fraction: Share of each Ray node's memory offered to loaders.
        scaling: Follow the mixture online (create and reclaim shards); off = the partition stays.
        interval_steps: Steps per scaling interval (the moving average's unit).
        lead_steps: Steps between a scaling decision and the step its new shards serve from.
        window: Intervals in the moving average of a source's weight.
        patience: Consecutive intervals a threshold crossing must hold before acting.
        hysteresis: Scale down only below ``(1 - hysteresis)`` of the smaller count's capacity.
        max_shards: Most data-parallel shards of one source.
    """

    enabled: bool = False
    profiles: str | None = None
    profile_samples: int = 32
    profile_per_kind: int = 8
    actor_memory_mib: float = 2048.0
    actor_base_mib: float = 80.0
    step_seconds: float = 1.0
    max_workers_per_actor: int = 4
    max_workers_per_source: int = 16
    node_memory_fraction: float = 0.5
    scaling: bool = True
    interval_steps: int = 4
    lead_steps: int = 2
    window: int = 4
    patience: int = 2
    hysteresis: float = 0.25
    max_shards: int = 8

    def problems(self) -> list[FieldProblem]:
        """What is wrong with the fields, as ``(field, message)``."""
        out = [(k, f"must be an integer >= 1, got {getattr(self, k)!r}") for k in
               ("profile_samples", "max_workers_per_actor", "max_workers_per_source", "interval_steps", "lead_steps",
                "window", "patience", "max_shards") if not _is_int(getattr(self, k)) or getattr(self, k) < 1]
        out += [(k, f"must be > 0, got {getattr(self, k)!r}") for k in ("actor_memory_mib", "step_seconds")
                if not isinstance(getattr(self, k), int | float) or not getattr(self, k) > 0]
        if not _is_int(self.profile_per_kind) or self.profile_per_kind < 0:
            out.append(("profile_per_kind", f"must be an integer >= 0, got {self.profile_per_kind!r}"))
        if not isinstance(self.actor_base_mib, int | float) or self.actor_base_mib < 0:
            out.append(("actor_base_mib", f"must be >= 0, got {self.actor_base_mib!r}"))
        if not isinstance(self.node_memory_fraction, int | float) or not 0 < self.node_memory_fraction <= 1:
            out.append(("node_memory_fraction", f"must be in (0, 1], got {self.node_memory_fraction!r}"))
        if not isinstance(self.hysteresis, int | float) or not 0 <= self.hysteresis < 1:
            out.append(("hysteresis", f"must be in [0, 1), got {self.hysteresis!r}"))
        return out


@dataclass(slots=True, kw_only=True)
class PlacementConfig:
    """Where loaders and constructors run (docs/autoscaler.md, "Placement").

    Attributes:
        trainer_nodes: Ray node names of the trainers in rank order (a node is named by a
            ``msd_node:<name>`` resource, or its Ray node id): ranks ``[i * ranks_per_node,
            (i + 1) * ranks_per_node)`` run on ``trainer_nodes[i]``. Each Data Constructor
            then runs on the node of the ranks it serves; empty = wherever Ray puts it.
        ranks_per_node: Trainer ranks per node.
        soft: Let Ray restart an actor elsewhere when its node is gone (False: hard affinity, and
            a lost node's actors can never restart).
        move_back_s: Seconds between checks for actors that restarted away from a home node
            that is back (a node named by its ``msd-node`` label); one seen away twice in a row
            is restarted at home. 0: they stay where they restarted.
    """

    trainer_nodes: list[str] = field(default_factory=list)
    ranks_per_node: int = 8
    soft: bool = True
    move_back_s: float = 10.0

    def problems(self) -> list[FieldProblem]:
        out: list[FieldProblem] = []
        if not _is_int(self.ranks_per_node) or self.ranks_per_node < 1:
            out.append(("ranks_per_node", f"must be an integer >= 1, got {self.ranks_per_node!r}"))
        if len(set(self.trainer_nodes)) != len(self.trainer_nodes):
            out.append(("trainer_nodes", f"names must be unique, got {self.trainer_nodes}"))
        if not isinstance(self.move_back_s, int | float) or isinstance(self.move_back_s, bool) or self.move_back_s < 0:
            out.append(("move_back_s", f"must be seconds >= 0 (0: never move back), got {self.move_back_s!r}"))
        return out


@dataclass(slots=True, kw_only=True)
class BatchConfig:
    """Batch shape and runtime knobs, shared by ServiceConfig and the ``data`` config node.

    Attributes:
        seed: Seeds epoch shuffles and random mixing; same seed + step -> same samples.
        samples_per_step: Samples in one global batch (before packing).
        num_microbatches: Microbatches per DP rank per step (Megatron's GBS / (DP * MBS)).
        seq_length: Token cap of one packed microbatch (the context length).
        shuffle: Shuffle each source's order per epoch (seeded).
        buffer_size: Samples per source whose metadata the planner may look at.
        prefetch: Steps planned and assembled ahead of the trainer.
        constructor_group: DP buckets served by one Data Constructor (1 = one per DP rank).
        with_attention_mask: Build the block-diagonal causal mask (needed without THD kernels).
        pad_to_multiple_of: Packed length granularity (multiplied by 2*cp for CP slicing).
        overflow: "defer": samples of a step that do not fit DP x num_microbatches x seq_length
            tokens wait for the next step (`samples_per_step` is then a maximum); "error": stop
            with a CapacityError naming the sample.
        middle_stage_masks: Middle pipeline stages (pp > 2) also fetch the attention mask and
            cu_seqlens, so packed documents never attend across boundaries on any stage.
        replay_dir: Serve the plans `megascale-data plan` wrote there instead of planning
            (replay mode); None plans live.
        tokens_per_step: Token-budget mode (a Megatron global batch of GBS x seq_length tokens):
            each step takes as many documents as fill this many real tokens, at most DP x
            num_microbatches x seq_length; `samples_per_step` is then unused. None = count mode.
        split_documents: Token-budget mode only: a document that does not fit the room left in
            a microbatch is split, as Megatron's GPTDataset does; the rest continues in the next
            microbatch (possibly next step), positions restarting at 0. Sources then keep
            documents longer than seq_length whole (no implicit `max_tokens`).
    """

    seed: int = 1234
    samples_per_step: int = 32
    num_microbatches: int = 2
    seq_length: int = 1024
    shuffle: bool = True
    buffer_size: int = 4096
    prefetch: int = 2
    constructor_group: int = 1
    with_attention_mask: bool = True
    pad_to_multiple_of: int = 8
    overflow: str = "defer"
    middle_stage_masks: bool = True
    replay_dir: str | None = None
    tokens_per_step: int | None = None
    split_documents: bool = False

    def problems(self) -> list[FieldProblem]:
        """What is wrong with the batch fields, as ``(field, message)``."""
        out = [(k, f"must be a positive integer, got {getattr(self, k)!r}") for k in _POSITIVE
               if not _is_int(getattr(self, k)) or getattr(self, k) < 1]
        if not _is_int(self.seed) or self.seed < 0:
            out.append(("seed", f"must be an integer >= 0 (numpy SeedSequence), got {self.seed!r}"))
        return out + choice_problems("overflow", self.overflow, OVERFLOW_MODES) + self._token_problems()

    def _token_problems(self) -> list[FieldProblem]:
        if self.tokens_per_step is None:
            if self.split_documents:
                return [("split_documents", "needs token-budget mode: set `tokens_per_step` (e.g. "
                                            "global_batch_size * seq_length) or split_documents=false")]
            return []
        out: list[FieldProblem] = []
        if not _is_int(self.tokens_per_step) or self.tokens_per_step < 1:
            out.append(("tokens_per_step", f"must be a positive integer or null, got {self.tokens_per_step!r}"))
        elif _is_int(self.seq_length) and self.tokens_per_step < self.seq_length:
            out.append(("tokens_per_step", f"must be >= seq_length ({self.seq_length}) so a step fills at least "
                                           f"one microbatch, got {self.tokens_per_step}"))
        if self.replay_dir is not None:
            out.append(("tokens_per_step", "replay mode (`replay_dir`) serves count-mode plans only; "
                                           "set tokens_per_step=null or replay_dir=null"))
        return out


@dataclass(slots=True, kw_only=True)
class ServiceConfig(BatchConfig):
    """Sources, strategy, mixing and Ray of one data service, plus the :class:`BatchConfig` fields.

    Attributes:
        sources: The sources, in mixing order.
        strategy: Name of a registered strategy ("vanilla", "llm_balance", "vlm_balance").
        strategy_args: Keyword arguments of the strategy (model, method, level, ...).
        mixing: Mixing schedule mapping for `mixing.build_schedule` (default: source weights).
        mix_mode: "deterministic" (Megatron-like error minimisation) or "random".
        ray: Where the actors run (`RayConfig.init_kwargs` starts or joins Ray).
        fault_tolerance: How killed actors are recovered (restarts, planner checkpoints,
            shadow loaders, client prefetch, fault injection).
        autoscale: Partitioned and mixture-scaled loader actors instead of one per source.
        placement: Trainer nodes, for constructor sidecars.
    """

    sources: list[SourceSpec]
    strategy: str = DEFAULT_STRATEGY
    strategy_args: dict[str, Any] = field(default_factory=dict)
    mixing: dict[str, Any] | None = None
    mix_mode: str = MixMode.DETERMINISTIC.value
    ray: RayConfig = field(default_factory=RayConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        # A sample can never be longer than the context: sources without their own limit get
        # seq_length; their `truncate` flag decides between cutting and a named error.
        # Splitting documents (token mode) cuts them into spans instead, so they stay whole.
        if not (self.split_documents and self.tokens_per_step is not None):
            self.sources = [s if s.max_tokens is not None else replace(s, max_tokens=self.seq_length)
                            for s in self.sources]
        problems = self.problems()
        if problems:
            raise ConfigError(render_problems("data service config", problems))

    def problems(self) -> list[FieldProblem]:
        """What is wrong, as ``(field, message)``: the batch fields, sources, mix mode, Ray."""
        out = BatchConfig.problems(self)
        if not self.sources:
            out.append(("sources", "is empty: give at least one source"))
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            out.append(("sources", f"names must be unique, got {names}"))
        out += choice_problems("mix_mode", self.mix_mode, MIX_MODES)
        if self.tokens_per_step is not None and self.strategy == StrategyName.VANILLA:
            out.append(("tokens_per_step", "needs a strategy with a token cap (llm_balance, vlm_balance); "
                                           "vanilla packs a fixed sample count without one"))
        out += [(f"autoscale.{key}", msg) for key, msg in self.autoscale.problems()]
        out += [(f"placement.{key}", msg) for key, msg in self.placement.problems()]
        return out + [(f"ray.{key}", msg) for key, msg in self.ray.problems()]

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def feedback_mixing(self) -> bool:
        """Whether the mixture follows the trainer's per-source loss (a feedback schedule)."""
        return self.mixing_config().get("type") == "feedback"

    @property
    def report_delay(self) -> int | None:
        """d of a feedback schedule (step k's loss report shapes step k + d: no step can be planned
        more than d - 1 ahead of the trainer's); None when the mixture needs no reports."""
        if not self.feedback_mixing:
            return None
        return build_schedule(self.mixing_config(), source_names=self.source_names).delay

    def mixing_config(self) -> dict[str, Any]:
        if self.mixing is not None:
            return dict(self.mixing)
        return {"type": "constant", "weights": [s.weight for s in self.sources]}

    def fingerprint(self) -> dict[str, Any]:
        """Fields that decide the delivered stream; a resume must match them (see ResumeError)."""
        return {
            "sources": [(s.name, s.format, sorted(s.paths)) for s in self.sources],
            "seed": self.seed,
            "samples_per_step": self.samples_per_step,
            "num_microbatches": self.num_microbatches,
            "seq_length": self.seq_length,
            "strategy": [self.strategy, json.dumps(self.strategy_args, sort_keys=True, default=str)],
            "mixing": json.dumps(self.mixing_config(), sort_keys=True, default=str),
            "mix_mode": self.mix_mode,
            "shuffle": self.shuffle,
            "overflow": self.overflow,
            "tokens_per_step": self.tokens_per_step,
            "split_documents": self.split_documents,
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
