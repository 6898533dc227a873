"""Top-k sparse attention: each query attends only to the keys an indexer ranks highest.

DeepSeek-V3.2's sparse attention (DSA) runs a cheap scorer, the *lightning indexer*, over every
(query, key) pair, keeps each query's ``topk`` best keys (2048 in V3.2), and runs full attention on
those alone. The result is ordinary softmax attention under a keep-mask that says "this key is
among the query's top k": :func:`topk_sparse_attention` equals SDPA with that mask. What it saves
comes from computing only the kept pairs: the selected keys and values are *gathered* (``topk``
per query) and scored, never the ``S`` of the whole context, which is what this implementation
does and what a kernel must do to profit (the keep-mask form still computes every score).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from . import validation as validate
from .attention import check_arguments, softmax
from .masks import _causal_mask


def topk_keep_mask(index_scores: Tensor, topk: int, *, is_causal: bool = True) -> Tensor:
    """The keep-mask of top-k selection: True where a key is among its query's ``topk`` best.

    Args:
        index_scores: the indexer's score of every (query, key) pair; higher is better.
        topk: keys kept per query (all of them where a query sees fewer).
        is_causal: only keys ``j <= i`` may be selected (top-left aligned, as in torch).

    Shapes:
        index_scores ``(..., L, S)`` -> ``(..., L, S)`` bool.
    """
    validate.tensor("index_scores", index_scores, floating=True)
    if index_scores.dim() < 2:
        raise ValueError(
            f"index_scores must have at least 2 dims (..., L, S), got shape "
            f"{validate.shape(index_scores)}"
        )
    topk = validate.positive_int("topk", topk)
    validate.flag("is_causal", is_causal)
    idx, valid = _select(index_scores, topk, is_causal)  # (..., L, k) each
    keep = torch.zeros(index_scores.shape, dtype=torch.bool, device=index_scores.device)
    return keep.scatter(-1, idx, valid)  # (..., L, S)


def _select(index_scores: Tensor, topk: int, is_causal: bool) -> tuple[Tensor, Tensor]:
    """Each query's ``min(topk, S)`` best keys and whether each is a real choice (a key the query
    may see: where fewer are visible, topk fills up with hidden ones, marked False).

    Shapes:
        index_scores ``(..., L, S)`` -> indices ``(..., L, k)`` int64, valid ``(..., L, k)`` bool.
    """
    L, S = index_scores.shape[-2:]
    ranked = index_scores.float()
    if is_causal and L and S:
        ranked = ranked.masked_fill(~_causal_mask(L, S, device=ranked.device), float("-inf"))
    best, idx = ranked.topk(min(topk, S), dim=-1)  # (..., L, k)
    return idx, best > float("-inf")


def topk_sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    index_scores: Tensor,
    topk: int,
    *,
    is_causal: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Attention in which each query sees only its ``topk`` keys with the highest index scores.

    Args:
        query, key, value: as in :func:`mha.scaled_dot_product_attention`.
        index_scores: the indexer's scores, broadcasting to ``(..., L, S)`` like a mask (e.g.
            ``(B, 1, L, S)``: one ranking shared by the heads, as DeepSeek's indexer gives). A key
            scored ``-inf`` is never selected.
        topk: keys attended per query; a query that may see fewer attends to all it may see.
        is_causal: a query ``i`` selects among keys ``0..i`` only (top-left aligned).
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)`` -> ``(..., L, Dv)``.
        Memory and FLOPs grow with ``L · topk``, not ``L · S``: the kept keys are gathered.
    """
    _, scale = check_arguments(query, key, value, None, is_causal, scale, False)
    validate.tensor("index_scores", index_scores, floating=True)
    L, S = query.shape[-2], key.shape[-2]
    target = (*query.shape[:-2], L, S)
    try:
        if torch.broadcast_shapes(index_scores.shape, target) != torch.Size(target):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"index_scores must broadcast to (..., L, S) = {target}, got shape "
            f"{validate.shape(index_scores)}"
        ) from None
    topk = validate.positive_int("topk", topk)
    if index_scores.device != query.device:
        raise ValueError(
            f"index_scores must be on the query's device {query.device}, got {index_scores.device}"
        )
    return _topk_sparse(query, key, value, index_scores, topk, is_causal, scale)


def _topk_sparse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    index_scores: Tensor,
    topk: int,
    is_causal: bool,
    scale: float,
) -> Tensor:
    """:func:`topk_sparse_attention` on checked arguments: select, gather, attend.

    Shapes:
        as :func:`topk_sparse_attention`; ``k = min(topk, S)`` keys per query.
    """
    ones = (1,) * (query.dim() - index_scores.dim())  # e.g. (L, S) scores for (B, H, L, D)
    index_scores = index_scores.view(*ones, *index_scores.shape)  # same number of dims as query
    idx, valid = _select(index_scores, topk, is_causal)  # (..., L, k): shared by broadcast dims
    dtype = query.dtype
    q = query.float() if dtype in validate.LOW_PRECISION else query
    *lead, L, k = idx.expand(*query.shape[:-2], -1, -1).shape  # the kept keys of every row
    S = key.shape[-2]
    rows = torch.arange(math.prod(lead), device=q.device).view(-1, 1, 1)  # (N, 1, 1)
    picks = idx.expand(*lead, L, k).reshape(-1, L, k)  # (N, L, k), N = prod(lead)
    k_sel = key.to(q.dtype).reshape(-1, S, key.shape[-1])[rows, picks]  # (N, L, k, D): gathered
    v_sel = value.to(q.dtype).reshape(-1, S, value.shape[-1])[rows, picks]  # (N, L, k, Dv)
    k_sel, v_sel = k_sel.view(*lead, L, k, -1), v_sel.view(*lead, L, k, -1)  # (..., L, k, ·)
    scores = (k_sel @ (q * scale).unsqueeze(-1)).squeeze(-1)  # (..., L, k): q · each kept key
    scores = scores.masked_fill(~valid, float("-inf"))  # hidden keys topk had to fill in
    weights = softmax(scores, dim=-1)  # (..., L, k); a row with no key gives zeros
    out = (weights.unsqueeze(-2) @ v_sel).squeeze(-2)  # (..., L, Dv)
    return cast(Tensor, out.to(dtype))
