"""Chapter 1, "Queries, keys and values": the exercises as data for :mod:`._harness`, with the
seed's own mistakes (no 1/√d_k, a hard argmax) among the usual ones."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from .. import attention as attention_module
from .. import flash as flash_module
from ._harness import NO_SDPA, Case, Exercise, ExerciseError, attend, defined_in, publish, tr

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


# --- 1.1: the weights of kernel regression (Nadaraya–Watson) ---------------------------------------

#: Ready-made attention, which the chapter's exercises may not call: torch's and mha's, every
#: function of mha's attention and flash modules (public and private), and the layers around them.
READY_MADE_ATTENTION: tuple[Callable[..., Any], ...] = (
    *NO_SDPA,
    *defined_in(attention_module),
    *defined_in(flash_module),
    mha.MultiHeadAttention.forward,
    mha.TransformerBlock.forward,
    torch.nn.MultiheadAttention.forward,
    mha.varlen_attention,
    mha.paged_attention,
    mha.flash_decoding,
    mha.topk_sparse_attention,
)


def _kernel_scores(x: Tensor, x_keys: Tensor, width: float, **slip: bool) -> Tensor:
    """-‖x - x_i‖² / (2 width²) for every query and key: (..., L, S); or with one ``slip``."""
    diff = x[..., :, None, :] - x_keys[..., None, :, :]  # (..., L, S, D)
    if slip.get("sum_first"):
        dist2 = diff.sum(-1) ** 2  # (..., L, S)
    elif slip.get("unsquared"):
        dist2 = diff.pow(2).sum(-1).sqrt()
    else:
        dist2 = diff.pow(2).sum(-1)
    two = 1.0 if slip.get("no_two") else 2.0
    wide = width if slip.get("width_once") else width**2
    return (1.0 if slip.get("plus") else -1.0) * dist2 / (two * wide)


def _kernel_reference(x: Tensor, x_keys: Tensor, width: float) -> Tensor:
    """The Nadaraya–Watson weights, in float64: softmax over the keys of the Gaussian scores."""
    return _kernel_scores(x.double(), x_keys.double(), width).softmax(-1).to(x.dtype)


def _kernel_slip(x: Tensor, x_keys: Tensor, width: float, **slip: bool) -> Tensor:
    return torch.softmax(_kernel_scores(x, x_keys, width, **slip), dim=-1)


def _kernel_by_exp(x: Tensor, x_keys: Tensor, width: float) -> Tensor:
    """The kernel values exp(-d² / 2w²) divided by their sum: 0/0 once they all underflow."""
    kernel = torch.exp(_kernel_scores(x, x_keys, width))  # (..., L, S)
    return kernel / kernel.sum(-1, keepdim=True)


def _kernel_by_hand(x: Tensor, x_keys: Tensor, width: float) -> Tensor:
    """The stable softmax written out: the nearest key's score subtracted first."""
    scores = _kernel_scores(x, x_keys, width)
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def _kernel_expanded(
    x: Tensor, x_keys: Tensor, width: float, *, no_key_term: bool = False
) -> Tensor:
    """The square expanded: x·x_i / w² - ‖x_i‖² / (2 w²); the query's own term cancels."""
    key_term = 0.0 if no_key_term else x_keys.pow(2).sum(-1)[..., None, :] / 2  # (..., 1, S)
    return ((x @ x_keys.mT - key_term) / width**2).softmax(-1)  # (..., L, S)


def _features(x: Tensor, x_keys: Tensor, width: float) -> tuple[Tensor, Tensor]:
    """Query and key vectors whose dot product is the Gaussian score up to a per-query term."""
    q = torch.cat([x / width**2, torch.ones_like(x[..., :1])], -1)  # (..., L, D + 1)
    k = torch.cat([x_keys, -x_keys.pow(2).sum(-1, keepdim=True) / 2], -1)  # (..., S, D + 1)
    return q, k


def _kernel_by_library(x: Tensor, x_keys: Tensor, width: float) -> Tensor:
    """The weights of mha.scaled_dot_product_attention on those vectors."""
    q, k = _features(x, x_keys, width)
    return mha.scaled_dot_product_attention(q, k, k, scale=1.0, return_weights=True)[1]


def _kernel_by_private_helper(x: Tensor, x_keys: Tensor, width: float) -> Tensor:
    """The same through mha.attention's private helper, which skips the argument checks."""
    from mha.attention import _attention  # reached around the public name

    q, k = _features(x, x_keys, width)
    return _attention(q, k, k, None, 0.0, False, 1.0, return_weights=True)[1]


def _kernel_cases() -> list[Case]:
    g = torch.Generator().manual_seed(101)
    line = torch.linspace(0, 6, 10)[:, None]  # (S, 1): 1-D points, as in the section
    far_keys = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])  # (S, D) = (3, 2)
    far_queries = torch.tensor([[1.2, 0.1], [-2.0, -1.0], [2.2, 3.0]])  # >= 1 from every key
    specs = [
        (torch.linspace(0.3, 5.7, 6)[:, None], line, 0.5),
        (1.5 * torch.randn(4, 2, generator=g), 1.5 * torch.randn(7, 2, generator=g), 1.0),
        (torch.randn(2, 3, 3, generator=g), torch.randn(2, 5, 3, generator=g), 2.0),
        (far_queries, far_keys, 0.05),  # every exp(-d² / 2w²) is 0 in float32
    ]
    return [
        Case(f"fn(x {tuple(x.shape)}, x_keys {tuple(k.shape)}, width={w})", (x, k, w))
        for x, k, w in specs
    ]


_ROWS = "Each query (a row) spreads its weight over the keys: softmax over dim=-1."
_NO_READY_MADE = (
    "compute the weights from the distances yourself (torch.softmax is fine), without a "
    "ready-made attention."
)
_UNDERFLOW = (
    "At width 0.05 every kernel value exp(-d² / 2w²) underflows to 0, and 0/0 is NaN: take the "
    "softmax of the scores, which subtracts each row's largest (the nearest key's) first."
)
_KEY_TERM = (
    "x · x_i / w² is only part of the expanded square: keep the key's own term -‖x_i‖² / (2 w²) "
    "(the query's term is the same for every key, so the softmax ignores it)."
)
_SUM_FIRST = "Square each coordinate's difference, then sum: ‖x - x_i‖² = Σ_d (x_d - x_i,d)²."
LOOKUP_WEIGHTS = Exercise(
    "check_lookup_weights",
    "Gaussian-kernel weights for points in 1, 2 and 3 dimensions and with a batch dim; at width "
    "0.05, where every kernel value underflows, all the weight on the nearest key",
    _kernel_reference,
    _kernel_cases,
    variants=(
        _kernel_by_hand,
        lambda x, x_keys, width: (-(torch.cdist(x, x_keys) ** 2) / (2 * width**2)).softmax(-1),
        _kernel_expanded,
    ),
    mistakes=(
        (_kernel_by_exp, _UNDERFLOW),
        (partial(_kernel_slip, unsquared=True), "Square the distance: exp(-‖x - x_i‖² / 2w²)."),
        (
            partial(_kernel_slip, no_two=True),
            "The exponent is -‖x - x_i‖² / (2 w²): the 2 is missing.",
        ),
        (partial(_kernel_slip, width_once=True), "Divide by 2 w², the width squared."),
        (partial(_kernel_slip, plus=True), "The weight must fall with the distance: a minus sign."),
        (partial(_kernel_slip, sum_first=True), _SUM_FIRST),
        (partial(_kernel_expanded, no_key_term=True), _KEY_TERM),
        (lambda x, x_keys, width: torch.softmax(_kernel_scores(x, x_keys, width), 0), _ROWS),
        (
            _kernel_scores,
            "These are the scores: a softmax over the keys (dim=-1) makes them weights.",
        ),
        (_kernel_by_library, _NO_READY_MADE),
        (_kernel_by_private_helper, _NO_READY_MADE),
    ),
    hint="Expected softmax(-‖x - x_i‖² / (2 width²)) over the keys (dim=-1), one row per query.",
    crash_hint="x is (..., L, D) and x_keys (..., S, D): x[..., :, None, :] - x_keys[..., None, :, :] "
    "broadcasts to (..., L, S, D).",
    forbidden=READY_MADE_ATTENTION,
    forbidden_hint=_NO_READY_MADE,
    # attention computes them, with q = [x / w², 1] and k = [x_i, -‖x_i‖² / 2] (section 1.1)
    rewrites=(mha.scaled_dot_product_attention, F.scaled_dot_product_attention),
    params=("kernel_weights",),
    doc="Check ``kernel_weights(x (..., L, D), x_keys (..., S, D), width) -> (..., L, S)``, the "
    "Nadaraya–Watson weights of a Gaussian kernel, also where every kernel value underflows.",
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


def _head_by_library(
    x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor
) -> Tensor | tuple[Tensor, Tensor]:
    return mha.scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v)


def _head_by_private_helper(
    x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor
) -> Tensor | tuple[Tensor, Tensor]:
    """mha.attention's private helper, reached around the public name."""
    from mha.attention import _attention

    return _attention(x @ w_q, x @ w_k, x @ w_v, None, 0.0, False, w_q.shape[1] ** -0.5)


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
        (_head_by_library, _NO_READY_MADE_HEAD),
        (_head_by_private_helper, _NO_READY_MADE_HEAD),
    ),
    hint="Expected softmax(q @ k.T / sqrt(d_k), dim=-1) @ v, q, k, v = x @ w_q, x @ w_k, x @ w_v.",
    crash_hint="q, k and v are x @ w_q, x @ w_k and x @ w_v; the scores are q @ k.T.",
    forbidden=READY_MADE_ATTENTION,
    forbidden_hint=_NO_READY_MADE_HEAD,
    rewrites=(mha.scaled_dot_product_attention, F.scaled_dot_product_attention),
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
    rewrites=(),  # indexing: neither mha nor torch has a function that predicts the reordering
    doc="Check ``fn(out (L, E), perm (L,)) -> (L, E)``: the output of torch's "
    "``nn.MultiheadAttention`` (no positions) for ``x[perm]``, predicted from its output for x.",
)

EXERCISES = publish(globals())
