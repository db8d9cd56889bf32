"""The dataset provider Megatron-LM's own `pretrain_gpt.py` calls with `--dataloader-type external`.

With `external`, Megatron passes whatever the provider returns straight to its training loop
(wrapped in `RerunDataIterator`) and calls `next()` on it once per microbatch, leaving sharding
and resumption to the provider. This module returns, on every rank, a `MicrobatchIterator`: a
Megatron-shaped view of the rank's trainer-side `Client` (the same client the schedule hooks
use), which walks (step, microbatch) in order and holds the data position.

Megatron calls the provider with nothing but sample counts, so where the service lives has to
come from outside: `configure(handles)` (a `DatasetProvider` to pass to `pretrain`) in the
launching process, or environment variables set for torchrun (the only thing that travels to every rank); the service's `ServiceTopology` is
then asked of its Planner:

* ``MEGASCALE_RAY_ADDRESS``: Ray address of the service's cluster (``ray://...`` or ``host:port``).
* ``MEGASCALE_NAMESPACE`` (required): Ray namespace of the service's named actors.
* ``MEGASCALE_NUM_MICROBATCHES``: microbatches per step per DP rank; default Megatron's
  ``get_num_microbatches()`` (it must equal the service's ``num_microbatches``).
* ``MEGASCALE_START_STEP``: first step to fetch; default Megatron's ``args.iteration`` (the
  iteration of the loaded checkpoint), so a resumed job asks for the steps it has not trained.
* ``MEGASCALE_DELIVERY_LOG`` (opt-in): a path; fetching ranks append one JSON line per delivered
  microbatch (rank, step, microbatch, its samples as ``[source, position, index]``), so a run of
  Megatron-LM's own loop can be checked for samples delivered twice or lost.
* ``MEGASCALE_PACKED_SEQ=0``: yield no ``cu_seqlens``/``max_seqlen``, so `get_batch` builds no
  PackedSeqParams; for ``--transformer-impl local``, whose DotProductAttention refuses packed
  sequences. Documents of a microbatch then attend across their boundaries (causal over the whole
  pack), as in Megatron's own GPTDataset without ``--reset-attention-mask``.
* ``MEGASCALE_VALID_NAMESPACE``: namespace of the validation service (``serve`` starts one for
  ``data.validation.sources``); the provider then returns its iterator as Megatron's validation
  iterator, positioned as Megatron positions its own on a resume (``iteration // eval_interval *
  eval_iters`` steps in), so ``--eval-interval`` / ``--eval-iters`` evaluate held-out data.

Contract with Megatron's `get_batch` (pretrain_gpt.py at core_v0.16.1): only TP rank 0 of the
first and last pipeline stage calls `next()`; it then broadcasts the microbatch to its TP group
itself, so the client runs without its TP broadcast (which would deadlock). With CP > 1 the
service already hands each rank its slice, cut exactly as Megatron's THD path
(``get_thd_batch_on_this_cp_rank``: every document padded to a multiple of 2·cp, zigzag per
document); the provider therefore turns Megatron's own CP slicing in the loaded modules
(``pretrain_gpt``'s imported names) into the unsliced call (`install_cp_passthrough`), and
sends the padded document boundaries as ``cu_seqlens``, which is how Megatron-LM's packed
datasets describe padded documents (``get_batch_on_this_tp_rank`` forwards no
``cu_seqlens_padded``). Batches come out as Megatron's DataLoader with ``--micro-batch-size 1``
would yield them (see `megatron_view`).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.megatron.cp_passthrough import install_cp_passthrough, remove_cp_passthrough
from megascale_data_ext.runtime.client import Client, MicrobatchSource
from megascale_data_ext.runtime.topology import ServiceTopology

ENV_RAY_ADDRESS = "MEGASCALE_RAY_ADDRESS"
ENV_NAMESPACE = "MEGASCALE_NAMESPACE"
ENV_NUM_MICROBATCHES = "MEGASCALE_NUM_MICROBATCHES"
ENV_START_STEP = "MEGASCALE_START_STEP"
ENV_DELIVERY_LOG = "MEGASCALE_DELIVERY_LOG"
ENV_PACKED_SEQ = "MEGASCALE_PACKED_SEQ"
ENV_VALID_NAMESPACE = "MEGASCALE_VALID_NAMESPACE"

MEGATRON_REQUIRED_FIELDS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")
"""Keys Megatron's `get_batch_on_this_tp_rank` indexes unconditionally on TP rank 0."""


@dataclass(slots=True, kw_only=True, frozen=True)
class ProviderConfig:
    """Where the service is and how this trainer steps through it.

    Attributes:
        namespace: Ray namespace of the service's named actors.
        address: Ray address to join; None when Ray is already initialised in this process.
        num_microbatches: Microbatches per step per DP rank; None reads Megatron's calculator.
        start_step: First step to fetch; None reads Megatron's ``args.iteration`` (else 0).
        topology: The service's topology (from `ServiceHandles`); None asks the service's Planner.
        valid_namespace: Namespace of the validation service (``serve`` starts it for
            ``data.validation.sources``); None = no validation iterator.
    """

    namespace: str
    address: str | None = None
    num_microbatches: int | None = None
    start_step: int | None = None
    topology: ServiceTopology | None = None
    valid_namespace: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProviderConfig:
        """Read the ``MEGASCALE_*`` variables; every bad or missing one is reported at once."""
        env = os.environ if env is None else env
        problems: list[str] = []

        def integer(name: str, minimum: int) -> int | None:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            try:
                value = int(raw)
            except ValueError:
                value = minimum - 1
            if value < minimum:
                problems.append(f"{name} must be an integer >= {minimum}, got {raw!r}")
                return None
            return value

        namespace = env.get(ENV_NAMESPACE, "").strip()
        if not namespace:
            problems.append(f"{ENV_NAMESPACE} is not set: export the namespace the data service was started in")
        num_microbatches = integer(ENV_NUM_MICROBATCHES, 1)
        start = integer(ENV_START_STEP, 0)
        if problems:
            raise ConfigError("megascale data provider environment: " + "; ".join(problems)
                              + " (or pass pretrain the provider megascale_data_ext.megatron.provider.configure(...) returns)")
        return cls(namespace=namespace, address=env.get(ENV_RAY_ADDRESS, "").strip() or None,
                   num_microbatches=num_microbatches, start_step=start,
                   valid_namespace=env.get(ENV_VALID_NAMESPACE, "").strip() or None)

    def validation(self) -> ProviderConfig | None:
        """The validation service's settings (same address and microbatches), or None."""
        if self.valid_namespace is None:
            return None
        return replace(self, namespace=self.valid_namespace, topology=None, valid_namespace=None, start_step=None)

    @classmethod
    def from_handles(cls, handles: Any) -> ProviderConfig:
        """From the `ServiceHandles` that `DataService.start()` returned."""
        return cls(namespace=handles.namespace, address=handles.address, topology=handles.topology)


SourceFactory = Callable[[ServiceTopology, ProviderConfig], MicrobatchSource]
"""(topology, config) -> where fetching ranks pull from; called on fetching ranks only."""

TopologyFactory = Callable[[ClientPlaceTree, ProviderConfig], ServiceTopology]
"""(trainer tree, config) -> the service's topology."""


def remote_source(topology: ServiceTopology, config: ProviderConfig) -> MicrobatchSource:
    """The service's constructors over Ray (the default source)."""
    from megascale_data_ext.runtime.remote import RemoteConstructors

    return RemoteConstructors(topology, config.address)


def find_topology(tree: ClientPlaceTree, config: ProviderConfig, *, trainer: str = "Megatron-LM") -> ServiceTopology:
    """The configured topology, else the running service's; it must match the trainer's layout."""
    topology = config.topology
    if topology is None:
        from megascale_data_ext.runtime.remote import fetch_topology

        topology = fetch_topology(config.address, config.namespace)
    if topology.tree.layout() != tree.layout():
        raise ConfigError(f"the data service in namespace {config.namespace!r} plans for {topology.tree.layout()} "
                          f"but {trainer} runs {tree.layout()}: start the service with this job's parallel layout")
    if topology.report_delay is not None:  # its training loop sends no per-source loss: step d would wait forever
        raise ConfigError(f"the data service in namespace {config.namespace!r} mixes by loss feedback (delay "
                          f"{topology.report_delay}: step s waits for the per-source loss of step s - "
                          f"{topology.report_delay}), which {trainer}'s training loop does not report: start it with "
                          "data.mixing.type=constant (without data.mixing.params), or train with "
                          "examples/pretrain_gpt.py, whose hooks report it")
    return topology


def service_topology(tree: ClientPlaceTree, config: ProviderConfig) -> ServiceTopology:
    """`find_topology`, checked against Megatron-LM's ``get_batch`` (it broadcasts over TP itself)."""
    topology = find_topology(tree, config)
    dims = topology.broadcast_dims
    if set(dims) - {"tp"} or (tree.tp > 1 and "tp" not in dims):
        raise ConfigError(f"the data service broadcasts along {list(dims)}, but Megatron-LM's get_batch broadcasts "
                          "over TP only: start the service with the strategy's default broadcast (broadcast: [tp])")
    return topology


def megatron_view(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reshape a service microbatch into what Megatron's DataLoader (micro-batch 1) yields.

    Megatron's collate adds a batch dim to ``cu_seqlens`` (its `_broadcast_cu_seqlens` asserts
    ``shape[0] == 1``), and TP rank 0 indexes tokens/labels/loss_mask/position_ids on every
    stage even where it broadcasts only some of them; the service sends a stage only its own
    fields, so absent ones are filled with zeros of the sequence shape (never read there).
    """
    out = dict(batch)
    padded = out.pop("cu_seqlens_padded", None)
    if padded is not None:  # CP slice: Megatron-LM's packed format lists the padded documents
        out["cu_seqlens"] = padded
    cu = out.get("cu_seqlens")
    if cu is not None and cu.dim() == 1:
        out["cu_seqlens"] = cu.unsqueeze(0)
    ref = next((out[k] for k in MEGATRON_REQUIRED_FIELDS if k in out), None)
    if ref is not None:
        for key in MEGATRON_REQUIRED_FIELDS:
            if key not in out:
                out[key] = torch.zeros(ref.shape, dtype=torch.float32 if key == "loss_mask" else torch.int64)
    return out


class MicrobatchIterator(Iterator[dict[str, torch.Tensor] | None]):
    """Endless iterator over (step, microbatch) for one rank, over its `Client`.

    Single-threaded: Megatron's training loop is its only caller. Ranks that do not fetch
    (TP rank > 0, middle pipeline stages, model chunks that read no data) get None and still
    advance, so counters agree across a TP group. Its state is the client's data position.

    Args:
        client: The rank's client, built with ``broadcast=False``.
        reads: False for a virtual-pipeline chunk that reads no data (it yields None).
        delivery_log: Append one JSON line per delivered microbatch there (``MEGASCALE_DELIVERY_LOG``):
            Megatron's loop keeps no record of what it consumed, this is the exactly-once evidence.
        packed: False drops the document boundaries (``MEGASCALE_PACKED_SEQ=0``, see the module doc).
    """

    __slots__ = ("client", "reads", "delivery_log", "packed")

    def __init__(self, client: Client, *, reads: bool = True, delivery_log: str | None = None,
                 packed: bool = True) -> None:
        if client.broadcast:
            raise ConfigError("the provider's client must not broadcast over TP (Megatron's get_batch does)")
        self.client = client
        self.reads = reads
        self.delivery_log = delivery_log
        self.packed = packed

    @property
    def step(self) -> int:
        """Step of the next microbatch."""
        return self.client.step

    @property
    def microbatch(self) -> int:
        """Index, within its step, of the next microbatch."""
        return self.client.microbatch

    @property
    def fetches(self) -> bool:
        """Whether this rank pulls from the service (else it yields None)."""
        return self.reads and self.client.fetches

    def __iter__(self) -> MicrobatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor] | None:
        if not self.reads:
            self.client.skip()
            return None
        step, microbatch = self.client.step, self.client.microbatch
        batch = self.client.next_microbatch()
        if batch is None:
            return None
        if self.delivery_log:
            self._log_delivery(step, microbatch)
        out = megatron_view(batch)
        if not self.packed:
            for key in ("cu_seqlens", "max_seqlen"):
                out.pop(key, None)
        return out

    def _log_delivery(self, step: int, microbatch: int) -> None:
        info = self.client.last_info or {}
        samples = info.get("samples")
        record = {"rank": self.client.rank, "step": step, "microbatch": microbatch,
                  "samples": [] if samples is None else [[int(x) for x in row] for row in samples],
                  "tokens": info.get("tokens")}
        with open(self.delivery_log, "a", encoding="utf-8") as f:  # one short line per append: ranks may share it
            f.write(json.dumps(record) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return self.client.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; refuses another version or microbatch count."""
        self.client.load_state_dict(state)

    # Megatron's --dataloader-save (checkpointing.maybe_save_dataloader_state) calls save_state().
    def save_state(self) -> dict[str, Any]:
        return self.state_dict()

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state)


class DatasetProvider:
    """Megatron's dataset-provider hook, bound to where the service is (no module state).

    ``provider(train_val_test_num_samples, vp_stage)`` is what Megatron's `pretrain` calls; it
    returns per-rank iterators over the service. Sample counts are ignored: the service plans
    steps forever and Megatron stops after ``--train-iters``. Call after
    `initialize_model_parallel` (Megatron does). With CP > 1 it also installs
    `install_cp_passthrough` (the service already sliced; `reset` undoes it).

    Args:
        config: Where the service is; None reads the environment at each call (what `serve`
            exports to torchrun).
        source_factory: Builds a fetching rank's `MicrobatchSource` (default: Ray; tests pass a fake).
        topology_factory: Finds the service's topology (default: the config's, else the Planner's).
        valid_factory: Called with `vp_stage` to build the validation iterator (None: the
            validation service's, when the config names one; else no validation).
        test_factory: Same for the test iterator.
    """

    is_distributed = True  # every rank builds its own iterator (Megatron's flag for the provider)

    def __init__(self, config: ProviderConfig | None = None, *, source_factory: SourceFactory | None = None,
                 topology_factory: TopologyFactory | None = None,
                 valid_factory: Callable[[int | None], Any] | None = None,
                 test_factory: Callable[[int | None], Any] | None = None) -> None:
        self.config = config
        self.source_factory = source_factory or remote_source
        self.topology_factory = topology_factory or service_topology
        self.valid_factory, self.test_factory = valid_factory, test_factory

    def __call__(self, train_val_test_num_samples: Any,
                 vp_stage: int | None = None) -> tuple[MicrobatchIterator, Any, Any]:
        """Per-rank iterators ``(train, valid, test)``.

        Raises:
            ConfigError: Missing service settings, a service planned for another layout,
                or ``--dataloader-type`` not external.
            ParallelLayoutError: parallel_state is not initialised.
        """
        del train_val_test_num_samples
        config = self.config or ProviderConfig.from_env()
        args = _megatron_args()
        problems: list[str] = []
        if args is not None and getattr(args, "dataloader_type", "external") != "external":
            problems.append(f"--dataloader-type is {args.dataloader_type!r}; pass --dataloader-type external")
        tree = ClientPlaceTree.from_megatron()
        num_microbatches = config.num_microbatches or _megatron_num_microbatches()
        if num_microbatches is None:
            problems.append(f"number of microbatches unknown: set {ENV_NUM_MICROBATCHES} "
                            "or configure(num_microbatches=...)")
        if problems:
            raise ConfigError("megascale data provider: " + "; ".join(problems))
        start = config.start_step
        if start is None:
            start = int(getattr(args, "iteration", 0) or 0) if args is not None else 0
        if tree.cp > 1:
            install_cp_passthrough()
        train = self._iterator(config, tree, vp_stage, num_microbatches, start,
                               delivery_log=os.environ.get(ENV_DELIVERY_LOG) or None)
        valid = None
        if self.valid_factory is not None:
            valid = self.valid_factory(vp_stage)
        elif config.validation() is not None:
            valid = self._iterator(config.validation(), tree, vp_stage, num_microbatches,
                                   _validation_position(args, start))
        test = self.test_factory(vp_stage) if self.test_factory else None
        return train, valid, test

    def _iterator(self, config: ProviderConfig, tree: ClientPlaceTree, vp_stage: int | None, num_microbatches: int,
                  start: int, delivery_log: str | None = None) -> MicrobatchIterator:
        """This rank's iterator over the service `config` names, from step `start`."""
        rank = global_rank()
        topology = self.topology_factory(tree, config)
        reads = _chunk_reads_data(tree, rank, vp_stage)
        fetches = reads and topology.fetches(rank) and topology.needs_data(rank)
        source = self.source_factory(topology, config) if fetches else None
        client = Client(topology, rank, source=source, num_microbatches=num_microbatches, broadcast=False)
        client.seek(start)
        return MicrobatchIterator(client, reads=reads, delivery_log=delivery_log,
                                  packed=os.environ.get(ENV_PACKED_SEQ, "1").strip() != "0")


#: What Megatron-LM's patched `pretrain_gpt.py` imports: the service named by the environment.
train_valid_test_datasets_provider = DatasetProvider()


def configure(
    service: Any = None,
    *,
    num_microbatches: int | None = None,
    start_step: int | None = None,
    source_factory: SourceFactory | None = None,
    topology_factory: TopologyFactory | None = None,
    valid_factory: Callable[[int | None], Any] | None = None,
    test_factory: Callable[[int | None], Any] | None = None,
) -> DatasetProvider:
    """A provider pointed at a service: pass it to Megatron's `pretrain` as its dataset provider.

    Args:
        service: `ServiceHandles` from `DataService.start()`, a `ProviderConfig`, an environment
            mapping (read like `os.environ`), or None to read `os.environ` now.
        num_microbatches: Overrides the config's count.
        start_step: Overrides the config's first step.
        source_factory, topology_factory, valid_factory, test_factory: As `DatasetProvider`.

    Returns:
        The provider (its ``config`` is the settings it will use).
    """
    from megascale_data_ext.runtime.handles import ServiceHandles

    if service is None or isinstance(service, Mapping):
        config = ProviderConfig.from_env(service)
    elif isinstance(service, ProviderConfig):
        config = service
    elif isinstance(service, ServiceHandles):
        config = ProviderConfig.from_handles(service)
    else:
        raise ConfigError(f"configure(service=...) takes ServiceHandles, ProviderConfig, a mapping or None, "
                          f"got {type(service).__name__}")
    if num_microbatches is not None:
        config = replace(config, num_microbatches=num_microbatches)
    if start_step is not None:
        config = replace(config, start_step=start_step)
    return DatasetProvider(config, source_factory=source_factory, topology_factory=topology_factory,
                           valid_factory=valid_factory, test_factory=test_factory)


def reset() -> None:
    """Undo the CP pass-through a provider call installed (`install_cp_passthrough`)."""
    remove_cp_passthrough()


def _chunk_reads_data(tree: ClientPlaceTree, rank: int, vp_stage: int | None) -> bool:
    """With interleaving, only the first virtual stage and the last one read data (Megatron's
    `is_first_or_last_pipeline_stage(vp_stage)`); other chunks get an iterator that yields None."""
    if vp_stage is None or not tree.vpp:
        return True
    pp_rank = tree.coords(rank)["pp"]
    return (pp_rank == 0 and vp_stage == 0) or (pp_rank == tree.pp - 1 and vp_stage == tree.vpp - 1)


def _megatron_args() -> Any:
    """Megatron-LM's parsed args when `megatron.training` is importable and initialised, else None."""
    try:
        global_vars = importlib.import_module("megatron.training.global_vars")
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _validation_position(args: Any, start: int) -> int:
    """Megatron's validation position at iteration `start`: every evaluation so far took
    ``--eval-iters`` steps (as `megatron.training` sets ``consumed_valid_samples`` on a resume)."""
    interval = int(getattr(args, "eval_interval", 0) or 0) if args is not None else 0
    iters = int(getattr(args, "eval_iters", 0) or 0) if args is not None else 0
    return (start // interval) * iters if interval > 0 else 0


def _megatron_num_microbatches() -> int | None:
    try:
        calc = importlib.import_module("megatron.core.num_microbatches_calculator")
        return int(calc.get_num_microbatches())
    except (ImportError, AttributeError, AssertionError, TypeError):
        return None


def global_rank() -> int:
    """This process's global rank: torch.distributed's, else Megatron's TP group's member for it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    ps = importlib.import_module("megatron.core.parallel_state")
    return int(ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS[ps.get_tensor_model_parallel_rank()])
