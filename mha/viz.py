"""Pictures of attention: weight heatmaps, masks, FlashAttention tiles, log-log curves.

Every function draws into a matplotlib ``Axes`` you may pass as ``ax`` (a new figure is made
otherwise) and returns it; :func:`attention_heads` takes and returns an array of them, one per
head. Nothing here calls ``plt.show()``: the notebook cell decides when the figure is shown.
Tensors are accepted directly (detached and moved to the CPU here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

from . import validation as validate
from .fit import loglog_fit

__all__ = [
    "attention_heads",
    "attention_heatmap",
    "loglog_curves",
    "mask_heatmap",
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


def _annotate(ax: Axes, values: np.ndarray, fmt: str, high: float) -> None:
    """Write each value in its cell, in white on dark cells and black on light ones."""
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = values[i, j]
            color = "white" if v < high else "black"
            ax.text(j, i, format(v, fmt), ha="center", va="center", color=color, fontsize=8)


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
        lo, hi = im.get_clim()
        _annotate(ax, w, fmt, lo + 0.6 * (hi - lo))
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
    xs = [float(v) for v in _to_numpy("x", x).ravel()]
    if not isinstance(ys, Mapping) or not ys:
        raise TypeError(
            f"ys must be a non-empty mapping of name -> values, got {type(ys).__name__}"
        )
    ax = _new_ax(ax)
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
