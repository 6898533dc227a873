"""Pictures of attention as matrices: weight heatmaps, keep-masks, FlashAttention's tiles.

Every function draws into a matplotlib ``Axes`` you may pass as ``ax`` (a new figure is made
otherwise) and returns it; :func:`attention_heads`, :func:`heatmap_grid` and :func:`mask_panels`
make a grid of them and return an array of Axes. Nothing here calls ``plt.show()``: the notebook
cell decides when the figure is shown. Tensors are accepted directly (detached and moved to the
CPU here).

Curves and bars of measurements are in :mod:`mha.lab.charts`; the book's one-off diagrams (the
layer, the head split, the roofline) in :mod:`mha.lab.figures`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from .. import validation as validate
from ..flash import visible_blocks
from . import _axes

__all__ = [
    "attention_heads",
    "attention_heatmap",
    "heatmap_grid",
    "mask_heatmap",
    "mask_panels",
    "mask_tiles",
    "outline_cell",
    "skippable_tiles",
    "text_color_on",
    "tile_grid",
]


def _squeeze_leading(arr: np.ndarray, ndim: int) -> np.ndarray:
    """Drop leading size-1 dims (e.g. the batch of a ``(1, 1, L, S)`` mask) down to ``ndim``."""
    while arr.ndim > ndim and arr.shape[0] == 1:
        arr = arr[0]
    return arr


def _check_axis_labels(
    query_labels: Sequence[str] | None, key_labels: Sequence[str] | None, L: int, S: int, of: str
) -> tuple[list[str] | None, list[str] | None]:
    """One label per row (query) and per column (key) of the ``(L, S)`` matrix named ``of``."""
    return (
        _axes.check_labels("query_labels", query_labels, L, f"queries (rows of {of})"),
        _axes.check_labels("key_labels", key_labels, S, f"keys (columns of {of})"),
    )


def _set_ticks(ax: Axes, query_labels: list[str] | None, key_labels: list[str] | None) -> None:
    """Label the cells; without labels, tick whole positions only (never 2.5 for a count)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
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
            ax.text(
                j,
                i,
                format(v, fmt),
                ha="center",
                va="center",
                color=color,
                fontsize=_axes.SMALL_TEXT,
            )


def _side_legend(ax: Axes, handles: list[Patch]) -> None:
    """A legend to the right of the axes, outside them, so that it covers no cell."""
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=_axes.SMALL_TEXT,
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
    w = _squeeze_leading(_axes.as_array("weights", weights), 2)
    if w.ndim != 2:
        raise ValueError(f"weights must be 2-D (L, S) for one head, got shape {w.shape}")
    L, S = w.shape
    query_labels, key_labels = _check_axis_labels(query_labels, key_labels, L, S, "weights")
    ax = _axes.new_axes(ax)
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
    panel_size: float = 2.2,
) -> np.ndarray:
    """Draw the weights of every head side by side, on one shared color scale.

    Args:
        weights: per-head attention weights, e.g. ``MultiHeadAttention(..., need_weights=True)``
            output for one batch element; leading size-1 dims are dropped.
        query_labels, key_labels: as in :func:`attention_heatmap`.
        axes: ``H`` (or more) Axes to draw into; a new figure with a grid is made if ``None``.
        ncols: columns of the new grid (default: up to 2, which a phone shows readably).
        annotate, fmt, cmap: as in :func:`attention_heatmap`.
        titles: one title per head (default ``"head 0"``, ``"head 1"`` ...).
        panel_size: inches per panel of a new figure.

    Shapes:
        weights ``(H, L, S)``.

    Returns:
        A 1-D NumPy array of the ``H`` Axes drawn, one per head, in head order (unused panels of
        a new grid are hidden). One colorbar for the whole figure is attached to them.
    """
    w = _squeeze_leading(_axes.as_array("weights", weights), 3)
    if w.ndim != 3:
        raise ValueError(f"weights must be 3-D (H, L, S), got shape {w.shape}")
    H, L, S = w.shape
    query_labels, key_labels = _check_axis_labels(query_labels, key_labels, L, S, "weights")
    titles = _axes.check_labels("titles", titles, H, "heads") or [f"head {h}" for h in range(H)]
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
    if axes is None:  # a new grid, up to 2 panels per row by default (phones); unused hidden
        ncols = min(2 if ncols is None else validate.positive_int("ncols", ncols), H)
        _, flat = _panel_grid(H, ncols, panel_size, panel_size, width_extra=1.0)
        return flat, ncols
    flat = np.asarray(axes, dtype=object).ravel()
    if len(flat) < H or not all(isinstance(a, Axes) for a in flat):
        raise ValueError(
            f"axes must hold at least {H} matplotlib Axes (one per head), got {len(flat)} items"
        )
    return flat[:H], None


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
    panel_size: tuple[float, float] = (2.4, 2.3),
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
    ax = _axes.new_axes(ax)
    hidden, keep = "#f0f0f0", "#3b6fb6"
    ax.imshow(m.astype(float), cmap=ListedColormap([hidden, keep]), vmin=0, vmax=1, aspect="auto")
    _set_ticks(ax, query_labels, key_labels)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    _axes.cell_lines(ax, L, S, linewidth=0.8)
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
    m = _squeeze_leading(_axes.as_array("mask", mask), 2)
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
                fontsize=_axes.SMALL_TEXT,
            )


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
    ax = _axes.new_axes(ax)
    ax.imshow(s, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(categories) - 0.5, aspect="equal")
    _axes.cell_lines(ax, nq, nk, linewidth=2)
    _tile_ticks(ax, nq, nk, block_size, token_lengths)
    if t is not None:
        _write_in_tiles(ax, t)
    _side_legend(ax, [Patch(color=c, label=name) for c, name in zip(colors, categories)])
    if title is not None:
        ax.set_title(title)
    return ax


def _check_status(status: object, categories: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """``status`` as a 2-D integer array whose values index ``categories``, and their names."""
    s = _axes.as_array("status", status)
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
    if block_size is None:  # at most 8 labels across (on a phone, more would collide)
        ax.set_xticks(range(0, nk, -(-nk // 8)))
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
            ax.text(j, i, str(text[i, j]), ha="center", va="center", fontsize=_axes.SMALL_TEXT)


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
    ax = _axes.new_axes(ax)
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
    panel_size: float = 2.6,
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
