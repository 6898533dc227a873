"""Scaled dot-product attention, the readable reference implementation.

``softmax(Q Kᵀ · scale + mask) V`` written out step by step. Its signature mirrors
``torch.nn.functional.scaled_dot_product_attention`` so both can be called with the same keywords.

A query row whose keys are all masked gets zero weights and a zero output, never NaN, in the
forward and backward pass. Float16/bfloat16 inputs are computed in float32 (scores, softmax and
weighted sum) and the results rounded back to the input dtype once, at the end.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import validation as validate
from .masks import _causal_mask


def fold_groups(t: Tensor, groups: int) -> Tensor:
    """View the ``groups`` query heads that share one key/value head as one taller head.

    Grouped-query attention without copying keys: query head ``i`` reads key/value head
    ``i // groups``, so stacking each group's rows, ``(..., H, R, X) -> (..., H/groups,
    groups·R, X)``, lets one matmul per key/value head serve the whole group.
    """
    if groups == 1:
        return t
    *lead, H, R, X = t.shape
    return t.reshape(*lead, H // groups, groups * R, X)


def check_arguments(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: bool,
) -> tuple[int, float]:
    """Validate the arguments every attention function shares; return ``(groups, scale)``.

    ``groups`` is ``H // Hkv`` (1 without grouped-query attention); ``scale`` defaults to
    ``1/sqrt(D)``.
    """
    groups = validate.qkv(query, key, value, enable_gqa=validate.flag("enable_gqa", enable_gqa))
    validate.flag("is_causal", is_causal)
    scale = validate.scale(scale)
    if attn_mask is not None:
        validate.attn_mask(attn_mask, (*query.shape[:-1], key.shape[-2]))
    return groups, 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax that gives zeros (not NaN) for rows that are all ``-inf``.

    Subtracting the row maximum leaves the result unchanged (the factor ``exp(-max)`` cancels) but
    keeps every exponent ``<= 0``, so nothing overflows. A row whose entries are all ``-inf`` (a
    query that may attend to no key) has no finite maximum; we shift it by 0 instead, which makes
    every ``exp`` exactly 0, and return 0 for that row in the forward *and* backward pass.
    """
    if scores.shape[dim] == 0:  # rows without entries (no keys): amax has nothing to reduce
        return torch.softmax(scores, dim)
    row_max = scores.amax(dim, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max).detach()
    exp = torch.exp(scores - row_max)
    total = exp.sum(dim, keepdim=True)
    return exp / torch.where(total == 0, torch.ones_like(total), total)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    return_weights: bool = False,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention written out step by step: scores, masks, stable softmax, weighted sum.

    Args:
        query, key, value: what each position looks for, offers, and hands over when attended.
        attn_mask: bool keep-mask (``True`` = may attend) or float mask added to the scores
            (``-inf`` hides a key); broadcasts to ``(..., L, S)``.
        dropout_p: probability of zeroing a weight (whenever ``> 0``, like torch's function).
        is_causal: hide future keys, top-left (query ``i`` sees keys ``0..i``); may add to a mask.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        return_weights: also return the attention weights.
        enable_gqa: key/value may have fewer heads (dim -3); query head ``i`` reads head
            ``i // (H // Hkv)`` without copies.
        sinks: a learned logit per head (gpt-oss's "attention sink"): one more softmax column
            that takes probability mass and hands over no value, so a row's weights may sum to
            less than 1. ``None`` for plain attention.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)`` (with ``enable_gqa``
        key/value ``(..., Hkv, S, ·)``), sinks broadcasting to ``query.shape[:-2]`` (e.g.
        ``(H,)``); returns ``(..., L, Dv)`` [and weights ``(..., L, S)``, without the sink].
    """
    groups, scale = check_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    validate.probability("dropout_p", dropout_p)
    validate.flag("return_weights", return_weights)
    if sinks is not None:
        validate.sinks(sinks, validate.shape(query))
    return _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, groups, return_weights, sinks
    )


def _attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    groups: int = 1,
    return_weights: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The math of :func:`scaled_dot_product_attention`, on checked arguments.

    ``scale`` is a number here (the public function turns ``None`` into ``1/sqrt(D)``), and
    ``groups`` is the number of query heads that share one key/value head (``H // Hkv``; 1
    without grouped-query attention).

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``; returns
        ``(..., L, Dv)`` [and weights ``(..., L, S)``] in the input dtype.
    """
    L, S = query.shape[-2], key.shape[-2]
    scores_shape = (*query.shape[:-2], L, S)  # (..., L, S)
    dtype = query.dtype
    if dtype in validate.LOW_PRECISION:
        # Products of float16/bfloat16 numbers are exact in float32, and |q·k| may exceed float16's
        # range (65504) long before the softmax sees it: compute everything in float32.
        query, key, value = query.float(), key.float(), value.float()

    q = query * scale  # (..., L, D): scaling L·D numbers is cheaper than scaling L·S scores
    if groups > 1:  # grouped-query attention (chapter 5): G query heads share each key head,
        q = fold_groups(q, groups)  # so stack their rows, (..., Hkv, G·L, D): no key is copied
    scores = (q @ key.transpose(-2, -1)).view(scores_shape)  # (..., L, S)
    masked = attn_mask is not None or is_causal
    if is_causal and L and S:  # (L or S = 0: no score to hide, and the output is empty or 0)
        scores = scores.masked_fill(~_causal_mask(L, S, device=scores.device), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))  # broadcasts to (..., L, S)
        else:
            scores = scores + attn_mask
    # Without a mask no row can be all -inf, so torch's fused softmax (which also subtracts the
    # row max) is the whole story; with a mask we need the version that is safe for empty rows.
    if sinks is not None:  # the sink is one more key whose score is the learned logit
        sink = sinks.to(scores.dtype)[..., None, None].expand(*scores.shape[:-1], 1)  # (..., L, 1)
        scores = torch.cat([scores, sink], dim=-1)  # (..., L, S + 1)
    weights = softmax(scores, dim=-1) if masked else torch.softmax(scores, dim=-1)  # (..., L, S)
    if sinks is not None:
        weights = weights[..., :-1]  # (..., L, S): the sink's share hands over no value
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = fold_groups(weights, groups) @ value  # (..., L, Dv); (..., Hkv, G·L, Dv) with groups
    out = out.view(*query.shape[:-1], value.shape[-1]).to(dtype)  # (..., L, Dv)
    return (out, weights.to(dtype)) if return_weights else out
