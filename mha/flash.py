"""FlashAttention's forward pass in plain PyTorch: online softmax over key/value tiles.

The full ``(L, S)`` score matrix is never built. As in FlashAttention-2, the outer loop runs over
blocks of query rows and the inner loop over tiles of ``block_size`` keys; each tile updates the
rows that can see it, which carry three running statistics per row:

* ``m``   — the largest score seen so far,
* ``l``   — the softmax denominator so far, measured relative to ``m``,
* ``acc`` — the unnormalised output so far, also relative to ``m``.

When a later tile raises the maximum, the old ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``; at the end ``out = acc / l``. Query blocks that a mask hides from a tile
entirely (causal attention, sliding windows) are skipped: that is where the speed of causal
FlashAttention comes from. Tiles are large (128 keys, and 512 query rows per step) because each
one is a few separate PyTorch calls: fewer, larger calls keep the matrix products efficient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import validation as validate
from .attention import check_arguments


def online_softmax_update(
    m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold one tile of scores and values into the running softmax state, in place.

    Args:
        m: running row maximum, ``-inf`` for rows that have seen no key yet.
        l: running denominator ``sum(exp(score - m))``.
        acc: running numerator ``sum(exp(score - m) * value)``.
        scores: this tile's scaled (and masked: ``-inf`` = hidden) scores.
        value: this tile's values, in the dtype of ``scores`` (float32 for float16/bfloat16
            inputs: the weights ``p`` are never rounded to the input's precision).

    Shapes:
        m, l ``(..., R, 1)``; acc ``(..., R, Dv)``; scores ``(..., R, C)``; value ``(..., C, Dv)``
        for ``R`` query rows and a tile of ``C`` keys. Returns ``(m, l, acc)``, updated in place
        (they may be views into a larger state: the rows of one tile). In place because a tile is
        a handful of passes over memory, and writing new state back into the rows is one more.
    """
    # The maximum only shifts the exponents (the result does not depend on it), so it carries no
    # gradient: detaching it keeps autograd correct through the in-place updates below.
    m_new = torch.maximum(m, scores.detach().amax(-1, keepdim=True))  # (..., R, 1)
    # A row that has seen only hidden keys keeps m = -inf; shifting it by 0 instead makes every
    # exp below exactly 0 rather than exp(-inf - (-inf)) = NaN.
    shift = torch.where(torch.isneginf(m_new), 0.0, m_new)  # (..., R, 1)
    alpha = torch.exp(m - shift)  # (..., R, 1) how much the old state shrinks
    p = (scores - shift).exp_()  # (..., R, C) this tile's unnormalised weights
    m.copy_(m_new)
    l.mul_(alpha).add_(p.sum(-1, keepdim=True))  # (..., R, 1) l = alpha * l + rowsum(p)
    acc.mul_(alpha).add_(p @ value)  # (..., R, Dv) acc = alpha * acc + p @ v
    return m, l, acc


@dataclass(frozen=True)
class Tile:
    """One step of the tile loop: key columns ``[k0, k1)`` update query rows ``[q0, q1)``."""

    k0: int
    k1: int
    q0: int
    q1: int


QUERY_BLOCKS_PER_STEP = 4  # a step of the loop serves 4 blocks of query rows (see tile_schedule)


def _visible_blocks(attn_mask: Tensor, L: int, S: int, block_size: int) -> list[list[bool]]:
    """``visible[r][c]``: may some row of block ``r`` see some key of tile ``c`` (in any batch)?"""
    keep = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
    while keep.dim() > 2:  # may row i see key j in any batch or head?
        keep = keep.any(0)
    n_rows, n_keys = math.ceil(L / block_size), math.ceil(S / block_size)
    padded = torch.zeros(
        n_rows * block_size, n_keys * block_size, dtype=torch.bool, device=keep.device
    )
    padded[:L, :S] = keep  # broadcasts a (1, S) or (L, 1) mask to (L, S)
    blocks = padded.view(n_rows, block_size, n_keys, block_size)
    return blocks.any(3).any(1).tolist()  # one transfer to the host, not one per tile


def tile_schedule(
    L: int,
    S: int,
    *,
    block_size: int = 128,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
) -> list[Tile]:
    """The tiles :func:`flash_attention` computes, in order; hidden ones are left out.

    The query rows are cut into steps of ``QUERY_BLOCKS_PER_STEP`` blocks of ``block_size`` rows
    and the keys into tiles of ``block_size`` keys. For each step (the outer loop, as in
    FlashAttention-2) come the key tiles its rows can see, each with the span of row blocks that
    see it: with ``is_causal`` (top-left alignment) a block of rows ending before the tile starts
    sees nothing of it; with a mask, a block whose mask entries are all ``False`` (or ``-inf``)
    for the tile sees nothing of it. A step's rows and their running state are reused by every
    key tile, so they stay in the processor's cache.

    Shapes:
        attn_mask broadcasts to ``(..., L, S)``.
    """
    block_size = validate.positive_int("block_size", block_size)
    n_blocks = math.ceil(L / block_size)
    visible = None if attn_mask is None else _visible_blocks(attn_mask, L, S, block_size)
    tiles = []
    for step in range(0, n_blocks, QUERY_BLOCKS_PER_STEP):
        step_blocks = range(step, min(step + QUERY_BLOCKS_PER_STEP, n_blocks))
        for c, k0 in enumerate(range(0, S, block_size)):
            rows: Sequence[int] = step_blocks  # the blocks of this step that can see tile c
            if is_causal:
                rows = range(max(step, c), step_blocks.stop)  # row i sees key j only if j <= i
            if visible is not None:
                rows = [r for r in rows if visible[r][c]]
            if rows:
                q0, q1 = rows[0] * block_size, min((rows[-1] + 1) * block_size, L)
                tiles.append(Tile(k0, min(k0 + block_size, S), q0, q1))
    return tiles


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    block_size: int = 128,
    enable_gqa: bool = False,
) -> Tensor:
    """Tiled attention with an online softmax; same result as scaled dot-product attention.

    Args:
        query, key, value: as in :func:`mha.scaled_dot_product_attention`.
        attn_mask: bool keep-mask or float mask added to the scores, broadcasting to ``(..., L, S)``.
        is_causal: hide future keys, aligned top-left as in PyTorch. May be combined with a mask.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        block_size: keys per tile, and rows per query block when tiles are skipped.
        enable_gqa: key and value may have fewer heads than query (grouped-query attention);
            each tile of a shared key/value head is read once for its whole group of query heads.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``; returns ``(..., L, Dv)``.
        Extra memory is ``O(L · block_size)`` for one tile of scores plus ``O(L · Dv)`` for the state.

    Fully masked rows give zeros. Float16/bfloat16 inputs are computed in float32 (scores,
    ``m``, ``l``, ``acc``) and the output is rounded to the input dtype once, at the end.
    """
    groups, scale = check_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    L, S = query.shape[-2], key.shape[-2]
    batch = query.shape[:-2]
    schedule = tile_schedule(L, S, block_size=block_size, is_causal=is_causal, attn_mask=attn_mask)

    dtype = query.dtype
    compute = torch.float32 if dtype in validate.LOW_PRECISION else dtype
    query = query.to(compute) * scale  # (..., L, D): scaling L·D numbers once, not every tile
    key, value = key.to(compute), value.to(compute)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*batch, L, S)  # a view (no memory) that slices like the scores
    if groups > 1:  # (..., Hkv, G, L, D) queries against (..., Hkv, 1, S, D) keys: no copies
        query = query.unflatten(-3, (key.shape[-3], groups))
        key, value = key.unsqueeze(-3), value.unsqueeze(-3)
        if attn_mask is not None:
            attn_mask = attn_mask.unflatten(-3, (key.shape[-4], groups))
    state = query.shape[:-1]  # (..., L)
    m = torch.full((*state, 1), float("-inf"), dtype=compute, device=query.device)
    l = torch.zeros((*state, 1), dtype=compute, device=query.device)
    acc = torch.zeros((*state, value.shape[-1]), dtype=compute, device=query.device)
    if is_causal:  # in a tile whose rows start at its first key (q0 == k0), row q0 + i may not
        # see key k0 + j for j > i: the same triangle for every diagonal tile
        future = torch.ones(block_size, block_size, dtype=torch.bool, device=query.device).triu(1)

    for t in schedule:
        rows = slice(t.q0, t.q1)
        k = key[..., t.k0 : t.k1, :]  # (..., C, D)
        scores = query[..., rows, :] @ k.transpose(-2, -1)  # (..., R, C)
        if is_causal and t.k0 == t.q0:
            n = min(t.k1, t.q1) - t.q0
            scores[..., :n, :].masked_fill_(future[:n, : t.k1 - t.k0], float("-inf"))
        if attn_mask is not None:
            tile_mask = attn_mask[..., rows, t.k0 : t.k1]  # (..., R, C)
            if tile_mask.dtype == torch.bool:
                scores.masked_fill_(~tile_mask, float("-inf"))
            else:
                scores += tile_mask
        v = value[..., t.k0 : t.k1, :]  # (..., C, Dv)
        # Views of this tile's rows: the update writes straight into the state.
        online_softmax_update(m[..., rows, :], l[..., rows, :], acc[..., rows, :], scores, v)

    out = acc / torch.where(l == 0, 1.0, l)  # rows that saw no key stay 0
    return out.reshape(*batch, L, value.shape[-1]).to(dtype)  # (..., L, Dv)
