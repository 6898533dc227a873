"""Pictures of attention: weight heatmaps, masks, FlashAttention tiles, log-log curves.

Every function draws into a matplotlib ``Axes`` you may pass as ``ax`` (a new figure is made
otherwise) and returns it; :func:`attention_heads` takes and returns an array of them, one per
head. Nothing here calls ``plt.show()``: the notebook cell decides when the figure is shown.
Tensors are accepted directly (detached and moved to the CPU here).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle
from matplotlib.ticker import MaxNLocator, NullLocator

from . import validation as validate
from .fit import loglog_fit
from .flash import visible_blocks
from .multihead import MultiHeadAttention

__all__ = [
    "attention_heads",
    "attention_heatmap",
    "grouped_bars",
    "heatmap_grid",
    "kv_head_sharing",
    "layer_diagram",
    "loglog_curves",
    "mask_heatmap",
    "mask_panels",
    "mask_tiles",
    "outline_cell",
    "quantile_band",
    "ratio_curves",
    "record_shapes",
    "roofline",
    "skippable_tiles",
    "split_slots",
    "text_color_on",
    "tile_grid",
]


def _to_numpy(name: str, x: object) -> np.ndarray:
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


def _squeeze_leading(arr: np.ndarray, ndim: int) -> np.ndarray:
    """Drop leading size-1 dims (e.g. the batch of a ``(1, 1, L, S)`` mask) down to ``ndim``."""
    while arr.ndim > ndim and arr.shape[0] == 1:
        arr = arr[0]
    return arr


def _check_labels(name: str, labels: Sequence[str] | None, n: int, what: str) -> list[str] | None:
    if labels is None:
        return None
    if isinstance(labels, str):
        raise TypeError(f"{name} must be a sequence of labels, got the string {labels!r}")
    labels = [str(t) for t in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but there are {n} {what}")
    return labels


def _check_axis_labels(
    query_labels: Sequence[str] | None, key_labels: Sequence[str] | None, L: int, S: int, of: str
) -> tuple[list[str] | None, list[str] | None]:
    """One label per row (query) and per column (key) of the ``(L, S)`` matrix named ``of``."""
    return (
        _check_labels("query_labels", query_labels, L, f"queries (rows of {of})"),
        _check_labels("key_labels", key_labels, S, f"keys (columns of {of})"),
    )


def _new_ax(ax: Axes | None, figsize: tuple[float, float] | None = None) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    elif not isinstance(ax, Axes):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    return ax


def _set_ticks(ax: Axes, query_labels: list[str] | None, key_labels: list[str] | None) -> None:
    if key_labels is not None:
        ax.set_xticks(
            range(len(key_labels)),
            key_labels,
            rotation=45 if max(map(len, key_labels), default=0) > 2 else 0,
        )
    if query_labels is not None:
        ax.set_yticks(range(len(query_labels)), query_labels)


def text_color_on(rgb: Sequence[float] | np.ndarray) -> str:
    """``"black"`` or ``"white"``, whichever contrasts more with the colour ``rgb`` (0..1).

    Uses the WCAG relative luminance of the colour: black text on a colour of luminance ``Y``
    has contrast ``(Y + 0.05) / 0.05``, white text ``1.05 / (Y + 0.05)``.
    """
    c = np.asarray(rgb, dtype=float)[:3]
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return "black" if (y + 0.05) / 0.05 >= 1.05 / (y + 0.05) else "white"


def _annotate(ax: Axes, values: np.ndarray, fmt: str, image: AxesImage) -> None:
    """Write each value in its cell, in black or white, whichever reads better on the cell."""
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = values[i, j]
            color = text_color_on(image.cmap(image.norm(v)))
            ax.text(j, i, format(v, fmt), ha="center", va="center", color=color, fontsize=9)


def _cell_lines(ax: Axes, rows: int, cols: int, linewidth: float) -> None:
    """Thin white lines between cells, so that single positions (or tiles) can be counted."""
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=linewidth)
    ax.tick_params(which="minor", length=0)


def _side_legend(ax: Axes, handles: list[Patch]) -> None:
    """A legend to the right of the axes, outside them, so that it covers no cell."""
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )


def attention_heatmap(
    weights: torch.Tensor | np.ndarray,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    ax: Axes | None = None,
    annotate: bool = False,
    fmt: str = ".2f",
    colorbar: bool = True,
    vmin: float | None = 0.0,
    vmax: float | None = None,
    cmap: str = "viridis",
    title: str | None = None,
) -> Axes:
    """Draw the attention weights of one head: row ``i`` is where query ``i`` looks.

    Args:
        weights: attention weights (or scores) of one head; leading size-1 dims are dropped,
            so ``(1, 1, L, S)`` works too.
        query_labels: one label per query (row), e.g. the tokens.
        key_labels: one label per key (column).
        ax: where to draw; a new figure is made if ``None``.
        annotate: write each value in its cell (for small matrices).
        fmt: format of the annotations.
        colorbar: add a colorbar next to the axes.
        vmin, vmax: color range; weights lie in ``[0, 1]``, so ``vmin`` defaults to 0 and
            ``vmax`` to the largest weight. Pass ``vmin=None`` for scores.
        cmap: matplotlib colormap name.
        title: axes title.

    Shapes:
        weights ``(L, S)``.

    Returns:
        The ``Axes``: one image, x axis = keys, y axis = queries.
    """
    w = _squeeze_leading(_to_numpy("weights", weights), 2)
    if w.ndim != 2:
        raise ValueError(f"weights must be 2-D (L, S) for one head, got shape {w.shape}")
    L, S = w.shape
    query_labels, key_labels = _check_axis_labels(query_labels, key_labels, L, S, "weights")
    ax = _new_ax(ax)
    w = w.astype(float)
    im = ax.imshow(w, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    _set_ticks(ax, query_labels, key_labels)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title is not None:
        ax.set_title(title)
    if annotate:
        _annotate(ax, w, fmt, im)
    if colorbar:
        ax.figure.colorbar(im, ax=ax)
    return ax


def attention_heads(
    weights: torch.Tensor | np.ndarray,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    axes: Sequence[Axes] | np.ndarray | None = None,
    ncols: int | None = None,
    annotate: bool = False,
    fmt: str = ".2f",
    cmap: str = "viridis",
    titles: Sequence[str] | None = None,
    panel_size: float = 2.6,
) -> np.ndarray:
    """Draw the weights of every head side by side, on one shared color scale.

    Args:
        weights: per-head attention weights, e.g. ``MultiHeadAttention(..., need_weights=True)``
            output for one batch element; leading size-1 dims are dropped.
        query_labels, key_labels: as in :func:`attention_heatmap`.
        axes: ``H`` (or more) Axes to draw into; a new figure with a grid is made if ``None``.
        ncols: columns of the new grid (default: up to 4).
        annotate, fmt, cmap: as in :func:`attention_heatmap`.
        titles: one title per head (default ``"head 0"``, ``"head 1"`` ...).
        panel_size: inches per panel of a new figure.

    Shapes:
        weights ``(H, L, S)``.

    Returns:
        A 1-D NumPy array of the ``H`` Axes drawn, one per head, in head order (unused panels of
        a new grid are hidden). One colorbar for the whole figure is attached to them.
    """
    w = _squeeze_leading(_to_numpy("weights", weights), 3)
    if w.ndim != 3:
        raise ValueError(f"weights must be 3-D (H, L, S), got shape {w.shape}")
    H, L, S = w.shape
    query_labels, key_labels = _check_axis_labels(query_labels, key_labels, L, S, "weights")
    titles = _check_labels("titles", titles, H, "heads") or [f"head {h}" for h in range(H)]
    axes_used, grid_cols = _head_axes(axes, H, ncols, panel_size)
    # One color scale for all heads, so that equal colors mean equal weights across panels.
    vmax = float(w.max()) if w.size else 1.0
    for h, ax in enumerate(axes_used):
        attention_heatmap(
            w[h],
            query_labels=query_labels,
            key_labels=key_labels,
            ax=ax,
            annotate=annotate,
            fmt=fmt,
            colorbar=False,
            vmin=0.0,
            vmax=vmax,
            cmap=cmap,
            title=titles[h],
        )
        if grid_cols is not None:
            _outer_labels_only(ax, h, H, grid_cols)
    axes_used[0].figure.colorbar(axes_used[0].images[0], ax=list(axes_used))
    return np.asarray(axes_used, dtype=object)


def _head_axes(
    axes: Sequence[Axes] | np.ndarray | None, H: int, ncols: int | None, panel_size: float
) -> tuple[np.ndarray, int | None]:
    """The ``H`` Axes to draw the heads into, and the column count of the grid if it is made here.

    The caller's Axes (any array shape) come with ``None``: their layout is the caller's, so
    every panel keeps its labels.
    """
    if axes is None:
        return _heads_grid(H, ncols, panel_size)
    flat = np.asarray(axes, dtype=object).ravel()
    if len(flat) < H or not all(isinstance(a, Axes) for a in flat):
        raise ValueError(
            f"axes must hold at least {H} matplotlib Axes (one per head), got {len(flat)} items"
        )
    return flat[:H], None


def _heads_grid(H: int, ncols: int | None, panel_size: float) -> tuple[np.ndarray, int]:
    """The first ``H`` panels of a new grid of ``ncols`` columns (default up to 4), and ``ncols``.

    The panels of the last row that no head needs are hidden.
    """
    if ncols is not None:
        validate.positive_int("ncols", ncols)
    ncols = min(H, 4) if ncols is None else min(ncols, H)
    nrows = -(-H // ncols)
    _, grid = plt.subplots(
        nrows,
        ncols,
        figsize=(panel_size * ncols + 1.0, panel_size * nrows),
        squeeze=False,
        layout="constrained",
    )
    flat = grid.ravel()
    for extra in flat[H:]:
        extra.set_visible(False)
    return flat[:H], ncols


def _outer_labels_only(ax: Axes, h: int, H: int, ncols: int) -> None:
    """In a grid made here, only the outer panels keep tick labels and axis names.

    Every panel shows the same tokens, so repeating them inside the grid only adds clutter.
    """
    if h % ncols != 0:  # not in the first column
        ax.set_ylabel("")
        ax.tick_params(labelleft=False)
    if h + ncols < H:  # a panel below it holds a head too
        ax.set_xlabel("")


def _panel_grid(
    n: int,
    ncols: int,
    width: float,
    height: float,
    *,
    width_extra: float = 0.0,
    height_extra: float = 0.0,
) -> tuple[Figure, np.ndarray]:
    """A figure of ``n`` panels, ``ncols`` (at most ``n``) per row; unused cells hidden."""
    ncols = min(validate.positive_int("ncols", ncols), n)
    nrows = -(-n // ncols)
    figsize = (width * ncols + width_extra, height * nrows + height_extra)
    fig, grid = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, layout="constrained")
    flat = grid.ravel()
    for extra in flat[n:]:
        extra.set_visible(False)
    return fig, flat[:n]


def heatmap_grid(
    matrices: Mapping[str, torch.Tensor | np.ndarray],
    *,
    query_labels: Sequence[str] | Sequence[Sequence[str]] | None = None,
    key_labels: Sequence[str] | Sequence[Sequence[str]] | None = None,
    ncols: int = 2,
    panel_size: tuple[float, float] = (3.6, 2.8),
    fmt: str = ".2f",
    vmin: float = 0.0,
    vmax: float = 1.0,
    title: str | None = None,
) -> np.ndarray:
    """Draw named matrices as annotated heatmaps, ``ncols`` per row, on one color scale.

    For side-by-side comparisons ("the post's weights" vs. "attention's weights"): every panel
    is an :func:`attention_heatmap` with its values written in the cells and no colorbar. Two
    columns keep the panels readable on a phone.

    Args:
        matrices: panel title -> matrix; the panels may differ in shape.
        query_labels, key_labels: one list of labels for every panel, or one list per panel.
        ncols: columns of the grid (at most the number of matrices).
        panel_size: ``(width, height)`` of one panel in inches.
        fmt: format of the annotations.
        vmin, vmax: the shared color range.
        title: figure title.

    Shapes:
        each matrix ``(L_i, S_i)``.

    Returns:
        A 1-D NumPy array of the Axes, one per matrix, in order (unused grid cells are hidden).
    """
    if not isinstance(matrices, Mapping) or not matrices:
        raise TypeError(
            f"matrices must be a non-empty mapping of title -> matrix, got {type(matrices).__name__}"
        )
    n = len(matrices)
    rows = _labels_per_panel("query_labels", query_labels, n)
    cols = _labels_per_panel("key_labels", key_labels, n)
    width, height = panel_size
    fig, flat = _panel_grid(n, ncols, width, height, height_extra=0.4 if title else 0.0)
    style: dict[str, Any] = {"annotate": True, "fmt": fmt, "colorbar": False}
    for ax, (name, m), q, k in zip(flat, matrices.items(), rows, cols):
        attention_heatmap(
            m, query_labels=q, key_labels=k, ax=ax, title=name, vmin=vmin, vmax=vmax, **style
        )
    if title is not None:
        fig.suptitle(title)
    return flat


def _labels_per_panel(
    name: str, labels: Sequence[str] | Sequence[Sequence[str]] | None, n: int
) -> list[Sequence[str] | None]:
    """One label list (or ``None``) per panel, from a shared list or a list of lists."""
    if labels is None:
        return [None] * n
    if isinstance(labels, str):
        raise TypeError(f"{name} must be a sequence of labels, got the string {labels!r}")
    if all(isinstance(x, str) for x in labels):
        return [list(labels)] * n  # type: ignore[arg-type]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} label lists but there are {n} matrices")
    return list(labels)  # type: ignore[arg-type]


def outline_cell(ax: Axes, row: int, col: int, *, color: str = "#e15759") -> Axes:
    """Draw a thick frame around one cell of a heatmap, e.g. the pair a claim is about.

    Returns:
        The ``Axes``, with one more (unfilled) rectangle patch.
    """
    for arg, value in (("row", row), ("col", col)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{arg} must be a non-negative integer, got {value!r}")
    frame = Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=2.5)
    ax.add_patch(frame)
    return ax


def mask_heatmap(
    mask: torch.Tensor | np.ndarray,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    ax: Axes | None = None,
    annotate: bool = False,
    title: str | None = None,
) -> Axes:
    """Draw a bool keep-mask: dark cells may be attended (``True``), light cells are hidden.

    Args:
        mask: bool keep-mask (``True`` = may attend), as the course and PyTorch's SDPA use it.
            Leading size-1 dims are dropped (``(1, 1, L, S)``, or ``(1, 1, 1, S)`` for a padding
            mask of one sequence, which is drawn as one row).
        query_labels, key_labels: as in :func:`attention_heatmap`.
        ax: where to draw; a new figure is made if ``None``.
        annotate: write 1/0 in each cell.
        title: axes title.

    Shapes:
        mask ``(L, S)`` or ``(S,)``.

    Returns:
        The ``Axes``: one image and a legend naming the two colors.
    """
    m = _as_keep_mask(mask)
    L, S = m.shape
    query_labels, key_labels = _check_axis_labels(query_labels, key_labels, L, S, "mask")
    ax = _new_ax(ax)
    hidden, keep = "#f0f0f0", "#3b6fb6"
    ax.imshow(m.astype(float), cmap=ListedColormap([hidden, keep]), vmin=0, vmax=1, aspect="auto")
    _set_ticks(ax, query_labels, key_labels)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    _cell_lines(ax, L, S, linewidth=0.8)
    if annotate:
        _annotate_mask(ax, m)
    _side_legend(
        ax,
        [Patch(color=keep, label="attend (True)"), Patch(color=hidden, label="masked (False)")],
    )
    if title is not None:
        ax.set_title(title)
    return ax


def _as_keep_mask(mask: torch.Tensor | np.ndarray) -> np.ndarray:
    """The mask as a bool array ``(L, S)``; a padding mask ``(S,)`` becomes one row ``(1, S)``."""
    # A float mask is an additive bias, not a keep-mask: drawing it as one would mislead.
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool keep-mask, got dtype {mask.dtype}")
    m = _squeeze_leading(_to_numpy("mask", mask), 2)
    if m.dtype != np.bool_:
        raise TypeError(f"mask must be a bool keep-mask, got dtype {m.dtype}")
    if m.ndim == 1:
        m = m[None, :]
    if m.ndim != 2:
        raise ValueError(
            f"mask must be (L, S) after dropping size-1 leading dims, got shape {m.shape}"
        )
    return m


def _annotate_mask(ax: Axes, m: np.ndarray) -> None:
    """Write 1 or 0 in each cell, in white on the dark (kept) cells and black on the light ones."""
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            ax.text(
                j,
                i,
                "1" if m[i, j] else "0",
                ha="center",
                va="center",
                color="white" if m[i, j] else "black",
                fontsize=8,
            )


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
        fit: also draw each curve's least-squares power law (:func:`mha.bench.loglog_fit`) as a
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
            f = loglog_fit(px, py)
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
    xs = [float(v) for v in _to_numpy("x", x).ravel()]
    if not isinstance(ys, Mapping) or not ys:
        raise TypeError(
            f"ys must be a non-empty mapping of name -> values, got {type(ys).__name__}"
        )
    return xs, _new_ax(ax)


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
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


# Light grey for the first category (usually "skipped"), then colors that stand apart from it.
_PALETTE = ["#e8e8e8", "#3b6fb6", "#f28e2b", "#59a14f", "#b07aa1", "#e15759"]


def tile_grid(
    status: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    *,
    categories: Sequence[str] = ("skipped", "computed"),
    colors: Sequence[str] | None = None,
    text: Sequence[Sequence[str]] | np.ndarray | None = None,
    block_size: int | None = None,
    lengths: tuple[int, int] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Draw the tiles of a tiled attention: one cell per (query block, key block).

    Args:
        status: the category of each tile, as integers indexing ``categories`` (or bools:
            ``False`` = 0, ``True`` = 1), e.g. 1 where FlashAttention computed the tile, 0
            where the mask let it skip it.
        categories: the names of the categories, for the legend.
        colors: one color per category (defaults: light grey for the first, then blues/orange).
        text: an optional string per tile (e.g. the order in which tiles are visited).
        block_size: tokens per tile; labels the axes with token ranges (``0-63``) if given.
        lengths: ``(L, S)``, the query and key lengths, so that the last (ragged) tile of each
            axis is labelled with its true end; used with ``block_size``.
        ax: where to draw; a new figure is made if ``None``.
        title: axes title.

    Shapes:
        status ``(number of query blocks, number of key blocks)``; text the same.

    Returns:
        The ``Axes``: one image, a legend with one entry per category, one text per tile when
        ``text`` is given.
    """
    # Every check comes before drawing, so a bad argument leaves no half-drawn figure behind.
    s, categories = _check_status(status, categories)
    colors = list(colors) if colors is not None else _PALETTE[: len(categories)]
    if len(colors) != len(categories):
        raise ValueError(f"colors has {len(colors)} entries but categories has {len(categories)}")
    nq, nk = s.shape
    token_lengths = None if block_size is None else _tile_lengths(nq, nk, block_size, lengths)
    t = None if text is None else np.asarray(text, dtype=object)
    if t is not None and t.shape != s.shape:
        raise ValueError(f"text must have the shape of status {s.shape}, got {t.shape}")
    ax = _new_ax(ax)
    ax.imshow(s, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(categories) - 0.5, aspect="equal")
    _cell_lines(ax, nq, nk, linewidth=2)
    _tile_ticks(ax, nq, nk, block_size, token_lengths)
    if t is not None:
        _write_in_tiles(ax, t)
    _side_legend(ax, [Patch(color=c, label=name) for c, name in zip(colors, categories)])
    if title is not None:
        ax.set_title(title)
    return ax


def _check_status(status: object, categories: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """``status`` as a 2-D integer array whose values index ``categories``, and their names."""
    s = _to_numpy("status", status)
    if s.ndim != 2:
        raise ValueError(f"status must be 2-D (query blocks, key blocks), got shape {s.shape}")
    if s.dtype == np.bool_:
        s = s.astype(int)
    if not np.issubdtype(s.dtype, np.integer):
        raise TypeError(f"status must hold integer categories or bools, got dtype {s.dtype}")
    categories = [str(c) for c in categories]
    if not categories:
        raise ValueError("categories must name at least one category")
    if s.size and (s.min() < 0 or s.max() >= len(categories)):
        raise ValueError(
            f"status values must index categories (0..{len(categories) - 1}), got values {s.min()}..{s.max()}"
        )
    return s, categories


def _tile_lengths(
    nq: int, nk: int, block_size: int, lengths: tuple[int, int] | None
) -> tuple[int, int]:
    """``(L, S)``: the given lengths, checked to fill the last tile of each axis, else whole tiles."""
    validate.positive_int("block_size", block_size)
    L, S = (nq * block_size, nk * block_size) if lengths is None else lengths
    if (
        not (nq - 1) * block_size < L <= nq * block_size
        or not (nk - 1) * block_size < S <= nk * block_size
    ):
        raise ValueError(
            f"lengths {lengths} do not fit {nq} x {nk} tiles of block_size {block_size}"
        )
    return L, S


def _tile_ticks(
    ax: Axes, nq: int, nk: int, block_size: int | None, lengths: tuple[int, int] | None
) -> None:
    """Label the tiles by their token ranges (``0-63``) with a block size, else by index."""
    if block_size is None:
        ax.set_xticks(range(nk))
        ax.set_yticks(range(nq))
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        return
    assert lengths is not None  # _tile_lengths gives them whenever there is a block size
    L, S = lengths
    ax.set_xticks(range(nk), _token_spans(nk, S, block_size), rotation=45)
    ax.set_yticks(range(nq), _token_spans(nq, L, block_size))
    ax.set_xlabel("key positions (tile)")
    ax.set_ylabel("query positions (tile)")


def _token_spans(n: int, total: int, block_size: int) -> list[str]:
    """``first-last`` token of each of ``n`` tiles; the last (ragged) tile ends at ``total - 1``."""
    return [f"{j * block_size}-{min((j + 1) * block_size, total) - 1}" for j in range(n)]


def _write_in_tiles(ax: Axes, text: np.ndarray) -> None:
    """Write each tile's text in its cell; ``None`` and ``""`` leave the tile blank."""
    for i, j in np.ndindex(text.shape):
        if text[i, j] not in (None, ""):
            ax.text(j, i, str(text[i, j]), ha="center", va="center", fontsize=8)


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
    cats = _check_labels("categories", categories, len(categories), "categories") or []
    if not isinstance(groups, Mapping) or not groups:
        raise TypeError(
            f"groups must be a non-empty mapping of name -> values, got {type(groups).__name__}"
        )
    for name, values in groups.items():
        if len(values) != len(cats):
            raise ValueError(
                f"groups[{name!r}] has {len(values)} values but there are {len(cats)} categories"
            )
    ax = _new_ax(ax)
    width = 0.8 / len(groups)
    for i, (name, values) in enumerate(groups.items()):
        shift = (i - (len(groups) - 1) / 2) * width  # centre the group on its category
        xs = [j + shift for j, v in enumerate(values) if v is not None]
        ax.bar(xs, [float(v) for v in values if v is not None], width=width, label=name)
    ax.set_xticks(range(len(cats)), cats, rotation=45 if max(map(len, cats), default=0) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    if title is not None:
        ax.set_title(title)
    return ax


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
    ax.legend(fontsize=9)
    if title is not None:
        ax.set_title(title)
    return ax


# Colours of :func:`mask_heatmap`, shared by the mask figures below.
_MASK_HIDDEN, _MASK_KEEP, _SKIP_HATCH = "#f0f0f0", "#3b6fb6", "#6e6e6e"


def _mask_legend_handles(tiles: bool) -> list[Patch]:
    handles = [
        Patch(color=_MASK_KEEP, label="attend (True)"),
        Patch(facecolor=_MASK_HIDDEN, edgecolor="#b0b0b0", label="masked (False)"),
    ]
    if tiles:
        handles.append(
            Patch(facecolor=_MASK_HIDDEN, edgecolor=_SKIP_HATCH, hatch="///", label="tile skipped")
        )
    return handles


def skippable_tiles(mask: torch.Tensor | np.ndarray, block_size: int) -> np.ndarray:
    """Which ``(block_size x block_size)`` tiles of a keep-mask hide every pair in them.

    A tiled kernel (:func:`mha.flash_attention`) never needs to touch such a tile.

    Shapes:
        mask ``(L, S)``; returns a bool array ``(ceil(L / block_size), ceil(S / block_size))``.
    """
    m = _as_keep_mask(mask)
    b = validate.positive_int("block_size", block_size)
    L, S = m.shape
    return (~visible_blocks(torch.from_numpy(np.ascontiguousarray(m)), L, S, b)).numpy()


def mask_tiles(
    mask: torch.Tensor | np.ndarray,
    block_size: int,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    legend: bool = True,
) -> Axes:
    """Draw a (large) keep-mask with its tile grid; hatch the tiles a tiled kernel skips.

    Unlike :func:`mask_heatmap` there are no lines between single positions, only between
    tiles, so masks of hundreds of positions stay readable.

    Args:
        mask: bool keep-mask (``True`` = may attend); leading size-1 dims are dropped.
        block_size: tile size in positions (rows and columns).
        ax: where to draw; a new figure is made if ``None``.
        title: axes title.
        legend: add a legend to the right of the axes.

    Shapes:
        mask ``(L, S)``.

    Returns:
        The ``Axes``: one image, one hatched rectangle per skippable tile (see
        :func:`skippable_tiles`), grid lines at the tile borders.
    """
    skip = skippable_tiles(mask, block_size)  # checks the arguments before drawing
    m = _as_keep_mask(mask)
    L, S = m.shape
    ax = _new_ax(ax)
    cmap = ListedColormap([_MASK_HIDDEN, _MASK_KEEP])
    ax.imshow(m.astype(float), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for i, j in zip(*np.nonzero(skip)):
        corner = (j * block_size - 0.5, i * block_size - 0.5)
        ax.add_patch(
            Rectangle(
                corner,
                block_size,
                block_size,
                fill=False,
                hatch="///",
                edgecolor=_SKIP_HATCH,
                linewidth=0,
            )
        )
    for edge in range(block_size, S, block_size):
        ax.axvline(edge - 0.5, color="#9a9a9a", linewidth=0.6)
    for edge in range(block_size, L, block_size):
        ax.axhline(edge - 0.5, color="#9a9a9a", linewidth=0.6)
    ax.set_xlim(-0.5, S - 0.5)
    ax.set_ylim(L - 0.5, -0.5)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if legend:
        _side_legend(ax, _mask_legend_handles(tiles=True))
    if title is not None:
        ax.set_title(title)
    return ax


def mask_panels(
    masks: Mapping[str, torch.Tensor | np.ndarray],
    *,
    ncols: int = 2,
    panel_size: float = 3.0,
    panel_height: float | None = None,
    block_size: int | None = None,
    title: str | None = None,
) -> np.ndarray:
    """Draw named keep-masks in a grid of at most ``ncols`` columns, with one legend below.

    Two columns keep every panel readable on a phone. Each panel is drawn by
    :func:`mask_heatmap` (with integer ticks) or, with ``block_size``, by :func:`mask_tiles`.

    Args:
        masks: panel title -> bool keep-mask.
        ncols: columns of the grid (at most the number of masks).
        panel_size: width of a panel in inches (and its height unless ``panel_height``).
        panel_height: height of a panel in inches.
        block_size: draw tile grids and hatch skippable tiles, with tiles of this size.
        title: figure title.

    Returns:
        A 1-D NumPy array of the Axes, one per mask, in order (unused grid cells are hidden).
    """
    if not isinstance(masks, Mapping) or not masks:
        raise TypeError(
            f"masks must be a non-empty mapping of title -> mask, got {type(masks).__name__}"
        )
    for m in masks.values():  # every check comes before drawing
        if block_size is None:
            _as_keep_mask(m)
        else:
            skippable_tiles(m, block_size)
    height = panel_size if panel_height is None else panel_height
    fig, flat = _panel_grid(
        len(masks), ncols, panel_size, height, width_extra=0.4, height_extra=0.6
    )
    for ax, (name, m) in zip(flat, masks.items()):
        if block_size is None:
            mask_heatmap(m, ax=ax, title=name)
            ax.get_legend().remove()
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are integers
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            mask_tiles(m, block_size, ax=ax, title=name, legend=False)
    fig.legend(
        handles=_mask_legend_handles(tiles=block_size is not None),
        loc="outside lower center",
        ncols=3,
        frameon=False,
    )
    if title is not None:
        fig.suptitle(title)
    return flat


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
    xs = [float(v) for v in _to_numpy("x", x).ravel()]
    values = _to_numpy("samples", samples).astype(float)
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
    ax = _new_ax(ax)
    (line,) = ax.plot(xs, mid, marker, label=label)
    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _label_measured_sizes(ax, xs)
    return ax


# ------------------------------------------------------------------ the layer, drawn (chapter 3)


@contextmanager
def _recording(layer: MultiHeadAttention, shapes: dict) -> Iterator[None]:
    """While active, ``layer``'s steps write the shapes of their results into ``shapes``."""

    def record(step: str, tensor: torch.Tensor) -> None:
        shapes[step] = tuple(tensor.shape)

    handle = layer.register_step_hook(record)
    try:
        yield
    finally:
        handle.remove()


def record_shapes(
    layer: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> dict[str, tuple[int, ...] | None]:
    """Run one forward pass of an ``mha.MultiHeadAttention`` and record the shape of every step.

    The layer's own steps are observed while it runs, through its step hook
    (:meth:`mha.MultiHeadAttention.register_step_hook`): the heads after the split, the weights,
    the per-head outputs, their concatenation and the output. The projections' weights are read
    from the layer, and what each projection outputs is ``(B, length, out_features)``.

    Args:
        layer: an ``mha.MultiHeadAttention``.
        query, key, value: its inputs, as for ``layer(query, key, value)``; ``key`` and
            ``value`` ``None`` for self-attention (recorded as ``None``).

    Returns:
        A dict of shapes: ``query``, ``key``, ``value`` (inputs), ``q_proj``, ``k_proj``,
        ``v_proj``, ``out_proj`` (weights, ``(out, in)``), ``q_projected``, ``k_projected``,
        ``v_projected``, ``q``, ``k``, ``v`` (after the split), ``weights``, ``heads``,
        ``concat`` and ``out``.
    """
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(f"layer must be an mha.MultiHeadAttention, got {type(layer).__name__}")
    shapes: dict[str, tuple[int, ...] | None] = {
        "query": tuple(query.shape),
        "key": None if key is None else tuple(key.shape),
        "value": None if value is None else tuple(value.shape),
    }
    with _recording(layer, shapes), torch.no_grad():
        layer(query, key, value, need_weights=True)
    k_in = query if key is None else key
    v_in = k_in if value is None else value
    for name, x in (("q", query), ("k", k_in), ("v", v_in)):
        proj = getattr(layer, f"{name}_proj")
        shapes[f"{name}_proj"] = tuple(proj.weight.shape)
        shapes[f"{name}_projected"] = (*x.shape[:-1], proj.out_features)
    shapes["out_proj"] = tuple(layer.out_proj.weight.shape)
    return shapes


_STEPS_FACE = {"input": "#e8eef7", "linear": "#fbe3c8", "reshape": "#e4e4e4", "head": "#d8efe0"}


def _box(ax: Axes, x: float, y: float, w: float, h: float, text: str, kind: str) -> None:
    """A rounded box centred at ``(x, y)`` with ``text`` in it (black: every face is light)."""
    face = _STEPS_FACE[kind]
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2, y - h / 2),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.12",
            facecolor=face,
            edgecolor="#555555",
            linewidth=1.0,
        )
    )
    ax.text(x, y, text, ha="center", va="center", fontsize=10, color=text_color_on(to_rgb(face)))


def _arrow(ax: Axes, x0: float, y0: float, x1: float, y1: float, label: str = "") -> None:
    """An arrow from ``(x0, y0)`` down to ``(x1, y1)`` with a shape written beside it."""
    ax.annotate(
        "",
        xy=(x1, y1),
        xytext=(x0, y0),
        arrowprops={"arrowstyle": "-|>", "color": "#333333", "linewidth": 1.2},
    )
    if label:
        ax.text((x0 + x1) / 2 + 0.12, (y0 + y1) / 2, label, ha="left", va="center", fontsize=9.5)


def _recorded(shapes: Mapping[str, tuple[int, ...] | None], name: str) -> tuple[int, ...]:
    shape = shapes.get(name)
    if shape is None:
        raise ValueError(f"shapes must come from record_shapes; {name!r} is missing")
    return shape


def _shape(shape: tuple[int, ...] | None) -> str:
    return str(shape).replace(",)", ")")


def _draw_inputs_and_projections(ax: Axes, shapes: Mapping[str, Any]) -> None:
    """Steps 1 and 2 of :func:`layer_diagram`: the inputs and the q/k/v projections."""
    cross = shapes["key"] is not None
    # 1. inputs
    if cross:
        names = (("query", "(B, L, E)"), ("key", "(B, S, kdim)"), ("value", "(B, S, vdim)"))
        for x, (name, letters) in zip((1.9, 5.0, 8.1), names):
            _box(ax, x, 12.0, 2.8, 0.9, f"{name}\n{letters} = {_shape(shapes[name])}", "input")
    else:
        text = f"input x  (query = key = value)\n(B, L, E) = {_shape(shapes['query'])}"
        _box(ax, 5.0, 12.0, 6.2, 0.9, text, "input")
    # 2. projections, one per input
    for x, name in zip((1.9, 5.0, 8.1), "qkv"):
        _arrow(ax, x if cross else 5.0, 11.55, x, 10.65)
        weight = _shape(shapes[f"{name}_proj"])
        _box(ax, x, 10.2, 2.8, 0.9, f"{name}_proj\nweight {weight}", "linear")
        _arrow(ax, x, 9.75, x, 8.85, _shape(shapes[f"{name}_projected"]))


def layer_diagram(
    shapes: Mapping[str, tuple[int, ...] | None], *, ax: Axes | None = None, max_heads: int = 4
) -> Axes:
    """Draw the multi-head attention layer as boxes and arrows, with the recorded shapes.

    Top to bottom: the input, the three projections, the split into heads, one box per head
    (scores, softmax, weighted sum), the concatenation and the output projection ``W_O``.
    Every shape written on the picture comes from ``shapes``.

    Args:
        shapes: the dict returned by :func:`record_shapes`.
        ax: where to draw; a new figure (6.4 x 8 inches) is made if ``None``.
        max_heads: draw at most this many head boxes (the first ones, "..." and the last).

    Returns:
        The ``Axes``, with its axis lines hidden.
    """
    needed = ("query", "q_proj", "q_projected", "q", "k", "v", "weights", "heads", "concat")
    missing = [k for k in (*needed, "out", "out_proj") if shapes.get(k) is None]
    if not isinstance(shapes, Mapping) or missing:
        raise ValueError(f"shapes must come from record_shapes; missing {missing}")
    max_heads = validate.positive_int("max_heads", max_heads)
    if max_heads < 2:
        raise ValueError(f"max_heads must be at least 2, got {max_heads}")
    B, H, L, D = _recorded(shapes, "q")
    S = _recorded(shapes, "k")[2]
    ax = _new_ax(ax, figsize=(6.4, 8.0))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 12.6)
    ax.set_axis_off()
    _draw_inputs_and_projections(ax, shapes)
    # 3. the split
    split = (
        "split into heads: .view(B, L, H, D).transpose(1, 2)\n"
        f"q {_shape(shapes['q'])}   k {_shape(shapes['k'])}   v {_shape(shapes['v'])}"
    )
    _box(ax, 5.0, 8.3, 9.4, 1.0, split, "reshape")
    # 4. one box per head
    shown = list(range(H)) if H <= max_heads else [*range(max_heads - 2), -1, H - 1]
    width = 9.4 / len(shown)
    xs = [0.3 + width * (i + 0.5) for i in range(len(shown))]
    for x, h in zip(xs, shown):
        _arrow(ax, x, 7.8, x, 7.0)
        if h < 0:
            ax.text(x, 6.2, "...", ha="center", va="center", fontsize=14)
            continue
        text = f"head {h}\nsoftmax(qkᵀ/√{D})\nweights ({L}, {S})\n· v → ({L}, {D})"
        _box(ax, x, 6.2, width - 0.25, 1.6, text, "head")
        _arrow(ax, x, 5.4, x, 4.6)
    # 5. concat and W_O
    concat = f"concat heads: .transpose(1, 2).reshape(B, L, E)\n{_shape(shapes['heads'])} → "
    concat += _shape(shapes["concat"])
    _box(ax, 5.0, 4.1, 9.4, 1.0, concat, "reshape")
    _arrow(ax, 5.0, 3.6, 5.0, 2.7, _shape(shapes["concat"]))
    _box(ax, 5.0, 2.2, 6.2, 0.9, f"out_proj = W_O\nweight {_shape(shapes['out_proj'])}", "linear")
    _arrow(ax, 5.0, 1.75, 5.0, 0.85)
    _box(ax, 5.0, 0.45, 6.2, 0.8, f"output (B, L, E) = {_shape(shapes['out'])}", "input")
    return ax


def split_slots(
    block: torch.Tensor | np.ndarray,
    *,
    embed_dim: int,
    token_names: Sequence[str],
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Draw which token and feature fills each slot of one head's ``(L, D)`` block.

    Args:
        block: integer ids, ``i * embed_dim + f`` for feature ``f`` of token ``i``, as they land
            in one head after a split (e.g. ``torch.arange(L * E).view(1, L, E)`` split).
        embed_dim: ``E``, to decode the ids.
        token_names: one name per token; each token gets its own (light) colour.
        ax: where to draw; a new figure is made if ``None``.
        title: axes title.

    Shapes:
        block ``(L, D)``.

    Returns:
        The ``Axes``: one labelled rectangle per slot, rows = positions, columns = features.
    """
    ids = _to_numpy("block", block)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"block must be a 2-D integer array (L, D), got {ids.dtype} {ids.shape}")
    E = validate.positive_int("embed_dim", embed_dim)
    if isinstance(token_names, str):
        raise TypeError(f"token_names must be a sequence of names, got the string {token_names!r}")
    names = [str(t) for t in token_names]
    if int(ids.min()) < 0 or int(ids.max()) // E >= len(names):
        raise ValueError(
            f"block holds ids of tokens 0..{int(ids.max()) // E} but token_names has "
            f"{len(names)} names"
        )
    L, D = ids.shape
    colors = [plt.get_cmap("Pastel1")(i) for i in range(9)]
    ax = _new_ax(ax)
    for i in range(L):
        for j in range(D):
            token, feature = divmod(int(ids[i, j]), E)
            face = colors[token % len(colors)]
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=face, edgecolor="white", lw=2))
            ax.text(
                j + 0.5,
                i + 0.5,
                f"{names[token]}\nf{feature}",
                ha="center",
                va="center",
                fontsize=9,
                color=text_color_on(face),
            )
    ax.set_xlim(0, D)
    ax.set_ylim(L, 0)
    ax.set_xticks([0.5 + j for j in range(D)], [f"d{j}" for j in range(D)])
    ax.set_yticks([0.5 + i for i in range(L)], [f"pos {i}" for i in range(L)])
    if title is not None:
        ax.set_title(title, fontsize=10)
    return ax


def kv_head_sharing(num_heads: int, layouts: Mapping[str, int], *, ax: Axes | None = None) -> Axes:
    """Draw which key/value head each query head reads, for several ``num_kv_heads``.

    One column per layout, one row per query head; each cell names the key/value head that
    query head ``i`` reads, ``i // (num_heads // num_kv_heads)``, and is coloured by it.

    Args:
        num_heads: query heads ``H``.
        layouts: column title -> ``num_kv_heads``, e.g. ``{"MHA": 8, "GQA": 2, "MQA": 1}``.
        ax: where to draw; a new figure is made if ``None``.

    Returns:
        The ``Axes``: an ``(H, len(layouts))`` image with the key/value head in every cell.
    """
    H = validate.positive_int("num_heads", num_heads)
    if not isinstance(layouts, Mapping) or not layouts:
        raise TypeError(
            f"layouts must be a non-empty mapping of title -> num_kv_heads, got {layouts!r}"
        )
    for name, hkv in layouts.items():
        validate.positive_int(f"layouts[{name!r}]", hkv)
        if H % hkv:
            raise ValueError(f"num_heads ({H}) must be divisible by layouts[{name!r}] ({hkv})")
    kv = np.array([[i // (H // hkv) for hkv in layouts.values()] for i in range(H)])
    ax = _new_ax(ax, figsize=(4.2, 0.45 * H + 1.2))
    image = ax.imshow(kv, cmap="viridis", vmin=0, vmax=max(H - 1, 1), aspect="auto")
    for i in range(H):
        for j in range(kv.shape[1]):
            color = text_color_on(image.cmap(image.norm(kv[i, j])))
            ax.text(j, i, f"kv {kv[i, j]}", ha="center", va="center", color=color, fontsize=9)
    titles = [f"{name}\n{hkv} kv head{'s' if hkv > 1 else ''}" for name, hkv in layouts.items()]
    ax.set_xticks(range(len(titles)), titles)
    ax.xaxis.tick_top()
    ax.set_yticks(range(H), [f"q head {i}" for i in range(H)])
    _cell_lines(ax, H, len(titles), linewidth=2)
    return ax


def _roof(intensity: np.ndarray, peak: float, bandwidth: float) -> np.ndarray:
    """The roofline ``min(peak, bandwidth * intensity)`` in FLOP/s."""
    return np.minimum(peak, bandwidth * intensity)


def roofline(
    points: Mapping[str, tuple[float, float]],
    *,
    peak: float,
    bandwidth: float,
    references: Mapping[str, tuple[float, float]] | None = None,
    label: str = "this machine (measured)",
    ax: Axes | None = None,
) -> Axes:
    """Draw a roofline on log-log axes, with measured points and reference rooflines.

    A device doing at most ``peak`` FLOP/s and moving ``bandwidth`` bytes/s can reach at most
    ``min(peak, bandwidth * I)`` FLOP/s on work of arithmetic intensity ``I`` (FLOP per byte).

    Args:
        points: name -> ``(intensity in FLOP/byte, achieved FLOP/s)``, one marker each.
        peak, bandwidth: this machine's roofs, in FLOP/s and bytes/s (solid line).
        references: name -> ``(peak FLOP/s, bytes/s)`` of other devices, drawn as dashed lighter
            lines (e.g. published datasheet figures).
        label: the legend entry of the solid roofline.
        ax: where to draw; a new figure is made if ``None``.

    Returns:
        The ``Axes``: one line per roofline (``label`` first, then ``references`` in order) and
        one marker per point, all in a legend below the axes.
    """
    peak = validate.positive_float("peak", peak)
    bandwidth = validate.positive_float("bandwidth", bandwidth)
    if not isinstance(points, Mapping) or not points:
        raise TypeError(
            f"points must be a non-empty mapping of name -> (I, FLOP/s), got {points!r}"
        )
    refs = dict(references or {})
    for what, pairs in (("points", points), ("references", refs)):
        for name, pair in pairs.items():
            if len(pair) != 2:
                raise ValueError(f"{what}[{name!r}] must be a pair of numbers, got {pair!r}")
            for value in pair:
                validate.positive_float(f"{what}[{name!r}]", value)
    ax = _new_ax(ax, figsize=(7.5, 5.0))
    ridges = [peak / bandwidth] + [p / w for p, w in refs.values()]
    xs = [i for i, _ in points.values()] + ridges
    grid = np.geomspace(min(xs) / 3, max(xs) * 3, 200)
    ax.plot(grid, _roof(grid, peak, bandwidth), color="black", linewidth=2, label=label)
    greys = ["#8c8c8c", "#a6a6d9", "#d9a6a6", "#a6d9a6"]
    for n, (name, (p, w)) in enumerate(refs.items()):
        ax.plot(
            grid,
            _roof(grid, p, w),
            linestyle="--",
            linewidth=1.5,
            color=greys[n % len(greys)],
            label=name,
        )
    markers = "osD^vP*X"
    for n, (name, (i, rate)) in enumerate(points.items()):
        ax.plot(
            i, rate, linestyle="none", marker=markers[n % len(markers)], markersize=8, label=name
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize=9)
    return ax
