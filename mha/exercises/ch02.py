"""Chapter 2, scaled dot-product attention: the exercises as data for :mod:`._harness`. Softmax
tolerances follow the dtype and the logits' magnitude."""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

import mha

from ._harness import (
    Case,
    Exercise,
    ExerciseError,
    as_shape,
    attend,
    defined_in,
    never_larger,
    publish,
    randn64,
    tr,
)
from .ch01 import READY_MADE_ATTENTION

linear_attention_module = importlib.import_module("mha.linear_attention")

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


def _softmax_by_private_helper(x: Tensor, dim: int = -1) -> Tensor:
    """The weights of mha.attention's private helper for one query whose scores are ``x``."""
    from mha.attention import _attention  # reached around the public name

    s = x.movedim(dim, -1)[..., None]  # (..., S, 1): one key per logit
    one = s.new_ones(*s.shape[:-2], 1, 1)  # (..., 1, 1): one query, score = the logit
    weights = _attention(one, s, s, None, 0.0, False, 1.0, return_weights=True)[1]
    return weights[..., 0, :].movedim(-1, dim)


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
        (_softmax_by_private_helper, _NO_SOFTMAX),
    ),
    hint="Each slice along `dim` must be exp(x - max) divided by its own sum.",
    crash_hint=_AXIS,
    exact_dtype=True,
    forbidden=(
        *(getattr(m, n) for m in (torch, torch.special, F, Tensor) for n in _SOFTMAXES),
        torch._softmax,
        *READY_MADE_ATTENTION,  # mha.softmax and every attention, which computes a softmax
    ),
    forbidden_hint=_NO_SOFTMAX,
    rewrites=(torch.softmax, mha.softmax),
    params=("my_softmax",),
    doc="Check a hand-written, numerically stable ``my_softmax(x, dim=-1)`` (no torch.softmax) "
    "against ``torch.softmax``: small and large logits, a middle axis, float16.",
)


@cache
def _variances() -> tuple[float, float]:
    """Var(q·k / √512) for q, k of d_k = 64 standard normal entries, and Var(q'·k' / √64) for
    q' = 2q, k' = 2k (entries of standard deviation 2), measured on the same 100,000 pairs."""
    g = torch.Generator().manual_seed(64)
    q, k = torch.randn(100_000, 64, generator=g), torch.randn(100_000, 64, generator=g)  # (N, D)
    by_width = ((q * k).sum(-1) / math.sqrt(512)).var().item()
    std_two = ((2 * q * 2 * k).sum(-1) / math.sqrt(64)).var().item()
    return by_width, std_two


def _as_numbers(answer: tuple[object, object]) -> tuple[float, float]:
    for name, value in zip(("by_width", "std_two"), answer):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            message = tr("{name} should be a number, got {value!r}.", name=name, value=value)
            raise ExerciseError(message)
    return float(answer[0]), float(answer[1])  # type: ignore[arg-type]  # checked above


_BY_WIDTH_SQUARE = "√8 shrinks the scores, the standard deviation; the variance shrinks by 8."
_STD_TWO_PRODUCT = "each product q_i·k_i has variance 2²·2² = 16, not 4: both factors are scaled."
QK_VARIANCE_PREDICTION = Exercise(
    "check_qk_variance_prediction",
    lambda want: tr("measured {0:.3f} scaled by √512 and {1:.1f} with entries of std 2", *want),
    _variances,
    prediction=True,
    variants=(lambda t: (1 / 8, 16), lambda t: (np.float64(64 / 512), 16.0), lambda t: t),
    mistakes=(
        (lambda t: (1.0, t[1]), "the scale fits d_k = 64, not the width E = 512: Var = 64 / 512."),
        (lambda t: (1 / math.sqrt(8), t[1]), _BY_WIDTH_SQUARE),
        (lambda t: (64 / math.sqrt(512), t[1]), "Var(x / c) = Var(x) / c²: divide 64 by 512."),
        (lambda t: (t[0], 1.0), "1/√d_k undoes the growth with D, not the entries' size (2·2)²."),
        (lambda t: (t[0], 4.0), _STD_TWO_PRODUCT),
        (lambda t: (t[0], 1024.0), "Var(q·k) = 64·16 = 1024; the scale 1/√64 divides it by 64."),
    ),
    hint={
        "by_width": "Var(q·k) = d_k = 64, and dividing by √512 divides the variance by 512.",
        "std_two": "Var(q_i·k_i) = Var(q_i)·Var(k_i); d_k of them add up, then divide by d_k.",
    },
    atol=0.0,
    rtol=0.1,
    outputs=("by_width", "std_two"),
    convert=_as_numbers,
    doc="Check predicted variances, for q and k of d_k = 64 independent entries: of q·k/√512 (the "
    "model width's scale, standard normal entries) and of q·k/√64 for entries of standard deviation "
    "2; within 10% of the variances measured on 100,000 random pairs.",
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


def _sdpa_by_private_helper(q: Tensor, k: Tensor, v: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    """mha.attention's private helper, which skips the argument checks."""
    from mha.attention import _attention  # reached around the public name

    return _attention(q, k, v, None, 0.0, False, q.shape[-1] ** -0.5)


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
        (_sdpa_by_private_helper, _NO_SDPA),
    ),
    hint="out must equal softmax(q @ kᵀ / √D, dim=-1) @ v.",
    crash_hint=_TRANSPOSE,
    forbidden=READY_MADE_ATTENTION,
    forbidden_hint=_NO_SDPA,
    rewrites=(mha.scaled_dot_product_attention, F.scaled_dot_product_attention),
    params=("my_attention",),
    doc="Check a hand-written ``my_attention(q, k, v)`` = softmax(q kᵀ / √D) v against "
    "``F.scaled_dot_product_attention`` (which it must not call): 2-D to 4-D, L ≠ S, D ≠ Dv.",
)


# --- 2.4: causal linear attention by prefix sums ------------------------------------------------


class ScoreMatrix(Exception):
    """An answer made a tensor as large as the (L, L) weights."""


class QuadraticWork(Exception):
    """An answer made, in all its tensors together, as many elements as the quadratic form."""


@dataclass(frozen=True)
class _Guarded(Case):
    """A case run under the guards: no tensor of ``limit`` elements or more and, if ``budget``
    is set, fewer than ``budget`` elements made in all."""

    limit: int = 0
    budget: int = 0


class _Work(TorchFunctionMode):
    """Adds up the elements of every tensor the torch functions called inside return (views and
    slices too: a slice of i keys is i keys' worth of work)."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget, self.total = budget, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.total += t.numel()
        if self.budget and self.total >= self.budget:
            raise QuadraticWork  # stop early; checked again on the way out
        return out


def _phi(x: Tensor) -> Tensor:
    return F.elu(x) + 1.0  # (..., L, D), every entry > 0


def _causal_linear_quadratic(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The quadratic form: the (L, L) weights φ(q_i)·φ(k_j) for j <= i, rows normalised."""
    sim = (_phi(q) @ _phi(k).mT).tril()  # (..., L, L), zero above the diagonal
    return sim / sim.sum(-1, keepdim=True) @ v  # (..., L, Dv)


def _masked_quadratic(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The same weights with a causal mask applied to the whole (L, L) matrix."""
    L = q.shape[-2]
    future = torch.ones(L, L, dtype=torch.bool).triu(1)  # (L, L) True above the diagonal
    sim = (F.elu(q) + 1) @ (F.elu(k) + 1).mT  # (..., L, L)
    weights = sim.masked_fill(future, 0.0)
    return weights / weights.sum(-1, keepdim=True) @ v


def _linear_slip(q: Tensor, k: Tensor, v: Tensor, **slip: bool) -> Tensor:
    """The prefix-sum form: right without ``slip``, or with one of the usual slips."""
    fq, fk = (q, k) if slip.get("no_phi") else (_phi(q), _phi(k))  # (..., L, D)
    kv = fk[..., :, None] * v[..., None, :]  # (..., L, D, Dv): φ(k_j) v_jᵀ per key
    kv_seen = kv.sum(-3, keepdim=True) if slip.get("all_keys") else kv.cumsum(-3)
    z_seen = fk.sum(-2, keepdim=True) if slip.get("global_z") else fk.cumsum(-2)  # (..., L, D)
    if slip.get("exclusive"):  # keys j < i only
        kv_seen, z_seen = kv_seen - kv, z_seen - fk
    num = (fq[..., :, None] * kv_seen).sum(-2)  # (..., L, Dv)
    if slip.get("no_norm"):
        return num
    return num / (fq * z_seen).sum(-1, keepdim=True)  # (..., L, Dv)


def _linear_by_loop(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The recurrent form: a running (D, Dv) state and a running (D,) normaliser."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])  # (..., D, Dv)
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])  # (..., D)
    rows = []
    for i in range(q.shape[-2]):
        state = state + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        num = torch.einsum("...d,...de->...e", fq[..., i, :], state)  # (..., Dv)
        rows.append(num / (fq[..., i, :] * z).sum(-1, keepdim=True))
    return torch.stack(rows, -2)  # (..., L, Dv)


def _linear_by_chunks(q: Tensor, k: Tensor, v: Tensor, chunk: int = 16) -> Tensor:
    """Chunks of 16 keys: a small masked matrix inside a chunk, a carried state across chunks."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    state = torch.einsum("...ld,...le->...de", fk[..., :0, :], v[..., :0, :])  # (..., D, Dv) zeros
    z = fk[..., :0, :].sum(-2)  # (..., D) zeros
    outs = []
    for c0 in range(0, q.shape[-2], chunk):
        qc, kc, vc = (
            fq[..., c0 : c0 + chunk, :],
            fk[..., c0 : c0 + chunk, :],
            v[..., c0 : c0 + chunk, :],
        )
        sim = torch.tril(qc @ kc.mT)  # (..., c, c): inside the chunk only
        num = sim @ vc + qc @ state  # (..., c, Dv)
        den = sim.sum(-1, keepdim=True) + (qc * z[..., None, :]).sum(-1, keepdim=True)
        outs.append(num / den)
        state, z = state + kc.mT @ vc, z + kc.sum(-2)
    return torch.cat(outs, -2)  # (..., L, Dv)


def _linear_row_by_row(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The quadratic form one query at a time: no (L, L) tensor, but L²/2 similarities."""
    fq, fk = _phi(q), _phi(k)  # (..., L, D)
    rows = []
    for i in range(q.shape[-2]):
        sim = fq[..., i : i + 1, :] @ fk[..., : i + 1, :].mT  # (..., 1, i + 1): keys 0..i
        rows.append(sim / sim.sum(-1, keepdim=True) @ v[..., : i + 1, :])  # (..., 1, Dv)
    return torch.cat(rows, -2)  # (..., L, Dv)


#: The long case: L = 1024 with D = Dv = 2, where running sums make about 60·L elements in all
#: and any form that meets every earlier key makes more than L²/2.
_LONG = 1024


def _causal_linear_cases() -> list[Case]:
    """Float64 inputs small enough in B·H·D·Dv that the prefix sums (..., L, D, Dv) stay under
    one (L, L) matrix, so the guard catches only the weights; then one long sequence whose
    elements are counted, so that a row-by-row quadratic form is caught too."""
    g = torch.Generator().manual_seed(24)
    specs = (((64,), 4, 3), ((2, 64), 4, 3), ((1, 2, 96), 4, 5), ((3, 80), 5, 4))
    cases: list[Case] = []
    for (*batch, L), D, Dv in specs:
        q, k = randn64(g, *batch, L, D) * 1.5, randn64(g, *batch, L, D) * 1.5
        v = randn64(g, *batch, L, Dv)
        shape = (*batch, L, D)
        label = f"my_causal_linear(q, k, v) with q {shape}, Dv = {Dv}"
        cases.append(_Guarded(label, (q, k, v), limit=L * L))
    q, k, v = (randn64(g, _LONG, 2) for _ in range(3))
    label = f"my_causal_linear(q, k, v) with q {(_LONG, 2)}, Dv = 2"
    return [*cases, _Guarded(label, (q, k, v), limit=_LONG**2, budget=_LONG**2 // 4)]


def _call_guarded(answer: Callable[..., Any], case: Case) -> Any:
    """The answer's output on ``case``, made with no tensor of L·L elements or more and, on the
    long case, with fewer than its ``budget`` elements in all."""
    args = [a.clone() if isinstance(a, Tensor) else a for a in case.args]
    seen: list[tuple[int, ...]] = []
    work = _Work(getattr(case, "budget", 0))
    out = None
    try:
        with never_larger(getattr(case, "limit", 0) or 1, "{shape}") as seen, work:
            out = answer(*args, **case.kwargs)
    except ExerciseError:
        if not seen:  # a banned call: watch's own error
            raise
        message = "it made a tensor of L·L elements or more, as large as the (L, L) weights"
        raise ScoreMatrix(tr(message)) from None
    except QuadraticWork:
        pass  # reported below
    if work.budget and work.total >= work.budget:  # also when the answer caught the exception
        message = (
            "its tensors added up to L²/4 = {budget} elements or more at L = {L}: quadratic work, "
            "as if each query met every key before it"
        )
        raise QuadraticWork(tr(message, budget=work.budget, L=_LONG))
    return out


def _linear_by_private_phi(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Running sums, φ taken from mha.linear_attention's private _phi."""
    from mha.linear_attention import _phi as library_phi  # reached around the public names

    fq, fk = library_phi(q), library_phi(k)  # (..., L, D)
    kv = (fk[..., :, None] * v[..., None, :]).cumsum(-3)  # (..., L, D, Dv)
    return (fq[..., :, None] * kv).sum(-2) / (fq * fk.cumsum(-2)).sum(-1, keepdim=True)


_NO_LINEAR_LIBRARY = (
    "write causal linear attention yourself, with no function of mha.linear_attention "
    "(linear_attention, linear_attention_weights, elu_feature_map and their helpers)."
)
_ROW_BY_ROW = (
    "Each query still meets every key before it, one row at a time: L²/2 similarities, the work "
    "of the quadratic form. Carry running sums of φ(k_j) v_jᵀ and φ(k_j) instead (a cumsum, or "
    "a state updated once per position)."
)
_QUADRATIC_FORM = (
    "Make no (L, L) matrix: that is the quadratic form, which costs what softmax attention "
    "costs. Sum φ(k_j) v_jᵀ and φ(k_j) over the keys so far with cumsum along the sequence dim."
)
_CAUSAL = (
    "Query i may only see keys 0..i: a sum over all the keys lets it read the future. Replace "
    "the sums over the sequence by running sums, cumsum(dim=-3) for φ(k_j) v_jᵀ (..., L, D, Dv) "
    "and cumsum(dim=-2) for φ(k_j)."
)
_CAUSAL_Z = (
    "The normaliser must see the same keys as the numerator: Σ_{j <= i} φ(k_j), a cumsum, "
    "not the sum over all the keys."
)
_INCLUSIVE = (
    "Key i is visible to query i: the running sums include the current key (cumsum is inclusive)."
)
_NORMALISE = "Divide by φ(q_i)·Σ_{j <= i} φ(k_j), so that each query's weights sum to 1."
_FEATURES = "Apply the feature map first: φ(x) = elu(x) + 1 keeps every similarity positive."
CAUSAL_LINEAR_ATTENTION = Exercise(
    "check_causal_linear_attention",
    "equals the masked quadratic form (float64, 1 to 3 batch dims), with no tensor of L·L "
    "elements; at L = 1024, fewer than L²/4 elements made in all: linear work, not the quadratic "
    "form row by row",
    _causal_linear_quadratic,
    _causal_linear_cases,
    variants=(_linear_slip, _linear_by_loop, _linear_by_chunks),
    mistakes=(
        (_masked_quadratic, _QUADRATIC_FORM),
        (_linear_row_by_row, _ROW_BY_ROW),
        (partial(_linear_slip, all_keys=True, global_z=True), _CAUSAL),
        (partial(_linear_slip, global_z=True), _CAUSAL_Z),
        (partial(_linear_slip, exclusive=True), _INCLUSIVE),
        (partial(_linear_slip, no_norm=True), _NORMALISE),
        (partial(_linear_slip, no_phi=True), _FEATURES),
        (lambda q, k, v: mha.linear_attention(q, k, v), _NO_LINEAR_LIBRARY),
        (lambda q, k, v: mha.linear_attention_weights(q, k).tril() @ v, _NO_LINEAR_LIBRARY),
        (_linear_by_private_phi, _NO_LINEAR_LIBRARY),
    ),
    hint="out_i = φ(q_i)ᵀ (Σ_{j <= i} φ(k_j) v_jᵀ) / φ(q_i)ᵀ Σ_{j <= i} φ(k_j), φ(x) = elu(x) + 1.",
    crash_hint="q, k: (..., L, D), v: (..., L, Dv); the running sums are (..., L, D, Dv) and (..., L, D).",
    atol=1e-10,
    rtol=1e-8,
    call=_call_guarded,
    forbidden=tuple(defined_in(linear_attention_module)),
    forbidden_hint=_NO_LINEAR_LIBRARY,
    rewrites=(mha.linear_attention,),
    params=("my_causal_linear",),
    doc="Check a causal linear attention ``my_causal_linear(q, k, v)`` (φ = elu + 1) written with "
    "running sums against the masked quadratic form, under a guard against any tensor of L·L "
    "elements and, at L = 1024, a count of every element it makes (under L²/4: linear work); no "
    "function of ``mha.linear_attention``.",
)


EXERCISES = publish(globals())
