"""Chapter 2, scaled dot-product attention: the exercises as data for :mod:`._harness`. Softmax
tolerances follow the dtype and the logits' magnitude."""

from __future__ import annotations

import math
import numbers
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from ._harness import NO_SDPA, Case, Exercise, ExerciseError, as_shape, attend, publish, tr

_SOFTMAXES = ("softmax", "log_softmax")
_AXIS = "Use `dim` in both the max and the sum, with keepdim=True so that they broadcast back."
_OVERFLOW = "exp(89) is inf in float32 (exp(11.1) in float16) and inf/inf is NaN"


def _normalise(e: Tensor, dim: int | None) -> Tensor:
    """``e`` divided by its sums along ``dim`` (over the whole tensor if ``dim`` is None)."""
    return e / e.sum(dim, keepdim=True)


def _shifted(x: Tensor, shift: Tensor, dim: int | None = -1) -> Tensor:
    return _normalise((x - shift).exp(), dim)


def _softmax_case(label: str, x: Tensor, **kwargs: int) -> Case:
    """Tolerances relative to the dtype and the logits' size: rounding ``x - m`` (or ``x - lse``)
    costs a relative error of about eps · max|x| in a correct answer."""
    tol = 4 * torch.finfo(x.dtype).eps * max(1.0, x.abs().max().item())
    return Case(
        f"my_softmax(x{', dim=1' if kwargs else ''}) {label}", (x,), kwargs, atol=tol, rtol=tol
    )


def _softmax_cases() -> list[Case]:  # exp(89) overflows float32, exp(12) float16
    g = torch.Generator().manual_seed(2)
    return [
        _softmax_case("on small logits", torch.randn(4, 6, generator=g)),
        _softmax_case("on a (2, 5, 3) tensor", torch.randn(2, 5, 3, generator=g) * 3, dim=1),
        _softmax_case("on logits near 1000", 1000 - torch.tensor([[0.0, 1, 2, 10], [5, 0, 10, 1]])),
        _softmax_case(
            "on rows of very different size", torch.tensor([[1000.0, 999, 998], [0, -1, -2]])
        ),
        _softmax_case(
            "on rows [1000, 0] and [0, 1000]", torch.tensor([[1000.0, 0.0], [0.0, 1000.0]])
        ),
        _softmax_case("in float16", torch.tensor([[12.0, 10.0, 8.0, 0.0]], dtype=torch.float16)),
    ]


_BY_MEAN = f"Only the row *maximum* keeps exponents <= 0: [1000, 0] minus its mean is [500, -500]; {_OVERFLOW}."
_BY_FIRST = (
    f"Subtract the row maximum, not the first element: [0, 1000] stays as it is, and {_OVERFLOW}."
)
_NAIVE = f"exp() overflowed: {_OVERFLOW}. Subtract the maximum along `dim` first."
_GLOBAL_MAX = "Subtract each slice's own maximum, x.amax(dim, keepdim=True): rows far below a global one give 0/0."
_DTYPE = "Return the input's dtype (compute in float32 inside if you like, then convert back)."
_NO_SOFTMAX = (
    "write softmax yourself from exp, max and sum, without calling torch.softmax or its aliases."
)


def _in_float64(x: Tensor, dim: int = -1) -> Tensor:
    y = x.double()
    e = (y - y.max(dim, keepdim=True).values).exp()
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


SOFTMAX = Exercise(
    "check_softmax",
    "stable for large logits, right axis, float16 included",
    lambda x, dim=-1: torch.softmax(x.double(), dim=dim).to(x.dtype),
    _softmax_cases,
    variants=(
        lambda x, dim=-1: _shifted(x, x.amax(dim, keepdim=True), dim),
        lambda x, dim=-1: torch.exp(x - torch.logsumexp(x, dim, keepdim=True)),  # 2e-5 off at 1000
        _in_float64,
    ),
    mistakes=(
        (lambda x, dim=-1: _shifted(x, x.mean(dim, keepdim=True), dim), _BY_MEAN),
        (lambda x, dim=-1: _shifted(x, x.narrow(dim, 0, 1), dim), _BY_FIRST),
        (lambda x, dim=-1: _normalise(x.exp(), dim), _NAIVE),
        (lambda x, dim=-1: _shifted(x, x.max(), dim), _GLOBAL_MAX),
        (lambda x, dim=-1: _shifted(x, x.amax(-1, keepdim=True)), f"Not along `dim`. {_AXIS}"),
        (lambda x, dim=-1: _shifted(x, x.max(), None), f"You divided by the total. {_AXIS}"),
        (lambda x, dim=-1: _shifted(x.float(), x.float().amax(dim, keepdim=True), dim), _DTYPE),
        (torch.softmax, _NO_SOFTMAX),
        (lambda x, dim=-1: x.softmax(dim), _NO_SOFTMAX),
        (lambda x, dim=-1: F.log_softmax(x, dim).exp(), _NO_SOFTMAX),
        (lambda x, dim=-1: torch.nn.Softmax(dim)(x), _NO_SOFTMAX),
        (lambda x, dim=-1: mha.softmax(x, dim), _NO_SOFTMAX),
    ),
    hint="Each slice along `dim` must be exp(x - max) divided by its own sum.",
    crash_hint=_AXIS,
    exact_dtype=True,
    forbidden=(
        *(getattr(m, n) for m in (torch, torch.special, F, Tensor) for n in _SOFTMAXES),
        torch._softmax,
        mha.softmax,
    ),
    forbidden_hint=_NO_SOFTMAX,
    params=("my_softmax",),
    doc="Check a hand-written, numerically stable ``my_softmax(x, dim=-1)`` (no torch.softmax) "
    "against ``torch.softmax``: small and large logits, a middle axis, float16.",
)


def _variances() -> tuple[float, float]:
    """Var(q·k) and Var(q·k / √64), measured on 100,000 pairs of standard normal vectors."""
    g = torch.Generator().manual_seed(64)
    dots = (torch.randn(100_000, 64, generator=g) * torch.randn(100_000, 64, generator=g)).sum(-1)
    return dots.var().item(), (dots / math.sqrt(64)).var().item()


def _as_numbers(answer: tuple[object, object]) -> tuple[float, float]:
    for name, value in zip(("unscaled", "scaled"), answer):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            message = tr("{name} should be a number, got {value!r}.", name=name, value=value)
            raise ExerciseError(message)
    return float(answer[0]), float(answer[1])  # type: ignore[arg-type]  # checked above


_SCALED = "dividing a variable by c divides its variance by c², here by d_k."
QK_VARIANCE_PREDICTION = Exercise(
    "check_qk_variance_prediction",
    lambda want: tr("measured {0:.1f} unscaled and {1:.2f} scaled", *want),
    _variances,
    prediction=True,
    variants=(lambda t: (64, 1), lambda t: (np.float64(64), 1.0), lambda t: t),
    mistakes=(
        (lambda t: (math.sqrt(t[0]), t[1]), "that is the standard deviation √d_k; square it."),
        (lambda t: (1.0, t[1]), "the variances of the 64 independent products add up."),
        (lambda t: (t[0], 1 / math.sqrt(64)), _SCALED),
        (lambda t: (t[0], math.sqrt(64)), _SCALED),
    ),
    hint={
        "unscaled": "q·k is a sum of d_k independent products q_i·k_i, each of variance 1.",
        "scaled": "Var(x / c) = Var(x) / c²; with c = √d_k that undoes the growth exactly.",
    },
    atol=0.0,
    rtol=0.1,
    outputs=("unscaled", "scaled"),
    convert=_as_numbers,
    doc="Check predicted variances of q·k and q·k/√64 for standard normal q, k (d_k = 64), within "
    "10% of the variances measured on 100,000 random pairs.",
)


def _true_shapes() -> tuple[tuple[int, ...], tuple[int, ...]]:
    q, k, v = torch.zeros(2, 8, 10, 64), torch.zeros(2, 8, 7, 64), torch.zeros(2, 8, 7, 32)
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # (B, H, L, S)
    return tuple(weights.shape), tuple(F.scaled_dot_product_attention(q, k, v).shape)


SHAPE_PREDICTION = Exercise(
    "check_shape_prediction",
    lambda want: tr("weights {0}, out {1}", *want),
    _true_shapes,
    prediction=True,
    variants=(
        lambda t: ((2, 8, 10, 7), (2, 8, 10, 32)),
        lambda t: (torch.Size([2, 8, 10, 7]), [2, 8, 10, 32]),
    ),
    mistakes=(
        (lambda t: ((2, 8, 7, 10), t[1]), "rows are queries (L = 10), columns keys (S = 7)."),
        (lambda t: ((2, 8, 10, 64), t[1]), "q @ kᵀ sums the head dim D away."),
        (lambda t: (t[0], (2, 8, 10, 64)), "the output's last dim is the value dim Dv = 32."),
        (lambda t: (t[0], (2, 8, 7, 32)), "one output row per query (L = 10)."),
    ),
    hint={
        "weights": "one weight per (query, key) pair in every batch and head: (B, H, L, S).",
        "out": "(B, H, L, S) weights times (B, H, S, Dv) values gives (B, H, L, Dv).",
    },
    outputs=("weights", "out"),
    convert=lambda answer: (as_shape(answer[0], "weights"), as_shape(answer[1], "out")),
    doc="Check the predicted shapes of the weights and the output of attention with query "
    "(2, 8, 10, 64), key (2, 8, 7, 64), value (2, 8, 7, 32), found by running torch's operators.",
)

_TRANSPOSE = (
    "Transpose the last two dims with k.transpose(-2, -1) (or k.mT): negative dims work for any "
    "number of batch dims, while k.T reverses them all."
)


def _sdpa_cases() -> list[Case]:
    g = torch.Generator().manual_seed(3)
    cases = []
    for shapes in [((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)), ((2, 5, 6), (2, 6, 6), (2, 6, 3))]:
        label = "my_attention(q, k, v) with q {}, k {}, v {}".format(*shapes)
        # std 3 so that a missing or wrong scale changes the result clearly
        cases.append(Case(label, tuple(torch.randn(*s, generator=g) * 3 for s in shapes)))
    q, k, v = (torch.randn(*s, generator=g) * 3 for s in ((3, 4), (7, 4), (7, 2)))
    return [*cases, Case("my_attention(q, k, v) with q (3, 4), k (7, 4), v (7, 2)", (q, k, v))]


_SUM_TO_1 = "Softmax over the keys (dim=-1), so that each query's weights sum to 1."
_NO_SDPA = (
    "build attention from matmul and softmax yourself, without calling a ready-made "
    "scaled_dot_product_attention."
)
SDPA = Exercise(
    "check_sdpa",
    "matches torch's scaled_dot_product_attention for 2-D, 3-D and 4-D inputs",
    F.scaled_dot_product_attention,
    _sdpa_cases,
    variants=(
        attend,
        lambda q, k, v: torch.softmax((q / math.sqrt(q.shape[-1])) @ k.mT, dim=-1) @ v,
        lambda q, k, v: (
            (torch.einsum("...ld,...sd->...ls", q.double(), k.double()) / q.shape[-1] ** 0.5)
            .softmax(-1)
            .float()
            @ v
        ),
    ),
    mistakes=(
        (partial(attend, scale=1.0), "Scale the scores by 1/√D, D = q.shape[-1]."),
        (lambda q, k, v: attend(q, k, v, scale=1 / q.shape[-1]), "The scale is 1/√D, not 1/D."),
        (lambda q, k, v: attend(q, k, v, scale=q.shape[-1] ** 0.5), "Divide by √D, not multiply."),
        (partial(attend, dim=-2), _SUM_TO_1),
        (lambda q, k, v: attend(q, k.transpose(-2, -1), v), _TRANSPOSE),
        (lambda q, k, v: attend(q, k), "Those are the weights (..., L, S): multiply them by v."),
        (lambda q, k, v: (attend(q, k, v), q @ k.mT), "Return only the output tensor."),
        (F.scaled_dot_product_attention, _NO_SDPA),
        (lambda q, k, v: mha.scaled_dot_product_attention(q, k, v), _NO_SDPA),
        (lambda q, k, v: mha.flash_attention(q, k, v), _NO_SDPA),
    ),
    hint="out must equal softmax(q @ kᵀ / √D, dim=-1) @ v.",
    crash_hint=_TRANSPOSE,
    forbidden=NO_SDPA,
    forbidden_hint=_NO_SDPA,
    params=("my_attention",),
    doc="Check a hand-written ``my_attention(q, k, v)`` = softmax(q kᵀ / √D) v against "
    "``F.scaled_dot_product_attention`` (which it must not call): 2-D to 4-D, L ≠ S, D ≠ Dv.",
)

EXERCISES = publish(globals())
