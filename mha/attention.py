"""Scaled dot-product attention, the readable reference implementation.

``softmax(Q Kᵀ · scale + mask) V`` written out step by step. Its signature mirrors
``torch.nn.functional.scaled_dot_product_attention`` so both can be called with the same keywords.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(query: object, key: object, value: object) -> None:
    """Raise ``TypeError``/``ValueError`` unless query, key and value fit together.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)`` with the same leading
        dims: batch dims are never broadcast silently.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., length, dim), got shape {_shape(t)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device} and {value.device}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same head dim, got query {_shape(query)} and key {_shape(key)}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S, got key {_shape(key)} and value {_shape(value)}"
        )
    if not (query.shape[:-2] == key.shape[:-2] == value.shape[:-2]):
        raise ValueError(
            "query, key and value must have the same leading (batch) dims, got "
            f"query {_shape(query)}, key {_shape(key)} and value {_shape(value)}"
        )


def check_mask(attn_mask: object, target: tuple[int, ...]) -> None:
    """Raise unless ``attn_mask`` is a bool or float tensor that broadcasts to ``target``.

    ``target`` is the shape of the scores, ``(..., L, S)``. The mask may have fewer dims and size-1
    dims, but it may never *grow* the scores (that would be a silent broadcast of the batch).
    """
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating (added to the scores), "
            f"got dtype {attn_mask.dtype}"
        )
    shape = _shape(attn_mask)
    fits = len(shape) <= len(target) and all(
        m in (1, t) for m, t in zip(reversed(shape), reversed(target))
    )
    if not fits:
        raise ValueError(f"attn_mask of shape {shape} is not broadcastable to the scores {target}")


def check_scale_and_dropout(scale: object, dropout_p: object = 0.0) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax that gives zeros (not NaN) for rows that are all ``-inf``.

    Subtracting the row maximum leaves the result unchanged (the factor ``exp(-max)`` cancels) but
    keeps every exponent ``<= 0``, so nothing overflows. A row whose entries are all ``-inf`` (a
    query that may attend to no key) has no finite maximum; we shift it by 0 instead, which makes
    every ``exp`` exactly 0, and return 0 for that row in the forward *and* backward pass.
    """
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
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention written out step by step: scores, masks, stable softmax, weighted sum.

    Args:
        query: what each position is looking for.
        key: what each position offers to be matched against.
        value: what each position hands over when it is attended to.
        attn_mask: a bool keep-mask (``True`` = may attend) or a float mask added to the scores
            (``-inf`` hides a key, other values bias it); broadcasts to ``(..., L, S)``.
        dropout_p: probability of zeroing an attention weight (applied whenever ``> 0``, like
            torch's functional form; pass 0 at evaluation time).
        is_causal: hide future keys, aligned top-left as in PyTorch (query ``i`` sees keys
            ``0..i``). May be combined with ``attn_mask``.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        return_weights: also return the attention weights.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)`` with the same leading
        dims; returns ``(..., L, Dv)``, and with ``return_weights`` also weights ``(..., L, S)``.

    A query row whose keys are all masked gets zero weights and a zero output, never NaN, in the
    forward and backward pass. Float16/bfloat16 scores are upcast to float32 for the softmax.
    """
    check_qkv(query, key, value)
    check_scale_and_dropout(scale, dropout_p)
    L, S = query.shape[-2], key.shape[-2]
    scores_shape = (*query.shape[:-2], L, S)
    if attn_mask is not None:
        check_mask(attn_mask, scores_shape)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    scores = query @ key.transpose(-2, -1)  # (..., L, S)
    if scores.dtype in _LOW_PRECISION:
        scores = scores.float()  # softmax statistics in float32
    scores = scores * scale

    masked = attn_mask is not None or is_causal
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()  # (L, S)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))  # broadcasts to (..., L, S)
        else:
            scores = scores + attn_mask

    # Without a mask no row can be all -inf, so torch's fused softmax (which also subtracts the
    # row max) is the whole story; with a mask we need the version that is safe for empty rows.
    weights = softmax(scores, dim=-1) if masked else torch.softmax(scores, dim=-1)  # (..., L, S)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    weights = weights.to(value.dtype)
    out = weights @ value  # (..., L, Dv)
    return (out, weights) if return_weights else out
