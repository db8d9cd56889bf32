"""Subcommands of `megascale-data`; each module is discovered by `megascale_data_ext.cli`."""
