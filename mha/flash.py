"""FlashAttention's forward pass in plain PyTorch: online softmax over key/value tiles.

The full ``(L, S)`` score matrix is never built. Keys and values are visited one tile of
``block_size`` columns at a time (the outer loop of FlashAttention's Algorithm 1); for each tile
every query row that can see it is updated at once, carrying three running statistics per row:

* ``m``   — the largest score seen so far,
* ``l``   — the softmax denominator so far, measured relative to ``m``,
* ``acc`` — the unnormalised output so far, also relative to ``m``.

When a later tile raises the maximum, the old ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``; at the end ``out = acc / l``. Query blocks that a mask hides from a tile
entirely (causal attention, sliding windows) are skipped: that is where the speed of causal
FlashAttention comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import _LOW_PRECISION, check_mask, check_qkv, check_scale_and_dropout


def online_softmax_update(
    m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold one tile of scores and values into the running softmax state.

    Args:
        m: running row maximum, ``-inf`` for rows that have seen no key yet.
        l: running denominator ``sum(exp(score - m))``.
        acc: running numerator ``sum(exp(score - m) * value)``.
        scores: this tile's scaled (and masked: ``-inf`` = hidden) scores, in float32.
        value: this tile's values.

    Shapes:
        m, l ``(..., R, 1)``; acc ``(..., R, Dv)``; scores ``(..., R, C)``; value ``(..., C, Dv)``
        for ``R`` query rows and a tile of ``C`` keys. Returns the new ``(m, l, acc)``.
    """
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))  # (..., R, 1)
    # A row that has seen only hidden keys keeps m = -inf; shifting it by 0 instead makes every
    # exp below exactly 0 rather than exp(-inf - (-inf)) = NaN.
    shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    p = (scores - shift).exp_()  # (..., R, C) this tile's unnormalised weights
    alpha = torch.exp(m - shift)  # (..., R, 1) how much the old state shrinks
    l = alpha * l + p.sum(-1, keepdim=True)  # (..., R, 1)
    acc = torch.addcmul(p.to(value.dtype) @ value, alpha, acc)  # (..., R, Dv) = p @ v + alpha * acc
    return m_new, l, acc


@dataclass(frozen=True)
class Tile:
    """One step of the tile loop: key columns ``[k0, k1)`` update query rows ``[q0, q1)``."""

    k0: int
    k1: int
    q0: int
    q1: int


def tile_schedule(
    L: int,
    S: int,
    *,
    block_size: int = 64,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
) -> list[Tile]:
    """The tiles :func:`flash_attention` computes, in order; hidden query blocks are left out.

    For every key tile the query rows are cut to whole blocks of ``block_size`` rows and only the
    span of blocks that can see at least one key of the tile is kept: with ``is_causal`` (top-left
    alignment) a block of rows ending before the tile starts sees nothing of it; with a mask, a
    block whose mask entries are all ``False`` (or ``-inf``) for the tile sees nothing of it.

    Shapes:
        attn_mask broadcasts to ``(..., L, S)``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    n_row_blocks = math.ceil(L / block_size)
    n_key_tiles = math.ceil(S / block_size)
    sees_tile = None
    if attn_mask is not None:
        keep = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
        while keep.dim() > 2:  # may row i see key j in any batch or head?
            keep = keep.any(0)
        padded = torch.zeros(L, n_key_tiles * block_size, dtype=torch.bool, device=keep.device)
        padded[:, :S] = keep  # broadcasts a (1, S) or (L, 1) mask to (L, S)
        sees_tile = padded.view(L, n_key_tiles, block_size).any(-1)  # (L, n_key_tiles)
    tiles = []
    for k0 in range(0, S, block_size):
        k1 = min(k0 + block_size, S)
        first, last = 0, n_row_blocks - 1  # row blocks that can see this tile
        if is_causal:
            first = max(first, k0 // block_size)  # row i sees key j only if j <= i
        if sees_tile is not None:
            rows = sees_tile[:, k0 // block_size].nonzero()
            if rows.numel() == 0:
                continue
            first = max(first, int(rows[0]) // block_size)
            last = min(last, int(rows[-1]) // block_size)
        if first > last or first * block_size >= L:
            continue
        tiles.append(Tile(k0, k1, first * block_size, min((last + 1) * block_size, L)))
    return tiles


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    block_size: int = 64,
) -> Tensor:
    """Tiled attention with an online softmax; same result as scaled dot-product attention.

    Args:
        query, key, value: as in :func:`mha.scaled_dot_product_attention`.
        attn_mask: bool keep-mask or float mask added to the scores, broadcasting to ``(..., L, S)``.
        is_causal: hide future keys, aligned top-left as in PyTorch. May be combined with a mask.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        block_size: keys per tile, and rows per query block when tiles are skipped.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``; returns ``(..., L, Dv)``.
        Extra memory is ``O(L · block_size)`` for one tile of scores plus ``O(L · Dv)`` for the state.

    Fully masked rows give zeros. Float16/bfloat16 inputs keep ``m``, ``l`` and ``acc`` in float32.
    """
    check_qkv(query, key, value)
    check_scale_and_dropout(scale)
    L, S = query.shape[-2], key.shape[-2]
    batch = query.shape[:-2]
    if attn_mask is not None:
        check_mask(attn_mask, (*batch, L, S))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    stat_dtype = torch.float32 if query.dtype in _LOW_PRECISION else query.dtype

    m = torch.full((*batch, L, 1), float("-inf"), dtype=stat_dtype, device=query.device)
    l = torch.zeros((*batch, L, 1), dtype=stat_dtype, device=query.device)
    acc = torch.zeros((*batch, L, value.shape[-1]), dtype=stat_dtype, device=query.device)

    schedule = tile_schedule(L, S, block_size=block_size, is_causal=is_causal, attn_mask=attn_mask)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*batch, L, S)  # a view (no memory) that slices like the scores
    for t in schedule:
        q = query[..., t.q0 : t.q1, :]  # (..., R, D) the rows that can see this tile
        k = key[..., t.k0 : t.k1, :] * scale  # (..., C, D): scaling a key tile is cheaper than the scores
        v = value[..., t.k0 : t.k1, :]  # (..., C, Dv)
        scores = (q @ k.transpose(-2, -1)).to(stat_dtype)  # (..., R, C)
        if is_causal and t.k1 - 1 > t.q0:
            # Only rows above k1 - 1 can see a future key of this tile: mask just those.
            n = min(t.k1 - 1 - t.q0, t.q1 - t.q0)
            rows = torch.arange(t.q0, t.q0 + n, device=query.device)[:, None]  # (n, 1)
            cols = torch.arange(t.k0, t.k1, device=query.device)[None, :]  # (1, C)
            scores[..., :n, :].masked_fill_(cols > rows, float("-inf"))
        if attn_mask is not None:
            tile_mask = attn_mask[..., t.q0 : t.q1, t.k0 : t.k1]  # (..., R, C)
            if tile_mask.dtype == torch.bool:
                scores.masked_fill_(~tile_mask, float("-inf"))
            else:
                scores += tile_mask
        if t.q0 == 0 and t.q1 == L:  # the tile updates every row: no need to write into slices
            m, l, acc = online_softmax_update(m, l, acc, scores, v)
        else:
            rows = slice(t.q0, t.q1)
            m[..., rows, :], l[..., rows, :], acc[..., rows, :] = online_softmax_update(
                m[..., rows, :], l[..., rows, :], acc[..., rows, :], scores, v
            )

    out = acc / torch.where(l == 0, torch.ones_like(l), l)  # rows that saw no key stay 0
    return out.to(value.dtype)
