"""What the lab's drawing modules share: arrays from tensors, label checks, the Axes to draw in.

:mod:`mha.lab.viz`, :mod:`mha.lab.charts` and :mod:`mha.lab.figures` draw with these; nothing here
is meant to be called from a chapter.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes


def as_array(name: str, x: object) -> np.ndarray:
    """A float or bool NumPy array from a tensor or array-like, with the argument named on failure."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.float() if x.is_floating_point() and x.dtype != torch.float64 else x
        return x.numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a tensor or array, got {type(x).__name__}") from None
    if arr.dtype == object:
        raise TypeError(f"{name} must hold numbers, got {type(x).__name__} of objects")
    return arr


def check_labels(name: str, labels: Sequence[str] | None, n: int, what: str) -> list[str] | None:
    """``labels`` as strings, one for each of the ``n`` rows, columns or panels it names."""
    if labels is None:
        return None
    if isinstance(labels, str):
        raise TypeError(f"{name} must be a sequence of labels, got the string {labels!r}")
    labels = [str(t) for t in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but there are {n} {what}")
    return labels


# The smallest text a figure draws, in points. A phone shows a figure 342 CSS px wide: text of
# SMALL_TEXT pt in a figure 5.4 inches wide (the course's default, tools/setup_cell.txt; 5.6 with
# the saved image's padding) is 11 / 72 / 5.6 * 342 = 9.3 px tall there (tests/test_browser.py
# checks every figure). Wider figures need larger text, or their panels stacked.
SMALL_TEXT = 11


def new_axes(ax: Axes | None, figsize: tuple[float, float] | None = None) -> Axes:
    """``ax`` itself, checked, or the Axes of a new figure when it is ``None``."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    elif not isinstance(ax, Axes):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    return ax


def cell_lines(ax: Axes, rows: int, cols: int, linewidth: float) -> None:
    """Thin white lines between cells, so that single positions (or tiles) can be counted."""
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=linewidth)
    ax.tick_params(which="minor", length=0)
