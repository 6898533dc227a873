"""The book's one-off figures: the layer and its shapes, the head split, kv heads, the roofline.

Each draws one kind of picture a chapter needs (chapter 1 a small sketch of the layer; chapter 3
the layer, the Transformer block around it, the split and the sharing of key/value heads;
chapters 5 and 8 the roofline), into a matplotlib ``Axes`` it returns. The
reusable pictures they build on are in :mod:`mha.lab.viz` (matrices) and :mod:`mha.lab.charts`
(measurements).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.patches import Circle, FancyBboxPatch, Rectangle

from .. import validation as validate
from ..block import TransformerBlock
from ..multihead import MultiHeadAttention
from . import _axes, viz

__all__ = [
    "block_diagram",
    "kv_head_sharing",
    "layer_diagram",
    "layer_sketch",
    "record_shapes",
    "roofline",
    "split_slots",
]


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


def _box(
    ax: Axes, x: float, y: float, w: float, h: float, text: str, kind: str, size: float = 12
) -> None:
    """A rounded box centred at ``(x, y)`` with ``text`` in it, ``size`` pt (black: every face is
    light)."""
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
    ax.text(
        x, y, text, ha="center", va="center", fontsize=size, color=viz.text_color_on(to_rgb(face))
    )


def _arrow(ax: Axes, x0: float, y0: float, x1: float, y1: float, label: str = "") -> None:
    """An arrow from ``(x0, y0)`` down to ``(x1, y1)`` with a shape written beside it."""
    ax.annotate(
        "",
        xy=(x1, y1),
        xytext=(x0, y0),
        arrowprops={"arrowstyle": "-|>", "color": "#333333", "linewidth": 1.2},
    )
    if label:
        ax.text(
            (x0 + x1) / 2 + 0.12,
            (y0 + y1) / 2,
            label,
            ha="left",
            va="center",
            fontsize=_axes.SMALL_TEXT,
        )


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
    ax = _axes.new_axes(ax, figsize=(5.3, 7.2))
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
    width = 9.9 / len(shown)  # the whole width: four boxes abreast hold softmax(qkᵀ/√D)
    xs = [0.05 + width * (i + 0.5) for i in range(len(shown))]
    for x, h in zip(xs, shown):
        _arrow(ax, x, 7.8, x, 7.0)
        if h < 0:
            ax.text(x, 6.2, "...", ha="center", va="center", fontsize=14)
            continue
        text = f"head {h}\nsoftmax(qkᵀ/√{D})\nweights ({L}, {S})\n· v → ({L}, {D})"
        _box(ax, x, 6.2, width - 0.12, 1.6, text, "head", _axes.SMALL_TEXT)
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


def layer_sketch(num_heads: int = 4, *, ax: Axes | None = None) -> Axes:
    """Draw a small multi-head attention layer: project, split, heads side by side, concat, W_O.

    The small version of :func:`layer_diagram`, without shapes, for a first look: the three
    projections feed every head, and each head has its own weights. Four heads by default, so
    that no head sits under one projection as if it were made of it alone.

    Args:
        num_heads: how many head boxes to draw (2 to 6).
        ax: where to draw; a new figure (4.2 x 4.0 inches) is made if ``None``.

    Returns:
        The ``Axes``, with its axis lines hidden.
    """
    H = validate.positive_int("num_heads", num_heads)
    if not 2 <= H <= 6:
        raise ValueError(f"num_heads must be between 2 and 6 to fit the sketch, got {H}")
    ax = _axes.new_axes(ax, figsize=(4.2, 4.0))
    ax.set_xlim(0, 10)
    ax.set_ylim(1.1, 10.9)
    ax.set_axis_off()
    _box(ax, 5.0, 10.3, 8.0, 0.9, "tokens x  (L tokens, E features)", "input")
    for x, name in zip((1.8, 5.0, 8.2), "QKV"):
        _arrow(ax, x, 9.85, x, 9.15)
        _box(ax, x, 8.7, 2.8, 0.9, f"${name} = x\\,W^{name}$", "linear")
        _arrow(ax, x, 8.25, x, 7.55)
    _box(ax, 5.0, 7.1, 9.4, 0.9, f"split the columns into H = {H} heads", "reshape")
    width = 9.4 / H
    for h in range(H):
        x = 0.3 + width * (h + 0.5)
        _arrow(ax, x, 6.65, x, 6.0)
        _box(ax, x, 5.2, width - 0.3, 1.5, f"head {h}\nown\nweights", "head")
        _arrow(ax, x, 4.45, x, 3.8)
    _box(ax, 5.0, 3.35, 9.4, 0.9, "concatenate the heads, then mix: $W^O$", "reshape")
    _arrow(ax, 5.0, 2.9, 5.0, 2.2)
    _box(ax, 5.0, 1.75, 8.0, 0.9, "output  (L tokens, E features)", "input")
    return ax


def _plus(ax: Axes, x: float, y: float) -> None:
    """The residual addition: a circle with a plus sign."""
    ax.add_patch(Circle((x, y), 0.38, facecolor="white", edgecolor="#333333", linewidth=1.2))
    ax.text(x, y, "+", ha="center", va="center", fontsize=14, color="#222222")


def _residual(ax: Axes, y_from: float, y_to: float, x: float, x_side: float) -> None:
    """The skip path: from the stream at ``y_from`` around the sublayer into the ``+`` at ``y_to``."""
    ax.plot([x, x_side, x_side], [y_from, y_from, y_to], color="#333333", linewidth=1.2)
    _arrow(ax, x_side, y_to, x + 0.4, y_to)
    ax.text(
        x_side + 0.2,
        (y_from + y_to) / 2,
        "residual",
        rotation=90,
        ha="left",
        va="center",
        fontsize=_axes.SMALL_TEXT,
    )


def block_diagram(block: TransformerBlock, *, ax: Axes | None = None) -> Axes:
    """Draw a pre-norm Transformer block with its sizes: two sublayers, each norm → layer → add.

    The stream ``x`` runs down the middle and never passes through a norm: each sublayer reads a
    normalised copy and its output is added back (the residual paths on the right). The widths
    written on the picture are read from ``block``.

    Args:
        block: an :class:`mha.TransformerBlock`.
        ax: where to draw; a new figure (4.4 x 6.2 inches) is made if ``None``.

    Returns:
        The ``Axes``, with its axis lines hidden.
    """
    if not isinstance(block, TransformerBlock):
        raise TypeError(f"block must be an mha.TransformerBlock, got {type(block).__name__}")
    E, H, F = block.embed_dim, block.attn.num_heads, block.ffn_dim
    ax = _axes.new_axes(ax, figsize=(4.4, 6.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0.3, 13.2)
    ax.set_axis_off()
    x = 4.0
    _box(ax, x, 12.5, 6.6, 0.9, f"x  (B, L, E = {E})", "input")
    ax.plot([x, x], [12.05, 7.7], color="#333333", linewidth=1.2, zorder=0)  # under the boxes
    _residual(ax, 11.4, 7.3, x, 8.4)
    _box(ax, x, 10.5, 5.6, 0.8, "LayerNorm", "reshape")
    _box(ax, x, 8.9, 6.6, 1.3, f"multi-head attention\nH = {H} heads, E = {E}", "head")
    _plus(ax, x, 7.3)
    ax.plot([x, x], [6.92, 2.7], color="#333333", linewidth=1.2, zorder=0)
    _residual(ax, 6.4, 2.3, x, 8.4)
    _box(ax, x, 5.6, 5.6, 0.8, "LayerNorm", "reshape")
    mlp = f"MLP: Linear {E} → {F}\n{block.activation.upper()}\nLinear {F} → {E}"
    _box(ax, x, 3.95, 6.6, 1.6, mlp, "linear")
    _plus(ax, x, 2.3)
    _arrow(ax, x, 1.92, x, 1.35)
    _box(ax, x, 0.9, 6.6, 0.8, f"out  (B, L, E = {E})", "input")
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
    ids = _axes.as_array("block", block)
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
    ax = _axes.new_axes(ax)
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
                fontsize=_axes.SMALL_TEXT,
                color=viz.text_color_on(face),
            )
    ax.set_xlim(0, D)
    ax.set_ylim(L, 0)
    ax.set_xticks([0.5 + j for j in range(D)], [f"d{j}" for j in range(D)])
    ax.set_yticks([0.5 + i for i in range(L)], [f"pos {i}" for i in range(L)])
    if title is not None:
        ax.set_title(title, fontsize=12)
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
        validate.divisible("num_heads", H, f"layouts[{name!r}]", hkv)
    kv = np.array([[i // (H // hkv) for hkv in layouts.values()] for i in range(H)])
    ax = _axes.new_axes(ax, figsize=(4.2, 0.45 * H + 1.2))
    image = ax.imshow(kv, cmap="viridis", vmin=0, vmax=max(H - 1, 1), aspect="auto")
    for i in range(H):
        for j in range(kv.shape[1]):
            color = viz.text_color_on(image.cmap(image.norm(kv[i, j])))
            ax.text(
                j,
                i,
                f"kv {kv[i, j]}",
                ha="center",
                va="center",
                color=color,
                fontsize=_axes.SMALL_TEXT,
            )
    titles = [f"{name}\n{hkv} kv head{'s' if hkv > 1 else ''}" for name, hkv in layouts.items()]
    ax.set_xticks(range(len(titles)), titles)
    ax.xaxis.tick_top()
    ax.set_yticks(range(H), [f"q head {i}" for i in range(H)])
    _axes.cell_lines(ax, H, len(titles), linewidth=2)
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
    ax = _axes.new_axes(ax, figsize=(5.4, 4.2))
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
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize=_axes.SMALL_TEXT)
    return ax
