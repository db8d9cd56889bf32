"""megascale_data_ext: a disaggregated, parallelism-aware, multi-source data service for Megatron.

The public surface is re-exported here; internals live in `dataplane`, `sources`,
`runtime` and `megatron`.
"""

__all__: list[str] = []
