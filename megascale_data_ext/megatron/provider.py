"""The dataset provider Megatron-LM's own `pretrain_gpt.py` calls with `--dataloader-type external`.

With `external`, Megatron passes whatever the provider returns straight to its training loop
(wrapped in `RerunDataIterator`) and calls `next()` on it once per microbatch, leaving sharding
and resumption to the provider. This module returns, on every rank, a `MicrobatchIterator` that
walks (step, microbatch) in order and pulls each microbatch from this rank's Data Constructor.

Megatron calls the provider with nothing but sample counts, so where the service lives has to
come from outside: `configure(...)` in the launching process, or environment variables set for
torchrun (the only thing that travels to every rank):

* ``MEGASCALE_RAY_ADDRESS``: Ray address of the service's cluster (``ray://...`` or ``host:port``).
* ``MEGASCALE_NAMESPACE`` (required): Ray namespace of the service's named actors.
* ``MEGASCALE_NUM_MICROBATCHES``: microbatches per step per DP rank; default Megatron's
  ``get_num_microbatches()`` (it must equal the service's ``num_microbatches``).
* ``MEGASCALE_CONSTRUCTOR_GROUP``: DP buckets per Data Constructor (default 1, as the service).
* ``MEGASCALE_START_STEP``: first step to fetch; default Megatron's ``args.iteration`` (the
  iteration of the loaded checkpoint), so a resumed job asks for the steps it has not trained.

Contract with Megatron's `get_batch` (pretrain_gpt.py at core_v0.16.1): only TP rank 0 of the
first and last pipeline stage calls `next()`; it then broadcasts the microbatch to its TP group
itself, so this iterator never broadcasts (the service's `Client.get` would, and deadlock). The
service already slices for context parallelism, which Megatron's `get_batch` would do a second
time, so CP > 1 is refused here. Batches come out as Megatron's DataLoader with
``--micro-batch-size 1`` would yield them (see `megatron_view`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import ConfigError, ResumeError

ENV_RAY_ADDRESS = "MEGASCALE_RAY_ADDRESS"
ENV_NAMESPACE = "MEGASCALE_NAMESPACE"
ENV_NUM_MICROBATCHES = "MEGASCALE_NUM_MICROBATCHES"
ENV_CONSTRUCTOR_GROUP = "MEGASCALE_CONSTRUCTOR_GROUP"
ENV_START_STEP = "MEGASCALE_START_STEP"

STATE_VERSION = 1
"""Version stamped into `MicrobatchIterator.state_dict()`."""

MEGATRON_REQUIRED_FIELDS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")
"""Keys Megatron's `get_batch_on_this_tp_rank` indexes unconditionally on TP rank 0."""


@dataclass(slots=True, kw_only=True, frozen=True)
class ProviderConfig:
    """Where the service is and how this trainer steps through it.

    Attributes:
        namespace: Ray namespace of the service's named actors.
        address: Ray address to join; None when Ray is already initialised in this process.
        num_microbatches: Microbatches per step per DP rank; None reads Megatron's calculator.
        constructor_group: DP buckets per Data Constructor (must match the service).
        start_step: First step to fetch; None reads Megatron's ``args.iteration`` (else 0).
    """

    namespace: str
    address: str | None = None
    num_microbatches: int | None = None
    constructor_group: int = 1
    start_step: int | None = None

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
        group = integer(ENV_CONSTRUCTOR_GROUP, 1)
        start = integer(ENV_START_STEP, 0)
        if problems:
            raise ConfigError("megascale data provider environment: " + "; ".join(problems)
                              + " (or call megascale_data_ext.megatron.provider.configure(...) before pretrain)")
        return cls(namespace=namespace, address=env.get(ENV_RAY_ADDRESS, "").strip() or None,
                   num_microbatches=num_microbatches, constructor_group=1 if group is None else group,
                   start_step=start)

    @classmethod
    def from_handles(cls, handles: Any) -> ProviderConfig:
        """From the `ServiceHandles` that `DataService.start()` returned."""
        return cls(namespace=handles.namespace, address=handles.address,
                   constructor_group=int(handles.constructor_group))


class MicrobatchSource(Protocol):
    """Where a fetching rank's microbatches come from (the service, or a fake in tests)."""

    def fetch(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        """Microbatch `microbatch` of `step` for this rank, as torch tensors."""
        ...


ClientFactory = Callable[[ClientPlaceTree, int, ProviderConfig, int], MicrobatchSource]
"""(tree, global rank, config, num_microbatches) -> source; called on fetching ranks only."""


class ServiceMicrobatchSource:
    """A `runtime.client.Client` without its TP broadcast: Megatron's `get_batch` broadcasts."""

    def __init__(self, tree: ClientPlaceTree, rank: int, config: ProviderConfig, num_microbatches: int) -> None:
        from megascale_data_ext.runtime.client import Client

        self.client = Client(tree, rank, namespace=config.namespace, address=config.address,
                             num_microbatches=num_microbatches, constructor_group=config.constructor_group)

    def fetch(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        from megascale_data_ext.runtime.client import to_torch

        raw, info = self.client.fetch(step, microbatch)
        self.client.delivered.append(info)
        return to_torch(raw)


def megatron_view(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reshape a service microbatch into what Megatron's DataLoader (micro-batch 1) yields.

    Megatron's collate adds a batch dim to ``cu_seqlens`` (its `_broadcast_cu_seqlens` asserts
    ``shape[0] == 1``), and TP rank 0 indexes tokens/labels/loss_mask/position_ids on every
    stage even where it broadcasts only some of them; the service sends a stage only its own
    fields, so absent ones are filled with zeros of the sequence shape (never read there).
    """
    out = dict(batch)
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
    """Endless iterator over (step, microbatch) for one rank: microbatch j of step s, in order.

    Single-threaded: Megatron's training loop is its only caller. Ranks that do not fetch
    (TP rank > 0, middle pipeline stages) get None and still advance, so counters agree across
    a TP group. Checkpoint schema (`state_dict`): ``{"version", "step", "microbatch",
    "num_microbatches"}``: the position of the next microbatch the trainer will consume.
    """

    __slots__ = ("_source", "_n", "_step", "_mb", "rank")

    def __init__(self, source: MicrobatchSource | None, *, num_microbatches: int, start_step: int = 0,
                 rank: int = 0) -> None:
        if num_microbatches < 1 or start_step < 0:
            raise ConfigError(f"num_microbatches must be >= 1 and start_step >= 0, got "
                              f"num_microbatches={num_microbatches!r}, start_step={start_step!r}")
        self._source = source
        self._n = int(num_microbatches)
        self._step = int(start_step)
        self._mb = 0
        self.rank = rank

    @property
    def step(self) -> int:
        """Step of the next microbatch."""
        return self._step

    @property
    def microbatch(self) -> int:
        """Index, within its step, of the next microbatch."""
        return self._mb

    @property
    def fetches(self) -> bool:
        """Whether this rank pulls from the service (else it yields None)."""
        return self._source is not None

    def __iter__(self) -> MicrobatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor] | None:
        batch = None if self._source is None else megatron_view(self._source.fetch(self._step, self._mb))
        self._mb += 1
        if self._mb == self._n:
            self._step, self._mb = self._step + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"version": STATE_VERSION, "step": self._step, "microbatch": self._mb, "num_microbatches": self._n}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; refuses another version or microbatch count."""
        missing = [k for k in ("version", "step", "microbatch", "num_microbatches") if k not in state]
        if missing:
            raise ResumeError(f"data iterator state lacks {missing}; got keys {sorted(state)}")
        if state["version"] != STATE_VERSION:
            raise ResumeError(f"data iterator state version {state['version']!r} != {STATE_VERSION}; "
                              "re-save it with this version of megascale_data_ext")
        if state["num_microbatches"] != self._n:
            raise ResumeError(f"num_microbatches changed: saved {state['num_microbatches']} != current {self._n} "
                              f"(set {ENV_NUM_MICROBATCHES} / the global batch size back, or restart the plan)")
        if not 0 <= int(state["microbatch"]) < self._n or int(state["step"]) < 0:
            raise ResumeError(f"data iterator state out of range: {dict(state)!r}")
        self._step, self._mb = int(state["step"]), int(state["microbatch"])

    # Megatron's --dataloader-save (checkpointing.maybe_save_dataloader_state) calls save_state().
    def save_state(self) -> dict[str, int]:
        return self.state_dict()

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state)


@dataclass(slots=True, kw_only=True)
class _Settings:
    config: ProviderConfig | None = None
    client_factory: ClientFactory = ServiceMicrobatchSource
    valid_factory: Callable[[int | None], Any] | None = None
    test_factory: Callable[[int | None], Any] | None = None


# Megatron calls the provider with sample counts only, so the service's whereabouts must live at
# module level; `configure` and `reset` are the only writers.
_SETTINGS = _Settings()


def configure(
    service: Any = None,
    *,
    num_microbatches: int | None = None,
    start_step: int | None = None,
    client_factory: ClientFactory | None = None,
    valid_factory: Callable[[int | None], Any] | None = None,
    test_factory: Callable[[int | None], Any] | None = None,
) -> ProviderConfig:
    """Point the provider at a service before Megatron's `pretrain` builds its data iterators.

    Args:
        service: `ServiceHandles` from `DataService.start()`, a `ProviderConfig`, an environment
            mapping (read like `os.environ`), or None to read `os.environ` now.
        num_microbatches: Overrides the config's count.
        start_step: Overrides the config's first step.
        client_factory: Builds a fetching rank's `MicrobatchSource` (tests pass a fake).
        valid_factory: Called with `vp_stage` to build the validation iterator (None: no validation).
        test_factory: Same for the test iterator.

    Returns:
        The config the provider will use.
    """
    if service is None or isinstance(service, Mapping):
        config = ProviderConfig.from_env(service)
    elif isinstance(service, ProviderConfig):
        config = service
    elif hasattr(service, "namespace") and hasattr(service, "constructor_group"):
        config = ProviderConfig.from_handles(service)
    else:
        raise ConfigError(f"configure(service=...) takes ServiceHandles, ProviderConfig, a mapping or None, "
                          f"got {type(service).__name__}")
    if num_microbatches is not None:
        config = replace(config, num_microbatches=num_microbatches)
    if start_step is not None:
        config = replace(config, start_step=start_step)
    _SETTINGS.config = config
    _SETTINGS.client_factory = client_factory or ServiceMicrobatchSource
    _SETTINGS.valid_factory, _SETTINGS.test_factory = valid_factory, test_factory
    return config


def reset() -> None:
    """Forget `configure`: the next provider call reads the environment again."""
    _SETTINGS.config, _SETTINGS.client_factory = None, ServiceMicrobatchSource
    _SETTINGS.valid_factory = _SETTINGS.test_factory = None


def train_valid_test_datasets_provider(
    train_val_test_num_samples: Any, vp_stage: int | None = None
) -> tuple[MicrobatchIterator, Any, Any]:
    """Megatron's dataset-provider hook: per-rank iterators over the service.

    Sample counts are ignored: the service plans steps forever and Megatron stops after
    ``--train-iters``. Call after `initialize_model_parallel` (Megatron does).

    Raises:
        ConfigError: Missing service settings, CP > 1, or ``--dataloader-type`` not external.
        ParallelLayoutError: parallel_state is not initialised.
    """
    del train_val_test_num_samples
    config = _SETTINGS.config or ProviderConfig.from_env()
    args = _megatron_args()
    problems: list[str] = []
    if args is not None and getattr(args, "dataloader_type", "external") != "external":
        problems.append(f"--dataloader-type is {args.dataloader_type!r}; pass --dataloader-type external")
    tree = ClientPlaceTree.from_megatron()
    if tree.cp > 1:
        problems.append(f"context parallel size {tree.cp} > 1: the service slices for CP and Megatron's "
                        "get_batch slices again; run with --context-parallel-size 1 or use megatron.train_worker")
    num_microbatches = config.num_microbatches or _megatron_num_microbatches()
    if num_microbatches is None:
        problems.append(f"number of microbatches unknown: set {ENV_NUM_MICROBATCHES} "
                        "or configure(num_microbatches=...)")
    if problems:
        raise ConfigError("megascale data provider: " + "; ".join(problems))
    start = config.start_step
    if start is None:
        start = int(getattr(args, "iteration", 0) or 0) if args is not None else 0
    rank = _global_rank()
    fetches = tree.must_fetch(rank) and tree.needs_data(rank) and _chunk_reads_data(tree, rank, vp_stage)
    source = _SETTINGS.client_factory(tree, rank, config, num_microbatches) if fetches else None
    train = MicrobatchIterator(source, num_microbatches=num_microbatches, start_step=start, rank=rank)
    valid = _SETTINGS.valid_factory(vp_stage) if _SETTINGS.valid_factory else None
    test = _SETTINGS.test_factory(vp_stage) if _SETTINGS.test_factory else None
    return train, valid, test


train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


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


def _megatron_num_microbatches() -> int | None:
    try:
        calc = importlib.import_module("megatron.core.num_microbatches_calculator")
        return int(calc.get_num_microbatches())
    except (ImportError, AttributeError, AssertionError, TypeError):
        return None


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    ps = importlib.import_module("megatron.core.parallel_state")
    return int(ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS[ps.get_tensor_model_parallel_rank()])
