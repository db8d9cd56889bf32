"""Model step profiling for `megascale-data profile --model`, and the model timer that
`bench gpu-balance` shares.

The cost model is only as good as its fit to the kernel that runs: per-document attention
follows the FLOPs model's shape but adds a fixed per-microbatch time, a dense S×S mask does
not follow it at all. So the profile step times the project's own GPT (megatron-core
`GPTModel` from `trainer/model.py`) forward + backward on packs whose document lengths vary
from one long document to many short ones, fits `dataplane.calibration` to those times,
saves the fit and prints predicted vs measured. On CUDA the timings come from CUDA events in
bf16 autocast; on CPU from `time.perf_counter` in fp32.

torch and megatron-core are imported inside the functions: the CLI lists every command at
start-up and must not pay for them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.calibration import CalibratedCost, CalibrationReport, fit_calibration
from megascale_data_ext.dataplane.costs import TransformerConfig, TransformerCost
from megascale_data_ext.commands._config_args import fail
from megascale_data_ext.errors import ConfigError, MegascaleDataError

#: The shape a CPU-only machine runs (smoke test): seconds, not minutes.
CPU_SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 128, "seq": 256}
GPU_DEFAULT = {"hidden": 2048, "layers": 8, "heads": 16, "vocab": 32000, "seq": 8192}


@dataclass(slots=True, kw_only=True)
class ModelShape:
    """What is timed: the GPT's shape, the longest pack, device, dtype and attention kind."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    device: str
    dtype: str
    attention: str

    def cost_config(self) -> TransformerConfig:
        """The FLOPs model's view of this GPT (ffn = 4·hidden as `GPTModelConfig` builds it)."""
        return TransformerConfig(name=f"gpt-h{self.hidden}-l{self.layers}", hidden=self.hidden, layers=self.layers,
                                 heads=self.heads, vocab=self.vocab)

    def fitted_for(self) -> dict[str, Any]:
        out = asdict(self)
        out["name"] = f"{self.device}:{self.dtype}:h{self.hidden}-l{self.layers}-{self.attention}"
        out["device_name"] = device_name(self.device)
        return out

    def describe(self) -> str:
        return (f"{device_name(self.device)} ({self.device}, {self.dtype}), GPT hidden {self.hidden}, "
                f"{self.layers} layers, {self.heads} heads, vocab {self.vocab}, packs <= {self.seq} tokens, "
                f"{self.attention} attention")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


def torch_version() -> str:
    import torch

    return torch.__version__


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def attention_choices() -> list[str]:
    """The `GPTModelConfig.attention` choices `trainer/model.py` offers (dense only before it had any)."""
    try:
        from megascale_data_ext.trainer.attention import ATTENTION_BACKENDS
    except ImportError:
        return ["auto", "dense"]
    return list(ATTENTION_BACKENDS)


def resolve_attention_choice(choice: str, *, device: str) -> str:
    """The backend that runs for `choice` on `device` (te, flex or dense), or a named error."""
    choices = attention_choices()
    if choice not in choices:
        raise ConfigError(f"attention must be one of {choices} (trainer/model.py's GPTModelConfig.attention), "
                          f"got {choice!r}")
    try:
        from megascale_data_ext.trainer.attention import resolve_attention
    except ImportError:
        return "dense"
    return resolve_attention(choice, cuda=device.startswith("cuda"))


def per_document_backend(device: str) -> str | None:
    """The per-document backend `auto` picks on `device`, None when only dense attention exists."""
    backend = resolve_attention_choice("auto", device=device)
    return None if backend == "dense" else backend


def resolve_shape(*, hidden: int | None, layers: int | None, heads: int | None, vocab: int | None, seq: int | None,
                  attention: str = "auto", device: str | None = None) -> ModelShape:
    """Fill unset shape flags: the GPU default on CUDA, the CPU smoke shape otherwise."""
    device = device or ("cuda" if cuda_available() else "cpu")
    base = GPU_DEFAULT if device.startswith("cuda") else CPU_SMOKE
    given = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab, "seq": seq}
    vals = {k: int(v) if v is not None else base[k] for k, v in given.items()}
    bad = [f"--model-{k} must be >= 1, got {v}" for k, v in vals.items() if v < 1]
    if bad:
        raise ConfigError("; ".join(bad))
    dtype = "bf16" if device.startswith("cuda") else "fp32"
    return ModelShape(device=device, dtype=dtype, attention=resolve_attention_choice(attention, device=device), **vals)


@contextlib.contextmanager
def single_process_megatron(seed: int = 1234, *, device: str = "cpu") -> Iterator[None]:
    """A one-rank gloo group and megatron's parallel state (TP = PP = DP = 1) for the block,
    torn down afterwards if this block created them; reuses what a caller already set up.

    On CPU the block runs torch with one intra-op thread: the smoke shape's matmuls are tiny,
    and on a shared machine extra threads made each pack 10-50× slower and far noisier.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megascale_data_ext.trainer.model import set_random_seed
    from megascale_data_ext.patches import apply_cpu_shims

    with tempfile.TemporaryDirectory(prefix="megascale-profile-") as tmp:
        own_pg = not dist.is_initialized()
        if own_pg:
            # NCCL for CUDA tensors: with gloo alone megatron's cross-entropy all-reduces would copy
            # to the host inside the timed window
            cuda = device.startswith("cuda")
            if cuda:
                torch.cuda.set_device(torch.device(device).index or 0)
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{tmp}/pg",
                                    rank=0, world_size=1)
        own_mp = not parallel_state.model_parallel_is_initialized()
        if own_mp:
            parallel_state.initialize_model_parallel()
        apply_cpu_shims()
        set_random_seed(seed)
        threads = torch.get_num_threads()
        if not device.startswith("cuda"):
            torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            if own_mp:
                parallel_state.destroy_model_parallel()
            if own_pg:
                dist.destroy_process_group()


class ModelTimer:
    """Times forward + backward of the project's GPT on packs of given document lengths.

    Build inside `single_process_megatron`. Each pack is one microbatch ([1, s], s = Σ lengths,
    documents separated by `cu_seqlens` and, for dense attention, a block-diagonal causal
    mask). Gradients accumulate over a rank's microbatches like a real step and are zeroed
    after it, staying allocated as Megatron DDP's grad buffers do (set to None, every rank's
    first microbatch paid their allocation: 5–15% on an H100). Not thread-safe.

    On CUDA `host_seconds` keeps, per microbatch of the last `time_rank`, how long the host took
    to launch its forward + backward: where that is as long as the device time, the microbatch
    was launch-bound (its time is the host's, not the tokens').
    """

    def __init__(self, shape: ModelShape, *, seed: int = 0):
        import torch

        from megascale_data_ext.trainer.model import GPTModelConfig, build_gpt_model

        self.shape = shape
        kwargs: dict[str, Any] = {"vocab_size": shape.vocab, "hidden_size": shape.hidden, "num_layers": shape.layers,
                                  "num_attention_heads": shape.heads, "seq_length": shape.seq}
        fields = GPTModelConfig.__dataclass_fields__
        if "attention" in fields:
            kwargs["attention"] = shape.attention
        bf16 = shape.dtype == "bf16"
        if bf16 and "bf16" in fields:  # megatron's bf16 params and activations
            kwargs["bf16"], bf16 = True, False
        self.device = torch.device(shape.device)
        self.model = build_gpt_model(GPTModelConfig(**kwargs), pre_process=True, post_process=True).to(self.device)
        self._autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        self._gen = torch.Generator().manual_seed(seed)
        self.host_seconds: list[float] = []

    def batch(self, doc_lens: Sequence[int]) -> dict[str, Any]:
        """One packed microbatch on the device, in `trainer.model.forward_step`'s format."""
        import torch

        lens = np.asarray(doc_lens, dtype=np.int64)
        if lens.size == 0 or lens.min() < 1:
            raise ConfigError(f"a timed pack needs documents of >= 1 token, got {lens.tolist()}")
        s = int(lens.sum())
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        position_ids = np.arange(s) - starts
        doc = np.repeat(np.arange(lens.size), lens)
        tokens = torch.randint(0, self.shape.vocab, (1, s), generator=self._gen)
        labels = torch.roll(tokens, -1, dims=1)
        loss_mask = torch.from_numpy((position_ids < np.repeat(lens, lens) - 1).astype(np.float32))[None]
        cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
        batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                 "position_ids": torch.from_numpy(position_ids)[None],
                 "cu_seqlens": torch.from_numpy(cu), "max_seqlen": torch.tensor([int(lens.max())], dtype=torch.int32)}
        if self.shape.attention == "dense":
            d = torch.from_numpy(doc)
            same_doc = d[:, None] == d[None, :]
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            batch["attention_mask"] = ~(same_doc & causal)[None, None]
        # the boundaries stay on the host, as the data client delivers them: a CUDA copy would cost
        # forward_step a device sync per microbatch that a real step does not pay
        return {k: v if k in ("cu_seqlens", "max_seqlen") else v.to(self.device) for k, v in batch.items()}

    def _fwd_bwd(self, batch: dict[str, Any]) -> None:
        from megascale_data_ext.trainer.model import forward_step

        with self._autocast:
            output, loss_fn = forward_step(iter([batch]), self.model)
            loss, num_tokens, _ = loss_fn(output)
        (loss / num_tokens.clamp(min=1)).backward()

    def time_rank(self, microbatches: Sequence[Sequence[int]]) -> list[float]:
        """Seconds of each microbatch's forward + backward, run serially as one rank's step."""
        batches = [self.batch(mb) for mb in microbatches]
        gc.collect()  # as timeit does: a collection inside the timed window is host jitter, not the model
        gc.disable()
        try:
            return self._time_batches(batches)
        finally:
            gc.enable()
            self.model.zero_grad(set_to_none=False)  # kept allocated, as Megatron DDP's grad buffers are

    def _time_batches(self, batches: list[dict[str, Any]]) -> list[float]:
        import torch

        if self.device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in batches]
            host = []
            for batch, (start, end) in zip(batches, events, strict=True):
                t0 = time.perf_counter()
                start.record()
                self._fwd_bwd(batch)
                end.record()
                host.append(time.perf_counter() - t0)
            torch.cuda.synchronize(self.device)
            out = [start.elapsed_time(end) / 1e3 for start, end in events]
        else:
            out = []
            for batch in batches:
                t0 = time.perf_counter()
                self._fwd_bwd(batch)
                out.append(time.perf_counter() - t0)
            host = list(out)
        self.host_seconds = host
        return out

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_gb(self) -> float | None:
        """Peak CUDA memory allocated since the last reset (None on CPU: not measured)."""
        if self.device.type != "cuda":
            return None
        import torch

        return torch.cuda.max_memory_allocated(self.device) / 2**30


#: Pack sizes of the profile step as fractions of `seq`: dense above half, where a GPU's step
#: leaves the launch-bound floor (issue 18: at hidden 2048 every pack <= ~4,000 tokens sat on it).
PROFILE_FRACTIONS = (0.125, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0)


def profile_packs(seq: int, *, seed: int = 0) -> list[list[int]]:
    """Packs from one long document to many short ones at 1/8 … 1/1 of `seq` tokens, so the
    fit sees the floor and the fixed, linear and quadratic terms vary independently."""
    rng = np.random.default_rng(seed)
    packs = []
    for fraction in PROFILE_FRACTIONS:
        total = max(1, int(seq * fraction))
        for docs in (1, 4, 16, 64):
            docs = min(docs, total)
            cuts = np.sort(rng.choice(np.arange(1, total), size=docs - 1, replace=False)) if docs > 1 else []
            packs.append(np.diff(np.concatenate(([0], cuts, [total]))).astype(int).tolist())
    return packs


def measure_packs(timer: ModelTimer, packs: Sequence[Sequence[int]], *, repeats: int) -> list[float]:
    """Median seconds of each pack over `repeats` runs, after one warm-up of the largest pack."""
    timer.time_rank([max(packs, key=sum)])
    runs = [timer.time_rank(packs) for _ in range(max(1, repeats))]
    return [statistics.median(r[i] for r in runs) for i in range(len(packs))]


def flops_ratio(shape: ModelShape) -> float:
    """The FLOPs model's quadratic / linear coefficient ratio for this shape."""
    cost = TransformerCost(shape.cost_config())
    return cost.quadratic / cost.linear


def fit_report_lines(model: CalibratedCost, report: CalibrationReport, shape: ModelShape,
                     packs: Sequence[Sequence[int]]) -> str:
    labels = [f"{sum(p)} tok / {len(p)} docs" for p in packs]
    ratio = model.quadratic_over_linear
    return "\n".join([
        report.format(labels, limit=len(packs)),
        f"fit: fixed {model.fixed * 1e3:.3f} ms per microbatch, {model.per_document * 1e3:.4f} ms per document, "
        f"linear {model.linear * 1e6:.4f} µs per token, "
        f"quadratic {model.quadratic * 1e9:.4g} ns per token² (per document), "
        f"floor {model.floor * 1e3:.3f} ms (launch-bound below it; {model.fit.get('microbatches_on_floor', 0)} "
        "fitted microbatches on it)",
        f"quadratic/linear {'n/a' if ratio is None else f'{ratio:.3e}'} measured vs {flops_ratio(shape):.3e} "
        "modelled by the FLOPs cost model",
    ])


def add_shape_arguments(parser: Any, prefix: str = "", *, seq: bool = False) -> None:
    """The model-shape flags (``--<prefix>hidden`` ...) shared by `profile --model` and
    `bench gpu-balance`; unset ones take `resolve_shape`'s device defaults."""
    helps = {"hidden": "hidden size", "layers": "layers", "heads": "attention heads", "vocab": "vocabulary",
             **({"seq": "longest pack in tokens"} if seq else {})}
    for key, what in helps.items():
        parser.add_argument(f"--{prefix}{key}", type=int,
                            help=f"{what} (default {GPU_DEFAULT[key]} on CUDA, {CPU_SMOKE[key]} on CPU)")
    parser.add_argument(f"--{prefix}attention", default="auto",
                        help="GPTModelConfig.attention: auto (per-document: te with Transformer Engine on CUDA, "
                             "else flex), te, flex or dense (default auto)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the model-profiling part of `megascale-data profile`."""
    group = parser.add_argument_group("model profiling (cost-model calibration)")
    group.add_argument("--model", action="store_true",
                       help="also time the project's model on this machine and fit the cost model")
    add_shape_arguments(group, "model-", seq=True)
    group.add_argument("--model-repeats", type=int, default=3, help="timed runs per pack, median kept (3)")
    group.add_argument("--model-out", type=Path, default=None,
                       help="where to save the fit (default: model_calibration.json in profile's --out "
                            "directory); strategies use it as model 'calibrated:<path>'")


def _default_out(args: argparse.Namespace) -> Path:
    for name in ("out_dir", "output_dir", "out", "output"):
        value = getattr(args, name, None)
        if value and Path(value).suffix == "":
            return Path(value) / "model_calibration.json"
    return Path("model_calibration.json")


def run_model_profile(args: argparse.Namespace) -> int:
    """Time the model on varied packs, fit and save the calibration, print predicted vs measured.

    Returns 0, or 2 after printing a named error (bad flag, unavailable attention backend).
    """
    try:
        if args.model_repeats < 1:
            raise ConfigError(f"--model-repeats must be >= 1, got {args.model_repeats}")
        shape = resolve_shape(hidden=args.model_hidden, layers=args.model_layers, heads=args.model_heads,
                              vocab=args.model_vocab, seq=args.model_seq, attention=args.model_attention)
    except MegascaleDataError as exc:
        return fail(exc)
    out = args.model_out or _default_out(args)
    smoke = "" if shape.device.startswith("cuda") else " (CPU smoke shape: not a GPU calibration)"
    print(f"profile --model: {shape.describe()}{smoke}")
    packs = profile_packs(shape.seq)
    with single_process_megatron(device=shape.device):
        timer = ModelTimer(shape)
        seconds = measure_packs(timer, packs, repeats=args.model_repeats)
    model, report = fit_calibration([[p] for p in packs], seconds, fitted_for=shape.fitted_for())
    print(fit_report_lines(model, report, shape, packs))
    model.save(out)
    print(f"saved the calibration to {out}; strategies use it as model: 'calibrated:{out}'")
    return 0
