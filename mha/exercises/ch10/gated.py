"""Section 10.2, gated attention, QK-norm and partial RoPE (Qwen3-Next): the exercises as data for
:mod:`.._harness`.

References: Qwen3-Next's split of ``q_proj``'s output by its definition (per head, ``D`` query
coordinates then ``D`` gate coordinates); RMSNorm with a zero-centred gain written with
``torch.nn.functional.rms_norm``; partial RoPE as complex multiplication on the first ``R``
coordinates, in float64. Mistakes: the projection cut in two halves, query and gate swapped, the
query left as ``(B, L, H, D)``; the gain used without its 1, the norm over all heads, a
LayerNorm; all coordinates rotated, the last ``R`` rotated, the speeds of a ``D``-dim head, the
pairs ``(i, i + D/2)``; and ``mha.apply_rope``, which the exercise bans.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import mha
from mha import norms
from mha import rope as rope_library
from mha.models import deepseek_v3, gated_deltanet, qwen3_next

from .._harness import Case, Exercise, defined_in, publish, randn64

# --- splitting q_proj's output into queries and gates -----------------------------------------------


def _split_reference(proj: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    B, L, _ = proj.shape
    per_head = proj.view(B, L, num_heads, 2, head_dim)  # (B, L, H, 2, D): [query, gate] per head
    q = per_head[..., 0, :].transpose(1, 2)  # (B, H, L, D)
    gate = per_head[..., 1, :].reshape(B, L, num_heads * head_dim)  # (B, L, H·D)
    return q, gate


def _split_cases() -> list[Case]:
    g = torch.Generator().manual_seed(102)
    return [
        Case(
            f"split(proj {(B, L, 2 * H * D)}, num_heads={H}, head_dim={D})",
            (randn64(g, B, L, 2 * H * D), H, D),
        )
        for B, L, H, D in ((2, 5, 3, 4), (1, 7, 4, 8))
    ]


def _split_by_chunk(proj: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    B, L, _ = proj.shape
    q, gate = proj.view(B, L, num_heads, 2 * head_dim).chunk(2, dim=-1)  # (B, L, H, D) each
    return q.transpose(1, 2), gate.reshape(B, L, -1)


def _split_by_index(proj: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    B, L, _ = proj.shape
    col = torch.arange(2 * num_heads * head_dim).view(num_heads, 2, head_dim)  # columns per head
    q = proj[..., col[:, 0].flatten()].view(B, L, num_heads, head_dim).permute(0, 2, 1, 3)
    return q, proj[..., col[:, 1].flatten()]


def _split_halves(proj: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    B, L, _ = proj.shape
    q, gate = proj.chunk(2, dim=-1)  # all queries, then all gates: not Qwen3-Next's layout
    return q.reshape(B, L, num_heads, head_dim).transpose(1, 2), gate


def _split_swapped(proj: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    B, L, _ = proj.shape
    gate, q = proj.view(B, L, num_heads, 2 * head_dim).chunk(2, dim=-1)
    return q.transpose(1, 2), gate.reshape(B, L, -1)


def _split_heads_after_l(proj: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    q, gate = _split_reference(proj, num_heads, head_dim)
    return q.transpose(1, 2), gate  # (B, L, H, D): the heads left after L


_HINT_SPLIT = (
    "q_proj's output holds, for each head in turn, D query coordinates then D gate coordinates: "
    "view it as (B, L, H, 2·D), cut the last dim in two, move the heads before L for the query "
    "(B, H, L, D), and flatten the gate back to (B, L, H·D)."
)

QUERY_GATE_SPLIT = Exercise(
    "check_query_gate_split",
    "queries and gates taken from each head's own 2·D columns",
    _split_reference,
    _split_cases,
    variants=(_split_by_chunk, _split_by_index),
    mistakes=(
        (
            _split_halves,
            "The projection is not all queries then all gates: each head has its own D query "
            "columns followed by its D gate columns. " + _HINT_SPLIT,
        ),
        (_split_swapped, "Query and gate are swapped: the query comes first. " + _HINT_SPLIT),
        (
            _split_heads_after_l,
            "The query must be (B, H, L, D): move the heads before L. " + _HINT_SPLIT,
        ),
    ),
    hint=_HINT_SPLIT,
    outputs=("q", "gate"),
    rewrites=(),  # Qwen3-Next's layer splits inline in its forward; no function does only this
    params=("split",),
    doc="Check ``split(proj, num_heads, head_dim) -> (q (B, H, L, D), gate (B, L, H·D))``.",
)

# --- QK-norm ------------------------------------------------------------------------------------------


def _qk_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), 1 + weight, eps=eps)


def _qk_norm_cases() -> list[Case]:
    g = torch.Generator().manual_seed(103)
    cases = []
    for shape, eps in (((2, 5, 3, 8), 1e-6), ((1, 4, 2, 16), 0.5)):
        x, w = randn64(g, *shape), randn64(g, shape[-1]) * 0.5
        x[0, 0, 0] = 0.0  # a zero row: eps keeps it finite
        cases.append(Case(f"qk_norm(x {shape}, weight ({shape[-1]},), eps={eps})", (x, w, eps)))
    return cases


def _qk_norm_by_hand(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _qk_norm_slip(**slip: bool) -> Callable[[Tensor, Tensor, float], Tensor]:
    def answer(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        dims = (-2, -1) if slip.get("all_heads") else (-1,)
        centred = x - x.mean(-1, keepdim=True) if slip.get("layer_norm") else x
        rms = torch.sqrt(centred.pow(2).mean(dims, keepdim=True) + eps)
        return centred / rms * (weight if slip.get("raw_gain") else 1 + weight)

    return answer


_HINT_QK_NORM = (
    "Normalise each head's vector on its own: x / sqrt(mean(x², over the last dim) + eps), then "
    "multiply by the gain 1 + weight (Qwen3-Next stores the gain minus 1)."
)

_NO_RMS_NORM = (
    "normalise by hand: no F.rms_norm, nn.RMSNorm or mha.rms_norm (nor Qwen3-Next's modules)."
)

QK_NORM = Exercise(
    "check_qk_norm",
    "RMSNorm over each head's D coordinates, gain 1 + weight",
    _qk_norm_reference,
    _qk_norm_cases,
    variants=(_qk_norm_by_hand, _qk_norm_slip()),
    mistakes=(
        (
            _qk_norm_slip(raw_gain=True),
            "The stored weight is the gain minus 1: multiply by 1 + weight. " + _HINT_QK_NORM,
        ),
        (
            _qk_norm_slip(all_heads=True),
            "The norm was taken over all heads of a token together; QK-norm normalises each "
            "head (the last dim) on its own. " + _HINT_QK_NORM,
        ),
        (
            _qk_norm_slip(layer_norm=True),
            "This is a LayerNorm: RMSNorm does not subtract the mean. " + _HINT_QK_NORM,
        ),
        (lambda x, weight, eps: F.rms_norm(x, (x.shape[-1],), 1 + weight, eps=eps), _NO_RMS_NORM),
        (lambda x, weight, eps: mha.rms_norm(x, 1 + weight, eps=eps), _NO_RMS_NORM),
        (lambda x, weight, eps: norms._rms_norm(x, 1 + weight, eps), _NO_RMS_NORM),
    ),
    hint=_HINT_QK_NORM,
    forbidden=(
        F.rms_norm,
        torch.rms_norm,
        torch.nn.RMSNorm.forward,
        *defined_in(norms),
        *defined_in(qwen3_next),
        *defined_in(gated_deltanet),
    ),
    forbidden_hint=_NO_RMS_NORM,
    rewrites=(F.rms_norm, mha.rms_norm),
    params=("qk_norm",),
    doc="Check ``qk_norm(x, weight, eps) -> x`` normalised per head with gain ``1 + weight``.",
)

# --- partial RoPE -------------------------------------------------------------------------------------


def _partial_rope(x: Tensor, positions: Tensor, rotary_dim: int, **slip: bool) -> Tensor:
    """RoPE on the first ``rotary_dim`` coordinates as complex multiplication, or a slip."""
    D = x.shape[-1]
    R = D if slip.get("all") else rotary_dim
    speeds_of = D if slip.get("speeds_of_d") else R
    theta = 10000.0 ** (-torch.arange(R // 2, dtype=torch.float64) * 2 / speeds_of)  # (R/2,)
    turn = torch.polar(torch.ones(()).double(), positions.double()[:, None] * theta)  # (L, R/2)
    if slip.get("last"):
        rest, part = x[..., : D - R], x[..., D - R :]
    else:
        part, rest = x[..., :R], x[..., R:]
    if slip.get("half_of_d"):  # pairs (i, i + D/2) cut at R: coordinates i and i + R/2 of x
        z = torch.complex(x[..., : R // 2], x[..., D // 2 : D // 2 + R // 2]) * turn
        out = x.clone()
        out[..., : R // 2], out[..., D // 2 : D // 2 + R // 2] = z.real, z.imag
        return out
    z = torch.complex(part[..., : R // 2], part[..., R // 2 :]) * turn  # (..., L, R/2)
    turned = torch.cat([z.real, z.imag], dim=-1)  # (..., L, R)
    return torch.cat([rest, turned], -1) if slip.get("last") else torch.cat([turned, rest], -1)


def _partial_rope_cases() -> list[Case]:
    g = torch.Generator().manual_seed(104)
    return [
        Case(
            f"rope(x {shape}, positions {label}, rotary_dim={R})",
            (randn64(g, *shape), pos, R),
            atol=1e-6 * max(1, int(pos.max())),
            rtol=1e-5,
        )
        for shape, pos, label, R in (
            ((2, 3, 6, 16), torch.arange(6), "0…5", 4),
            ((5, 32), torch.tensor([3, 700, 12, 0, 41]), "[3, 700, 12, 0, 41]", 8),
        )
    ]


def _partial_rope_by_halves(x: Tensor, positions: Tensor, rotary_dim: int) -> Tensor:
    R = rotary_dim
    theta = 1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)  # (R/2,)
    angles = positions.double()[:, None] * theta  # (L, R/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (L, R)
    part = x[..., :R]
    x1, x2 = part[..., : R // 2], part[..., R // 2 :]
    return torch.cat([part * cos + torch.cat([-x2, x1], -1) * sin, x[..., R:]], dim=-1)


_HINT_PARTIAL = (
    "Rotate only the first rotary_dim = R coordinates, as RoPE on an R-dim head: pair i with "
    "i + R/2, speeds θ_i = 10000 ** (-2i / R); the other D - R coordinates pass through unchanged."
)
_NO_APPLY_ROPE = "write the rotation yourself, without mha.apply_rope."

PARTIAL_ROPE = Exercise(
    "check_partial_rope",
    "RoPE on the first rotary_dim coordinates, the rest unchanged",
    _partial_rope,
    _partial_rope_cases,
    variants=(
        _partial_rope_by_halves,
        lambda x, positions, R: _partial_rope(x, positions, R).float().double(),
    ),
    mistakes=(
        (lambda x, p, R: mha.apply_rope(x, p, rotary_dim=R), _NO_APPLY_ROPE),
        (
            lambda x, p, R: torch.cat(
                [rope_library._apply_rope(x[..., :R], p, 10000.0), x[..., R:]], -1
            ),
            _NO_APPLY_ROPE,
        ),
        (
            lambda x, p, R: _partial_rope(x, p, R, all=True),
            "Every coordinate was rotated: partial RoPE turns only the first rotary_dim. "
            + _HINT_PARTIAL,
        ),
        (
            lambda x, p, R: _partial_rope(x, p, R, last=True),
            "The last rotary_dim coordinates were rotated; Qwen3-Next rotates the first ones. "
            + _HINT_PARTIAL,
        ),
        (
            lambda x, p, R: _partial_rope(x, p, R, speeds_of_d=True),
            "The speeds are those of a D-dim head: the rotated part is an R-dim head, "
            "θ_i = 10000 ** (-2i / R). " + _HINT_PARTIAL,
        ),
        (
            lambda x, p, R: _partial_rope(x, p, R, half_of_d=True),
            "Coordinate i was paired with i + D/2; within the rotated part it pairs with i + R/2. "
            + _HINT_PARTIAL,
        ),
    ),
    hint=_HINT_PARTIAL,
    forbidden=(*defined_in(rope_library), deepseek_v3.rotate, *defined_in(qwen3_next)),
    forbidden_hint=_NO_APPLY_ROPE,
    rewrites=(mha.apply_rope,),
    params=("rope",),
    doc="Check ``rope(x, positions, rotary_dim) -> (..., L, D)``, RoPE on the first coordinates.",
)

EXERCISES = publish(globals())
