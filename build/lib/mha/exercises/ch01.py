"""Chapter 1, "Queries, keys and values": the exercises as data for :mod:`._harness`, with the
seed's own mistakes (no 1/√d_k, a hard argmax) among the usual ones."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from ._harness import NO_SDPA, Case, Exercise, ExerciseError, attend, publish, tr

# The seed's "猫 吃 鱼" example: three tokens with 2-dimensional embeddings, Q = K = V = X.
CAT_EATS_FISH = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # (L, E) = (3, 2)
HEAD_PROJECTIONS = (
    torch.diag(torch.tensor([1.0, 0.0])),  # W1: keeps the first coordinate
    torch.diag(torch.tensor([0.0, 1.0])),  # W2: keeps the second coordinate
    torch.eye(2),  # W3: keeps both
)


def _hard(scores: Tensor, dim: int = -1) -> Tensor:
    """All the weight on the best key, the seed's "softmax": (..., L, S)."""
    return F.one_hot(scores.argmax(dim=-1), scores.shape[-1]).to(scores.dtype)


def _no_softmax(scores: Tensor, dim: int) -> Tensor:
    return scores


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


_SQRT_D = "divide the scores by sqrt(D), D = query.shape[-1]"
_ROWS = "Each query (a row) spreads its weight over the keys: softmax over dim=-1."
_HARD = "This is a hard lookup; softmax gives every key a positive weight."
_SCALED = "These are scaled scores, not weights: apply a softmax over dim=-1."
_NO_READY_MADE = "compute the weights yourself, without a ready-made attention."
LOOKUP_WEIGHTS = Exercise(
    "check_lookup_weights",
    "every query spreads a total weight of 1 over the keys",
    _lookup_reference,
    _lookup_cases,
    variants=(
        attend,
        lambda q, k: (q @ k.mT * q.shape[-1] ** -0.5).softmax(-1),
        lambda q, k: (
            torch.einsum("...ld,...sd->...ls", q.double(), k.double())
            .div(math.sqrt(q.shape[-1]))
            .softmax(-1)
        ),
    ),
    mistakes=(
        (partial(attend, scale=1.0), f"The scale is missing: {_SQRT_D}."),
        (
            lambda q, k: attend(q, k, scale=1 / q.shape[-1]),
            "You divided by D; the scale is 1/sqrt(D).",
        ),
        (partial(attend, dim=-2), _ROWS),
        (partial(attend, scale=1.0, dim=-2), f"Softmax over the keys (dim=-1), and {_SQRT_D}."),
        (lambda q, k: q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), _SCALED),
        (lambda q, k: q @ k.mT, f"These are raw scores: {_SQRT_D}, then softmax over dim=-1."),
        (partial(attend, weigh=_hard), _HARD),
        (_lookup_reference, _NO_READY_MADE),
        (
            lambda q, k: mha.scaled_dot_product_attention(q, k, k, return_weights=True)[1],
            _NO_READY_MADE,
        ),
    ),
    hint="Expected softmax(query @ key^T / sqrt(D)) over the last axis.",
    crash_hint="Transpose with key.transpose(-2, -1) (not key.T) so leading batch dims stay put.",
    forbidden=NO_SDPA,
    forbidden_hint=_NO_READY_MADE,
    doc="Check ``fn(query (..., L, D), key (..., S, D)) -> weights (..., L, S)`` of a soft lookup.",
)


def _head(x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, **slip: Any) -> Tensor:
    """One head written out: right without ``slip``, or with one of the seed's slips."""
    return attend(x @ w_q, x @ w_k, x @ w_v, **slip)  # (L, Dv)


def _seed_head_cases() -> list[Case]:
    g = torch.Generator().manual_seed(102)
    x = torch.randn(4, 6, generator=g)  # L=4, E=6, D=2, Dv=3: sqrt(D) is not sqrt(E) ...
    w_q, w_k = (1.5 * torch.randn(6, 2, generator=g) for _ in range(2))  # ... nor w_q w_k
    W1 = HEAD_PROJECTIONS[0]
    cases = [(CAT_EATS_FISH, W1, W1, W1), (x, w_q, w_k, torch.randn(6, 3, generator=g))]
    return [Case(f"fn(x {tuple(c[0].shape)}, w_q {tuple(c[1].shape)}, ...)", c) for c in cases]


_SEED = "Still the seed's scores @ v: add the 1/sqrt(d_k) scale and the softmax."
_WIDTH = "d_k is the head dimension w_q.shape[1], not the model width E = x.shape[1]."
_OWN = "k = x @ w_k and v = x @ w_v have their own projections (equal in the seed's example)."
_NO_READY_MADE_HEAD = "write the head from matmul and softmax, without a ready-made attention."
SEED_HEAD_FIX = Exercise(
    "check_seed_head_fix",
    "head 1 of 猫 吃 鱼 is [[0.50, 0], [0.33, 0], [0.33, 0]]",
    lambda x, w_q, w_k, w_v: F.scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v),
    _seed_head_cases,
    variants=(
        _head,
        lambda x, w_q, w_k, w_v: (
            torch.softmax((x @ w_q / math.sqrt(w_k.shape[1])) @ (x @ w_k).T, dim=1) @ (x @ w_v)
        ),
    ),
    mistakes=(
        (partial(_head, scale=1.0, weigh=_no_softmax), _SEED),
        (
            partial(_head, scale=1.0),
            "The scale is missing: divide by sqrt(d_k), d_k = w_q.shape[1].",
        ),
        (partial(_head, weigh=_no_softmax), "The softmax is missing: softmax(scores / sqrt(d_k))."),
        (partial(_head, weigh=_hard), "A hard argmax; softmax gives every key a positive weight."),
        (partial(_head, dim=0), "Wrong axis: normalise each query's row over the keys, dim=-1."),
        (lambda x, w_q, w_k, w_v: _head(x, w_q, w_k, w_v, scale=x.shape[1] ** -0.5), _WIDTH),
        (lambda x, w_q, w_k, w_v: _head(x, w_q, w_q, w_q), _OWN),
        (
            lambda x, w_q, w_k, w_v: F.scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v),
            _NO_READY_MADE_HEAD,
        ),
    ),
    hint="Expected softmax(q @ k.T / sqrt(d_k), dim=-1) @ v, q, k, v = x @ w_q, x @ w_k, x @ w_v.",
    crash_hint="q, k and v are x @ w_q, x @ w_k and x @ w_v; the scores are q @ k.T.",
    forbidden=NO_SDPA,
    forbidden_hint=_NO_READY_MADE_HEAD,
    doc="Check ``fn(x (L, E), w_q (E, D), w_k (E, D), w_v (E, Dv)) -> out (L, Dv)``, one head.",
)


def _as_matrix(answer: object) -> Tensor:
    try:
        return torch.as_tensor(answer, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        message = (
            "Write the prediction as a 3x2 nested list of numbers, e.g. [[a, b], [c, d], [e, f]] "
            "({kind}: {err})."
        )
        raise ExerciseError(tr(message, kind=type(err).__name__, err=err)) from None


def _seed_head(w: Tensor, **slip: Any) -> Tensor:
    """A head of the seed's example, where Q = K = V = X @ w: (3, 2)."""
    return _head(CAT_EATS_FISH, w, w, w, **slip)


_SEED_V2 = "The seed's scores @ V2: add scale and softmax (equal scores then get 1/3 each)."
_SQRT_2 = "Divide the scores by sqrt(2) before the softmax: e^0.71 / (e^0.71 + 2) = 0.50."
_EQUAL = "猫 and 鱼 see three equal scores (0): weights 1/3 each, output the mean of V2's rows."
HEAD2_PREDICTION = Exercise(
    "check_head2_prediction",
    "row 1 (吃) ≈ [0, 0.50], rows 0 and 2 = [0, 1/3]",
    lambda: F.scaled_dot_product_attention(*(CAT_EATS_FISH @ HEAD_PROJECTIONS[1],) * 3),
    prediction=True,
    variants=(
        lambda t: [[0.0, 0.33], [0.0, 0.50], [0.0, 0.33]],
        lambda t: ((0, 1 / 3), (0, 0.5), (0, 1 / 3)),
        lambda t: np.array([[0, 0.33]] * 3) + [[0, 0], [0, 0.17], [0, 0]],
        lambda t: t,
    ),
    mistakes=(
        (lambda t: _seed_head(HEAD_PROJECTIONS[1], scale=1.0, weigh=_no_softmax), _SEED_V2),
        (lambda t: _seed_head(HEAD_PROJECTIONS[1], scale=1.0), _SQRT_2),
        (lambda t: t * torch.tensor([[0.0], [1.0], [0.0]]), _EQUAL),
        (lambda t: _seed_head(HEAD_PROJECTIONS[0]), "That is head 1; W2 = diag(0, 1)."),
        (lambda t: t.flip(-1), "Columns swapped: W2 = diag(0, 1) zeroes the first."),
    ),
    hint="That is not head 2. Row i: scores q_i . k_j / sqrt(2), softmax over j, weighted sum of "
    "the rows of V2 = X @ W2.",
    atol=0.01,
    rtol=0.0,
    convert=_as_matrix,
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
        out, perms = layer(x, x, x)[0][0], (torch.tensor([2, 0, 3, 4, 1]), torch.arange(4, -1, -1))
        # token i of the new sentence is old token perm[i]
        got = [layer(x[:, p], x[:, p], x[:, p])[0][0] for p in perms]
    return [Case(f"fn(out, perm={p.tolist()})", (out, p), expected=y) for p, y in zip(perms, got)]


_INVERSE = "That is the inverse permutation: new row i is old row perm[i], out[perm[i]]."
PERMUTED_OUTPUTS = Exercise(
    "check_permuted_outputs",
    "reorder the tokens and the outputs reorder the same way",
    lambda out, perm: out[perm],
    _permuted_cases,
    variants=(
        lambda out, perm: out.index_select(0, perm),
        lambda out, perm: torch.stack([out[i] for i in perm.tolist()]),
    ),
    mistakes=(
        (lambda out, perm: out, "Each token's output travels with it: reorder out's rows."),
        (lambda out, perm: out[torch.argsort(perm)], _INVERSE),
    ),
    hint="Self-attention without positions is permutation-equivariant: "
    "attention(x[perm]) = attention(x)[perm].",
    crash_hint="Index the rows of out with perm.",
    doc="Check ``fn(out (L, E), perm (L,)) -> (L, E)``: the output of torch's "
    "``nn.MultiheadAttention`` (no positions) for ``x[perm]``, predicted from its output for x.",
)

EXERCISES = publish(globals())
