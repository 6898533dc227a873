"""Chapter 7, the backward pass: the exercises as data for :mod:`._harness`.

References: autograd through ``torch.softmax`` and ``F.scaled_dot_product_attention`` (float64),
the weights by their definition, and the bytes autograd saves, counted with
``torch.autograd.graph.saved_tensors_hooks``; mistakes: no rowsum term, the wrong axis, no scale or
the scale twice, ``dS`` where ``dSᵀ`` belongs, a tile normalised on its own, ``exp(s) / exp(lse)``
(overflow), the default scale in place of the given one, O(L²) for the tiles; and autograd itself,
which the backward exercises ban.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from .. import flash
from ._harness import Case, Exercise, ExerciseError, publish, randn64, tr

#: What the backward exercises are to do by hand: autograd in every form, and torch's own kernel.
AUTOGRAD = (
    torch.autograd.grad,
    torch.autograd.backward,
    Tensor.backward,
    *(getattr(torch.func, n) for n in ("grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd")),
    *(getattr(torch.autograd.functional, n) for n in ("jacobian", "vjp", "jvp", "vhp", "hvp")),
    torch._softmax_backward_data,
)
_NO_AUTOGRAD = (
    "compute dS with the formula, without autograd (torch.autograd.grad, .backward(), torch.func)."
)


# --- the softmax backward -----------------------------------------------------------------------


def _softmax_backward_reference(p: Tensor, dp: Tensor) -> Tensor:
    """Autograd's gradient of the scores, given the weights ``p = softmax(scores)`` and ``dp``."""
    scores = p.log().detach().requires_grad_()  # softmax(log p) = p: p's rows sum to 1
    (ds,) = torch.autograd.grad(torch.softmax(scores, -1), scores, dp)
    return ds


def _softmax_cases() -> list[Case]:
    g = torch.Generator().manual_seed(70)
    cases = []
    for label, shape in (("(2, 3, 4, 6)", (2, 3, 4, 6)), ("(3, 5, 5)", (3, 5, 5))):
        p = torch.softmax(randn64(g, *shape) * 2, -1)  # (..., L, S), rows sum to 1
        cases.append(Case(f"softmax_backward(p, dp) on {label}", (p, randn64(g, *shape))))
    return cases


_HINT_SOFTMAX = (
    "Row by row, dS_i = J_i dP_i with J_i = diag(p_i) - p_i p_iᵀ, that is "
    "dS = P * (dP - (P * dP).sum(-1, keepdim=True))."
)


def _jacobian_softmax_backward(p: Tensor, dp: Tensor) -> Tensor:
    """The explicit Jacobian, J = diag(p) - p pᵀ per row, times dP (J is symmetric)."""
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)  # (..., L, S, S)
    return (jac @ dp.unsqueeze(-1)).squeeze(-1)  # (..., L, S)


SOFTMAX_BACKWARD = Exercise(
    "check_softmax_backward",
    "equals autograd's gradient through torch.softmax (float64)",
    _softmax_backward_reference,
    _softmax_cases,
    variants=(
        lambda p, dp: p * (dp - (p * dp).sum(-1, keepdim=True)),
        _jacobian_softmax_backward,
        lambda p, dp: p * dp - p * torch.einsum("...s,...s->...", p, dp).unsqueeze(-1),
    ),
    mistakes=(
        (
            lambda p, dp: p * dp,
            "The rowsum term is missing: every weight of a row depends on every score of it "
            "(the -p pᵀ part of the Jacobian). " + _HINT_SOFTMAX,
        ),
        (
            lambda p, dp: p * (dp - (p * dp).sum(-2, keepdim=True)),
            "Sum over the keys (dim -1): each query row is its own softmax. " + _HINT_SOFTMAX,
        ),
        (
            lambda p, dp: dp - (p * dp).sum(-1, keepdim=True),
            "Multiply by P: the diagonal of the Jacobian is p_i, not 1. " + _HINT_SOFTMAX,
        ),
        (_softmax_backward_reference, _NO_AUTOGRAD),
        (lambda p, dp: torch._softmax_backward_data(dp, p, -1, p.dtype), _NO_AUTOGRAD),
        (lambda p, dp: torch.func.vjp(lambda s: s.softmax(-1), p.log())[1](dp)[0], _NO_AUTOGRAD),
    ),
    hint=_HINT_SOFTMAX,
    crash_hint="p and dp are (..., L, S); keep the summed dimension (keepdim=True) so that it "
    "broadcasts back.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=AUTOGRAD,
    forbidden_hint=_NO_AUTOGRAD,
    params=("softmax_backward",),
    doc="Check ``softmax_backward(p, dp) -> ds``: the gradient of the scores from the weights "
    "``p`` (..., L, S) and their gradient ``dp``, written without autograd, against autograd in "
    "float64.",
)


# --- the whole backward pass of attention ---------------------------------------------------------


def _attention_grads(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    """Autograd through torch's SDPA: ``(dq, dk, dv)``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, Dv)
    return torch.autograd.grad(out, (q, k, v), d_out)


def _backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, **slip: int) -> tuple[Tensor, ...]:
    """The backward pass by hand: right without ``slip``, or with one of the usual slips."""
    scale = 1 / math.sqrt(slip.get("D") or q.shape[-1])
    p = torch.softmax(q @ k.transpose(-2, -1) * scale, -1)  # (B, H, L, S)
    dv = (p if slip.get("p_not_transposed") else p.transpose(-2, -1)) @ d_out  # (B, H, S, Dv)
    dp = d_out @ v.transpose(-2, -1)  # (B, H, L, S)
    delta = 0.0 if slip.get("no_delta") else (p * dp).sum(-1, keepdim=True)  # (B, H, L, 1)
    ds = p * (dp - delta)  # (B, H, L, S)
    factor = {"no_scale": 1.0, "scale_twice": scale * scale}
    s = next((f for name, f in factor.items() if slip.get(name)), scale)
    dq = ds @ k * s  # (B, H, L, D)
    dk = (ds if slip.get("ds_not_transposed") else ds.transpose(-2, -1)) @ q * s  # (B, H, S, D)
    return dq, dk, dv


def _attention_cases() -> list[Case]:
    g = torch.Generator().manual_seed(71)
    cases = []
    for L, S, D in ((6, 6, 8), (5, 7, 16)):
        q, k, v = randn64(g, 2, 3, L, D), randn64(g, 2, 3, S, D), randn64(g, 2, 3, S, 4)
        d_out = randn64(g, 2, 3, L, 4)  # dO
        label = f"attention_backward(q, k, v, d_out) with L={L}, S={S}"
        cases.append(Case(label, (q, k, v, d_out)))
    return cases


def _slip(name: str) -> Callable[..., tuple[Tensor, ...]]:
    return lambda q, k, v, d_out: _backward(q, k, v, d_out, **{name: True})


_FORMULAS = (
    "dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P * (dP - δ) with δ = rowsum(dO * O), "
    "dQ = dS·K·scale, dK = dSᵀ·Q·scale."
)


def _einsum_attention_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor):
    scale = q.shape[-1] ** -0.5
    p = torch.einsum("...ld,...sd->...ls", q, k).mul(scale).softmax(-1)  # (B, H, L, S)
    out = p @ v  # (B, H, L, Dv)
    dp = torch.einsum("...le,...se->...ls", d_out, v)  # (B, H, L, S)
    ds = p * (dp - (d_out * out).sum(-1, keepdim=True))  # δ = rowsum(dO * O)
    dq = torch.einsum("...ls,...sd->...ld", ds, k) * scale
    dk = torch.einsum("...ls,...ld->...sd", ds, q) * scale
    dv = torch.einsum("...ls,...le->...se", p, d_out)
    return dq, dk, dv


def _by_autograd(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), -1) @ v
    return torch.autograd.grad(out, (q, k, v), d_out)


def _by_flash_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    out, lse = mha.flash_attention(q, k, v, return_lse=True)
    scale = 1 / math.sqrt(q.shape[-1])
    return flash.flash_attention_backward(
        d_out, q, k, v, out, lse, None, False, scale=scale, block_size=4
    )[:3]


_NO_AUTOGRAD_ATTENTION = (
    "compute the gradients with the formulas, without autograd (torch.autograd.grad, "
    ".backward()) or mha.flash.flash_attention_backward."
)
ATTENTION_BACKWARD = Exercise(
    "check_attention_backward",
    "dQ, dK and dV equal autograd's through torch's SDPA (float64, L = S and L ≠ S)",
    _attention_grads,
    _attention_cases,
    variants=(lambda q, k, v, d_out: _backward(q, k, v, d_out), _einsum_attention_backward),
    mistakes=(
        (_slip("no_delta"), "dS = P * (dP - δ): the -δ term (δ = rowsum(dO * O)) is missing."),
        (_slip("no_scale"), "The scores are q·kᵀ·scale: dQ and dK carry the scale once."),
        (
            _slip("scale_twice"),
            "The scale is applied twice: dQ = dS·K·scale and dK = dSᵀ·Q·scale, once each.",
        ),
        (
            _slip("ds_not_transposed"),
            "dK = dSᵀ·Q·scale: transpose dS so that the keys come first, (S, L) @ (L, D).",
        ),
        (
            _slip("p_not_transposed"),
            "dV = Pᵀ·dO: key j collects the gradient of every query that looked at it, "
            "(S, L) @ (L, Dv).",
        ),
        (
            lambda q, k, v, d_out: _backward(q, k, v, d_out, D=8),
            "Take D from the inputs, q.shape[-1]: a fixed head dimension is right for one size only.",
        ),
        (_by_autograd, _NO_AUTOGRAD_ATTENTION),
        (_by_flash_backward, _NO_AUTOGRAD_ATTENTION),
    ),
    hint={name: f"{name} is wrong. " + _FORMULAS for name in ("dq", "dk", "dv")},
    crash_hint=_FORMULAS,
    atol=1e-10,
    rtol=1e-8,
    outputs=("dq", "dk", "dv"),
    forbidden=(*AUTOGRAD, flash.flash_attention_backward),
    forbidden_hint=_NO_AUTOGRAD_ATTENTION,
    params=("attention_backward",),
    doc="Check ``attention_backward(q, k, v, d_out) -> (dq, dk, dv)`` for attention with scale "
    "1/sqrt(D), no mask, written without autograd, against autograd through torch's SDPA.",
)


# --- one tile of the weights from the logsumexp -------------------------------------------------


def _tile_cases() -> list[Case]:
    """Tiles of two (2, 2, 12, 16) attentions: the reference slices the full softmax. The second
    has another scale than 1/√D and scores near 750, where exp overflows even in float64 (at
    709.8; float32 at 88.7): a key column of 50s adds 2500 · scale to every score of a row."""
    g = torch.Generator().manual_seed(72)
    cases = []
    for scale, rows, cols, what in (
        (1 / math.sqrt(8), slice(4, 8), slice(8, 12), ""),
        (0.3, slice(0, 4), slice(10, 16), ", scale 0.3, scores near 750"),
    ):
        q, k = randn64(g, 2, 2, 12, 8) * 2, randn64(g, 2, 2, 16, 8) * 2
        if what:
            q[..., 0], k[..., 0] = 50.0, 50.0  # the same shift for every key of a row
        scores = q @ k.transpose(-2, -1) * scale  # (B, H, L, S)
        args = (q[..., rows, :], k[..., cols, :], torch.logsumexp(scores, -1)[..., rows], scale)
        r, c = (f"{s.start}:{s.stop}" for s in (rows, cols))
        expected = torch.softmax(scores, -1)[..., rows, cols]  # (B, H, R, C)
        cases.append(Case(f"weights_tile for rows {r}, keys {c}{what}", args, expected=expected))
    return cases


def _weights_tile(q: Tensor, k: Tensor, lse: Tensor, scale: float) -> Tensor:
    return torch.exp(q @ k.transpose(-2, -1) * scale - lse.unsqueeze(-1))  # (..., R, C)


_HINT_TILE = "P_tile = exp(q_tile·k_tileᵀ·scale - lse[..., None]): lse is one number per row."

WEIGHTS_TILE = Exercise(
    "check_weights_tile",
    "the tiles equal the full softmax's weights (float64)",
    _weights_tile,
    _tile_cases,
    variants=(
        lambda q, k, lse, scale: (q @ k.mT * scale - lse[..., None]).exp(),
        lambda q, k, lse, scale: torch.exp(
            torch.einsum("...rd,...cd->...rc", q * scale, k) - lse.unsqueeze(-1)
        ),
    ),
    mistakes=(
        (
            lambda q, k, lse, scale: torch.exp(q @ k.transpose(-2, -1) * scale - lse),
            "lse (..., R) must broadcast over the keys, not the rows: subtract "
            "lse[..., None] (or lse.unsqueeze(-1)). " + _HINT_TILE,
        ),
        (
            lambda q, k, lse, scale: torch.softmax(q @ k.transpose(-2, -1) * scale, -1),
            "A softmax over the tile divides by this tile's sum; the row's sum over *all* keys "
            "is exp(lse), which is what the forward pass saved. " + _HINT_TILE,
        ),
        (
            lambda q, k, lse, scale: torch.exp(q @ k.transpose(-2, -1) - lse.unsqueeze(-1)),
            "Scale the scores as the forward pass did. " + _HINT_TILE,
        ),
        (
            lambda q, k, lse, scale: torch.exp(q @ k.transpose(-2, -1) * scale + lse.unsqueeze(-1)),
            "Subtract lse: exp(s - lse) = exp(s) / sum_j exp(s_j). " + _HINT_TILE,
        ),
        (
            lambda q, k, lse, scale: (q @ k.mT * scale).exp() / lse.exp()[..., None],
            "exp of a large score overflows (inf / inf = NaN): subtract lse inside the exp, "
            "exp(s - lse), never divide exp(s) by exp(lse). " + _HINT_TILE,
        ),
        (
            lambda q, k, lse, scale: torch.exp(q @ k.mT / math.sqrt(q.shape[-1]) - lse[..., None]),
            "Use the scale you are given: the forward pass need not have used 1/sqrt(D). "
            + _HINT_TILE,
        ),
    ),
    hint=_HINT_TILE,
    crash_hint=_HINT_TILE,
    atol=1e-10,
    rtol=1e-8,
    params=("weights_tile",),
    doc="Check ``weights_tile(q_tile, k_tile, lse_tile, scale) -> P_tile`` (..., R, C): one tile "
    "of the attention weights rebuilt from the saved row logsumexp.",
)


# --- predict the memory ---------------------------------------------------------------------------


def _saved_bytes(fn: Callable[..., object], L: int) -> int:
    """Bytes of the tensors autograd saves for one call of ``fn`` at ``L = S`` (H=4, D=16)."""
    g = torch.Generator().manual_seed(73)
    q, k, v = (torch.randn(1, 4, L, 16, generator=g).requires_grad_() for _ in range(3))
    total = [0]

    def pack(t: Tensor) -> Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    return total[0]


@cache
def _memory_truth() -> tuple[float, float, float]:
    mib = 1 * 32 * 8192 * 8192 * 4 / 2**20  # one float32 (B, H, L, S) tensor
    naive, tiled = mha.scaled_dot_product_attention, mha.flash_attention
    return (
        mib,
        _saved_bytes(naive, 512) / _saved_bytes(naive, 256),
        _saved_bytes(tiled, 512) / _saved_bytes(tiled, 256),
    )


def _as_numbers(answer: tuple[object, ...]) -> tuple[float, ...]:
    for name, value in zip(("mib", "naive_growth", "tiled_growth"), answer):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            message = tr("{name} should be a number, got {value!r}.", name=name, value=value)
            raise ExerciseError(message)
    return tuple(float(v) for v in answer)  # type: ignore[arg-type]  # checked above


_QUADRATIC = "The saved (L, S) weights have L·S = L² entries: doubling L multiplies them by 4."
_LINEAR = "The tiled Function saves q, k, v, out and lse, all O(L): doubling L doubles them."
MEMORY_PREDICTION = Exercise(
    "check_memory_prediction",
    lambda want: tr(
        "{0:.0f} MiB; saved bytes grow ~{1:.1f}x (naive) and ~{2:.1f}x (tiled) when L doubles",
        *want,
    ),
    _memory_truth,
    prediction=True,
    variants=(lambda t: (8192, 4, 2), lambda t: (8192.0, 3.9, 2.0), lambda t: t),
    mistakes=(
        (lambda t: (t[0] / 32, t[1], t[2]), "Count all 32 heads: B·H·L·S numbers."),
        (lambda t: (t[0] / 2, t[1], t[2]), "float32 is 4 bytes per number, not 2."),
        (lambda t: (t[0] * 2**20, t[1], t[2]), "Answer in MiB: divide the bytes by 2**20."),
        (lambda t: (t[0], 2.0, t[2]), _QUADRATIC),
        (lambda t: (t[0], t[1], 4.0), _LINEAR),
        (lambda t: (t[0], t[1], 1.0), _LINEAR),
    ),
    hint={
        "mib": "B·H·L·S numbers of 4 bytes each, divided by 2**20.",
        "naive_growth": _QUADRATIC,
        "tiled_growth": _LINEAR,
    },
    atol=0.0,
    rtol=0.1,  # within 10%: the O(L) inputs make the naive growth a little under 4
    outputs=("mib", "naive_growth", "tiled_growth"),
    convert=_as_numbers,
    doc="Check predictions: the MiB of one float32 (B, H, L, S) tensor for B=1, H=32, "
    "L=S=8192, and by how much the bytes autograd saves grow when L=S doubles, for "
    "mha.scaled_dot_product_attention and mha.flash_attention (measured with saved_tensors_hooks).",
)

EXERCISES = publish(globals())
