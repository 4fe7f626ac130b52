"""One matplotlib style for the book, and saving figures beside the results."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from .results import results_dir

# Okabe-Ito: distinguishable for colour-blind readers, one colour per precision.
COLOURS = {"float32": "#000000", "bfloat16": "#D55E00", "float16": "#0072B2",
           "float8_e4m3fn": "#009E73", "float8_e5m2": "#CC79A7"}


def style() -> None:
    """Apply the book's figure style."""
    plt.rcParams.update({
        "figure.figsize": (7.0, 4.0), "figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "legend.frameon": False,
        "font.size": 10,
    })


def colour(name: str) -> str:
    """The book's colour for a precision (by format name), grey otherwise."""
    return COLOURS.get(name, "#777777")


class SavedFigure(type(Path())):
    """A saved figure's path. As a cell's last value it displays nothing: a page shows the figure,
    not a path on the machine that built it."""

    def _ipython_display_(self) -> None:
        pass


def save(fig, chapter: str, name: str) -> Path:
    """Save `fig` as `<results>/figures/<chapter>-<name>.png` and return the path."""
    folder = results_dir() / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    path = SavedFigure(folder / f"{chapter}-{name}.png")
    fig.savefig(path, bbox_inches="tight")
    return path
