"""Section 7.2's capstone, the whole tiled backward pass, as data for :mod:`._harness`;
published by :mod:`.ch07` with the chapter's other exercises."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from .. import flash, triton_flash
from ._harness import (
    AUTOGRAD,
    Case,
    Exercise,
    ExerciseError,
    defined_in,
    never_larger,
    randn64,
    slipped,
    tr,
)

# --- the capstone: the whole tiled backward pass ------------------------------------------------


def _torch_backward_kernels() -> list[Any]:
    """torch's own fused attention backward kernels (``torch.ops.aten``), those this build has."""
    names = (
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
    )
    ops = [getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)]
    return [f for op in ops for f in (op, op.default)]


def _triton_backward() -> list[Callable[..., Any]]:
    """The course's Triton backward: its launchers, its autograd Function and its kernels."""
    kernels = (
        triton_flash._attn_bwd_preprocess_kernel,
        triton_flash._attn_bwd_dkdv_kernel,
        triton_flash._attn_bwd_dq_kernel,
    )
    return [
        triton_flash.triton_attention,
        triton_flash._triton_attention,
        triton_flash._backward,
        triton_flash._launch_backward,
        inspect.unwrap(triton_flash._TritonAttention.backward),
        *(getattr(k, "fn", k) for k in kernels),  # a jitted kernel wraps its Python function
    ]


#: What the tiled backward is to do by hand: autograd, torch's fused backward kernels, everything
#: mha.flash defines (the library's tiled backward and every helper of it) and the Triton backward.
TILED_BANNED = (
    *AUTOGRAD,
    *_torch_backward_kernels(),
    *defined_in(flash),
    *_triton_backward(),
)


class WholeScoreMatrix(Exception):
    """A tiled answer made a tensor as large as the (L, S) scores."""


class TooManyTiles(Exception):
    """A causal tiled answer computed the tiles the mask hides."""


@dataclass(frozen=True)
class _Tiled(Case):
    """A case run under the (L, S) guard: no tensor of ``limit`` elements or more, and (causal)
    no more matrix-product FLOPs than ``max_flops``."""

    limit: int = 0
    max_flops: float = 0.0


_SLACK = 1.8  # FLOPs allowed over the visible tiles' five products: a second pass (7) fits


def _visible(q0: int, q1: int, k0: int, is_causal: bool) -> bool:
    """May a row of [q0, q1) see a key of the tile starting at k0 (top-left causal: j <= i)?"""
    return not is_causal or k0 <= q1 - 1


def _tile_flops(shape: tuple[int, ...], S: int, Dv: int, is_causal: bool, bq: int, bk: int):
    """FLOPs of the five products of every tile, ``(visible ones, all)``, for q ``shape``."""
    *batch, L, D = shape
    heads = math.prod(batch)
    visible = every = 0.0
    for q0 in range(0, L, bq):
        for k0 in range(0, S, bk):
            R, C = min(bq, L - q0), min(bk, S - k0)
            flops = 2 * heads * R * C * (3 * D + 2 * Dv)  # S, dP, dS·K, dSᵀ·Q; Pᵀ·dO
            every += flops
            visible += flops if _visible(q0, q0 + R, k0, is_causal) else 0
    return visible, every


def _tiled_cases() -> list[Case]:
    """Float64 attentions, L ≠ S both ways, causal and not, tiles that do not divide L or S;
    the last two under the guard, sized so that inputs, gradients and tiles are all smaller than
    one head's (L, S) scores: B·H·max(D, Dv) < S and B·H·block_q·block_k < L·S."""
    g = torch.Generator().manual_seed(75)
    specs = (  # B, H, L, S, D, Dv, is_causal, block_q, block_k, guarded
        (2, 2, 20, 20, 8, 8, False, 8, 8, False),
        (2, 2, 13, 29, 8, 4, True, 5, 7, False),
        (2, 2, 29, 13, 8, 4, True, 8, 6, False),
        (1, 3, 22, 30, 16, 8, False, 6, 9, False),
        (1, 2, 96, 64, 8, 8, False, 16, 16, True),
        (1, 2, 48, 72, 8, 8, True, 8, 8, True),
    )
    cases: list[Case] = []
    for B, H, L, S, D, Dv, causal, bq, bk, guarded in specs:
        q, k, v = randn64(g, B, H, L, D), randn64(g, B, H, S, D), randn64(g, B, H, S, Dv)
        dout = randn64(g, B, H, L, Dv)  # dO
        scores = q @ k.mT / math.sqrt(D)  # (B, H, L, S), to build the inputs only
        if causal:
            scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
        out, lse = torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
        kwargs = {"is_causal": causal, "block_q": bq, "block_k": bk}
        label = f"my_flash_backward with L={L}, S={S}, is_causal={causal}, tiles {bq}×{bk}"
        args = (q, k, v, out, lse, dout)
        if not guarded:
            cases.append(Case(label, args, kwargs))
            continue
        visible, _ = _tile_flops(q.shape, S, Dv, causal, bq, bk)
        budget = _SLACK * visible if causal else 0.0
        label += ", no tensor of L·S elements"
        cases.append(_Tiled(label, args, kwargs, limit=L * S, max_flops=budget))
    return cases


def _call_tiled(answer: Callable[..., Any], case: Case) -> Any:
    """The answer's output on ``case``; a guarded case raises :class:`WholeScoreMatrix` for a
    tensor of L·S elements or more and :class:`TooManyTiles` for FLOPs past its budget."""
    args = [a.clone() if isinstance(a, Tensor) else a for a in case.args]
    limit = getattr(case, "limit", 0)
    if not limit:
        return answer(*args, **case.kwargs)
    seen: list[tuple[int, ...]] = []
    try:
        with never_larger(limit, "{shape}") as seen, FlopCounterMode(display=False) as counter:
            out = answer(*args, **case.kwargs)
    except ExerciseError:
        if not seen:  # a banned call: watch's own error
            raise
        message = "it made a tensor of L·S elements or more, as large as the (L, S) scores"
        raise WholeScoreMatrix(tr(message)) from None
    budget = getattr(case, "max_flops", 0.0)
    if budget and counter.get_total_flops() > budget:
        message = "its matrix products took far more FLOPs than the visible tiles need"
        raise TooManyTiles(tr(message))
    return out


def _sdpa_grads(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    """Autograd through torch's SDPA (float64): ``(dq, dk, dv)``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H, L, Dv)
    return torch.autograd.grad(o, (q, k, v), dout)


def _tiled_backward(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16, **slip):
    """The tiled backward, query blocks outer, key tiles inner: right without ``slip``, or with
    one of the usual slips (``tile_delta``, ``no_scale``, ``no_mask``, ``tile_softmax``,
    ``no_skip``)."""
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 if slip.get("no_scale") else q.shape[-1] ** -0.5
    delta = (dout * out).sum(-1, keepdim=True)  # (B, H, L, 1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0 in range(0, L, block_q):
        q1 = min(q0 + block_q, L)
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if not (slip.get("no_skip") or _visible(q0, q1, k0, is_causal)):
                continue
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].mT * q.shape[-1] ** -0.5  # (B, H, R, C)
            if is_causal and not slip.get("no_mask"):
                rows, cols = torch.arange(q0, q1), torch.arange(k0, k1)
                s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
            if slip.get("tile_softmax"):
                p = torch.softmax(s, -1)  # (B, H, R, C)
            else:
                p = torch.exp(s - lse[..., q0:q1, None])  # (B, H, R, C)
            d_rows = dout[..., q0:q1, :]  # (B, H, R, Dv)
            dp = d_rows @ v[..., k0:k1, :].mT  # (B, H, R, C)
            d = (p * dp).sum(-1, keepdim=True) if slip.get("tile_delta") else delta[..., q0:q1, :]
            ds = p * (dp - d)  # (B, H, R, C)
            dv[..., k0:k1, :] += p.mT @ d_rows
            dq[..., q0:q1, :] += ds @ k[..., k0:k1, :] * scale
            dk[..., k0:k1, :] += ds.mT @ q[..., q0:q1, :] * scale
    return dq, dk, dv


def _tiled_backward_by_keys(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    """Key tiles outer (each owns its dK, dV), query blocks inner; Q scaled once; einsum."""
    L, S = q.shape[-2], k.shape[-2]
    qs = q * q.shape[-1] ** -0.5  # (B, H, L, D)
    delta = torch.einsum("bhle,bhle->bhl", dout, out)  # (B, H, L)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for k0 in range(0, S, block_k):
        k_t, v_t = k[..., k0 : k0 + block_k, :], v[..., k0 : k0 + block_k, :]
        dk_t, dv_t = torch.zeros_like(k_t), torch.zeros_like(v_t)
        first = k0 // block_q * block_q if is_causal else 0  # the block holding row k0
        for q0 in range(first, L, block_q):
            rows = torch.arange(q0, min(q0 + block_q, L))
            s = torch.einsum("bhrd,bhcd->bhrc", qs[..., rows, :], k_t)
            if is_causal:
                cols = torch.arange(k0, k0 + k_t.shape[-2])
                s = torch.where(cols <= rows[:, None], s, -math.inf)
            p = (s - lse[..., rows, None]).exp()
            dp = torch.einsum("bhre,bhce->bhrc", dout[..., rows, :], v_t)
            ds = p * (dp - delta[..., rows, None])
            dv_t += torch.einsum("bhrc,bhre->bhce", p, dout[..., rows, :])
            dk_t += torch.einsum("bhrc,bhrd->bhcd", ds, qs[..., rows, :])
            dq[..., rows, :] += torch.einsum("bhrc,bhcd->bhrd", ds, k_t) * q.shape[-1] ** -0.5
        dk[..., k0 : k0 + block_k, :], dv[..., k0 : k0 + block_k, :] = dk_t, dv_t
    return dq, dk, dv


def _tile_weights(q, k, lse, q0, q1, k0, k1, is_causal):
    """P of one tile, rebuilt from lse, with the top-left causal mask: (B, H, R, C)."""
    s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        hidden = torch.arange(k0, k1)[None, :] > torch.arange(q0, q1)[:, None]  # (R, C)
        s = s.masked_fill(hidden, float("-inf"))
    return torch.exp(s - lse[..., q0:q1].unsqueeze(-1))


def _tiled_backward_two_passes(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    """As the Triton kernels do: a pass over key tiles for dK, dV, then one over query blocks for
    dQ, each accumulator written by one loop only (P and dP rebuilt in both passes)."""
    L, S = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(-1)[..., None]  # (B, H, L, 1)
    dk, dv = [], []
    for k0 in range(0, S, block_k):
        k1 = min(k0 + block_k, S)
        dk_t = k.new_zeros(*k.shape[:-2], k1 - k0, k.shape[-1])
        dv_t = v.new_zeros(*v.shape[:-2], k1 - k0, v.shape[-1])
        for q0 in range(0, L, block_q):
            q1 = min(q0 + block_q, L)
            if is_causal and k0 > q1 - 1:
                continue
            p = _tile_weights(q, k, lse, q0, q1, k0, k1, is_causal)
            ds = p * (
                dout[..., q0:q1, :] @ v[..., k0:k1, :].transpose(-2, -1) - delta[..., q0:q1, :]
            )
            dv_t = dv_t + p.transpose(-2, -1) @ dout[..., q0:q1, :]
            dk_t = dk_t + ds.transpose(-2, -1) @ q[..., q0:q1, :] * scale
        dk.append(dk_t)
        dv.append(dv_t)
    dq = []
    for q0 in range(0, L, block_q):
        q1 = min(q0 + block_q, L)
        dq_t = torch.zeros_like(q[..., q0:q1, :])
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if is_causal and k0 > q1 - 1:
                break  # every later tile lies further right of the diagonal
            p = _tile_weights(q, k, lse, q0, q1, k0, k1, is_causal)
            ds = p * (
                dout[..., q0:q1, :] @ v[..., k0:k1, :].transpose(-2, -1) - delta[..., q0:q1, :]
            )
            dq_t = dq_t + ds @ k[..., k0:k1, :] * scale
        dq.append(dq_t)
    return torch.cat(dq, -2), torch.cat(dk, -2), torch.cat(dv, -2)


def _whole_matrix_backward(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    """The right gradients, from whole (L, S) matrices: what the tiles are there to avoid."""
    L, S = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5
    s = q @ k.mT * scale  # (B, H, L, S)
    if is_causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - lse[..., None])  # (B, H, L, S)
    ds = p * (dout @ v.mT - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.mT @ q * scale, p.mT @ dout


def _tiled_by_library(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    return flash.flash_attention_backward(
        dout, q, k, v, out, lse, None, is_causal, scale=q.shape[-1] ** -0.5, block_size=block_q
    )


def _tiled_by_private_helper(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    """The tiled loop with each tile's scores from mha.flash's private _tile_scores (the library
    reached around its public names)."""
    L, S = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5
    delta = (dout * out).sum(-1, keepdim=True)  # (B, H, L, 1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    future = torch.ones(max(block_q, block_k), max(block_q, block_k), dtype=torch.bool).triu(1)
    for q0 in range(0, L, block_q):
        for k0 in range(0, S, block_k):
            t = SimpleNamespace(q0=q0, q1=min(q0 + block_q, L), k0=k0, k1=min(k0 + block_k, S))
            if is_causal and k0 > t.q1 - 1:
                continue
            s = flash._tile_scores(q * scale, k, t, None, future if is_causal else None)
            p = torch.exp(s - lse[..., t.q0 : t.q1, None])  # (B, H, R, C)
            d_rows = dout[..., t.q0 : t.q1, :]
            ds = p * (d_rows @ v[..., t.k0 : t.k1, :].mT - delta[..., t.q0 : t.q1, :])
            dv[..., t.k0 : t.k1, :] += p.mT @ d_rows
            dq[..., t.q0 : t.q1, :] += ds @ k[..., t.k0 : t.k1, :] * scale
            dk[..., t.k0 : t.k1, :] += ds.mT @ q[..., t.q0 : t.q1, :] * scale
    return dq, dk, dv


def _tiled_by_autograd(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    if is_causal:
        scores = scores.masked_fill(scores.new_ones(scores.shape[-2:]).bool().triu(1), -math.inf)
    (torch.softmax(scores, -1) @ v).backward(dout)
    return q.grad, k.grad, v.grad


_TILED_FORMULAS = (
    "δ = rowsum(dO * O) once, before the loop; then for each tile that a row can see: "
    "S = Q_rows·K_colsᵀ·scale (causal: -inf where key j > query i), P = exp(S - lse_rows), "
    "dV_cols += Pᵀ·dO_rows, dP = dO_rows·V_colsᵀ, dS = P * (dP - δ_rows), "
    "dQ_rows += dS·K_cols·scale, dK_cols += dSᵀ·Q_rows·scale."
)
_NO_SHORTCUT = (
    "write the tiled backward yourself: no autograd (torch.autograd.grad, .backward(), "
    "torch.func), no torch's own attention backward kernels, no function of mha.flash "
    "(flash_attention_backward and its helpers) and not the Triton backward of mha.triton_flash."
)
_WHOLE = (
    "Work tile by tile: make no tensor as large as the (L, S) scores, neither the scores, P, dP "
    "and dS of all the keys nor a whole (L, S) causal mask; build each tile's mask from its query "
    "and key indices."
)
_SKIP = (
    "With is_causal, a tile whose first key comes after its last query (k0 > q1 - 1) is all "
    "-inf: its P is 0 and it adds nothing to any gradient. Skip it, as the forward pass does."
)
TILED_BACKWARD = Exercise(
    "check_flash_backward",
    "dQ, dK and dV equal autograd's through torch's SDPA (float64; L ≠ S, causal, tiles that "
    "do not divide L or S); no tensor of L·S elements, no autograd, hidden tiles skipped "
    "(matrix-product FLOPs counted)",
    _sdpa_grads,
    _tiled_cases,
    variants=(_tiled_backward, _tiled_backward_by_keys, _tiled_backward_two_passes),
    mistakes=(
        (_whole_matrix_backward, _WHOLE),  # first: on the guarded cases others raise its error
        (_tiled_by_library, _NO_SHORTCUT),
        (_tiled_by_autograd, _NO_SHORTCUT),
        (_tiled_by_private_helper, _NO_SHORTCUT),
        (
            slipped(_tiled_backward, "tile_delta"),
            "δ is a sum over the whole row of keys: rowsum(P * dP) over one tile's keys misses "
            "the other tiles. Compute δ = rowsum(dO * O) once, before the loop: it needs no "
            "weights at all. " + _TILED_FORMULAS,
        ),
        (
            slipped(_tiled_backward, "no_scale"),
            "The scores were scaled, S = Q·Kᵀ·scale, so the chain rule brings the scale back: "
            "dQ = dS·K·scale and dK = dSᵀ·Q·scale, with scale = 1/sqrt(D). " + _TILED_FORMULAS,
        ),
        (
            slipped(_tiled_backward, "no_mask"),
            "With is_causal, rebuild P with the mask: in a tile that the diagonal crosses, a key "
            "after its query (key j > query i) gets the score -inf, so exp(S - lse) = 0 there. "
            + _TILED_FORMULAS,
        ),
        (
            slipped(_tiled_backward, "tile_softmax"),
            "A softmax over the tile divides by that tile's own sum: the weights are "
            "exp(S - lse), with the logsumexp of the whole row that the forward pass saved. "
            + _TILED_FORMULAS,
        ),
        (slipped(_tiled_backward, "no_skip"), _SKIP),
    ),
    hint={name: f"{name} is wrong. " + _TILED_FORMULAS for name in ("dq", "dk", "dv")},
    crash_hint=_TILED_FORMULAS,
    atol=1e-10,
    rtol=1e-8,
    outputs=("dq", "dk", "dv"),
    call=_call_tiled,
    forbidden=TILED_BANNED,
    rewrites=(flash.flash_attention_backward, torch.autograd.grad),
    forbidden_hint=_NO_SHORTCUT,
    params=("my_flash_backward",),
    doc="Check ``my_flash_backward(q, k, v, out, lse, dout, *, is_causal=False, block_q=16, "
    "block_k=16) -> (dq, dk, dv)``: the backward pass of attention with scale 1/sqrt(D) (causal: "
    "top-left, as torch's is_causal), tile by tile from the saved logsumexp, without autograd, "
    "against autograd through torch's SDPA; on two cases no tensor of L·S elements may be made, "
    "and a causal answer must skip the hidden tiles.",
)
