"""Charts of measurements: curves on log-log axes with fitted slopes, ratios, spreads, bars.

Every function draws into a matplotlib ``Axes`` you may pass as ``ax`` (a new figure is made
otherwise) and returns it; nothing here calls ``plt.show()``. Values may be lists, arrays or
tensors; ``None`` leaves out a size that a curve (or a bar that a group) skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.ticker import NullLocator

from . import _axes
from . import fit as _fit

__all__ = ["grouped_bars", "loglog_curves", "quantile_band", "ratio_curves"]


def loglog_curves(
    x: Sequence[float],
    ys: Mapping[str, Sequence[float]],
    *,
    ax: Axes | None = None,
    fit: bool = False,
    xlabel: str = "sequence length",
    ylabel: str = "",
    title: str | None = None,
) -> Axes:
    """Plot one or more measured curves on log-log axes, optionally with fitted slopes.

    On log-log axes a power law ``y = c · x**k`` is a straight line of slope ``k``: memory that
    grows like ``L²`` climbs twice as steeply as memory that grows like ``L``.

    Args:
        x: the sizes, shared by every curve.
        ys: curve name -> one positive value per size (``None`` for a size a curve skipped).
        ax: where to draw; a new figure is made if ``None``.
        fit: also draw each curve's least-squares power law (:func:`mha.lab.fit.loglog_fit`) as a
            dashed line, and put its slope in the legend.
        xlabel, ylabel, title: axis labels and title.

    Returns:
        The ``Axes``: one line per curve, plus one dashed line per curve with ``fit=True``.
    """
    xs, ax = _curves_setup(x, ys, ax)
    for name, values in ys.items():
        px, py = _curve_points(name, values, xs)
        label = name
        if fit:
            f = _fit.loglog_fit(px, py)
            label = f"{name} (slope {f.slope:.2f})"
        (line,) = ax.plot(px, py, marker="o", label=label)
        if fit:
            ax.plot(px, f(px), linestyle="--", color=line.get_color(), linewidth=1, alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    if len(set(xs)) <= 12:
        _label_measured_sizes(ax, xs)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title is not None:
        ax.set_title(title)
    return ax


def _curves_setup(x: Any, ys: Any, ax: Axes | None) -> tuple[list[float], Axes]:
    """The shared sizes as floats and the Axes to draw on, once ``ys`` is checked."""
    xs = [float(v) for v in _axes.as_array("x", x).ravel()]
    if not isinstance(ys, Mapping) or not ys:
        raise TypeError(
            f"ys must be a non-empty mapping of name -> values, got {type(ys).__name__}"
        )
    return xs, _axes.new_axes(ax)


def _curve_points(
    name: str, values: Sequence[float | None] | torch.Tensor, xs: list[float]
) -> tuple[list[float], list[float]]:
    """The ``(x, y)`` points of one curve, without the sizes it skipped (``None``)."""
    vals = list(values.detach().cpu().tolist() if isinstance(values, torch.Tensor) else values)
    if len(vals) != len(xs):
        raise ValueError(f"ys[{name!r}] has {len(vals)} values but x has {len(xs)}")
    pts = [(a, float(b)) for a, b in zip(xs, vals) if b is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _label_measured_sizes(ax: Axes, xs: list[float]) -> None:
    """Label the measured sizes themselves (256, 512, ...) rather than powers of ten."""
    ticks = sorted(set(xs))
    labels = [f"{t:g}" for t in ticks]
    ax.set_xticks(ticks, labels)
    ax.xaxis.set_minor_locator(NullLocator())
    if len(ticks) * max(map(len, labels)) > 40:  # 262144 next to 131072 would run together
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")


def ratio_curves(
    x: Sequence[float],
    ys: Mapping[str, Sequence[float | None]],
    *,
    target: float | None = None,
    ax: Axes | None = None,
    xlabel: str = "sequence length",
    ylabel: str = "ratio",
    title: str | None = None,
) -> Axes:
    """Ratios against a size on a log x axis, with an optional dashed target line.

    Args:
        x: the sizes, shared by every curve.
        ys: curve name -> one ratio per size (``None`` for a size a curve skipped).
        target: draw a dashed horizontal line at this ratio, labelled ``target``.
        ax: where to draw; a new figure is made if ``None``.
        xlabel, ylabel, title: axis labels and title.

    Returns:
        The ``Axes``: one line per curve, plus the target line when ``target`` is given.
    """
    xs, ax = _curves_setup(x, ys, ax)
    for name, values in ys.items():
        px, py = _curve_points(name, values, xs)
        ax.plot(px, py, marker="o", label=name)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xscale("log")
    _label_measured_sizes(ax, xs)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=_axes.SMALL_TEXT)
    if title is not None:
        ax.set_title(title)
    return ax


def quantile_band(
    x: Sequence[float],
    samples: torch.Tensor | np.ndarray,
    *,
    ax: Axes | None = None,
    label: str | None = None,
    marker: str = "o-",
    band: tuple[float, float] = (0.25, 0.75),
) -> Axes:
    """The median of many samples per size as a line, with a shaded band between two quantiles.

    For measurements that scatter (a gradient norm per random input, say): the line shows the
    typical value, the band how far the bulk of the samples spreads around it. Both axes are
    logarithmic, with the measured sizes as x tick labels.

    Args:
        x: the sizes, one per row of ``samples``.
        samples: ``(len(x), N)`` values, ``N`` samples per size; the band's lower quantile must
            be positive (a few zeros below it are fine).
        ax: where to draw; a new figure is made if ``None``.
        label: the legend label of the line (the band is unlabelled).
        marker: a matplotlib format string for the median line.
        band: the lower and upper quantile of the band, ``0 <= low < high <= 1``.

    Returns:
        The ``Axes``, with one more line (the median) and one more filled band.
    """
    xs = [float(v) for v in _axes.as_array("x", x).ravel()]
    values = _axes.as_array("samples", samples).astype(float)
    if values.ndim != 2 or values.shape[0] != len(xs):
        raise ValueError(
            f"samples must have shape (len(x), N) = ({len(xs)}, N), got {tuple(values.shape)}"
        )
    low, high = band
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"band must satisfy 0 <= low < high <= 1, got {band!r}")
    lo, mid, hi = np.quantile(values, [low, 0.5, high], axis=1)
    if not (lo > 0).all():  # a few zero samples are fine; a band reaching 0 has no log
        raise ValueError(
            f"the {low} quantile of samples must be positive at every size (log axes), got {lo}"
        )
    ax = _axes.new_axes(ax)
    (line,) = ax.plot(xs, mid, marker, label=label)
    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _label_measured_sizes(ax, xs)
    return ax


def grouped_bars(
    categories: Sequence[str],
    groups: Mapping[str, Sequence[float | None]],
    *,
    ax: Axes | None = None,
    ylabel: str = "",
    title: str | None = None,
) -> Axes:
    """Bars grouped by category, one bar per group in each (e.g. seconds per chapter per machine).

    Args:
        categories: the labels along the x axis (e.g. chapters).
        groups: group name -> one value per category (``None`` leaves that bar out); one colour
            and one legend entry per group.
        ax: where to draw; a new figure is made if ``None``.
        ylabel, title: axis label and title.

    Returns:
        The ``Axes``: one bar container per group, x ticks labelled with ``categories``.
    """
    cats = _axes.check_labels("categories", categories, len(categories), "categories") or []
    if not isinstance(groups, Mapping) or not groups:
        raise TypeError(
            f"groups must be a non-empty mapping of name -> values, got {type(groups).__name__}"
        )
    for name, values in groups.items():
        if len(values) != len(cats):
            raise ValueError(
                f"groups[{name!r}] has {len(values)} values but there are {len(cats)} categories"
            )
    ax = _axes.new_axes(ax)
    width = 0.8 / len(groups)
    for i, (name, values) in enumerate(groups.items()):
        shift = (i - (len(groups) - 1) / 2) * width  # centre the group on its category
        xs = [j + shift for j, v in enumerate(values) if v is not None]
        ax.bar(xs, [float(v) for v in values if v is not None], width=width, label=name)
    ax.set_xticks(range(len(cats)), cats, rotation=45 if max(map(len, cats), default=0) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.margins(y=0.25)  # room above the tallest bar, so that the legend never covers a bar
    ax.legend(fontsize=_axes.SMALL_TEXT, loc="upper left", ncols=min(len(groups), 3))
    if title is not None:
        ax.set_title(title)
    return ax
