"""Section 10.4, sparse attention: the exercises as data for :mod:`.._harness`.

References: the top-k keep-mask built by sorting each row's visible scores; the lightning
indexer's weighted sum of ReLU'd dot products with ``torch.einsum``; the (query, key) pairs of
dense and top-k causal attention, counted. Mistakes: future keys selectable, the lowest scores,
the wrong axis; the ReLU after the head sum, no ReLU, the weights ignored, a softmax; pairs of
non-causal attention, short rows given k keys, the diagonal forgotten; and ``mha.topk_keep_mask``
and ``mha.topk_sparse_attention``, which the first exercise bans.
"""

from __future__ import annotations

import torch
from torch import Tensor

import mha
from mha import sparse
from mha.models import deepseek_v32

from .._harness import Case, Exercise, defined_in, publish, randn64, whole

# --- the top-k keep-mask --------------------------------------------------------------------------


def _visible(L: int, S: int) -> Tensor:
    return torch.ones(L, S, dtype=torch.bool).tril()  # (L, S): key j <= query i


def _topk_keep_reference(index_scores: Tensor, topk: int) -> Tensor:
    """A key is kept if it is visible and scores at least the k-th best visible score of its row
    (random scores: no ties)."""
    L, S = index_scores.shape[-2:]
    ranked = index_scores.masked_fill(~_visible(L, S), float("-inf"))  # (..., L, S)
    k = min(topk, S)
    kth = ranked.sort(dim=-1, descending=True).values[..., k - 1 : k]  # (..., L, 1)
    return (ranked >= kth) & _visible(L, S)


def _topk_keep_cases() -> list[Case]:
    g = torch.Generator().manual_seed(104)
    shapes = (((6, 6), 2), ((2, 10, 10), 4), ((3, 1, 8, 8), 8), ((5, 9), 3), ((12, 12), 1))
    return [
        Case(f"topk_keep(index_scores {shape}, topk={k})", (randn64(g, *shape), k))
        for shape, k in shapes
    ]


def _topk_keep_by_loop(index_scores: Tensor, topk: int) -> Tensor:
    L, S = index_scores.shape[-2:]
    keep = torch.zeros(index_scores.shape, dtype=torch.bool)
    for i in range(L):
        row = index_scores[..., i, : min(i + 1, S)]  # (..., visible keys)
        idx = row.topk(min(topk, row.shape[-1]), dim=-1).indices
        keep[..., i, :].scatter_(-1, idx, True)
    return keep


def _topk_keep_by_scatter(index_scores: Tensor, topk: int) -> Tensor:
    L, S = index_scores.shape[-2:]
    ranked = index_scores.masked_fill(~_visible(L, S), float("-inf"))
    best, idx = ranked.topk(min(topk, S), dim=-1)
    return torch.zeros_like(ranked, dtype=torch.bool).scatter(-1, idx, best > float("-inf"))


def _topk_keep_slip(index_scores: Tensor, topk: int, *, causal=True, largest=True, dim=-1):
    L, S = index_scores.shape[-2:]
    ranked = index_scores
    if causal:
        ranked = ranked.masked_fill(~_visible(L, S), float("inf") if not largest else -torch.inf)
    k = min(topk, index_scores.shape[dim])
    idx = ranked.topk(k, dim=dim, largest=largest).indices
    keep = torch.zeros_like(ranked, dtype=torch.bool).scatter(dim, idx, True)
    return keep & _visible(L, S) if causal else keep


_HINT_KEEP = (
    "Hide the keys a query may not see (j > i) by giving them -inf, take each row's topk best "
    "(topk along the last dim, largest first) and keep those that are visible: a query that "
    "sees fewer than topk keys keeps them all."
)
_NO_SPARSE = "build the mask yourself, without mha.topk_keep_mask or mha.topk_sparse_attention."


def _topk_keep_by_private_helper(index_scores: Tensor, topk: int) -> Tensor:
    """mha.sparse's private _select, reached around topk_keep_mask; the mask scattered by hand."""
    idx, valid = sparse._select(index_scores, topk, True)
    return torch.zeros(index_scores.shape, dtype=torch.bool).scatter(-1, idx, valid)


TOPK_KEEP = Exercise(
    "check_topk_keep",
    "each query keeps its topk best visible keys, no future key",
    _topk_keep_reference,
    _topk_keep_cases,
    variants=(_topk_keep_by_loop, _topk_keep_by_scatter),
    mistakes=(
        (
            lambda s, k: _topk_keep_slip(s, k, causal=False),
            "Future keys were selected: a query may only choose among keys 0 … i. " + _HINT_KEEP,
        ),
        (
            lambda s, k: _topk_keep_slip(s, k, largest=False),
            "These are the lowest scores: keep the highest. " + _HINT_KEEP,
        ),
        (
            lambda s, k: _topk_keep_slip(s, k, dim=-2),
            "Each query (a row) chooses among the keys (the last dim), not each key among the "
            "queries. " + _HINT_KEEP,
        ),
        (
            lambda s, k: mha.topk_keep_mask(s, k),
            _NO_SPARSE,
        ),
        (_topk_keep_by_private_helper, _NO_SPARSE),
    ),
    hint=_HINT_KEEP,
    crash_hint="index_scores is (..., L, S) float; return a bool tensor of the same shape.",
    exact_dtype=True,
    forbidden=(*defined_in(sparse), *defined_in(deepseek_v32)),
    forbidden_hint=_NO_SPARSE,
    rewrites=(mha.topk_keep_mask,),
    params=("topk_keep",),
    doc="Check ``topk_keep(index_scores, topk) -> (..., L, S)`` bool, causal top-k selection.",
)

# --- the lightning indexer's scores ---------------------------------------------------------------


def _indexer_reference(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """``Σ_h w[b, i, h] · ReLU(q[b, i, h] · k[b, j])``."""
    return torch.einsum("bih,bihj->bij", w, torch.relu(torch.einsum("bihd,bjd->bihj", q, k)))


def _indexer_cases() -> list[Case]:
    g = torch.Generator().manual_seed(32)
    out = []
    for B, L, S, Hi, Di in ((1, 5, 5, 2, 4), (2, 3, 7, 4, 8), (2, 6, 6, 3, 16)):
        q, k, w = randn64(g, B, L, Hi, Di), randn64(g, B, S, Di), randn64(g, B, L, Hi)
        label = f"indexer_scores(q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)})"
        out.append(Case(label, (q, k, w)))
    return out


def _indexer_by_matmul(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    dots = q @ k.unsqueeze(1).transpose(-2, -1)  # (B, L, Hi, S)
    return (w.unsqueeze(-2) @ dots.clamp(min=0)).squeeze(-2)  # (B, L, S)


def _indexer_by_heads(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    total = torch.zeros(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype)  # (B, L, S)
    for h in range(q.shape[2]):
        dots = q[:, :, h] @ k.transpose(-2, -1)  # (B, L, S)
        total = total + w[:, :, h, None] * torch.nn.functional.relu(dots)
    return total


_HINT_INDEXER = (
    "For each query i and indexer head h, take the dot product q[b, i, h] · k[b, j] with every "
    "key, ReLU it, multiply by the head's weight w[b, i, h] and sum over the heads: (B, L, S)."
)

INDEXER_SCORES = Exercise(
    "check_indexer_scores",
    "a weighted sum over heads of ReLU(q · k), as DeepSeek-V3.2's lightning indexer",
    _indexer_reference,
    _indexer_cases,
    variants=(_indexer_by_matmul, _indexer_by_heads),
    mistakes=(
        (
            lambda q, k, w: torch.relu(torch.einsum("bih,bihd,bjd->bij", w, q, k)),
            "The ReLU applies to each head's dot product, before the weighted sum over the "
            "heads. " + _HINT_INDEXER,
        ),
        (
            lambda q, k, w: torch.einsum("bih,bihd,bjd->bij", w, q, k),
            "The ReLU is missing: each head's dot product is clipped at 0. " + _HINT_INDEXER,
        ),
        (
            lambda q, k, w: torch.relu(torch.einsum("bihd,bjd->bihj", q, k)).sum(2),
            "Each head counts by its weight w[b, i, h] (computed from the query token). "
            + _HINT_INDEXER,
        ),
        (
            lambda q, k, w: torch.einsum(
                "bih,bihj->bij", w, torch.einsum("bihd,bjd->bihj", q, k).softmax(-1)
            ),
            "The indexer uses no softmax: ReLU(q · k), which is cheap and keeps the scale of "
            "the scores. " + _HINT_INDEXER,
        ),
    ),
    hint=_HINT_INDEXER,
    crash_hint="q is (B, L, Hi, Di), k (B, S, Di) (one key per token, shared by the heads) and "
    "w (B, L, Hi); return (B, L, S).",
    rewrites=(),  # DeepSeek-V3.2's LightningIndexer scores from x and its weights, not from q, k, w
    params=("indexer_scores",),
    doc="Check ``indexer_scores(q, k, w) -> (B, L, S)``.",
)

# --- pairs computed by dense and top-k causal attention -------------------------------------------


def _pairs_reference(seq_len: int, topk: int) -> tuple[int, int]:
    """Query i sees i + 1 keys and keeps min(i + 1, topk) of them."""
    L = seq_len
    dense = L * (L + 1) // 2
    full = max(0, L - topk)  # queries i >= topk keep exactly topk
    return dense, full * topk + min(L, topk) * (min(L, topk) + 1) // 2


def _pairs_cases() -> list[Case]:
    calls = ((131072, 2048), (10, 3), (5, 8), (4096, 4096), (1, 1), (100000, 1))
    return [Case(f"attention_pairs({L}, {k})", (L, k)) for L, k in calls]


_HINT_PAIRS = (
    "Causal: query i (0 … seq_len-1) sees i + 1 keys, so dense attention scores "
    "seq_len·(seq_len + 1)/2 pairs; top-k keeps min(i + 1, topk) of them: sum that over i."
)

ATTENTION_PAIRS = Exercise(
    "check_attention_pairs",
    "(query, key) pairs of dense and top-k causal attention",
    _pairs_reference,
    _pairs_cases,
    variants=(
        lambda L, k: (sum(i + 1 for i in range(L)), sum(min(i + 1, k) for i in range(L))),
        lambda L, k: (
            L * (L + 1) // 2,
            L * (L + 1) // 2 - max(0, L - k) * (max(0, L - k) + 1) // 2,
        ),
    ),
    mistakes=(
        (
            lambda L, k: (L * (L + 1) // 2, L * k),
            "The first queries see fewer than topk keys and keep only those, min(i + 1, topk). "
            + _HINT_PAIRS,
        ),
        (
            lambda L, k: (L * L, L * min(k, L)),
            "The attention is causal: query i sees only i + 1 keys. " + _HINT_PAIRS,
        ),
        (
            lambda L, k: (L * (L - 1) // 2, sum(min(i, k) for i in range(L))),
            "A query also sees its own token: i + 1 keys, not i. " + _HINT_PAIRS,
        ),
    ),
    hint=_HINT_PAIRS,
    crash_hint="attention_pairs(seq_len, topk) returns two ints: (dense_pairs, sparse_pairs).",
    convert=whole,
    outputs=("dense", "sparse"),
    rewrites=(),  # arithmetic
    params=("attention_pairs",),
    doc="Check ``attention_pairs(seq_len, topk) -> (dense_pairs, sparse_pairs)``.",
)


EXERCISES = publish(globals())
