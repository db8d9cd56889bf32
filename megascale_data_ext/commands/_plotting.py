"""Matplotlib for the commands that draw (`--plot`, `heatmap`), an optional extra.

`pyplot()` is the one import: headless (Agg), and when matplotlib is missing one error line that
says how to install it. Commands call it before their work when a plot is asked for, so a long
benchmark never fails at its last step.
"""

from __future__ import annotations

from typing import Any

from megascale_data_ext.errors import ConfigError

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("drawing plots needs matplotlib: pip install 'megascale_data_ext[plot]' "
                          "(or drop --plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
