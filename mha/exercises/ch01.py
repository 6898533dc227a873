"""Checkers for the exercises of chapter 1, "Queries, keys and values".

Every checker runs the learner's answer on fixed inputs, compares it with a reference built on
PyTorch's own operators (``torch.nn.functional.scaled_dot_product_attention``,
``torch.nn.MultiheadAttention``), and, when the answer is wrong, recognises the usual mistakes
(no 1/sqrt(d_k) scale, softmax over the wrong axis, a hard argmax instead of a softmax, the
inverse permutation ...) to give a hint aimed at the mistake actually made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._check import ExerciseError, check_close, passed

__all__ = [
    "check_head2_prediction",
    "check_lookup_weights",
    "check_permuted_outputs",
    "check_seed_head_fix",
]

# The seed's "猫 吃 鱼" example: three tokens with 2-dimensional embeddings, Q = K = V = X.
CAT_EATS_FISH = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # (L, E) = (3, 2)
HEAD_PROJECTIONS = (
    torch.diag(torch.tensor([1.0, 0.0])),  # W1: keeps the first coordinate
    torch.diag(torch.tensor([0.0, 1.0])),  # W2: keeps the second coordinate
    torch.eye(2),  # W3: keeps both
)


def _same(actual: object, candidate: Tensor, atol: float = 1e-4) -> bool:
    """True if ``actual`` is a tensor of ``candidate``'s shape with (nearly) its values."""
    if not isinstance(actual, Tensor) or actual.shape != candidate.shape:
        return False
    actual = actual.detach().to(candidate.dtype)
    return bool(torch.allclose(actual, candidate, atol=atol, rtol=1e-3))


def _diagnose(
    actual: object, expected: Tensor, wrong_answers: Sequence[tuple[Tensor, str]], what: str
) -> None:
    """Raise the hint of the first typical wrong answer that ``actual`` reproduces.

    A wrong answer that happens to coincide with ``expected`` on this input is skipped.
    """
    for candidate, hint in wrong_answers:
        if _same(candidate, expected):
            continue
        if _same(actual, candidate):
            raise ExerciseError(f"{what} is not right yet. {hint}")


def _call(fn: Callable, *args: object, what: str, hint: str) -> object:
    """Call the learner's function; turn a crash into an ExerciseError with a hint."""
    try:
        return fn(*args)
    except ExerciseError:
        raise
    except Exception as err:
        raise ExerciseError(f"{what} raised {type(err).__name__}: {err}. {hint}") from err


def _weights_reference(query: Tensor, key: Tensor) -> Tensor:
    """softmax(Q K^T / sqrt(D)) computed by torch's own SDPA (values = identity -> weights)."""
    S = key.shape[-2]
    eye = torch.eye(S, dtype=query.dtype).expand(*key.shape[:-2], S, S)  # (..., S, S)
    return F.scaled_dot_product_attention(query, key, eye)  # (..., L, S)


def _one_hot_argmax(scores: Tensor) -> Tensor:
    return F.one_hot(scores.argmax(dim=-1), scores.shape[-1]).to(scores.dtype)


# --------------------------------------------------------------------------------------------
# Exercise: attention weights (a soft lookup for a whole batch of queries)
# --------------------------------------------------------------------------------------------


def check_lookup_weights(fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    """Check ``fn(query, key) -> weights``, the weights of a soft lookup.

    Shapes:
        query: (..., L, D); key: (..., S, D); returned weights: (..., L, S), every row sums to 1.
    """
    g = torch.Generator().manual_seed(101)
    cases = [
        (2.0 * torch.randn(3, 4, generator=g), 2.0 * torch.randn(5, 4, generator=g)),  # L=3, S=5
        (torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 6, 8, generator=g)),  # B, H
    ]
    for query, key in cases:
        what = f"fn(query {tuple(query.shape)}, key {tuple(key.shape)})"
        weights = _call(
            fn,
            query.clone(),
            key.clone(),
            what=what,
            hint="Transpose the key with key.transpose(-2, -1) (not key.T) so that any leading "
            "batch dimensions stay where they are.",
        )
        D = query.shape[-1]
        scores = query @ key.transpose(-2, -1)  # (..., L, S)
        expected = _weights_reference(query, key)  # (..., L, S)
        _diagnose(
            weights,
            expected,
            [
                (
                    torch.softmax(scores, dim=-1),
                    (
                        "The scale is missing: divide the scores by sqrt(D), where "
                        "D = query.shape[-1] is the head dimension, before the softmax."
                    ),
                ),
                (
                    torch.softmax(scores / D, dim=-1),
                    "You divided the scores by D; the scale is 1/sqrt(D).",
                ),
                (
                    torch.softmax(scores / math.sqrt(D), dim=-2),
                    (
                        "The softmax runs over the wrong axis: each query (a row) distributes its "
                        "attention over the keys, so normalise over the last axis, dim=-1."
                    ),
                ),
                (
                    torch.softmax(scores, dim=-2),
                    (
                        "Two things: the softmax must run over the keys (dim=-1), and the scores "
                        "must be divided by sqrt(D) first."
                    ),
                ),
                (
                    scores / math.sqrt(D),
                    (
                        "These are the scaled scores, not weights yet: apply a softmax over the keys "
                        "(dim=-1) so that every row is positive and sums to 1."
                    ),
                ),
                (
                    scores,
                    "These are raw scores: divide by sqrt(D), then apply a softmax over dim=-1.",
                ),
                (
                    _one_hot_argmax(scores),
                    (
                        "This is a hard lookup (all the weight on the best key). Attention is soft: "
                        "the softmax gives every key a positive weight."
                    ),
                ),
            ],
            what,
        )
        check_close(
            weights,
            expected,
            what=what,
            hint="Expected softmax(query @ key^T / sqrt(D)) over the last axis; each row must be "
            "positive and sum to 1.",
        )
    passed("check_lookup_weights", "every query spreads a total weight of 1 over the keys")


# --------------------------------------------------------------------------------------------
# Exercise: spot the bug in the seed's head 1
# --------------------------------------------------------------------------------------------


def check_seed_head_fix(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> None:
    """Check ``fn(x, w_q, w_k, w_v) -> out``, one attention head with its own projections.

    Shapes:
        x: (L, E); w_q, w_k: (E, D); w_v: (E, Dv); out: (L, Dv).
    """
    g = torch.Generator().manual_seed(102)
    W1 = HEAD_PROJECTIONS[0]
    cases = [
        (CAT_EATS_FISH, W1, W1, W1),  # the seed's head 1
        (  # L=4, E=6, D=2, Dv=3: separates sqrt(D) from sqrt(E) and w_q from w_k / w_v
            torch.randn(4, 6, generator=g),
            1.5 * torch.randn(6, 2, generator=g),
            1.5 * torch.randn(6, 2, generator=g),
            torch.randn(6, 3, generator=g),
        ),
    ]
    for x, w_q, w_k, w_v in cases:
        what = f"fn(x {tuple(x.shape)}, w_q {tuple(w_q.shape)}, ...)"
        out = _call(
            fn,
            x.clone(),
            w_q.clone(),
            w_k.clone(),
            w_v.clone(),
            what=what,
            hint="q, k and v are x @ w_q, x @ w_k and x @ w_v; the scores are q @ k.T.",
        )
        q, k, v = x @ w_q, x @ w_k, x @ w_v  # (L, D), (L, D), (L, Dv)
        scores = q @ k.T  # (L, L)
        D, E = w_q.shape[1], x.shape[1]
        expected = F.scaled_dot_product_attention(q, k, v)  # (L, Dv), torch's own operator
        _diagnose(
            out,
            expected,
            [
                (
                    scores @ v,
                    (
                        "This is still the seed's computation, scores @ v: the 1/sqrt(d_k) scale "
                        "and the softmax are both missing."
                    ),
                ),
                (
                    torch.softmax(scores, dim=-1) @ v,
                    (
                        "The softmax is there, but the scale is not: divide the scores by "
                        "sqrt(d_k), where d_k = w_q.shape[1] is the head dimension."
                    ),
                ),
                (
                    scores / math.sqrt(D) @ v,
                    (
                        "The scale is there, but the softmax is not: the weights must be "
                        "softmax(scores / sqrt(d_k)) over the keys (dim=-1)."
                    ),
                ),
                (
                    _one_hot_argmax(scores) @ v,
                    (
                        "This is a hard argmax. Softmax is soft: every key keeps a positive weight, "
                        "and a row of equal scores gets equal weights."
                    ),
                ),
                (
                    torch.softmax(scores / math.sqrt(D), dim=0) @ v,
                    (
                        "The softmax runs over the wrong axis: normalise each row (one query) over "
                        "the keys, dim=-1."
                    ),
                ),
                (
                    torch.softmax(scores / math.sqrt(E), dim=-1) @ v,
                    (
                        "d_k is the head dimension (w_q.shape[1]), not the model width "
                        "E = x.shape[1]: scale by 1/sqrt(w_q.shape[1])."
                    ),
                ),
                (
                    torch.softmax((x @ w_q) @ (x @ w_q).T / math.sqrt(D), dim=-1) @ (x @ w_q),
                    (
                        "Each of q, k, v has its own projection: k = x @ w_k and v = x @ w_v. "
                        "(In the seed's example all three are equal, so this bug hides there.)"
                    ),
                ),
            ],
            what,
        )
        check_close(
            out,
            expected,
            what=what,
            hint="Expected softmax(q @ k.T / sqrt(d_k), dim=-1) @ v with q, k, v = x @ w_q, "
            "x @ w_k, x @ w_v.",
        )
    passed("check_seed_head_fix", "head 1 of 猫 吃 鱼 is [[0.50, 0], [0.33, 0], [0.33, 0]]")


# --------------------------------------------------------------------------------------------
# Exercise: predict head 2 of "猫 吃 鱼" by hand
# --------------------------------------------------------------------------------------------


def _head(x: Tensor, w: Tensor, *, scale: float | None = None) -> Tensor:
    q = x @ w  # (L, D); Q = K = V in the seed's example
    return F.scaled_dot_product_attention(q, q, q, scale=scale)  # (L, D)


def check_head2_prediction(answer: object) -> None:
    """Check a hand-computed head 2 of the seed's example (rounded to two decimals is fine).

    Shapes:
        answer: (L, D) = (3, 2), a nested list or a tensor.
    """
    try:
        predicted = torch.as_tensor(answer, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ExerciseError(
            f"Write the prediction as a 3x2 nested list of numbers, e.g. [[a, b], [c, d], [e, f]] "
            f"({type(err).__name__}: {err})."
        ) from None
    x, (W1, W2, _) = CAT_EATS_FISH, HEAD_PROJECTIONS
    expected = _head(x, W2)  # (3, 2)
    if predicted.shape != expected.shape:
        raise ExerciseError(
            f"The prediction has shape {tuple(predicted.shape)}; head 2 has one row per token "
            f"(L = 3) and D = 2 columns, shape (3, 2)."
        )
    tol = 0.01  # two decimals are enough
    wrong_answers = [
        (
            (x @ W2) @ (x @ W2).T @ (x @ W2),
            (
                "That is the seed's recipe, scores @ V2 (here equal to V2 itself): the scale and the "
                "softmax are missing. Softmax is soft, so no weight is 0, and a row of equal scores "
                "gets weights 1/3 each."
            ),
        ),
        (
            _head(x, W2, scale=1.0),
            (
                "Close, but the scores were not scaled: divide them by sqrt(d_k) = sqrt(2) before "
                "the softmax (e^1 / (e^1 + 2) = 0.58 becomes e^0.71 / (e^0.71 + 2) = 0.50)."
            ),
        ),
        (
            expected * torch.tensor([[0.0], [1.0], [0.0]]),
            (
                "Tokens 猫 and 鱼 see three equal scores (all 0), so their weights are uniform, "
                "1/3 each, and their output is the mean of the rows of V2, not zero."
            ),
        ),
        (
            _head(x, W1),
            "That is head 1. Head 2 keeps the second coordinate (W2 = diag(0, 1)).",
        ),
        (
            _head(x, W2).flip(-1),
            "The columns are swapped: W2 = diag(0, 1) zeroes the first coordinate.",
        ),
    ]
    for candidate, hint in wrong_answers:
        if torch.allclose(predicted, candidate, atol=tol):
            raise ExerciseError(f"Your prediction is not right yet. {hint}")
    if not torch.allclose(predicted, expected, atol=tol):
        raise ExerciseError(
            f"Your prediction {[[round(v, 2) for v in row] for row in predicted.tolist()]} is "
            "not head 2. Per row: the scores are q_i . k_j / sqrt(2), the weights their softmax "
            "over j, the output the weighted sum of the rows of V2 = X @ W2."
        )
    passed("check_head2_prediction", "row 1 (吃) ≈ [0, 0.50], rows 0 and 2 = [0, 1/3]")


# --------------------------------------------------------------------------------------------
# Exercise: predict the outputs of a permuted sentence
# --------------------------------------------------------------------------------------------


def _torch_mha(E: int, H: int, g: torch.Generator) -> torch.nn.MultiheadAttention:
    """torch's own multi-head attention with weights drawn from ``g`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):  # the constructor's own init draws from the global RNG
        layer = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return layer.eval()


def check_permuted_outputs(fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    """Check ``fn(out, perm) -> out_perm``: predict self-attention's outputs for ``x[perm]``.

    ``out`` is the output of a multi-head self-attention layer (torch's ``nn.MultiheadAttention``,
    no positional encoding) for the tokens ``x``; the function must return the layer's output for
    the reordered tokens ``x[perm]`` without running the layer.

    Shapes:
        out: (L, E); perm: (L,) long; returned: (L, E).
    """
    g = torch.Generator().manual_seed(104)
    L, E, H = 5, 8, 2
    layer = _torch_mha(E, H, g)
    x = torch.randn(1, L, E, generator=g)  # (B, L, E)
    with torch.no_grad():
        out = layer(x, x, x, need_weights=False)[0][0]  # (L, E)
    for perm in (torch.tensor([2, 0, 3, 4, 1]), torch.tensor([4, 3, 2, 1, 0])):
        x_perm = x[:, perm]  # (1, L, E): token i of the new sentence is old token perm[i]
        with torch.no_grad():
            expected = layer(x_perm, x_perm, x_perm, need_weights=False)[0][0]  # (L, E)
        what = f"fn(out, perm={perm.tolist()})"
        predicted = _call(
            fn, out.clone(), perm.clone(), what=what, hint="Index the rows of out with perm."
        )
        inverse = torch.argsort(perm)
        wrong_answers = [
            (
                out,
                (
                    "The outputs do not stay in place: each token's output travels with the token, "
                    "so the rows of out must be reordered like the tokens."
                ),
            ),
        ]
        if not torch.equal(inverse, perm):
            wrong_answers.append(
                (
                    out[inverse],
                    (
                        "That is the inverse permutation. In x[perm], row i is old row perm[i], "
                        "so the new output row i is out[perm[i]]."
                    ),
                )
            )
        _diagnose(predicted, expected, wrong_answers, what)
        check_close(
            predicted,
            expected,
            what=what,
            hint="Self-attention without positions is permutation-equivariant: "
            "attention(x[perm]) = attention(x)[perm].",
            atol=1e-5,
        )
    passed("check_permuted_outputs", "reorder the tokens and the outputs reorder the same way")
