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

import math

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
    x: Tensor,
    positions: int | Tensor | None = None,
    *,
    base: float = 10000.0,
    frequencies: Tensor | None = None,
    rotary_dim: int | None = None,
    attention_factor: float = 1.0,
) -> Tensor:
    """Rotate each pair ``(x_i, x_{i + D/2})`` of every row by ``position · θ_i``.

    Args:
        x: queries or keys, heads already split; the last dim ``D`` must be even.
        positions: the position of each row: ``None`` for ``0 … L-1``; an int offset ``p0`` for
            ``p0 … p0+L-1`` (decoding after ``p0`` cached tokens); or an integer tensor ``(L,)``
            or broadcasting to ``x.shape[:-1]`` (e.g. ``(B, 1, L)`` for ``(B, H, L, D)``). No
            position may be negative, and a float is an error rather than truncated.
        base: sets the slowest speed, ``θ_{D/2-1} ≈ 1/base``.
        frequencies: the speed of each pair, ``(R/2,)``, instead of ``base``'s (e.g. from
            :func:`yarn_frequencies`).
        rotary_dim: rotate only the first ``R`` coordinates of each row and pass the others
            through unchanged ("partial RoPE", as Qwen3-Next on a quarter of each head); the
            speeds are then those of an ``R``-dim head. Defaults to ``D``.
        attention_factor: multiplies the rotated coordinates (YaRN's factor; a query·key score
            of two rotated parts grows by its square). 1 for plain RoPE.

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
    D = x.shape[-1]
    R = D if rotary_dim is None else validate.positive_int("rotary_dim", rotary_dim)
    if R > D or R % 2:
        raise ValueError(
            f"rotary_dim must be even and at most D, got rotary_dim {R} and x {validate.shape(x)}"
        )
    if frequencies is not None:
        validate.tensor("frequencies", frequencies, floating=True)
        if validate.shape(frequencies) != (R // 2,):
            raise ValueError(
                f"frequencies must have shape (rotary_dim/2,) = ({R // 2},), "
                f"got {validate.shape(frequencies)}"
            )
    attention_factor = validate.positive_float("attention_factor", attention_factor)
    if R == D:
        return _apply_rope(x, positions, base, frequencies, attention_factor)
    rotated = _apply_rope(x[..., :R], positions, base, frequencies, attention_factor)  # (..., L, R)
    return torch.cat([rotated, x[..., R:]], dim=-1)  # (..., L, D): the rest passes through


def _apply_rope(
    x: Tensor,
    positions: int | Tensor,
    base: float,
    frequencies: Tensor | None = None,
    attention_factor: float = 1.0,
) -> Tensor:
    """:func:`apply_rope` on checked arguments: ``positions`` is an int offset ``p0`` (rows at
    ``p0 … p0+L-1``) or an integer tensor of positions; every coordinate is rotated.

    Shapes:
        x ``(..., L, D)``, positions ``(L,)`` or broadcasting to ``(..., L)``, frequencies
        ``(D/2,)`` or None -> ``(..., L, D)``.
    """
    L, D = x.shape[-2:]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if frequencies is None:
        theta = _rope_frequencies(D, base, compute, x.device)  # (D/2,)
    else:
        theta = frequencies.to(x.device, compute)  # (D/2,)
    if isinstance(positions, int):  # an offset: the rows are p0, p0 + 1, ...
        positions = torch.arange(positions, positions + L, device=x.device)  # (L,)
    pos = positions.to(x.device, compute)  # (L,) or (..., L)
    angles = pos.unsqueeze(-1) * theta  # (..., L, D/2)
    cos = angles.cos().repeat(*[1] * (angles.dim() - 1), 2)  # (..., L, D): pair i and i + D/2
    sin = angles.sin().repeat(*[1] * (angles.dim() - 1), 2)  # (..., L, D)
    xc = x.to(compute)
    x1, x2 = xc[..., : D // 2], xc[..., D // 2 :]  # (..., L, D/2) each: the two halves
    rotated = torch.cat([-x2, x1], dim=-1)  # (..., L, D): (x1, x2) -> (-x2, x1)
    if attention_factor != 1.0:  # YaRN scales cos and sin, i.e. the rotated vector
        cos, sin = cos * attention_factor, sin * attention_factor
    return (xc * cos + rotated * sin).to(x.dtype)  # (..., L, D)


def yarn_frequencies(
    head_dim: int,
    *,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> tuple[Tensor, float]:
    """YaRN's RoPE speeds for a context ``factor`` times longer than the one trained on.

    Position interpolation divides every speed by ``factor`` (positions ``0 … factor·L0`` then
    turn no further than ``0 … L0`` did). YaRN does that only for the slow pairs: a pair that turns
    fewer than ``beta_slow`` times over the original context ``L0`` is interpolated, one that turns
    more than ``beta_fast`` times keeps its speed (its angles were all seen in training), and the
    pairs between are blended linearly in the pair index. Attention also gets sharper again with
    ``attention_factor = 0.1·ln(factor) + 1``, applied to the rotated queries and keys.

    Args:
        head_dim: the rotated dims ``D`` (``rotary_dim`` for partial RoPE).
        base: RoPE's base (``rope_theta``).
        factor: how many times longer the new context is.
        original_max_position_embeddings: ``L0``, the context length trained on.
        beta_fast, beta_slow: turns over ``L0`` above which a pair keeps its speed / below which it
            is fully interpolated.
        truncate: round the blend's boundaries to whole pairs (floor / ceil), as the YaRN paper
            does; gpt-oss sets it False.

    Returns:
        ``(frequencies (D/2,) float32, attention_factor)``, for :func:`apply_rope`'s
        ``frequencies=`` and ``attention_factor=``.
    """
    head_dim = validate.positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    base = validate.positive_float("base", base)
    factor = validate.positive_float("factor", factor)
    L0 = validate.positive_int("original_max_position_embeddings", original_max_position_embeddings)
    beta_fast = validate.positive_float("beta_fast", beta_fast)
    beta_slow = validate.positive_float("beta_slow", beta_slow)
    validate.flag("truncate", truncate)

    def pair_turning(turns: float) -> float:
        # the (fractional) pair index whose angle turns `turns` full circles over L0 positions
        return head_dim * math.log(L0 / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step rather than a ramp; avoids dividing by zero
    # The speeds in float32 with the same operations as Hugging Face's code: at position 5000 one
    # rounding step in a speed already moves the angle by ~3e-4 rad.
    inv_theta = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,) 1/θ
    i = torch.arange(head_dim // 2, dtype=torch.float32)  # (D/2,) pair index
    interpolated = ((i - low) / (high - low)).clamp(0, 1)  # (D/2,) 0: keep speed, 1: divide
    kept = 1 - interpolated  # (D/2,)
    frequencies = 1.0 / (factor * inv_theta) * (1 - kept) + 1.0 / inv_theta * kept  # (D/2,)
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return frequencies, attention_factor
