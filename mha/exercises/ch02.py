"""Chapter 2, scaled dot-product attention: the exercises as data for :mod:`._harness`.

References: ``torch.softmax`` and ``F.scaled_dot_product_attention``, which the learner must not
call (a tripwire); mistakes: no max subtraction, the wrong axis, the wrong scale, no transpose.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from ._harness import Case, Exercise, ExerciseError, Mistake, as_shape, forbid

_HINT_AXIS = (
    "Normalise along the `dim` you are given: use it in both the max and the sum, with "
    "keepdim=True so that the result broadcasts back against x."
)


def _normalise(e: Tensor, dim: int | None) -> Tensor:
    """``e`` divided by its sums along ``dim`` (over the whole tensor if ``dim`` is None)."""
    return e / e.sum(dim, keepdim=True)


def _stable(x: Tensor, dim: int) -> Tensor:
    return _normalise((x - x.amax(dim, keepdim=True)).exp(), dim)


def _softmax_cases() -> list[Case]:  # exp(89) overflows float32, exp(12) float16
    g = torch.Generator().manual_seed(2)
    small, middle = torch.randn(4, 6, generator=g), torch.randn(2, 5, 3, generator=g) * 3
    large = torch.tensor([[1000.0, 999.0, 998.0, 990.0], [995.0, 1000.0, 990.0, 999.0]])
    spread = torch.tensor([[1000.0, 999.0, 998.0], [0.0, -1.0, -2.0]])
    half = torch.tensor([[12.0, 10.0, 8.0, 0.0]], dtype=torch.float16)
    return [
        Case("my_softmax(x) on small logits", (small,)),
        Case("my_softmax(x, dim=1) on a (2, 5, 3) tensor", (middle,), {"dim": 1}),
        Case("my_softmax(x) on logits near 1000", (large,)),
        Case("my_softmax(x) on rows of very different size", (spread,)),
        Case("my_softmax(x) in float16 on logits up to 12", (half,), atol=2e-3, rtol=2e-3),
    ]


SOFTMAX = Exercise(
    "check_softmax",
    "stable for large logits, right axis, float16 included",
    lambda x, dim=-1: torch.softmax(x.float(), dim=dim).to(x.dtype),
    _softmax_cases,
    (
        Mistake(
            lambda x, dim=-1: _normalise(x.exp(), dim),
            "exp() overflowed: exp(89) is already inf in float32 (exp(11.1) in float16), and "
            "inf/inf is NaN. Subtract the maximum along `dim` before exponentiating: "
            "softmax(x) = softmax(x - max).",
        ),
        Mistake(
            lambda x, dim=-1: _normalise((x - x.max()).exp(), dim),
            "Subtract the maximum of each slice along `dim` (x.amax(dim=dim, keepdim=True)), "
            "not one global maximum: a row far below the global max underflows to all zeros, "
            "and 0/0 is NaN.",
        ),
        Mistake(
            lambda x, dim=-1: _stable(x, -1),
            "You normalised along the last axis, not along `dim`. " + _HINT_AXIS,
        ),
        Mistake(
            lambda x, dim=-1: _normalise((x - x.max()).exp(), None),
            "You divided by the sum of the whole tensor. " + _HINT_AXIS,
        ),
        Mistake(
            lambda x, dim=-1: _stable(x.float(), dim),
            "Keep the input's dtype: a float16 input gives a float16 softmax (compute in "
            "float32 inside if you like, then convert back).",
        ),
    ),
    hint="Each slice along `dim` must be exp(x - max) divided by its own sum.",
    crash_hint=_HINT_AXIS,
    atol=1e-6,
    rtol=1e-5,
    exact_dtype=True,
    context=lambda: forbid(
        [
            (m, n)
            for m in (torch, torch.special, F, torch.Tensor, mha)
            for n in ("softmax", "log_softmax")
        ],
        "check_softmax: write softmax yourself from exp, max and sum, without calling "
        "torch.softmax or its aliases.",
    ),
    solution=lambda x, dim=-1: _stable(x, dim),
    params=("my_softmax",),
    doc="""Check a hand-written, numerically stable ``my_softmax(x, dim=-1)`` (no torch.softmax)
    against ``torch.softmax``: small logits, logits of 1000, rows of very different size, a middle
    axis, float16.""",
)


def _variances() -> tuple[float, float]:
    """Var(q·k) and Var(q·k / √64), measured on 100,000 pairs of standard normal vectors."""
    g = torch.Generator().manual_seed(64)
    dots = (torch.randn(100_000, 64, generator=g) * torch.randn(100_000, 64, generator=g)).sum(-1)
    return dots.var().item(), (dots / math.sqrt(64)).var().item()


def _as_numbers(answer: tuple[object, object]) -> tuple[float, float]:
    for name, value in zip(("unscaled", "scaled"), answer):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ExerciseError(f"{name} should be a number, got {value!r}.")
    unscaled, scaled = answer[0], answer[1]
    assert isinstance(unscaled, numbers.Real) and isinstance(scaled, numbers.Real)  # checked above
    return float(unscaled), float(scaled)


_HINT_SCALED = "dividing a variable by c divides its variance by c², here by d_k."

QK_VARIANCE_PREDICTION = Exercise(
    "check_qk_variance_prediction",
    lambda want: f"measured {want[0]:.1f} unscaled and {want[1]:.2f} scaled",
    _variances,
    mistakes=(
        Mistake(
            lambda t: (math.sqrt(t[0]), t[1]),
            "that is the standard deviation √d_k; the variance is its square.",
        ),
        Mistake(
            lambda t: (1.0, t[1]),
            "each product q_i·k_i has variance 1, and the variances of the 64 independent "
            "terms add up.",
        ),
        Mistake(lambda t: (t[0], 1 / math.sqrt(64)), _HINT_SCALED),
        Mistake(lambda t: (t[0], math.sqrt(64)), _HINT_SCALED),
    ),
    hint={
        "unscaled": "q·k is a sum of d_k independent products q_i·k_i, each with mean 0 and "
        "variance E[q_i²]·E[k_i²] = 1.",
        "scaled": "Var(x / c) = Var(x) / c²; with c = √d_k that undoes the growth exactly.",
    },
    atol=0.0,
    rtol=0.1,  # within 10% of the measurement
    outputs=("unscaled", "scaled"),
    prediction=True,
    convert=_as_numbers,
    params=("unscaled", "scaled"),
    doc="""Check predicted variances of q·k and q·k/√64 for standard normal q, k with d_k = 64,
    within 10% of the variances measured on 100,000 random pairs.""",
)


def _true_shapes() -> tuple[tuple[int, ...], tuple[int, ...]]:
    q, k, v = torch.zeros(2, 8, 10, 64), torch.zeros(2, 8, 7, 64), torch.zeros(2, 8, 7, 32)
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # (B, H, L, S)
    return tuple(weights.shape), tuple(F.scaled_dot_product_attention(q, k, v).shape)


SHAPE_PREDICTION = Exercise(
    "check_shape_prediction",
    lambda want: f"weights {want[0]}, out {want[1]}",
    _true_shapes,
    mistakes=(
        Mistake(
            lambda t: ((2, 8, 7, 10), t[1]),
            "rows are queries (L = 10) and columns are keys (S = 7), not the other way.",
        ),
        Mistake(
            lambda t: ((2, 8, 10, 64), t[1]),
            "the head dim D is summed away by q @ kᵀ: one score per (query, key) pair.",
        ),
        Mistake(
            lambda t: (t[0], (2, 8, 10, 64)),
            "the output mixes value rows, so its last dim is the value dim Dv = 32.",
        ),
        Mistake(
            lambda t: (t[0], (2, 8, 7, 32)),
            "there is one output row per query (L = 10), whatever the number of keys.",
        ),
    ),
    hint={
        "weights": "one weight per (query, key) pair in every batch and head: (B, H, L, S).",
        "out": "(B, H, L, S) weights times (B, H, S, Dv) values gives (B, H, L, Dv).",
    },
    outputs=("weights", "out"),
    prediction=True,
    params=("weights", "out"),
    convert=lambda answer: (as_shape(answer[0], "weights"), as_shape(answer[1], "out")),
    doc="""Check the predicted shapes of the weights and the output of attention with query
    (2, 8, 10, 64), key (2, 8, 7, 64), value (2, 8, 7, 32), found by running torch's operators.""",
)

_HINT_TRANSPOSE = (
    "The scores are q @ kᵀ over the last two dims: use k.transpose(-2, -1) (or k.mT); negative "
    "dims make it work for any number of leading batch dims, while k.T reverses all dims of a "
    "batched tensor."
)


def _attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, dim: int = -1):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=dim) @ v  # (..., L, Dv)


def _sdpa_cases() -> list[Case]:
    g = torch.Generator().manual_seed(3)
    cases = []
    for shapes in [
        ((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)),
        ((2, 5, 6), (2, 6, 6), (2, 6, 3)),
        ((3, 4), (7, 4), (7, 2)),
    ]:  # (..., L, D), (..., S, D), (..., S, Dv)
        label = "my_attention(q, k, v) with q {}, k {}, v {}".format(*shapes)
        # std 3 so that a missing or wrong scale changes the result clearly
        cases.append(Case(label, tuple(torch.randn(*s, generator=g) * 3 for s in shapes)))
    return cases


SDPA = Exercise(
    "check_sdpa",
    "matches torch's scaled_dot_product_attention for 2-D, 3-D and 4-D inputs",
    F.scaled_dot_product_attention,
    _sdpa_cases,
    (
        Mistake(
            lambda q, k, v: _attention(q, k, v, 1.0),
            "Scale the scores by 1/√D (D = q.shape[-1]) before the softmax; without it the "
            "softmax saturates as D grows.",
        ),
        Mistake(
            lambda q, k, v: _attention(q, k, v, 1 / q.shape[-1]), "The scale is 1/√D, not 1/D."
        ),
        Mistake(
            lambda q, k, v: _attention(q, k, v, math.sqrt(q.shape[-1])),
            "Divide the scores by √D; you multiplied by it.",
        ),
        Mistake(
            lambda q, k, v: _attention(q, k, v, dim=-2),
            "The softmax runs over the keys (dim=-1): each query's weights must sum to 1. You "
            "normalised over the queries (dim=-2).",
        ),
        Mistake(lambda q, k, v: _attention(q, k.transpose(-2, -1), v), _HINT_TRANSPOSE),
        Mistake(
            lambda q, k, v: _attention(q, k, torch.eye(k.shape[-2])),
            "That is the shape of the weights (..., L, S). Multiply the weights by v to get "
            "the output (..., L, Dv).",
        ),
        Mistake(
            lambda q, k, v: (_attention(q, k, v), q @ k.mT),
            "You returned a tuple; return only the output tensor.",
        ),
    ),
    hint="out must equal softmax(q @ kᵀ / √D, dim=-1) @ v.",
    crash_hint=_HINT_TRANSPOSE,
    context=lambda: forbid(
        [(F, "scaled_dot_product_attention"), (mha, "scaled_dot_product_attention")],
        "check_sdpa: build attention from matmul and softmax yourself, without calling a "
        "ready-made scaled_dot_product_attention.",
    ),
    solution=_attention,
    params=("my_attention",),
    doc="""Check a hand-written ``my_attention(q, k, v)`` = softmax(q kᵀ / √D) v against
    ``F.scaled_dot_product_attention`` (which it must not call): 2-D to 4-D, L ≠ S, D ≠ Dv.""",
)

EXERCISES = (SOFTMAX, QK_VARIANCE_PREDICTION, SHAPE_PREDICTION, SDPA)
check_softmax = SOFTMAX.checker()
check_qk_variance_prediction = QK_VARIANCE_PREDICTION.checker()
check_shape_prediction = SHAPE_PREDICTION.checker()
check_sdpa = SDPA.checker()
