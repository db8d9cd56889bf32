"""CPU shims that let megatron-core 0.16.1–0.19 train a GPTModel on CPU with gloo.

megatron-core assumes a CUDA device in a handful of places that a CPU-only laptop or CI
run reaches: device queries, a few tensors created with ``device="cuda"``, a stream
synchronisation after batched p2p, and the CUDA RNG tracker that dropout forks into.
Each shim below replaces exactly one attribute, keeps the original so that
`remove_cpu_shims` restores it, and is applied only when ``torch.cuda.is_available()`` is
false: on a GPU machine nothing is touched. ``patches/README.md`` documents every shim
(what megatron-core does, why it breaks on CPU, what the replacement does).

Process contract: shims patch module/class attributes, so they are process-wide; apply them
once per trainer process after importing torch and before building the model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megascale_data_ext.patches.patching import Patches, current

__all__ = ["CPU_SHIMS", "CpuShim", "active_cpu_shims", "apply_cpu_shims", "remove_cpu_shims"]

_DEFAULT_RNG_STATE_NAME = "default-rng"  # CudaRNGStatesTracker's name for "no fork active".


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuShim:
    """One attribute replaced on CPU.

    Attributes:
        name: Stable name reported by `apply_cpu_shims` (``module[.Class].attr``).
        module: Dotted module that owns the attribute (or the class holding it).
        attr: Attribute replaced.
        make: Builds the replacement from the original attribute.
        owner: Class inside ``module`` that holds ``attr``; None for a module attribute.
    """

    name: str
    module: str
    attr: str
    make: Callable[[Any], Any]
    owner: str | None = None

    def target(self) -> Any:
        """Return the object whose attribute is patched (module or class)."""
        mod = importlib.import_module(self.module)
        return getattr(mod, self.owner) if self.owner else mod


def _as_cpu(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``) to CPU."""
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuDeviceTorch:
    """Stand-in for the ``torch`` module inside one megatron module.

    Everything is delegated to the real torch except the tensor factories, whose
    ``device="cuda"`` is redirected to the CPU. Installing it as that module's ``torch``
    global reaches hard-coded ``device="cuda"`` literals without a process-wide torch
    function mode (which would tax every op of the training step).
    """

    _FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange"})

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in self._FACTORIES:
            return value

        @functools.wraps(value)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _as_cpu(kwargs["device"])
            return value(*args, **kwargs)

        return factory


def _cpu_current_device(_original: Any) -> Callable[[], torch.device]:
    def current_device() -> torch.device:
        return torch.device("cpu")

    return current_device


def _noop_synchronize(_original: Any) -> Callable[..., None]:
    def synchronize(device: Any = None) -> None:
        del device  # CPU collectives of gloo complete before wait() returns; nothing to drain.

    return synchronize


class _HostStream:
    """What ``torch.cuda.current_stream()`` returns on CPU: every wait is already satisfied."""

    def wait_event(self, event: Any) -> None:
        del event

    def wait_stream(self, stream: Any) -> None:
        del stream

    def synchronize(self) -> None:
        """Nothing to drain: CPU work has finished when the call that issued it returned."""


def _host_current_stream(_original: Any) -> Callable[..., _HostStream]:
    def current_stream(device: Any = None) -> _HostStream:
        del device  # gloo's collectives and CPU kernels run in program order: no stream to wait on
        return _HostStream()

    return current_stream


def _cpu_torch_proxy(original: Any) -> _CpuDeviceTorch:
    return _CpuDeviceTorch(original)


def _cpu_default_causal_mask(_original: Any) -> Callable[[int], torch.Tensor]:
    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    return get_default_causal_mask


def _cpu_rng_add(_original: Any) -> Callable[[Any, str, int], None]:
    def add(self: Any, name: str, seed: int) -> None:
        """Track a named RNG stream as a CPU generator state seeded with ``seed``."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    return add


def _cpu_rng_fork(original: Any) -> Callable[..., Any]:
    # Same default stream as the original ("model-parallel-rng"), read off its signature.
    default_name = original.__wrapped__.__defaults__[0]

    @contextlib.contextmanager
    def fork(self: Any, name: str = default_name) -> Iterator[None]:
        """Swap the CPU default generator to stream ``name`` for the block, then back."""
        if name not in self.states_:
            raise RuntimeError(
                f"rng state {name} is not added; call "
                "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) first"
            )
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != _DEFAULT_RNG_STATE_NAME:
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise RuntimeError(f"current rng state {self._current_state_name} is not {name}")
            self.states_[name] = torch.get_rng_state()
            if orig_name != _DEFAULT_RNG_STATE_NAME:
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    return fork


CPU_SHIMS: tuple[CpuShim, ...] = (
    CpuShim(name="torch.cuda.current_device", module="torch.cuda", attr="current_device",
            make=_cpu_current_device),
    CpuShim(name="torch.cuda.synchronize", module="torch.cuda", attr="synchronize",
            make=_noop_synchronize),
    CpuShim(name="megatron.core.pipeline_parallel.schedules.torch",
            module="megatron.core.pipeline_parallel.schedules", attr="torch", make=_cpu_torch_proxy),
    CpuShim(name="megatron.core.fusions.fused_softmax.get_default_causal_mask",
            module="megatron.core.fusions.fused_softmax", attr="get_default_causal_mask",
            make=_cpu_default_causal_mask),
    CpuShim(name="megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add",
            module="megatron.core.tensor_parallel.random", owner="CudaRNGStatesTracker", attr="add",
            make=_cpu_rng_add),
    CpuShim(name="megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork",
            module="megatron.core.tensor_parallel.random", owner="CudaRNGStatesTracker", attr="fork",
            make=_cpu_rng_fork),
    CpuShim(name="torch.cuda.current_stream", module="torch.cuda", attr="current_stream",
            make=_host_current_stream),
)

_PATCHES = Patches()  # what the shims replaced (`patches.patching`: the package's one patching record)
_ACTIVE: list[str] = []  # names of the shims in effect, in the order applied


def apply_cpu_shims() -> list[str]:
    """Install every CPU shim when CUDA is absent.

    Idempotent: a second call patches nothing again and returns the same names.

    Returns:
        Names of the shims in effect (``CpuShim.name``), in `CPU_SHIMS` order; ``[]`` when
        ``torch.cuda.is_available()`` (a GPU run must use megatron-core untouched).
    """
    if torch.cuda.is_available():
        return []
    for shim in CPU_SHIMS:
        if shim.name in _ACTIVE:
            continue
        target = shim.target()
        _PATCHES.set(target, shim.attr, shim.make(current(target, shim.attr)))
        _ACTIVE.append(shim.name)
    return active_cpu_shims()


def remove_cpu_shims() -> list[str]:
    """Restore every attribute `apply_cpu_shims` replaced.

    Returns:
        Names of the shims removed (empty when none were applied), in `CPU_SHIMS` order.
    """
    removed = active_cpu_shims()
    _PATCHES.undo()
    _ACTIVE.clear()
    return removed


def active_cpu_shims() -> list[str]:
    """Names of the shims currently installed, in `CPU_SHIMS` order."""
    return [shim.name for shim in CPU_SHIMS if shim.name in _ACTIVE]
