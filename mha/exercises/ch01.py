"""Chapter 1, "Queries, keys and values": the exercises as data for :mod:`._harness`.

References: torch's ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``; mistakes: the
seed's (no 1/√d_k, a hard argmax) and the usual slips (wrong axis, one projection, inverse order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._harness import Case, Exercise, ExerciseError, Mistake

# The seed's "猫 吃 鱼" example: three tokens with 2-dimensional embeddings, Q = K = V = X.
CAT_EATS_FISH = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # (L, E) = (3, 2)
HEAD_PROJECTIONS = (
    torch.diag(torch.tensor([1.0, 0.0])),  # W1: keeps the first coordinate
    torch.diag(torch.tensor([0.0, 1.0])),  # W2: keeps the second coordinate
    torch.eye(2),  # W3: keeps both
)


def _scores(query: Tensor, key: Tensor) -> Tensor:
    return query @ key.transpose(-2, -1)  # (..., L, S)


def _hard(scores: Tensor, dim: int = -1) -> Tensor:
    """All the weight on the best key, the seed's "softmax": (..., L, S)."""
    return F.one_hot(scores.argmax(dim=-1), scores.shape[-1]).to(scores.dtype)


def _lookup_reference(query: Tensor, key: Tensor) -> Tensor:
    """softmax(Q K^T / sqrt(D)) by torch's SDPA: with identity values, out = weights."""
    S = key.shape[-2]
    eye = torch.eye(S, dtype=query.dtype).expand(*key.shape[:-2], S, S)  # (..., S, S)
    return F.scaled_dot_product_attention(query, key, eye)  # (..., L, S)


def _lookup_cases() -> list[Case]:
    g = torch.Generator().manual_seed(101)
    pairs = [
        (2.0 * torch.randn(3, 4, generator=g), 2.0 * torch.randn(5, 4, generator=g)),  # L=3, S=5
        (torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 6, 8, generator=g)),  # B, H
    ]
    return [Case(f"fn(query {tuple(q.shape)}, key {tuple(k.shape)})", (q, k)) for q, k in pairs]


LOOKUP_WEIGHTS = Exercise(
    "check_lookup_weights",
    "every query spreads a total weight of 1 over the keys",
    _lookup_reference,
    _lookup_cases,
    (
        Mistake(
            lambda q, k: torch.softmax(_scores(q, k), dim=-1),
            "The scale is missing: divide the scores by sqrt(D), where D = query.shape[-1] is "
            "the head dimension, before the softmax.",
        ),
        Mistake(
            lambda q, k: torch.softmax(_scores(q, k) / q.shape[-1], dim=-1),
            "You divided the scores by D; the scale is 1/sqrt(D).",
        ),
        Mistake(
            lambda q, k: torch.softmax(_scores(q, k) / math.sqrt(q.shape[-1]), dim=-2),
            "The softmax runs over the wrong axis: each query (a row) distributes its "
            "attention over the keys, so normalise over the last axis, dim=-1.",
        ),
        Mistake(
            lambda q, k: torch.softmax(_scores(q, k), dim=-2),
            "Two things: the softmax must run over the keys (dim=-1), and the scores must be "
            "divided by sqrt(D) first.",
        ),
        Mistake(
            lambda q, k: _scores(q, k) / math.sqrt(q.shape[-1]),
            "These are the scaled scores, not weights yet: apply a softmax over the keys "
            "(dim=-1) so that every row is positive and sums to 1.",
        ),
        Mistake(
            _scores, "These are raw scores: divide by sqrt(D), then apply a softmax over dim=-1."
        ),
        Mistake(
            lambda q, k: _hard(_scores(q, k)),
            "This is a hard lookup (all the weight on the best key). Attention is soft: the "
            "softmax gives every key a positive weight.",
        ),
    ),
    hint="Expected softmax(query @ key^T / sqrt(D)) over the last axis; each row must be "
    "positive and sum to 1.",
    crash_hint="Transpose the key with key.transpose(-2, -1) (not key.T) so that any leading "
    "batch dimensions stay where they are.",
    doc="Check ``fn(query (..., L, D), key (..., S, D)) -> weights (..., L, S)`` of a soft lookup.",
)


def _head(
    x: Tensor,
    w_q: Tensor,
    w_k: Tensor,
    w_v: Tensor,
    *,
    scale: float | None = None,
    dim: int = -1,
    weigh: Callable[[Tensor, int], Tensor] = torch.softmax,
) -> Tensor:
    """One head written out: right with the defaults, or with one of the seed's slips."""
    scale = 1 / math.sqrt(w_q.shape[1]) if scale is None else scale
    return weigh(_scores(x @ w_q, x @ w_k) * scale, dim) @ (x @ w_v)  # (L, Dv)


def _seed_head_cases() -> list[Case]:
    g = torch.Generator().manual_seed(102)
    x = torch.randn(4, 6, generator=g)  # L=4, E=6, D=2, Dv=3: sqrt(D) is not sqrt(E) ...
    w_q, w_k = (1.5 * torch.randn(6, 2, generator=g) for _ in range(2))  # ... nor w_q w_k
    W1 = HEAD_PROJECTIONS[0]
    cases = [(CAT_EATS_FISH, W1, W1, W1), (x, w_q, w_k, torch.randn(6, 3, generator=g))]
    return [Case(f"fn(x {tuple(c[0].shape)}, w_q {tuple(c[1].shape)}, ...)", c) for c in cases]


def _no_softmax(scores: Tensor, dim: int) -> Tensor:
    return scores


SEED_HEAD_FIX = Exercise(
    "check_seed_head_fix",
    "head 1 of 猫 吃 鱼 is [[0.50, 0], [0.33, 0], [0.33, 0]]",
    lambda x, w_q, w_k, w_v: F.scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v),
    _seed_head_cases,
    (
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, scale=1.0, weigh=_no_softmax),
            "This is still the seed's computation, scores @ v: the 1/sqrt(d_k) scale and the "
            "softmax are both missing.",
        ),
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, scale=1.0),
            "The softmax is there, but the scale is not: divide the scores by sqrt(d_k), "
            "where d_k = w_q.shape[1] is the head dimension.",
        ),
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, weigh=_no_softmax),
            "The scale is there, but the softmax is not: the weights must be "
            "softmax(scores / sqrt(d_k)) over the keys (dim=-1).",
        ),
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, weigh=_hard),
            "This is a hard argmax. Softmax is soft: every key keeps a positive weight, and a "
            "row of equal scores gets equal weights.",
        ),
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, dim=0),
            "The softmax runs over the wrong axis: normalise each row (one query) over the "
            "keys, dim=-1.",
        ),
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, scale=x.shape[1] ** -0.5),
            "d_k is the head dimension (w_q.shape[1]), not the model width E = x.shape[1]: "
            "scale by 1/sqrt(w_q.shape[1]).",
        ),
        Mistake(
            lambda x, w_q, w_k, w_v: _head(x, w_q, w_q, w_q),
            "Each of q, k, v has its own projection: k = x @ w_k and v = x @ w_v. (In the "
            "seed's example all three are equal, so this bug hides there.)",
        ),
    ),
    hint="Expected softmax(q @ k.T / sqrt(d_k), dim=-1) @ v with q, k, v = x @ w_q, x @ w_k, "
    "x @ w_v.",
    crash_hint="q, k and v are x @ w_q, x @ w_k and x @ w_v; the scores are q @ k.T.",
    doc="Check ``fn(x (L, E), w_q (E, D), w_k (E, D), w_v (E, Dv)) -> out (L, Dv)``, one head.",
)


def _as_matrix(answer: object) -> Tensor:
    try:
        return torch.as_tensor(answer, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ExerciseError(
            "Write the prediction as a 3x2 nested list of numbers, e.g. [[a, b], [c, d], [e, f]] "
            f"({type(err).__name__}: {err})."
        ) from None


def _seed_head(w: Tensor, **kwargs: Any) -> Tensor:
    """A head of the seed's example, where Q = K = V = X @ w: (3, 2)."""
    return _head(CAT_EATS_FISH, w, w, w, **kwargs)


HEAD2_PREDICTION = Exercise(
    "check_head2_prediction",
    "row 1 (吃) ≈ [0, 0.50], rows 0 and 2 = [0, 1/3]",
    lambda: F.scaled_dot_product_attention(*(CAT_EATS_FISH @ HEAD_PROJECTIONS[1],) * 3),
    mistakes=(
        Mistake(
            lambda truth: _seed_head(HEAD_PROJECTIONS[1], scale=1.0, weigh=_no_softmax),
            "That is the seed's recipe, scores @ V2 (here equal to V2 itself): the scale and "
            "the softmax are missing. Softmax is soft, so no weight is 0, and a row of equal "
            "scores gets weights 1/3 each.",
        ),
        Mistake(
            lambda truth: _seed_head(HEAD_PROJECTIONS[1], scale=1.0),
            "Close, but the scores were not scaled: divide them by sqrt(d_k) = sqrt(2) before "
            "the softmax (e^1 / (e^1 + 2) = 0.58 becomes e^0.71 / (e^0.71 + 2) = 0.50).",
        ),
        Mistake(
            lambda truth: truth * torch.tensor([[0.0], [1.0], [0.0]]),
            "Tokens 猫 and 鱼 see three equal scores (all 0), so their weights are uniform, "
            "1/3 each, and their output is the mean of the rows of V2, not zero.",
        ),
        Mistake(
            lambda truth: _seed_head(HEAD_PROJECTIONS[0]),
            "That is head 1. Head 2 keeps the second coordinate (W2 = diag(0, 1)).",
        ),
        Mistake(
            lambda truth: truth.flip(-1),
            "The columns are swapped: W2 = diag(0, 1) zeroes the first coordinate.",
        ),
    ),
    hint="That is not head 2. Per row: the scores are q_i . k_j / sqrt(2), the weights their "
    "softmax over j, the output the weighted sum of the rows of V2 = X @ W2.",
    atol=0.01,
    rtol=0.0,  # two decimals are enough
    prediction=True,
    convert=_as_matrix,
    params=("answer",),
    doc="Check a hand-computed head 2 (L, D) = (3, 2) of the seed's example, to two decimals.",
)


def _permuted_cases() -> list[Case]:
    """Outputs of torch's own nn.MultiheadAttention (no positions) for x and for x[perm]."""
    g = torch.Generator().manual_seed(104)
    with torch.random.fork_rng(devices=[]):  # the constructor's init draws from the global RNG
        layer = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()  # E=8, H=2
    x = torch.randn(1, 5, 8, generator=g)  # (B, L, E)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        out = layer(x, x, x, need_weights=False)[0][0]  # (L, E)
        return [  # token i of the new sentence is old token perm[i]
            Case(
                f"fn(out, perm={p.tolist()})",
                (out, p),
                expected=layer(x[:, p], x[:, p], x[:, p], need_weights=False)[0][0],
            )
            for p in (torch.tensor([2, 0, 3, 4, 1]), torch.tensor([4, 3, 2, 1, 0]))
        ]


PERMUTED_OUTPUTS = Exercise(
    "check_permuted_outputs",
    "reorder the tokens and the outputs reorder the same way",
    lambda out, perm: out[perm],
    _permuted_cases,
    (
        Mistake(
            lambda out, perm: out,
            "The outputs do not stay in place: each token's output travels with the token, so "
            "the rows of out must be reordered like the tokens.",
        ),
        Mistake(
            lambda out, perm: out[torch.argsort(perm)],
            "That is the inverse permutation. In x[perm], row i is old row perm[i], so the new "
            "output row i is out[perm[i]].",
        ),
    ),
    hint="Self-attention without positions is permutation-equivariant: "
    "attention(x[perm]) = attention(x)[perm].",
    crash_hint="Index the rows of out with perm.",
    doc="Check ``fn(out (L, E), perm (L,)) -> (L, E)``: the output of torch's "
    "``nn.MultiheadAttention`` (no positions) for ``x[perm]``, predicted from its output for x.",
)

EXERCISES = (LOOKUP_WEIGHTS, SEED_HEAD_FIX, HEAD2_PREDICTION, PERMUTED_OUTPUTS)
check_lookup_weights = LOOKUP_WEIGHTS.checker()
check_seed_head_fix = SEED_HEAD_FIX.checker()
check_head2_prediction = HEAD2_PREDICTION.checker()
check_permuted_outputs = PERMUTED_OUTPUTS.checker()
