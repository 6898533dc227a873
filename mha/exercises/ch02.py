"""Checkers for chapter 2, scaled dot-product attention.

Each checker runs the learner's answer on fixed inputs, compares it with PyTorch's own operators
(``torch.softmax``, ``torch.nn.functional.scaled_dot_product_attention``) and, when the answer is
wrong, recognises the usual mistakes (no max subtraction, wrong axis, no scaling, missing
transpose ...) to give a targeted hint.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from ._check import ExerciseError, check_close, passed

__all__ = [
    "check_qk_variance_prediction",
    "check_sdpa",
    "check_shape_prediction",
    "check_softmax",
]


class _ForbiddenCall(Exception):
    """Raised inside a checker when the learner calls the operator they are asked to write."""


@contextmanager
def _forbid(targets: list[tuple[object, str]], message: str) -> Iterator[None]:
    """Temporarily replace ``getattr(owner, name)`` for every pair in ``targets`` by a tripwire."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise _ForbiddenCall(message)

    # (owner, name, own attribute or None if inherited) so that restoring leaves no trace
    saved = [
        (owner, name, vars(owner).get(name)) for owner, name in targets if hasattr(owner, name)
    ]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, tripwire)
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class _Crash(Exception):
    """The learner's function raised; the message quotes the original error."""


def _call(fn: Callable[..., object], what: str, *args: object, **kwargs: object) -> object:
    """Call the learner's function, turning a crash into an ``ExerciseError`` that quotes it."""
    try:
        return fn(*args, **kwargs)
    except _ForbiddenCall as err:
        raise ExerciseError(f"{what}: {err}") from None
    except Exception as err:  # the learner's bug, reported with a hint by the caller
        raise _Crash(f"{what} raised {type(err).__name__}: {err}") from err


def _matches(actual: object, candidate: Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    """True if ``actual`` is a tensor numerically equal (NaN where NaN) to ``candidate``."""
    if not isinstance(actual, Tensor) or actual.shape != candidate.shape:
        return False
    return bool(
        torch.allclose(
            actual.detach().to(candidate.dtype), candidate, atol=atol, rtol=rtol, equal_nan=True
        )
    )


# ----------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------

_SOFTMAX_OPS = [
    (torch, "softmax"),
    (torch, "log_softmax"),
    (torch.special, "softmax"),
    (torch.special, "log_softmax"),
    (F, "softmax"),
    (F, "log_softmax"),
    (torch.Tensor, "softmax"),
    (torch.Tensor, "log_softmax"),
]

_HINT_OVERFLOW = (
    "exp() overflowed: exp(89) is already inf in float32 (exp(11.1) in float16), and inf/inf is "
    "NaN. Subtract the maximum along `dim` before exponentiating: softmax(x) = softmax(x - max)."
)
_HINT_ROW_MAX = (
    "Subtract the maximum of each slice along `dim` (x.amax(dim=dim, keepdim=True)), not one "
    "global maximum: a row far below the global max underflows to all zeros, and 0/0 is NaN."
)
_HINT_AXIS = (
    "Normalise along the `dim` you are given: use it in both the max and the sum, with "
    "keepdim=True so that the result broadcasts back against x."
)


def check_softmax(my_softmax: Callable[..., Tensor]) -> None:
    """Check a hand-written, numerically stable ``my_softmax(x, dim=-1)``.

    The learner's function must not call ``torch.softmax`` (or its aliases); it is compared with
    ``torch.softmax`` on small logits, on logits of 1000 (where the naive ``exp(x) / sum`` gives
    NaN), on rows of very different magnitude (where subtracting one global maximum gives NaN),
    along a middle axis, and in float16.
    """
    name = "check_softmax"
    g = torch.Generator().manual_seed(2)
    small = torch.randn(4, 6, generator=g)
    middle = torch.randn(2, 5, 3, generator=g) * 3
    large = torch.tensor([[1000.0, 999.0, 998.0, 990.0], [995.0, 1000.0, 990.0, 999.0]])
    spread = torch.tensor([[1000.0, 999.0, 998.0], [0.0, -1.0, -2.0]])
    half = torch.tensor([[12.0, 10.0, 8.0, 0.0]], dtype=torch.float16)

    cases = [
        ("my_softmax(x) on small logits", small, -1),
        ("my_softmax(x, dim=1) on a (2, 5, 3) tensor", middle, 1),
        ("my_softmax(x) on logits near 1000", large, -1),
        ("my_softmax(x) on rows of very different size", spread, -1),
        ("my_softmax(x) in float16 on logits up to 12", half, -1),
    ]
    import mha  # imported here: the package imports this module while it initialises

    forbidden = [*_SOFTMAX_OPS, (mha, "softmax")]
    outputs = []
    with _forbid(
        forbidden,
        "write softmax yourself from exp, max and sum, without "
        "calling torch.softmax or its aliases.",
    ):
        for what, x, dim in cases:
            try:
                outputs.append(_call(my_softmax, what, x.clone(), dim=dim))
            except _Crash as err:
                raise ExerciseError(f"{err}. {_HINT_AXIS}") from None

    for (what, x, dim), out in zip(cases, outputs):
        if not isinstance(out, Tensor):
            raise ExerciseError(f"{what} should return a torch.Tensor, got {type(out).__name__}.")
        if out.shape != x.shape:
            raise ExerciseError(
                f"{what} has shape {tuple(out.shape)}, expected {tuple(x.shape)}: softmax keeps "
                f"the shape of its input. {_HINT_AXIS}"
            )
        if out.dtype != x.dtype:
            raise ExerciseError(
                f"{what} returned {out.dtype} for a {x.dtype} input; keep the input's dtype."
            )
        ref = torch.softmax(x.float(), dim=dim)
        atol, rtol = (2e-3, 2e-3) if x.dtype == torch.float16 else (1e-6, 1e-5)
        check_close(
            out.float(), ref, what=what, hint=_softmax_hint(out, x, dim), atol=atol, rtol=rtol
        )
    passed(name, "stable for large logits, right axis, float16 included")


def _softmax_hint(out: Tensor, x: Tensor, dim: int) -> str:
    """Name the mistake that explains a wrong softmax result."""
    out = out.detach().float()
    xf = x.float()
    if not torch.isfinite(out).all():
        shifted = torch.exp(xf - xf.max())  # one global max: a typical slip
        if _matches(out, shifted / shifted.sum(dim, keepdim=True)):
            return _HINT_ROW_MAX
        return _HINT_OVERFLOW
    for other in range(x.dim()):
        if other != dim % x.dim() and _matches(out, torch.softmax(xf, dim=other)):
            return f"You normalised along dim={other}, not dim={dim}. {_HINT_AXIS}"
    if _matches(out, torch.exp(xf) / torch.exp(xf).sum()):
        return "You divided by the sum of the whole tensor. " + _HINT_AXIS
    return "Each slice along `dim` must be exp(x - max) divided by its own sum."


# ----------------------------------------------------------------------------------------------
# Predict, then run
# ----------------------------------------------------------------------------------------------


def _as_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ExerciseError(f"{what} should be a number, got {value!r}.")
    return float(value)


def check_qk_variance_prediction(unscaled: float, scaled: float) -> None:
    """Check a prediction of Var(q·k) for d_k = 64, without and with the 1/√d_k scale.

    The entries of q and k are independent standard normal draws. The checker *measures* the two
    variances on 100,000 random pairs and accepts predictions within 10% of the measurement.

    Args:
        unscaled: predicted variance of ``q @ k``.
        scaled: predicted variance of ``q @ k / sqrt(64)``.
    """
    d_k = 64
    u = _as_number(unscaled, "unscaled")
    s = _as_number(scaled, "scaled")
    g = torch.Generator().manual_seed(64)
    q = torch.randn(100_000, d_k, generator=g)
    k = torch.randn(100_000, d_k, generator=g)
    dots = (q * k).sum(-1)  # (N,)
    var_unscaled = dots.var().item()
    var_scaled = (dots / math.sqrt(d_k)).var().item()

    def close(pred: float, measured: float) -> bool:
        return abs(pred - measured) <= 0.1 * measured

    if not close(u, var_unscaled):
        if close(u, math.sqrt(var_unscaled)):
            hint = "that is the standard deviation √d_k; the variance is its square."
        elif close(u, 1.0):
            hint = (
                "each product q_i·k_i has variance 1, and the variances of the 64 "
                "independent terms add up."
            )
        else:
            hint = (
                "q·k is a sum of d_k independent products q_i·k_i, each with mean 0 and "
                "variance E[q_i²]·E[k_i²] = 1."
            )
        raise ExerciseError(
            f"Your unscaled prediction {u:g} is off: the measured variance of q·k for d_k = 64 is "
            f"about {var_unscaled:.1f}. Hint: {hint}"
        )
    if not close(s, var_scaled):
        if close(s, 1 / math.sqrt(d_k)) or close(s, math.sqrt(d_k)):
            hint = "dividing a variable by c divides its variance by c², here by d_k."
        else:
            hint = "Var(x / c) = Var(x) / c²; with c = √d_k that undoes the growth exactly."
        raise ExerciseError(
            f"Your scaled prediction {s:g} is off: the measured variance of q·k/√64 is about "
            f"{var_scaled:.2f}. Hint: {hint}"
        )
    passed(
        "check_qk_variance_prediction",
        f"measured {var_unscaled:.1f} unscaled and {var_scaled:.2f} scaled",
    )


def check_shape_prediction(weights: tuple[int, ...], out: tuple[int, ...]) -> None:
    """Check predicted shapes for attention with query (2, 8, 10, 64), key (2, 8, 7, 64), value (2, 8, 7, 32).

    The checker runs ``torch.nn.functional.scaled_dot_product_attention`` (and the softmax of
    the scores) on tensors of those shapes and compares.

    Args:
        weights: predicted shape of the attention weights.
        out: predicted shape of the output.
    """
    q = torch.zeros(2, 8, 10, 64)  # (B, H, L, D)
    k = torch.zeros(2, 8, 7, 64)  # (B, H, S, D)
    v = torch.zeros(2, 8, 7, 32)  # (B, H, S, Dv)
    true_weights = tuple(torch.softmax(q @ k.transpose(-2, -1), dim=-1).shape)  # (B, H, L, S)
    true_out = tuple(F.scaled_dot_product_attention(q, k, v).shape)  # (B, H, L, Dv)
    for what, predicted in (("weights", weights), ("out", out)):
        try:
            ok = all(isinstance(n, int) for n in predicted)
        except TypeError:
            ok = False
        if not ok:
            raise ExerciseError(f"{what} should be a tuple of ints, got {predicted!r}.")
    pw, po = tuple(weights), tuple(out)
    if pw != true_weights:
        if pw == (2, 8, 7, 10):
            hint = "rows are queries (L = 10) and columns are keys (S = 7), not the other way."
        elif len(pw) == 4 and pw[-1] == 64:
            hint = "the head dim D is summed away by q @ kᵀ: one score per (query, key) pair."
        else:
            hint = "one weight per (query, key) pair in every batch and head: (B, H, L, S)."
        raise ExerciseError(
            f"weights: you predicted {pw}, the real shape is {true_weights}. Hint: {hint}"
        )
    if po != true_out:
        if len(po) == 4 and po[-1] == 64:
            hint = "the output mixes value rows, so its last dim is the value dim Dv = 32."
        elif len(po) == 4 and po[-2] == 7:
            hint = "there is one output row per query (L = 10), whatever the number of keys."
        else:
            hint = "(B, H, L, S) weights times (B, H, S, Dv) values gives (B, H, L, Dv)."
        raise ExerciseError(f"out: you predicted {po}, the real shape is {true_out}. Hint: {hint}")
    passed("check_shape_prediction", f"weights {true_weights}, out {true_out}")


# ----------------------------------------------------------------------------------------------
# Scaled dot-product attention
# ----------------------------------------------------------------------------------------------

_HINT_TRANSPOSE = (
    "The scores are q @ kᵀ over the last two dims: use k.transpose(-2, -1) (or k.mT); "
    "negative dims make it work for any number of leading batch dims, while k.T reverses "
    "all dims of a batched tensor."
)


def _attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, softmax_dim: int = -1, transpose: bool = True
) -> Tensor:
    """Reference attention and its typical mis-implementations (for the hints)."""
    kt = k.transpose(-2, -1) if transpose else k  # (..., D, S), or (..., S, D) if not
    scores = q @ kt * scale  # (..., L, S)
    return torch.softmax(scores, dim=softmax_dim) @ v  # (..., L, Dv)


def check_sdpa(my_attention: Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
    """Check a hand-written ``my_attention(q, k, v) -> out`` = softmax(q kᵀ / √D) v.

    It must work for any number of leading batch dims, with L ≠ S and D ≠ Dv, and match
    ``torch.nn.functional.scaled_dot_product_attention`` (which it must not call).
    """
    name = "check_sdpa"
    g = torch.Generator().manual_seed(3)

    def rnd(*shape: int) -> Tensor:
        # std 3 so that a missing or wrong scale changes the result clearly
        return torch.randn(*shape, generator=g) * 3

    cases = [
        # (what, q, k, v) with shapes (..., L, D), (..., S, D), (..., S, Dv)
        (
            "my_attention(q, k, v) with q (2, 3, 4, 8), k (2, 3, 6, 8), v (2, 3, 6, 5)",
            rnd(2, 3, 4, 8),
            rnd(2, 3, 6, 8),
            rnd(2, 3, 6, 5),
        ),
        (
            "my_attention(q, k, v) with q (2, 5, 6), k (2, 6, 6), v (2, 6, 3)",
            rnd(2, 5, 6),
            rnd(2, 6, 6),
            rnd(2, 6, 3),
        ),
        (
            "my_attention(q, k, v) with q (3, 4), k (7, 4), v (7, 2)",
            rnd(3, 4),
            rnd(7, 4),
            rnd(7, 2),
        ),
    ]
    import mha  # imported here: the package imports this module while it initialises

    forbidden = [(F, "scaled_dot_product_attention"), (mha, "scaled_dot_product_attention")]

    for what, q, k, v in cases:
        ref = F.scaled_dot_product_attention(q, k, v)  # (..., L, Dv)
        scale = 1 / math.sqrt(q.shape[-1])
        with _forbid(
            forbidden,
            "build attention from matmul and softmax yourself, without "
            "calling a ready-made scaled_dot_product_attention.",
        ):
            try:
                out = _call(my_attention, what, q.clone(), k.clone(), v.clone())
            except _Crash as err:
                raise ExerciseError(f"{err}. {_HINT_TRANSPOSE}") from None
        if isinstance(out, tuple):
            raise ExerciseError(f"{what} returned a tuple; return only the output tensor.")
        if isinstance(out, Tensor) and out.shape == q.shape[:-1] + (k.shape[-2],):
            raise ExerciseError(
                f"{what} has shape {tuple(out.shape)}, the shape of the weights (..., L, S). "
                "Multiply the weights by v to get the output (..., L, Dv)."
            )
        candidates = {
            "Scale the scores by 1/√D (D = q.shape[-1]) before the softmax; without it the "
            "softmax saturates as D grows.": _attention(q, k, v, scale=1.0),
            "The scale is 1/√D, not 1/D.": _attention(q, k, v, scale=1 / q.shape[-1]),
            "Divide the scores by √D; you multiplied by it.": _attention(
                q, k, v, scale=math.sqrt(q.shape[-1])
            ),
            "The softmax runs over the keys (dim=-1): each query's weights must sum to 1. "
            "You normalised over the queries (dim=-2).": _attention(
                q, k, v, scale=scale, softmax_dim=-2
            ),
        }
        if k.shape[-1] == k.shape[-2]:
            candidates[_HINT_TRANSPOSE] = _attention(q, k, v, scale=scale, transpose=False)
        hint = next(
            (h for h, c in candidates.items() if _matches(out, c)),
            "out must equal softmax(q @ kᵀ / √D, dim=-1) @ v.",
        )
        check_close(out, ref, what=what, hint=hint)
    passed(name, "matches torch's scaled_dot_product_attention for 2-D, 3-D and 4-D inputs")
