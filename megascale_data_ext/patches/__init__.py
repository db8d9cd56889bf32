"""Runtime patches of megatron-core: CPU shims so that a GPT trains on CPU with gloo.

See ``patches/README.md`` at the repository root for what each shim replaces and why.
"""

from megascale_data_ext.patches.cpu import (
    CPU_SHIMS,
    CpuShim,
    active_cpu_shims,
    apply_cpu_shims,
    remove_cpu_shims,
)

__all__ = ["CPU_SHIMS", "CpuShim", "active_cpu_shims", "apply_cpu_shims", "remove_cpu_shims"]
