"""FlashAttention in plain PyTorch: online softmax over key/value tiles, forward and backward.

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

Extra memory is ``O(L · block_size)`` for one tile of scores plus ``O(L · Dv)`` for the state.
Fully masked rows give zeros. Float16/bfloat16 inputs are computed in float32 (scores, ``m``,
``l``, ``acc``) and the output is rounded to the input dtype once, at the end.

The backward pass keeps no weights either: the forward pass saves one number per row, the
logsumexp ``lse = m + log(l)``, from which :func:`flash_attention_backward` rebuilds any tile of
the weights exactly, ``P = exp(scores - lse)``, on the same tiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

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


BLOCK_SIZE = 128  # keys per tile, and query rows per block, unless told otherwise
QUERY_BLOCKS_PER_STEP = 4  # a step of the loop serves 4 blocks of query rows (see tile_schedule)


def visible_blocks(attn_mask: Tensor, L: int, S: int, block_size: int) -> Tensor:
    """``visible[r, c]``: may some row of block ``r`` see some key of tile ``c`` (in any batch)?

    Shapes:
        attn_mask broadcasts to ``(..., L, S)``; returns bool ``(ceil(L / b), ceil(S / b))``.
    """
    keep = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
    while keep.dim() > 2:  # may row i see key j in any batch or head?
        keep = keep.any(0)
    n_rows, n_keys = math.ceil(L / block_size), math.ceil(S / block_size)
    padded = torch.zeros(
        n_rows * block_size, n_keys * block_size, dtype=torch.bool, device=keep.device
    )
    padded[:L, :S] = keep  # broadcasts a (1, S) or (L, 1) mask to (L, S)
    return padded.view(n_rows, block_size, n_keys, block_size).any(3).any(1)


def tile_schedule(
    L: int,
    S: int,
    *,
    block_size: int = BLOCK_SIZE,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
) -> list[Tile]:
    """The tiles :func:`flash_attention` computes, in order; hidden ones are left out.

    Each :class:`Tile` is a span of key columns and the query rows it updates. With
    ``is_causal`` (top-left alignment) or with a mask (``False`` or ``-inf`` entries hidden), a
    tile that no row of a block of ``block_size`` rows can see is not computed for that block.

    Shapes:
        attn_mask broadcasts to ``(..., L, S)``.
    """
    L, S = validate.non_negative_int("L", L), validate.non_negative_int("S", S)
    block_size = validate.positive_int("block_size", block_size)
    validate.flag("is_causal", is_causal)
    return _tile_schedule(L, S, block_size, is_causal, attn_mask)


def _tile_schedule(
    L: int, S: int, block_size: int, is_causal: bool, attn_mask: Tensor | None
) -> list[Tile]:
    """:func:`tile_schedule` on checked arguments.

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
    n_blocks = math.ceil(L / block_size)
    # one transfer to the host, not one per tile
    visible = None if attn_mask is None else visible_blocks(attn_mask, L, S, block_size).tolist()
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


def _group_heads(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, groups: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Grouped-query attention without copies: (..., Hkv, G, L, D) queries against
    (..., Hkv, 1, S, D) keys and values; a mask ``(..., H, L, S)`` is grouped like the queries."""
    query = query.unflatten(-3, (key.shape[-3], groups))
    if attn_mask is not None:
        attn_mask = attn_mask.unflatten(-3, (key.shape[-3], groups))
    return query, key.unsqueeze(-3), value.unsqueeze(-3), attn_mask


def _empty_state(query: Tensor, dv: int) -> tuple[Tensor, Tensor, Tensor]:
    """The running ``(m, l, acc)`` before any key: ``-inf``, 0 and 0, one row per query row."""
    rows, dtype, device = query.shape[:-1], query.dtype, query.device
    m = torch.full((*rows, 1), float("-inf"), dtype=dtype, device=device)
    l = torch.zeros((*rows, 1), dtype=dtype, device=device)
    return m, l, torch.zeros((*rows, dv), dtype=dtype, device=device)


@overload
def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    enable_gqa: bool = False,
    return_lse: Literal[False] = False,
) -> Tensor: ...


@overload
def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    enable_gqa: bool = False,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Tiled attention with an online softmax; same result as scaled dot-product attention.

    Differentiable: the backward pass rebuilds each tile from the saved logsumexp (see
    :func:`flash_attention_backward`) instead of keeping an ``(L, S)`` matrix of weights.

    Args:
        query, key, value: as in :func:`mha.scaled_dot_product_attention`.
        attn_mask: bool keep-mask or float mask added to the scores (it gets no gradient).
        is_causal: hide future keys, top-left as in PyTorch; may be combined with a mask.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        block_size: keys per tile, and rows per query block when tiles are skipped.
        enable_gqa: key/value may have fewer heads; a tile is read once for its query group.
        return_lse: also return the logsumexp of each row's scaled, masked scores.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``, attn_mask broadcasting
        to ``(..., L, S)``; returns ``(..., L, Dv)``, and with ``return_lse`` also ``(..., L)``
        (float32, or float64 for float64 inputs; ``-inf`` for a row that sees no key).
    """
    groups, scale = check_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    block_size = validate.positive_int("block_size", block_size)
    validate.flag("return_lse", return_lse)
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError(
            "flash_attention does not compute a gradient for attn_mask; pass attn_mask.detach() "
            f"(attn_mask {tuple(attn_mask.shape)} requires grad)"
        )
    out, lse = _flash_attention(query, key, value, attn_mask, is_causal, scale, block_size, groups)
    return (out, lse) if return_lse else out


def _flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    block_size: int = BLOCK_SIZE,
    groups: int = 1,
) -> tuple[Tensor, Tensor]:
    """:func:`flash_attention` on checked arguments: ``(out, lse)``, differentiable in query,
    key and value (through :class:`_FlashAttention` when one of them requires grad)."""
    args = (query, key, value, attn_mask, is_causal)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        return _FlashAttention.apply(*args, scale, block_size, groups)
    return flash_attention_forward(*args, scale=scale, block_size=block_size, groups=groups)


class _FlashAttention(torch.autograd.Function):
    """Saves query, key, value, out and lse (no ``(L, S)`` tensor); recomputes tiles backward."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, block_size, groups):  # type: ignore[override]
        options = {"scale": scale, "block_size": block_size, "groups": groups}
        out, lse = flash_attention_forward(query, key, value, attn_mask, is_causal, **options)
        # The mask is an input (saving it costs no memory); saved, an in-place change to it
        # between the passes is an error instead of a silently different backward pass.
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.is_causal, ctx.options = is_causal, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable: say so, do not guess
    def backward(ctx, grad_out, _grad_lse):  # type: ignore[override]
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(
            grad_out, query, key, value, out, lse, attn_mask, ctx.is_causal, **ctx.options
        )
        return dq, dk, dv, None, None, None, None, None


def _tile_scores(
    query: Tensor, key: Tensor, t: Tile, attn_mask: Tensor | None, future: Tensor | None
) -> Tensor:
    """Scores of tile ``t`` (queries already scaled), with the causal diagonal and the mask."""
    rows = slice(t.q0, t.q1)
    scores = query[..., rows, :] @ key[..., t.k0 : t.k1, :].transpose(-2, -1)  # (..., R, C)
    if future is not None and t.k0 == t.q0:  # diagonal tile: row q0 + i hides key k0 + j, j > i
        n = min(t.k1, t.q1) - t.q0
        scores[..., :n, :].masked_fill_(future[:n, : t.k1 - t.k0], float("-inf"))
    if attn_mask is not None:
        tile_mask = attn_mask[..., rows, t.k0 : t.k1]  # (..., R, C)
        if tile_mask.dtype == torch.bool:
            scores.masked_fill_(~tile_mask, float("-inf"))
        else:
            scores += tile_mask
    return scores


def flash_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    *,
    scale: float,
    block_size: int,
    groups: int = 1,
) -> tuple[Tensor, Tensor]:
    """The tile loop of :func:`flash_attention` on checked arguments: returns ``(out, lse)``.

    ``lse`` is the logsumexp of each row's scaled, masked scores, ``m + log(l)`` (``-inf`` for a
    row that sees no key): all the backward pass needs to rebuild any tile of the weights.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``; returns out
        ``(..., L, Dv)`` in the input dtype and lse ``(..., L)`` in the compute dtype.
    """
    L, S = query.shape[-2], key.shape[-2]
    batch = query.shape[:-2]
    schedule = _tile_schedule(L, S, block_size, is_causal, attn_mask)
    dtype = query.dtype
    compute = torch.float32 if dtype in validate.LOW_PRECISION else dtype
    query = query.to(compute) * scale  # (..., L, D): scaling L·D numbers once, not every tile
    key, value = key.to(compute), value.to(compute)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*batch, L, S)  # a view (no memory) that slices like the scores
    if groups > 1:
        query, key, value, attn_mask = _group_heads(query, key, value, attn_mask, groups)
    m, l, acc = _empty_state(query, value.shape[-1])  # (..., L, 1), (..., L, 1), (..., L, Dv)
    future = _future(block_size, query.device) if is_causal else None
    for t in schedule:
        scores = _tile_scores(query, key, t, attn_mask, future)  # (..., R, C)
        v = value[..., t.k0 : t.k1, :]  # (..., C, Dv)
        rows = slice(t.q0, t.q1)  # views of this tile's rows: the update writes into the state
        online_softmax_update(m[..., rows, :], l[..., rows, :], acc[..., rows, :], scores, v)

    out = acc / torch.where(l == 0, 1.0, l)  # rows that saw no key stay 0
    lse = torch.where(l == 0, float("-inf"), m + l.log())  # (..., L, 1)
    # Dv named, not -1: with L = 0 the empty tensor could have any last dim
    return out.reshape(*batch, L, value.shape[-1]).to(dtype), lse.reshape(*batch, L)


def _future(block_size: int, device: torch.device) -> Tensor:
    """``future[i, j]``: in a diagonal tile, key ``j`` comes after row ``i`` (``j > i``)."""
    return torch.ones(block_size, block_size, dtype=torch.bool, device=device).triu(1)


def flash_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    *,
    scale: float,
    block_size: int,
    groups: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients with respect to query, key and value, rebuilding each tile from ``lse``.

    The same tiles as the forward pass (hidden ones skipped), each recomputed:
    ``P = exp(scores - lse)``, then ``dV += Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ - δ)`` with
    ``δ = rowsum(dO ∘ O)``, ``dQ += dS·K·scale`` and ``dK += dSᵀ·Q·scale``.

    Shapes:
        grad_out and out ``(..., L, Dv)``, lse ``(..., L)``, the rest as in the forward pass;
        returns ``(dq, dk, dv)`` shaped like query, key and value.
    """
    L, S = query.shape[-2], key.shape[-2]
    batch = query.shape[:-2]
    schedule = _tile_schedule(L, S, block_size, is_causal, attn_mask)
    compute = torch.float32 if query.dtype in validate.LOW_PRECISION else query.dtype
    q = query.to(compute) * scale  # (..., L, D) scaled once, as in the forward pass
    k, v, d_out = key.to(compute), value.to(compute), grad_out.to(compute)
    delta = (d_out * out.to(compute)).sum(-1, keepdim=True)  # (..., L, 1) δ = rowsum(dO ∘ O)
    # A row that saw no key has lse = -inf and only -inf scores: shifting it by 0 gives weights
    # exp(-inf) = 0, and zero gradients, instead of exp(-inf + inf) = NaN.
    lse = torch.where(torch.isneginf(lse), 0.0, lse).to(compute).unsqueeze(-1)  # (..., L, 1)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*batch, L, S)
    if groups > 1:  # (..., Hkv, G, L, ·) against (..., Hkv, 1, S, ·), as in the forward pass
        q, k, v, attn_mask = _group_heads(q, k, v, attn_mask, groups)
        d_out, delta, lse = (x.unflatten(-3, (key.shape[-3], groups)) for x in (d_out, delta, lse))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    future = _future(block_size, q.device) if is_causal else None
    for t in schedule:
        rows, cols = slice(t.q0, t.q1), slice(t.k0, t.k1)
        p = (_tile_scores(q, k, t, attn_mask, future) - lse[..., rows, :]).exp_()  # (..., R, C)
        d_rows = d_out[..., rows, :]  # (..., R, Dv)
        ds = p * (d_rows @ v[..., cols, :].transpose(-2, -1) - delta[..., rows, :])  # (..., R, C)
        dq[..., rows, :] += ds @ k[..., cols, :] * scale  # (..., R, D)
        dv_tile = p.transpose(-2, -1) @ d_rows  # (..., [G,] C, Dv)
        dk_tile = ds.transpose(-2, -1) @ q[..., rows, :]  # (..., [G,] C, D); q holds the scale
        if groups > 1:  # the query heads of a group all add to their shared key/value head
            dv_tile, dk_tile = dv_tile.sum(-3, keepdim=True), dk_tile.sum(-3, keepdim=True)
        dv[..., cols, :] += dv_tile
        dk[..., cols, :] += dk_tile
    if groups > 1:
        dq, dk, dv = dq.flatten(-4, -3), dk.squeeze(-3), dv.squeeze(-3)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
