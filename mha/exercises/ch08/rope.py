"""Section 8.1, RoPE: the exercise as data for :mod:`.._harness`.

Reference: RoPE as complex multiplication (``torch.polar``); mistakes: neighbour (interleaved)
pairs, the frequency exponent without its 2, the rotation backwards, the positions ignored, and
``mha.apply_rope``, which the exercise bans.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

import mha
from mha import rope as rope_library
from mha.models import deepseek_v3

from .._harness import Case, Exercise, defined_in, publish, randn64, slipped

# --- RoPE -----------------------------------------------------------------------------------------


def _rope_reference(x: Tensor, positions: Tensor) -> Tensor:
    """Pair (x_i, x_{i+D/2}) as the complex number x_i + j·x_{i+D/2}, times e^{j·p·θ_i}."""
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)  # (D/2,)
    turn = torch.polar(
        torch.ones(()).double(), positions.double()[:, None] * theta
    )  # (L, D/2) complex
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * turn  # (..., L, D/2)
    return torch.cat([z.real, z.imag], dim=-1)  # (..., L, D)


def _rope_slip(x: Tensor, positions: Tensor, **slip: bool) -> Tensor:
    """RoPE with one of the usual slips."""
    D = x.shape[-1]
    i = torch.arange(D // 2, dtype=torch.float64)  # pair index
    theta = 10000.0 ** (-i / D if slip.get("no_two") else -2 * i / D)  # (D/2,)
    pos = torch.arange(x.shape[-2]) if slip.get("ignore_positions") else positions
    angles = pos.double()[:, None] * theta  # (L, D/2)
    cos, sin = angles.cos(), angles.sin()
    if slip.get("backwards"):
        sin = -sin
    if slip.get("interleaved"):  # pairs (2i, 2i + 1), RoFormer's layout
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)  # (..., L, D)


def _rope_case(label: str, x: Tensor, positions: Tensor) -> Case:
    """A RoPE written in float32 (as models do) turns by angles p·θ rounded to float32: an error
    of about p · 1e-7 radians, which the tolerance allows (a wrong rotation is off by O(1))."""
    tol = 1e-6 * max(1, int(positions.abs().max()))
    return Case(label, (x, positions), atol=tol, rtol=tol)


def _rope_cases() -> list[Case]:
    g = torch.Generator().manual_seed(80)
    return [
        _rope_case(
            "rope(x, positions) with x (2, 3, 6, 8), positions 0…5",
            randn64(g, 2, 3, 6, 8),
            torch.arange(6),
        ),
        _rope_case(
            "rope(x, positions) with x (4, 16), positions [5, 900, 17, 3]",
            randn64(g, 4, 16),
            torch.tensor([5, 900, 17, 3]),
        ),
    ]


def _rope_hugging_face(x: Tensor, positions: Tensor) -> Tensor:
    """Hugging Face's way, in float32: cos and sin of shape (L, D), and rotate_half."""
    D = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # (D/2,)
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # (L, D)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def _rope_by_rotation_matrices(x: Tensor, positions: Tensor) -> Tensor:
    """Each pair times its 2×2 rotation matrix [[cos, -sin], [sin, cos]]."""
    D = x.shape[-1]
    theta = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    a = positions.double()[:, None] * theta  # (L, D/2)
    rot = torch.stack(
        [torch.stack([a.cos(), -a.sin()], -1), torch.stack([a.sin(), a.cos()], -1)], -2
    )  # (L, D/2, 2, 2)
    pairs = torch.stack([x[..., : D // 2], x[..., D // 2 :]], -1)  # (..., L, D/2, 2)
    turned = (rot @ pairs.unsqueeze(-1)).squeeze(-1)  # (..., L, D/2, 2)
    return torch.cat([turned[..., 0], turned[..., 1]], -1)


_HINT_ROPE = (
    "Pair coordinate i with i + D/2 (x1, x2 = the two halves) and turn each pair by "
    "p·θ_i with θ_i = 10000 ** (-2i / D), i = 0 … D/2-1: "
    "(x1·cos - x2·sin, x2·cos + x1·sin)."
)


def _rope_by_private_helper(x: Tensor, positions: Tensor) -> Tensor:
    """mha.rope's private helper, reached around the public apply_rope."""
    return rope_library._apply_rope(x, positions, 10000.0)


#: Every function of mha.rope (public and private) and DeepSeek's own rotation.
ROPE_BANNED: tuple[Callable[..., Any], ...] = (
    *defined_in(rope_library),
    deepseek_v3.rotate,
    deepseek_v3.rope_speeds,
)
_NO_APPLY_ROPE = "write the rotation yourself, without mha.apply_rope."
ROPE = Exercise(
    "check_rope",
    "equals RoPE as complex multiplication (rotate-half pairs, base 10000, float64)",
    _rope_reference,
    _rope_cases,
    variants=(partial(_rope_slip), _rope_hugging_face, _rope_by_rotation_matrices),
    mistakes=(
        (
            slipped(_rope_slip, "interleaved"),
            "These are neighbour pairs (2i, 2i + 1), RoFormer's layout (and Meta's Llama code); "
            "Hugging Face transformers' Llama (and this course) pairs coordinate i with i + D/2. "
            + _HINT_ROPE,
        ),
        (
            slipped(_rope_slip, "no_two"),
            "The exponent is -2i/D (i counts pairs, 2i the coordinates): with -i/D the slowest "
            "pair turns at 10000 ** -0.5 instead of about 1/10000. " + _HINT_ROPE,
        ),
        (
            slipped(_rope_slip, "backwards"),
            "The pairs turn the wrong way: the sine's sign is flipped. " + _HINT_ROPE,
        ),
        (
            slipped(_rope_slip, "ignore_positions"),
            "Use the positions you are given (they need not be 0 … L-1, e.g. while decoding). "
            + _HINT_ROPE,
        ),
        (mha.apply_rope, _NO_APPLY_ROPE),
        (lambda x, positions: mha.apply_rope(x, positions), _NO_APPLY_ROPE),
        (_rope_by_private_helper, _NO_APPLY_ROPE),
    ),
    hint=_HINT_ROPE,
    crash_hint="x is (..., L, D) and positions (L,): the angles positions[:, None] * theta are "
    "(L, D/2) and broadcast over the leading dims.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=ROPE_BANNED,
    forbidden_hint=_NO_APPLY_ROPE,
    rewrites=(mha.apply_rope,),
    params=("rope",),
    doc="Check ``rope(x, positions) -> (..., L, D)``: x ``(..., L, D)`` rotated by RoPE with "
    "base 10000 and rotate-half pairs, ``positions`` an integer tensor ``(L,)``.",
)


EXERCISES = publish(globals())
