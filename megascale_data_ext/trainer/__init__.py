"""The reference trainer: the examples' and the main job's megatron-core training loops, model
and command line. Not part of the integration a Megatron user imports (that is `megatron/`)."""
