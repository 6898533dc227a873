"""Chapter 7, the backward pass: the exercises as data for :mod:`._harness`.

References: autograd through gpt-oss-style sink attention (the sink as an extra softmax column),
through ``F.scaled_dot_product_attention`` and through ``torch.softmax`` (δ and one key tile's
share; float64), and the bytes autograd saves, counted with
``torch.autograd.graph.saved_tensors_hooks``; mistakes: a softmax without the sink, no gradient
for the sink or the wrong sign or shape of it, the three bugs of the chapter's ``buggy_backward``
(δ without the weights, ``P * dP - δ``, ``dS`` where ``dSᵀ`` belongs) one at a time and the two
that dQ depends on together, a tile's δ or softmax on its own, ``exp(s) / exp(lse)`` (overflow),
the default scale in place of the given one, O(L²) for the tiles; and autograd, mha.flash and
mha.triton_flash's launch arithmetic, which the exercises that re-write them ban.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from functools import cache, partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from .. import flash, triton_flash
from ._harness import (
    AUTOGRAD,
    Case,
    Exercise,
    ExerciseError,
    as_int,
    defined_in,
    publish,
    randn64,
    slipped,
    tr,
    whole,
)
from ._tiled_backward import TILED_BANNED

# --- the backward pass with a sink logit --------------------------------------------------------


def _sink_forward(q: Tensor, k: Tensor, v: Tensor, sink: Tensor) -> Tensor:
    """Attention whose softmax has one more logit per head, ``sink`` (H,), with no value: the
    way gpt-oss writes it, the sink as an extra column that is dropped after the softmax."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, L, 1)
    weights = torch.softmax(torch.cat([scores, column], -1), -1)  # (B, H, L, S + 1)
    return weights[..., :-1] @ v  # the sink's column has no value: (B, H, L, Dv)


def _sink_grads(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, d_out: Tensor):
    """Autograd through :func:`_sink_forward` (float64): ``(dq, dk, dv, d_sink)``."""
    q, k, v, sink = (t.detach().requires_grad_() for t in (q, k, v, sink))
    return torch.autograd.grad(_sink_forward(q, k, v, sink), (q, k, v, sink), d_out)


def _sink_cases() -> list[Case]:
    g = torch.Generator().manual_seed(74)
    cases = []
    for L, S, D in ((6, 6, 8), (5, 7, 16)):
        q, k, v = randn64(g, 2, 3, L, D), randn64(g, 2, 3, S, D), randn64(g, 2, 3, S, 4)
        sink = randn64(g, 3) + 1.0  # (H,): sinks that take a fair share of each row
        d_out = randn64(g, 2, 3, L, 4)  # dO
        label = f"sink_attention_backward(q, k, v, sink, d_out) with L={L}, S={S}"
        cases.append(Case(label, (q, k, v, sink, d_out)))
    return cases


def _sink_backward(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, d_out: Tensor, **slip: bool):
    """The backward pass by hand: right without ``slip``, or with one of the usual slips."""
    scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, L, S)
    sink_logit = sink.view(1, -1, 1, 1)  # (1, H, 1, 1)
    lse = torch.logaddexp(torch.logsumexp(scores, -1, keepdim=True), sink_logit)  # (B, H, L, 1)
    if slip.get("no_sink_mass"):
        lse = torch.logsumexp(scores, -1, keepdim=True)  # (B, H, L, 1)
    p = torch.exp(scores - lse)  # (B, H, L, S): rows sum to 1 - p_sink
    p_sink = torch.exp(sink_logit - lse)  # (B, H, L, 1)
    out = p @ v  # (B, H, L, Dv)
    dv = p.transpose(-2, -1) @ d_out  # (B, H, S, Dv)
    delta = (d_out * out).sum(-1, keepdim=True)  # (B, H, L, 1) δ = rowsum(dO ∘ O)
    ds = p * (d_out @ v.transpose(-2, -1) - delta)  # (B, H, L, S)
    dq = ds @ k * scale  # (B, H, L, D)
    dk = ds.transpose(-2, -1) @ q * scale  # (B, H, S, D)
    d_sink = -(p_sink * delta)  # (B, H, L, 1): the sink column's dS, with dP = 0 there
    if slip.get("sign"):
        d_sink = -d_sink
    if slip.get("per_row"):
        return dq, dk, dv, d_sink.squeeze(-1)  # (B, H, L)
    if slip.get("all_heads"):
        return dq, dk, dv, d_sink.sum()  # ()
    if slip.get("no_sink_grad") or slip.get("no_sink_mass"):
        return dq, dk, dv, torch.zeros_like(sink)  # (H,)
    return dq, dk, dv, d_sink.sum((0, 2, 3))  # (H,): one sink per head


def _sink_backward_by_columns(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, d_out: Tensor):
    """The sink as column S of an (L, S + 1) softmax whose value is 0: the chapter's formulas as
    they stand, on the widened matrices."""
    scale = q.shape[-1] ** -0.5
    B, H, L, _ = q.shape
    scores = torch.einsum("bhld,bhsd->bhls", q, k) * scale  # (B, H, L, S)
    wide = torch.cat([scores, sink[:, None, None].expand(B, H, L, 1)], -1)  # (B, H, L, S + 1)
    p = wide.softmax(-1)  # (B, H, L, S + 1)
    v0 = torch.cat([v, v.new_zeros(B, H, 1, v.shape[-1])], -2)  # (B, H, S + 1, Dv)
    dp = d_out @ v0.mT  # (B, H, L, S + 1): 0 in the sink's column
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))  # (B, H, L, S + 1)
    dq = ds[..., :-1] @ k * scale  # (B, H, L, D)
    dk = ds[..., :-1].mT @ q * scale  # (B, H, S, D)
    return dq, dk, p.mT[..., :-1, :] @ d_out, ds[..., -1].sum((0, 2))


def _sink_backward_by_denominator(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, d_out: Tensor):
    """The weights as exp(s - m) / (sum + exp(sink - m)), δ as rowsum(P ∘ dP)."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ k.mT * scale  # (B, H, L, S)
    m = torch.maximum(s.amax(-1, keepdim=True), sink[:, None, None])  # (B, H, L, 1)
    e, e_sink = (s - m).exp(), (sink[:, None, None] - m).exp()  # (B, H, L, S), (B, H, L, 1)
    total = e.sum(-1, keepdim=True) + e_sink  # (B, H, L, 1)
    p, p_sink = e / total, e_sink / total
    dp = d_out @ v.mT  # (B, H, L, S)
    delta = torch.einsum("bhls,bhls->bhl", p, dp)[..., None]  # (B, H, L, 1)
    ds = p * (dp - delta)  # (B, H, L, S)
    d_sink = torch.einsum("bhlx,bhlx->h", p_sink, -delta)  # (H,)
    return ds @ k * scale, ds.mT @ q * scale, p.mT @ d_out, d_sink


def _sink_by_autograd(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, d_out: Tensor):
    q, k, v, sink = (t.clone().requires_grad_() for t in (q, k, v, sink))
    _sink_forward(q, k, v, sink).backward(d_out)
    return q.grad, k.grad, v.grad, sink.grad


_SINK_GRAD = (
    "The sink has no value, but its logit is in every denominator of its head: raising it lowers "
    "every weight of the row. Treat it as column S of the softmax with dP = 0 there: its dS is "
    "p_sink·(0 - δ), summed over the batch and the queries."
)
_SINK_ONE_PER_HEAD = (
    "sink is one logit per head, shared by every sequence and query: d_sink has sink's shape, "
    "(H,), the sum of p_sink·(0 - δ) over the batch and the queries of each head."
)
_SINK_FORMULAS = (
    "P = exp(S - lse) with lse = logsumexp of the S scores and the sink; then the five formulas "
    "hold as they are (δ = rowsum(dO * O) = rowsum(P * dP)), and d_sink = -Σ p_sink·δ per head."
)
_NO_AUTOGRAD_SINK = (
    "derive the gradients and compute them with formulas, without autograd "
    "(torch.autograd.grad, .backward(), torch.func)."
)
SINK_BACKWARD = Exercise(
    "check_sink_backward",
    "dQ, dK, dV and d_sink equal autograd's through gpt-oss-style sink attention (float64)",
    _sink_grads,
    _sink_cases,
    variants=(
        lambda q, k, v, sink, d_out: _sink_backward(q, k, v, sink, d_out),
        _sink_backward_by_columns,
        _sink_backward_by_denominator,
    ),
    mistakes=(
        (slipped(_sink_backward, "no_sink_grad"), _SINK_GRAD),
        (
            slipped(_sink_backward, "no_sink_mass"),
            "The weights must include the sink in their denominator: a row's weights sum to "
            "1 - p_sink, not 1, so softmax over the S scores alone is wrong. " + _SINK_FORMULAS,
        ),
        (
            slipped(_sink_backward, "sign"),
            "Check the sign: raising the sink scales every weight of its row down by the same "
            "factor, so O shrinks towards 0 and the loss changes by dO·(-p_sink·O) = -p_sink·δ.",
        ),
        (slipped(_sink_backward, "per_row"), _SINK_ONE_PER_HEAD),
        (slipped(_sink_backward, "all_heads"), _SINK_ONE_PER_HEAD),
        (_sink_grads, _NO_AUTOGRAD_SINK),
        (_sink_by_autograd, _NO_AUTOGRAD_SINK),
    ),
    hint={
        "dq": "dq is wrong. " + _SINK_FORMULAS,
        "dk": "dk is wrong. " + _SINK_FORMULAS,
        "dv": "dv is wrong. " + _SINK_FORMULAS,
        "d_sink": _SINK_GRAD,
    },
    crash_hint=_SINK_FORMULAS,
    atol=1e-10,
    rtol=1e-8,
    outputs=("dq", "dk", "dv", "d_sink"),
    forbidden=AUTOGRAD,
    # mha has no backward of sink attention of its own: its gradient is autograd's
    rewrites=(torch.autograd.grad,),
    forbidden_hint=_NO_AUTOGRAD_SINK,
    params=("sink_attention_backward",),
    doc="Check ``sink_attention_backward(q, k, v, sink, d_out) -> (dq, dk, dv, d_sink)`` for "
    "attention with scale 1/sqrt(D), no mask, and one sink logit per head (``sink`` of shape "
    "(H,)) in every row's softmax, written without autograd, against autograd in float64.",
)


# --- spot the bug in a backward pass --------------------------------------------------------------


def _attention_grads(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    """Autograd through torch's SDPA: ``(dq, dk, dv)``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, Dv)
    return torch.autograd.grad(out, (q, k, v), d_out)


#: The slips of the chapter's buggy backward, by line: δ without the weights, the parentheses of
#: dS, and dS where dSᵀ belongs.
BUGS = ("delta", "parentheses", "transpose")


def _backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, **slip: bool) -> tuple[Tensor, ...]:
    """The backward pass by hand: right without ``slip``, or with some of :data:`BUGS`."""
    scale = 1 / math.sqrt(q.shape[-1])
    p = torch.softmax(q @ k.transpose(-2, -1) * scale, -1)  # (B, H, L, S)
    dv = p.transpose(-2, -1) @ d_out  # (B, H, S, Dv)
    dp = d_out @ v.transpose(-2, -1)  # (B, H, L, S)
    delta = dp if slip.get("delta") else p * dp  # (B, H, L, S)
    delta = delta.sum(-1, keepdim=True)  # (B, H, L, 1)
    ds = p * dp - delta if slip.get("parentheses") else p * (dp - delta)  # (B, H, L, S)
    dq = ds @ k * scale  # (B, H, L, D)
    dk = (ds if slip.get("transpose") else ds.transpose(-2, -1)) @ q * scale  # (B, H, S, D)
    return dq, dk, dv


def _buggy_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    """The backward pass of chapter 7's "spot the bug" exercise, with all of :data:`BUGS`."""
    return _backward(q, k, v, d_out, **dict.fromkeys(BUGS, True))


def _attention_cases() -> list[Case]:
    """L = S first, where every bug runs and returns wrong numbers; then L ≠ S, where the
    missing transpose cannot even multiply."""
    g = torch.Generator().manual_seed(71)
    cases = []
    for L, S, D in ((6, 6, 8), (5, 7, 16)):
        q, k, v = randn64(g, 2, 3, L, D), randn64(g, 2, 3, S, D), randn64(g, 2, 3, S, 4)
        d_out = randn64(g, 2, 3, L, 4)  # dO
        label = f"fixed_backward(q, k, v, d_out) with L={L}, S={S}"
        cases.append(Case(label, (q, k, v, d_out)))
    return cases


_BUG_HINTS = {
    "delta": "δ_i = Σ_j p_ij·dP_ij = rowsum(P * dP) (= rowsum(dO * O)): the -p pᵀ part of the "
    "softmax's Jacobian weighs each dP_ij by its weight, so rowsum(dP) alone is wrong.",
    "parentheses": "dS = P * (dP - δ): row i of the Jacobian, diag(p_i) - p_i p_iᵀ, gives "
    "p_ij·(dP_ij - δ_i); P * dP - δ subtracts δ from every key, also where p_ij is tiny.",
    "transpose": "dK = dSᵀ·Q·scale: key j collects from every query that scored it, so transpose "
    "dS, (S, L) @ (L, D); dS·Q only runs when L = S.",
}


def _bug_mistakes() -> list[tuple[Callable[..., tuple[Tensor, ...]], str]]:
    """The bugs one at a time, then the two that dQ depends on together: the hint names the bugs
    behind the first wrong output (``buggy_backward`` itself gets the pair's, as dQ comes first)."""
    left_in = [(b,) for b in BUGS] + [("delta", "parentheses")]
    return [
        (
            lambda q, k, v, d_out, left=left: _backward(
                q, k, v, d_out, **dict.fromkeys(left, True)
            ),
            " ".join(_BUG_HINTS[b] for b in left),
        )
        for left in left_in
    ]


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


def _by_private_tile_scores(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    """The scores from mha.flash's private _tile_scores (one tile: all of them), then right."""
    scale = 1 / math.sqrt(q.shape[-1])
    whole: flash.Tile = SimpleNamespace(q0=0, q1=q.shape[-2], k0=0, k1=k.shape[-2])  # type: ignore[assignment]
    p = torch.softmax(flash._tile_scores(q * scale, k, whole, None, None), -1)  # (B, H, L, S)
    ds = p * (d_out @ v.mT - (d_out * (p @ v)).sum(-1, keepdim=True))  # (B, H, L, S)
    return ds @ k * scale, ds.mT @ q * scale, p.mT @ d_out


def _by_flash_backward(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple[Tensor, ...]:
    out, lse = mha.flash_attention(q, k, v, return_lse=True)
    scale = 1 / math.sqrt(q.shape[-1])
    return flash.flash_attention_backward(
        d_out, q, k, v, out, lse, None, False, scale=scale, block_size=4
    )[:3]


_FORMULAS = (
    "dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P * (dP - δ) with δ = rowsum(dO * O), "
    "dQ = dS·K·scale, dK = dSᵀ·Q·scale."
)
_NO_AUTOGRAD_ATTENTION = (
    "fix the formulas, without autograd (torch.autograd.grad, .backward()) or "
    "mha.flash.flash_attention_backward (nor any other function of mha.flash)."
)
BACKWARD_FIX = Exercise(
    "check_backward_fix",
    "dQ, dK and dV equal autograd's through torch's SDPA (float64, L = S and L ≠ S)",
    _attention_grads,
    _attention_cases,
    variants=(lambda q, k, v, d_out: _backward(q, k, v, d_out), _einsum_attention_backward),
    mistakes=(
        *_bug_mistakes(),
        (_by_autograd, _NO_AUTOGRAD_ATTENTION),
        (_by_flash_backward, _NO_AUTOGRAD_ATTENTION),
        (_by_private_tile_scores, _NO_AUTOGRAD_ATTENTION),
    ),
    hint={name: f"{name} is wrong. " + _FORMULAS for name in ("dq", "dk", "dv")},
    crash_hint=_FORMULAS,
    atol=1e-10,
    rtol=1e-8,
    outputs=("dq", "dk", "dv"),
    forbidden=(*AUTOGRAD, *defined_in(flash)),
    rewrites=(torch.autograd.grad, flash.flash_attention_backward),
    forbidden_hint=_NO_AUTOGRAD_ATTENTION,
    params=("fixed_backward",),
    doc="Check ``fixed_backward(q, k, v, d_out) -> (dq, dk, dv)``, the repaired "
    "``buggy_backward`` of chapter 7 (scale 1/sqrt(D), no mask), written without autograd, "
    "against autograd through torch's SDPA.",
)


# --- delta, the first step of FlashAttention's backward pass -------------------------------------


def _delta_case() -> list[Case]:
    """Attention in float64, and the delta that autograd's gradient of the scores implies."""
    g = torch.Generator().manual_seed(60)
    B, H, L, S, D = 2, 3, 10, 12, 16
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (L, S, S))
    grad_out = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)  # dO
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).requires_grad_()  # (B, H, L, S)
    weights = torch.softmax(scores, dim=-1)  # (B, H, L, S) = P
    out = weights @ v  # (B, H, L, D) = O
    (d_scores,) = torch.autograd.grad(out, scores, grad_out)  # dS = P * (dP - delta)
    # Summed over the keys, P * delta is delta (the weights sum to 1): delta = sum(P * dP - dS).
    delta = (weights * (grad_out @ v.transpose(-2, -1)) - d_scores).sum(-1).detach()  # (B, H, L)
    return [Case("backward_delta(out, grad_out)", (out.detach(), grad_out), expected=delta)]


_HINT_DELTA = "delta is the row-wise dot product of grad_out and out: (grad_out * out).sum(-1)."

BACKWARD_DELTA = Exercise(
    "check_backward_delta",
    "with your delta, P * (dP - delta) equals autograd's gradient of the scores",
    lambda out, grad_out: (grad_out * out).sum(-1),
    _delta_case,
    variants=(
        lambda out, grad_out: torch.einsum("...ld,...ld->...l", out, grad_out),
        lambda out, grad_out: (grad_out * out).sum(-1, keepdim=True),
        lambda out, grad_out: (grad_out.unsqueeze(-2) @ out.unsqueeze(-1)).flatten(-3),
    ),
    mistakes=(
        (lambda out, grad_out: (grad_out * out).sum(-2), "Sum over dim -1, not -2. " + _HINT_DELTA),
        (lambda out, grad_out: grad_out.sum(-1), "Multiply by out first. " + _HINT_DELTA),
    ),
    hint=_HINT_DELTA,
    atol=1e-9,
    rtol=1e-9,
    convert=lambda d: d.squeeze(-1) if isinstance(d, Tensor) and d.shape[-1:] == (1,) else d,
    # () : a row-wise dot product; no public function of mha or torch returns δ (mha.flash and the
    # Triton backward compute it inside their backward passes only).
    rewrites=(),
    params=("backward_delta",),
    doc="Check ``backward_delta(out, grad_out) -> delta`` (B, H, L), with which P * (dP - "
    "delta) is the gradient of the scores.",
)


# --- one key tile's share of the backward pass, from the saved logsumexp ------------------------


def _key_tile_cases() -> list[Case]:
    """One key tile of (2, 2, L, S) attentions against all L queries; the expected gradients from
    autograd through the whole attention in float64: dK and dV of the tile's keys, and the tile's
    share of dQ, dS[..., tile] @ K_tile · scale, with autograd's dS. The second case has another
    scale than 1/√D and scores near 750, where exp overflows even in float64 (at 709.8; float32 at
    88.7): a key column of 50s adds 2500 · scale to every score of a row."""
    g = torch.Generator().manual_seed(72)
    cases = []
    for L, S, scale, cols, what in (
        (12, 16, 1 / math.sqrt(8), slice(8, 12), ""),
        (10, 16, 0.3, slice(10, 16), ", scale 0.3, scores near 750"),
        (5, 20, 1 / math.sqrt(8), slice(7, 14), ""),
    ):
        q, k, v = randn64(g, 2, 2, L, 8) * 2, randn64(g, 2, 2, S, 8) * 2, randn64(g, 2, 2, S, 4)
        dout = randn64(g, 2, 2, L, 4)  # dO
        if what:
            q[..., 0], k[..., 0] = 50.0, 50.0  # the same shift for every key of a row
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) * scale  # (B, H, L, S)
        scores.retain_grad()
        out = torch.softmax(scores, -1) @ v  # (B, H, L, Dv)
        out.backward(dout)
        assert q.grad is not None and k.grad is not None and v.grad is not None
        assert scores.grad is not None
        lse = torch.logsumexp(scores, -1).detach()  # (B, H, L), as the forward pass saves it
        k_tile, v_tile = k.detach()[..., cols, :], v.detach()[..., cols, :]
        dq_part = scores.grad[..., cols] @ k_tile * scale  # the tile's share of dQ
        expected = (dq_part, k.grad[..., cols, :], v.grad[..., cols, :])
        args = (q.detach(), k_tile, v_tile, out.detach(), dout, lse, scale)
        label = f"key_tile_backward for keys {cols.start}:{cols.stop} of {S}, L={L}{what}"
        cases.append(Case(label, args, expected=expected))
    return cases


def _key_tile(q, k_tile, v_tile, out, dout, lse, scale, **slip):
    """One key tile's gradients from the saved lse: right without ``slip``, or with one slip
    (``tile_delta``, ``tile_softmax``, ``overflow``, ``default_scale``, ``no_chain``)."""
    if slip.get("default_scale"):
        scale = q.shape[-1] ** -0.5
    s = q @ k_tile.transpose(-2, -1) * scale  # (B, H, L, C)
    if slip.get("tile_softmax"):
        p = torch.softmax(s, -1)
    elif slip.get("overflow"):
        p = s.exp() / lse.exp()[..., None]
    else:
        p = torch.exp(s - lse[..., None])  # (B, H, L, C)
    dp = dout @ v_tile.transpose(-2, -1)  # (B, H, L, C)
    if slip.get("tile_delta"):
        delta = (p * dp).sum(-1, keepdim=True)  # (B, H, L, 1): this tile's keys only
    else:
        delta = (dout * out).sum(-1, keepdim=True)  # (B, H, L, 1): the whole row
    ds = p * (dp - delta)  # (B, H, L, C)
    chain = 1.0 if slip.get("no_chain") else scale
    dq_part = ds @ k_tile * chain  # (B, H, L, D)
    dk = ds.transpose(-2, -1) @ q * chain  # (B, H, C, D)
    return dq_part, dk, p.transpose(-2, -1) @ dout  # dv (B, H, C, Dv)


def _key_tile_by_einsum(q, k_tile, v_tile, out, dout, lse, scale):
    """Q scaled once, einsum throughout, δ by einsum."""
    qs = q * scale  # (B, H, L, D)
    p = (torch.einsum("bhld,bhcd->bhlc", qs, k_tile) - lse.unsqueeze(-1)).exp()
    delta = torch.einsum("bhle,bhle->bhl", dout, out)  # (B, H, L)
    ds = p * (torch.einsum("bhle,bhce->bhlc", dout, v_tile) - delta.unsqueeze(-1))
    return (
        torch.einsum("bhlc,bhcd->bhld", ds, k_tile) * scale,
        torch.einsum("bhlc,bhld->bhcd", ds, qs),
        torch.einsum("bhlc,bhle->bhce", p, dout),
    )


def _key_tile_transposed(q, k_tile, v_tile, out, dout, lse, scale):
    """Everything as the key tile sees it, (C, L): Pᵀ and dSᵀ first, as the dK/dV kernel does."""
    p_t = torch.exp(k_tile @ q.mT * scale - lse[..., None, :])  # (B, H, C, L)
    dp_t = v_tile @ dout.mT  # (B, H, C, L)
    ds_t = p_t * (dp_t - torch.sum(dout * out, -1)[..., None, :])  # (B, H, C, L)
    return ds_t.mT @ k_tile * scale, ds_t @ q * scale, p_t @ dout


def _key_tile_by_library(q, k_tile, v_tile, out, dout, lse, scale):
    """mha.flash.flash_attention_backward handed the tile's keys and values: what it returns is
    exactly the tile's share."""
    return flash.flash_attention_backward(
        dout, q, k_tile, v_tile, out, lse, None, False, scale=scale, block_size=16
    )


def _key_tile_by_private_helper(q, k_tile, v_tile, out, dout, lse, scale):
    """The tile's scores from mha.flash's private _tile_scores, the rest by the formulas."""
    whole = SimpleNamespace(q0=0, q1=q.shape[-2], k0=0, k1=k_tile.shape[-2])  # one tile: all
    p = torch.exp(flash._tile_scores(q * scale, k_tile, whole, None, None) - lse[..., None])
    ds = p * (dout @ v_tile.mT - (dout * out).sum(-1, keepdim=True))
    return ds @ k_tile * scale, ds.mT @ q * scale, p.mT @ dout


def _key_tile_by_autograd(q, k_tile, v_tile, out, dout, lse, scale):
    """Autograd through the tile's weights rebuilt from lse: δ goes missing on the way."""
    q, k_tile, v_tile = (t.clone().requires_grad_() for t in (q, k_tile, v_tile))
    o_part = torch.exp(q @ k_tile.mT * scale - lse[..., None]) @ v_tile  # (B, H, L, Dv)
    return torch.autograd.grad(o_part, (q, k_tile, v_tile), dout)


_KEY_TILE_FORMULAS = (
    "P = exp(Q·K_tileᵀ·scale - lse[..., None]) (L, C); dV_tile = Pᵀ·dO; "
    "dS = P * (dO·V_tileᵀ - δ) with δ = rowsum(dO * O); dK_tile = dSᵀ·Q·scale; "
    "the share of dQ = dS·K_tile·scale."
)
_KEY_TILE_DELTA = (
    "δ is a sum over the whole row of keys, rowsum(P * dP) over all S of them; one tile's keys "
    "miss the others. The forward pass left what it needs: δ = rowsum(dO * O). "
)
_KEY_TILE_SOFTMAX = (
    "A softmax over the tile divides by this tile's sum; the row's sum over *all* keys is "
    "exp(lse), which is what the forward pass saved: P = exp(S - lse). "
)
_KEY_TILE_OVERFLOW = (
    "exp of a large score overflows (inf / inf = NaN): subtract lse inside the exp, "
    "exp(s - lse), never divide exp(s) by exp(lse). "
)
_KEY_TILE_SCALE = "Use the scale you are given: the forward pass need not have used 1/sqrt(D). "
_KEY_TILE_CHAIN = (
    "The scores were scaled, S = Q·Kᵀ·scale, so the chain rule brings the scale back into dQ "
    "and dK (not into dV). "
)
_NO_BACKWARD = (
    "write the tile's backward yourself: no autograd (torch.autograd.grad, .backward(), "
    "torch.func), no torch's own attention backward kernels and no function of mha.flash "
    "(flash_attention_backward and its helpers)."
)
KEY_TILE_BACKWARD = Exercise(
    "check_key_tile_backward",
    "the tile's dK and dV and its share of dQ equal autograd's (float64; L < C and L > C, a "
    "scale other than 1/sqrt(D), scores near 750), from the tile's keys and the saved lse only, "
    "without autograd or mha.flash",
    _key_tile,
    _key_tile_cases,
    variants=(_key_tile_by_einsum, _key_tile_transposed),
    mistakes=(
        (partial(_key_tile, tile_delta=True), _KEY_TILE_DELTA + _KEY_TILE_FORMULAS),
        (partial(_key_tile, tile_softmax=True), _KEY_TILE_SOFTMAX + _KEY_TILE_FORMULAS),
        (partial(_key_tile, overflow=True), _KEY_TILE_OVERFLOW + _KEY_TILE_FORMULAS),
        (partial(_key_tile, default_scale=True), _KEY_TILE_SCALE + _KEY_TILE_FORMULAS),
        (partial(_key_tile, no_chain=True), _KEY_TILE_CHAIN + _KEY_TILE_FORMULAS),
        (_key_tile_by_library, _NO_BACKWARD),
        (_key_tile_by_private_helper, _NO_BACKWARD),
        (_key_tile_by_autograd, _NO_BACKWARD),
    ),
    hint={name: f"{name} is wrong. " + _KEY_TILE_FORMULAS for name in ("dq_part", "dk", "dv")},
    crash_hint=_KEY_TILE_FORMULAS,
    atol=1e-10,
    rtol=1e-8,
    outputs=("dq_part", "dk", "dv"),
    forbidden=TILED_BANNED,
    rewrites=(flash.flash_attention_backward, torch.autograd.grad),
    forbidden_hint=_NO_BACKWARD,
    params=("key_tile_backward",),
    doc="Check ``key_tile_backward(q, k_tile, v_tile, out, dout, lse, scale) -> (dq_part, dk, "
    "dv)``: one tile of C keys against all L queries, its dK and dV and its share of dQ, from "
    "what the forward pass saved, without autograd, against autograd in float64.",
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

# --- the capstone: the whole tiled backward pass, in its own module ------------------------------

# Published with the other exercises.
from ._tiled_backward import TILED_BACKWARD  # noqa: E402, F401

# --- who owns which gradient in the Triton backward ---------------------------------------------

#: The prediction's setting: causal, L = S = 256, query tiles of 64 rows, key tiles of 32 keys.
OWNERSHIP_SHAPE = {"L": 256, "block_m": 64, "block_n": 32}


def _ownership_truth() -> tuple[int, int, int, int]:
    """From the kernels' own causal loop bounds (one (batch, head)): the dK/dV kernel's loop
    trips, the dQ kernel's, the key-tile programs that would add into query tile 1's dQ rows with
    atomics (their loops visit it), and the tl.dot calls of the two passes (4 and 3 per trip)."""
    L = S = OWNERSHIP_SHAPE["L"]
    bm, bn = OWNERSHIP_SHAPE["block_m"], OWNERSHIP_SHAPE["block_n"]
    starts = [triton_flash.causal_q_start(j, bn, bm) for j in range(S // bn)]
    dkdv = sum(len(range(start, L, bm)) for start in starts)
    dq = sum(len(range(0, triton_flash.causal_kv_end(i, bm, L, S), bn)) for i in range(L // bm))
    adders = sum(1 for start in starts if 1 * bm in range(start, L, bm))
    return dkdv, dq, adders, 4 * dkdv + 3 * dq


_OWNERSHIP = ("dkdv_trips", "dq_trips", "atomic_adders", "dots")


def _as_counts(answer: tuple[object, ...]) -> tuple[int, ...]:
    return tuple(as_int(whole(value), name) for name, value in zip(_OWNERSHIP, answer))


_DKDV_LOOP = (
    "The dK/dV kernel runs one program per key tile of BLOCK_N = 32 keys (8 of them); program j "
    "loops over the query tiles of 64 rows from the one holding row 32·j (causal_q_start) to L."
)
_DQ_LOOP = (
    "The dQ kernel runs one program per query tile of BLOCK_M = 64 rows (4 of them); program i "
    "loops over the key tiles of 32 keys up to the diagonal, key min(L, 64·(i + 1)) "
    "(causal_kv_end), as the forward kernel does."
)
_ADDERS = (
    "With atomics there is no dQ pass: every key-tile program adds dS·K into the dQ rows of each "
    "query tile its loop visits. Count the key tiles whose loop reaches query tile 1 (rows 64 to "
    "127): those whose first key is at most row 127."
)
_DOTS = (
    "Per trip the dK/dV kernel does 4 products (Sᵀ, dPᵀ, dV, dK) and the dQ kernel 3 (S, dP, dQ): "
    "4·dkdv_trips + 3·dq_trips."
)
OWNERSHIP_PREDICTION = Exercise(
    "check_backward_ownership",
    lambda want: tr(
        "dK/dV {0} and dQ {1} loop trips; with atomics, {2} programs would add into one dQ tile; "
        "{3} tl.dot calls",
        *want,
    ),
    _ownership_truth,
    prediction=True,
    variants=(
        lambda t: t,
        lambda t: tuple(float(x) for x in t),
        lambda t: [torch.tensor(x) for x in t],
    ),
    mistakes=(
        (
            lambda t: (8 * 4, *t[1:]),
            "Causal: a key tile's program starts at the diagonal, not at query tile 0. "
            + _DKDV_LOOP,
        ),
        (
            lambda t: (4 + 3 + 2 + 1, *t[1:]),
            "The key tiles are 32 keys wide, not 64: two key tiles share each diagonal query "
            "tile, and both start their loop there. " + _DKDV_LOOP,
        ),
        (
            lambda t: (t[0], 4 * 8, *t[2:]),
            "Causal: a query tile's program stops at the diagonal. " + _DQ_LOOP,
        ),
        (
            lambda t: (t[0], 1 + 2 + 3 + 4, *t[2:]),
            "The dQ kernel's loop steps by BLOCK_N = 32 keys, so a query tile of 64 rows crosses "
            "two key tiles per 64 keys. " + _DQ_LOOP,
        ),
        (
            lambda t: (*t[:2], 1, t[3]),
            "One program owns dQ only in the two-pass design. " + _ADDERS,
        ),
        (
            lambda t: (*t[:2], 8, t[3]),
            "Causal: key tiles that start after row 127 never visit query tile 1. " + _ADDERS,
        ),
        (
            lambda t: (*t[:2], 2, t[3]),
            "Key tiles left of the diagonal also see query tile 1: key j is seen by every row "
            "i ≥ j. " + _ADDERS,
        ),
        (
            lambda t: (*t[:3], 5 * t[0]),
            "That is the atomic version's count (5 per pair of tiles): two passes rebuild S and "
            "dP in the dQ kernel too. " + _DOTS,
        ),
        (lambda t: (*t[:3], 7 * (t[0] + t[1])), _DOTS),
    ),
    hint={
        "dkdv_trips": _DKDV_LOOP,
        "dq_trips": _DQ_LOOP,
        "atomic_adders": _ADDERS,
        "dots": _DOTS,
    },
    atol=0.0,
    rtol=0.0,
    outputs=_OWNERSHIP,
    convert=_as_counts,
    doc="Check predictions for the Triton backward of one (batch, head), causal, L = S = 256, "
    "BLOCK_M = 64, BLOCK_N = 32: the loop trips of the dK/dV kernel and of the dQ kernel, how many "
    "programs would add into the dQ rows of query tile 1 if dQ were accumulated with atomics in "
    "the dK/dV kernel, and the tl.dot calls of the two passes (computed from "
    "triton_flash.causal_q_start and causal_kv_end).",
)

EXERCISES = publish(globals())
