"""Rotary position embedding (RoPE): positions as rotations of the queries and keys.

The head dim ``D`` is cut into ``D/2`` pairs of coordinates. Pair ``i`` of the vector at position
``p`` is turned by the angle ``p · θ_i`` with ``θ_i = base ** (-2i / D)``: the first pairs turn
fast, the last ones slowly. Because a rotation by ``a`` followed by the transpose of one by ``b``
is a rotation by ``a - b``, the score of a rotated query at position ``m`` and a rotated key at
position ``n`` depends on the positions only through ``m - n``.

Pairing: coordinate ``i`` goes with coordinate ``i + D/2`` ("rotate half"), as Llama does in
Hugging Face transformers, not with its neighbour ``i + 1`` as in the RoFormer paper and Meta's
reference Llama code. The two conventions are a fixed permutation of each head's coordinates
apart: Hugging Face's Llama weight converter permutes the rows of ``W_Q`` and ``W_K`` (row
``2i + j`` of a head becomes row ``i + j·D/2``), after which rotate-half gives the scores that
neighbour pairs gave on the original weights. Unpermuted weights work only with the pairing they
were trained with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import validation as validate


def rope_frequencies(
    head_dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The angular speed ``θ_i = base ** (-2i / D)`` of each pair, in radians per position.

    Shapes:
        returns ``(D/2,)``.
    """
    head_dim = validate.positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    base = validate.positive_float("base", base)
    validate.floating_dtype("dtype", dtype)
    return _rope_frequencies(head_dim, base, dtype, device)


def _rope_frequencies(
    head_dim: int, base: float, dtype: torch.dtype, device: torch.device | str | None
) -> Tensor:
    """:func:`rope_frequencies` on checked arguments: ``(D/2,)``."""
    i = torch.arange(0, head_dim, 2, dtype=dtype, device=device)  # (D/2,) = 2i
    return base ** (-i / head_dim)  # (D/2,)


def apply_rope(
    x: Tensor, positions: int | Tensor | None = None, *, base: float = 10000.0
) -> Tensor:
    """Rotate each pair ``(x_i, x_{i + D/2})`` of every row by ``position · θ_i``.

    Args:
        x: queries or keys, heads already split; the last dim ``D`` must be even.
        positions: the position of each row: ``None`` for ``0 … L-1``; an int offset ``p0`` for
            ``p0 … p0+L-1`` (decoding after ``p0`` cached tokens); or an integer tensor ``(L,)``
            or broadcasting to ``x.shape[:-1]`` (e.g. ``(B, 1, L)`` for ``(B, H, L, D)``). No
            position may be negative, and a float is an error rather than truncated.
        base: sets the slowest speed, ``θ_{D/2-1} ≈ 1/base``.

    Shapes:
        x ``(..., L, D)`` -> ``(..., L, D)`` in x's dtype. The angles, cosines and sines are
        computed in float32 (float64 for float64 inputs), as float16 cannot even hold position
        2049 exactly.
    """
    validate.tensor("x", x, floating=True)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., L, D), got shape {validate.shape(x)}")
    if x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even last dim D (RoPE rotates pairs), got shape {validate.shape(x)}"
        )
    base = validate.positive_float("base", base)
    positions = validate.positions(
        "positions", 0 if positions is None else positions, validate.shape(x)[:-1]
    )
    return _apply_rope(x, positions, base)


def _apply_rope(x: Tensor, positions: int | Tensor, base: float) -> Tensor:
    """:func:`apply_rope` on checked arguments: ``positions`` is an int offset ``p0`` (rows at
    ``p0 … p0+L-1``) or an integer tensor of positions.

    Shapes:
        x ``(..., L, D)``, positions ``(L,)`` or broadcasting to ``(..., L)`` -> ``(..., L, D)``.
    """
    L, D = x.shape[-2:]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    theta = _rope_frequencies(D, base, compute, x.device)  # (D/2,)
    if isinstance(positions, int):  # an offset: the rows are p0, p0 + 1, ...
        positions = torch.arange(positions, positions + L, device=x.device)  # (L,)
    pos = positions.to(x.device, compute)  # (L,) or (..., L)
    angles = pos.unsqueeze(-1) * theta  # (..., L, D/2)
    cos = angles.cos().repeat(*[1] * (angles.dim() - 1), 2)  # (..., L, D): pair i and i + D/2
    sin = angles.sin().repeat(*[1] * (angles.dim() - 1), 2)  # (..., L, D)
    xc = x.to(compute)
    x1, x2 = xc[..., : D // 2], xc[..., D // 2 :]  # (..., L, D/2) each: the two halves
    rotated = torch.cat([-x2, x1], dim=-1)  # (..., L, D): (x1, x2) -> (-x2, x1)
    return (xc * cos + rotated * sin).to(x.dtype)  # (..., L, D)
