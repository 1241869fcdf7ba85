"""The demo's plots: axes to draw on and the figure written with its labels, through matplotlib
where it is installed (the demo runs without it, plotting nothing).

    >>> import os
    >>> ax = new_axes()
    >>> if ax is not None:
    ...     _ = ax.plot([1, 2, 3], [5.5, 4.1, 3.6], label="loss")
    ...     _ = save(ax, os.devnull, ylabel="training loss", title="a loss curve")
"""

from __future__ import annotations

from typing import Any

__all__ = ["new_axes", "save"]


def new_axes() -> Any:
    """A new figure's axes (8 x 4.5 in at 110 dpi), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt.subplots(figsize=(8, 4.5), dpi=110)[1]


def save(ax: Any, path: str, *, ylabel: str, title: str, legend_fontsize: int = 8) -> str:
    """Label ``ax`` (the step along x, in whole steps) and write its figure to ``path``;
    returns ``path``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_fontsize)
    fig = ax.figure
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
