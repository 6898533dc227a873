"""The dimension walk: run a multi-head layer step by step and record every tensor's shape.

:func:`walk_shapes` repeats what :meth:`mha.MultiHeadAttention.forward` does, one step at a time
(project, split into heads, attend, merge, ``W^O``), checks each intermediate shape against its
name in letters (``"B H L D"``), and proves at the end that the walk *is* the layer: its output
equals the layer's own. :func:`print_walk` prints the rows as a table::

    rows, out = walk_shapes(layer, x)
    print_walk(rows)
    # code                letters        shape
    # query               (B, L, E)      (1, 3, 6)
    # q = q_proj(query)   (B, L, E)      (1, 3, 6)
    # ...

It covers self- and cross-attention (``L ≠ S``, other ``kdim``/``vdim``) and fewer key/value
heads than query heads (``num_kv_heads``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..multihead import MultiHeadAttention

__all__ = ["print_walk", "walk_shapes"]

# One row of the table: the code of the step, its shape in letters, its shape in numbers.
Row = tuple[str, str, tuple[int, ...]]


def walk_shapes(
    layer: MultiHeadAttention,
    query: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
) -> tuple[list[Row], Tensor]:
    """Run ``layer`` step by step and record the shape of every tensor it makes.

    Each shape is checked against its letters (``B`` batch, ``L`` queries, ``S`` keys, ``E``
    model width, ``H`` heads, ``Hkv`` key/value heads, ``D`` head width, ``kdim``/``vdim`` the
    key's and value's widths; ``H·D`` is a product).

    Args:
        layer: the layer to walk through, without RoPE.
        query: the queries, ``(B, L, E)``.
        key: the keys, ``(B, S, kdim)``; ``None`` means ``query`` (self-attention).
        value: the values, ``(B, S, vdim)``; ``None`` means ``key``.

    Returns:
        ``(rows, out)``: one ``(code, letters, shape)`` row per step, e.g.
        ``("q.view(B, L, H, D)", "(B, L, H, D)", (1, 3, 3, 2))``, and the output ``(B, L, E)``.

    Raises:
        AssertionError: if a shape differs from its letters, or the walk's output from the
            layer's.
    """
    key = query if key is None else key
    value = key if value is None else value
    B, L, _ = query.shape
    S = key.shape[1]
    E, H, D, Hkv = layer.embed_dim, layer.num_heads, layer.head_dim, layer.num_kv_heads
    dims = {"B": B, "L": L, "S": S, "E": E, "H": H, "Hkv": Hkv, "D": D}
    dims |= {"kdim": layer.kdim, "vdim": layer.vdim}
    rows: list[Row] = []

    def rec(code: str, t: Tensor, letters: str) -> Tensor:
        # letters like "B L H·D": each entry is a product of named dims
        expected = tuple(math.prod(dims[f] for f in e.split("·")) for e in letters.split())
        shape = tuple(t.shape)
        if shape != expected:
            raise AssertionError(f"{code}: {shape} is not ({letters})")
        rows.append((code, "(" + ", ".join(letters.split()) + ")", shape))
        return t

    rec("query", query, "B L E")
    if key is not query:
        rec("key", key, "B S kdim")
    if value is not key:
        rec("value", value, "B S vdim")
    q = rec("q = q_proj(query)", layer.q_proj(query), "B L E")
    k = rec("k = k_proj(key)", layer.k_proj(key), "B S Hkv·D")
    v = rec("v = v_proj(value)", layer.v_proj(value), "B S Hkv·D")
    q = rec("q.view(B, L, H, D)", q.view(B, L, H, D), "B L H D")
    q = rec("  .transpose(1, 2)", q.transpose(1, 2), "B H L D")
    k = rec("k: the same view + transpose", k.view(B, S, Hkv, D).transpose(1, 2), "B Hkv S D")
    v = rec("v: the same view + transpose", v.view(B, S, Hkv, D).transpose(1, 2), "B Hkv S D")
    if Hkv != H:
        k = rec("k.repeat_interleave(H // Hkv, 1)", k.repeat_interleave(H // Hkv, 1), "B H S D")
        v = rec("v.repeat_interleave(H // Hkv, 1)", v.repeat_interleave(H // Hkv, 1), "B H S D")
    scores = rec("scores = q @ kᵀ / √D", q @ k.transpose(-2, -1) / math.sqrt(D), "B H L S")
    weights = rec("softmax(scores, dim=-1)", torch.softmax(scores, dim=-1), "B H L S")
    heads = rec("heads = weights @ v", weights @ v, "B H L D")
    out = rec("heads.transpose(1, 2)", heads.transpose(1, 2), "B L H D")
    out = rec("  .reshape(B, L, E)", out.reshape(B, L, E), "B L E")
    out = rec("out_proj(concat)", layer.out_proj(out), "B L E")
    torch.testing.assert_close(out, layer(query, key, value)[0])  # the walk *is* the layer
    return rows, out


def print_walk(rows: list[Row], extra: dict[int, str] | None = None) -> None:
    """Print the rows of :func:`walk_shapes` as a table: code, letters, shape.

    Args:
        rows: the rows :func:`walk_shapes` returned.
        extra: ``{row index: text}`` for a fourth column, "the post" (what a text says of
            that step's shape); rows it does not name show "—". ``None``: three columns.
    """
    header = ("code", "letters", "shape") + (("the post",) if extra else ())
    table = [header]
    for i, (code, letters, shape) in enumerate(rows):
        said = (extra.get(i, "—"),) if extra else ()
        table.append((code, letters, str(shape)) + said)
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    for r in table:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
