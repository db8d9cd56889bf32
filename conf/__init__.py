"""Hydra config groups of megascale_data_ext (a package so `pkg://megascale_data_ext/conf` finds them)."""
