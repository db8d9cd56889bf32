"""Mixing schedules and the per-step source-count allocator behind the ``mix(schedule)`` primitive.

A *schedule* says which fraction of the data each source should contribute at a training
step (constant, curriculum phases, a warm-up ramp, or loss feedback from the trainer). The
:class:`Mixer` turns those fractions into integer per-step counts that sum to the global
batch size and an interleaved source order for the step's samples.

Why not Megatron's ``BlendedDataset``: it precomputes one index per rank for a fixed blend,
so a weight that changes during training (curriculum, feedback) means rebuilding it. The
Mixer instead keeps the *cumulative* target ``sum_t w_s(t) * B_t`` and the cumulative count
per source and allocates each step by the same error-minimisation rule Megatron's
``build_blending_indices`` applies per sample, so any schedule is tracked to within about
one sample over the whole run, and its state is two short vectors.

Modules, each importing only those before it: `checks` (validation), `schedules` (the
schedules), `build` (`build_schedule`), `mixer`
(`Mixer`, `MixMode`, `apportion`). Pure numpy: no Ray, no torch.
"""

from megascale_data_ext.dataplane.mixing.build import WEIGHT_KEYS, build_schedule, required_keys
from megascale_data_ext.dataplane.mixing.mixer import Mixer, MixMode, apportion
from megascale_data_ext.dataplane.mixing.schedules import (
    ConstantSchedule,
    FeedbackSchedule,
    LinearRampSchedule,
    MixingSchedule,
    PiecewiseSchedule,
    ScheduleType,
)

__all__ = [
    "ConstantSchedule",
    "FeedbackSchedule",
    "LinearRampSchedule",
    "MixMode",
    "Mixer",
    "MixingSchedule",
    "PiecewiseSchedule",
    "ScheduleType",
    "apportion",
    "build_schedule",
]
