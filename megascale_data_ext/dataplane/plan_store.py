"""PlanStore: step plans on disk, for replay mode (precomputed plans for predictable schedules).

`megascale-data plan` runs the real Planner ahead of time and writes one ``step_<n>.npz`` per
step plus ``manifest.json``; a service started with ``replay_dir`` then serves those plans
without planning (MegaScale-Data Sec. 9's future work). The manifest holds the planner's
fingerprint (the config fields that decide the stream, and the parallel layout), so a replay
under another config or layout is refused instead of delivering another run's stream.

Plain numpy + JSON (no pickle): a plan directory is safe to share and to inspect.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from megascale_data_ext.dataplane.plan import EncoderPlan, StepPlan
from megascale_data_ext.errors import ConfigError, PlanError
from megascale_data_ext.state import plain

FORMAT_VERSION = 1
MANIFEST = "manifest.json"

_META = ("step", "axis", "num_buckets", "num_microbatches", "source_names", "bucket_ranks", "fetch_ranks",
         "broadcast_dims", "lineage", "cap")
_ENCODER_META = ("axis", "num_buckets")


def _step_file(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.npz"


class PlanStore:
    """A directory of step plans and its manifest.

    Args:
        directory: Where the plans are (created by `create`).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.is_file():
            raise ConfigError(f"no plans at {str(self.directory)!r} ({MANIFEST} is missing): write them with "
                              "`megascale-data plan <config> --steps N --out DIR`")
        self.manifest: dict[str, Any] = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT_VERSION:
            raise ConfigError(f"{path}: plan format {self.manifest.get('format')!r} != {FORMAT_VERSION}; "
                              "write the plans again with this release")

    @classmethod
    def create(cls, directory: str | Path, fingerprint: Mapping[str, Any]) -> PlanStore:
        """An empty store for plans made under `fingerprint` (existing plans there are replaced)."""
        d = Path(directory)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file of that name, no permission
            raise ConfigError(f"cannot write plans to {str(d)!r} ({exc.strerror}): name a directory to create "
                              "or one that holds plans") from exc
        for old in d.glob("step_*.npz"):
            old.unlink()
        manifest = {"format": FORMAT_VERSION, "fingerprint": plain(dict(fingerprint)), "steps": 0}
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        return cls(d)

    @property
    def num_steps(self) -> int:
        return int(self.manifest["steps"])

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self.manifest["fingerprint"])

    def check(self, fingerprint: Mapping[str, Any]) -> None:
        """Refuse replaying these plans under another config or layout, naming each difference."""
        saved, now = self.fingerprint, plain(dict(fingerprint))
        changed = [f"`{k}`: planned with {saved.get(k)!r}, now {now.get(k)!r}"
                   for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if changed:
            raise ConfigError(f"the plans at {str(self.directory)!r} were made for another run ("
                              + "; ".join(changed) + "): write them again with `megascale-data plan` for this config")

    def write(self, plan: StepPlan) -> None:
        """Add the next step's plan (steps are written in order from 0)."""
        if plan.step != self.num_steps:
            raise ConfigError(f"plans are written in step order: expected step {self.num_steps}, got {plan.step}")
        arrays = {f.name: getattr(plan, f.name) for f in fields(StepPlan)
                  if isinstance(getattr(plan, f.name), np.ndarray)}
        meta = {k: getattr(plan, k) for k in _META}
        if plan.encoder is not None:
            arrays.update({f"encoder.{f.name}": getattr(plan.encoder, f.name) for f in fields(EncoderPlan)
                           if f.name not in _ENCODER_META})
            meta["encoder"] = {k: getattr(plan.encoder, k) for k in _ENCODER_META}
        np.savez(_step_file(self.directory, plan.step), meta=np.asarray(json.dumps(plain(meta))), **arrays)
        self.manifest["steps"] = plan.step + 1
        (self.directory / MANIFEST).write_text(json.dumps(self.manifest, indent=1, sort_keys=True))

    def read(self, step: int) -> StepPlan:
        """The plan of `step`; a step past the last one written is a named error."""
        if not 0 <= step < self.num_steps:
            raise ConfigError(f"replay of {str(self.directory)!r} has steps 0..{self.num_steps - 1}, step {step} was "
                              f"asked: write more with `megascale-data plan ... --steps {step + 1}` "
                              "or train fewer steps")
        with np.load(_step_file(self.directory, step), allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {k: data[k] for k in data.files if k != "meta"}
        encoder = None
        if "encoder" in meta:
            enc = {k.removeprefix("encoder."): v for k, v in arrays.items() if k.startswith("encoder.")}
            encoder = EncoderPlan(**meta.pop("encoder"), **enc)
        tuples = {k: tuple(tuple(x) if isinstance(x, list) else x for x in meta[k])
                  for k in ("source_names", "bucket_ranks", "fetch_ranks", "broadcast_dims", "lineage")}
        plain_arrays = {k: v for k, v in arrays.items() if not k.startswith("encoder.")}
        return StepPlan(**{**meta, **tuples}, **plain_arrays, encoder=encoder)

    def read_continuing(self, step: int, cursors: np.ndarray) -> StepPlan:
        """The plan of `step`, which must continue every source's stream at its cursor (replay mode)."""
        plan = self.read(step)
        for s in range(len(cursors)):
            pos = np.sort(plan.position[plan.source == s])
            if len(pos) and not np.array_equal(pos, np.arange(cursors[s], cursors[s] + len(pos))):
                raise PlanError(f"replayed step {step} takes source {s} at positions {pos[:3].tolist()}..., "
                                f"but its stream is at {int(cursors[s])}: the plan directory is inconsistent")
        return plan
