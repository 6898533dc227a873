"""DeepSeek-V2/V3's multi-head latent attention (MLA), faithfully: the layer of the released models.

Chapter 8's :class:`mha.MultiHeadLatentAttention` keeps MLA's idea (cache a small latent, rebuild
keys and values from it, absorb the up-projections). The released layer adds four things, all
here, with Hugging Face's parameter names so that a checkpoint's weights load unchanged:

* a **low-rank query**: ``q = W_UQ RMSNorm(W_DQ x)`` (``q_a_proj``, ``q_a_layernorm``,
  ``q_b_proj``), or one ``q_proj`` when the config has no ``q_lora_rank`` (V2-Lite);
* an **RMSNorm on the compressed KV**: ``c = RMSNorm(W_DKV x)`` (``kv_a_layernorm``), the latent
  that is cached and that ``kv_b_proj`` (``W_UK`` and ``W_UV`` stacked per head) expands;
* **decoupled RoPE**: each head's query has ``qk_nope_head_dim`` numbers without position and
  ``qk_rope_head_dim`` rotated ones; the rotated key part is *one* vector per token, computed
  from ``x`` beside the latent (``kv_a_proj_with_mqa`` gives both) and shared by all heads. A
  cache entry is the latent and that key: ``kv_lora_rank + qk_rope_head_dim`` numbers (512 + 64
  = 576 in V2 and V3). RoPE on the latent's keys would put a position-dependent rotation between
  the query and ``W_UK``, which could then no longer be absorbed into the query;
* **YaRN** for long contexts: stretched rotation speeds, a factor on cos and sin, and
  ``mscale_all_dim`` folded into the softmax scale.

``rope_interleave`` (V3's checkpoints) pairs neighbouring coordinates ``(0, 1), (2, 3), …`` of
the rope part; it equals rotate-half RoPE after moving the even coordinates before the odd ones,
which is what :func:`rotate` does (queries and keys are permuted alike, so scores are unchanged).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from .. import validation as validate
from ..attention import _attention
from ..masks import _causal_mask
from . import _hf


@dataclass(frozen=True)
class YaRN:
    """YaRN's RoPE scaling, as DeepSeek's configs give it (``rope_scaling`` / ``rope_parameters``).

    Attributes:
        factor: how many times longer than pretraining the context may be.
        original_max_position_embeddings: the pretraining context.
        beta_fast, beta_slow: pairs turning more than ``beta_fast`` times over the original context
            keep their speed; fewer than ``beta_slow`` times are slowed by ``factor``; a ramp between.
        mscale, mscale_all_dim: DeepSeek's attention temperature: cos and sin are multiplied by
            ``m(mscale) / m(mscale_all_dim)`` and the softmax scale by ``m(mscale_all_dim)²``, with
            ``m(a) = 1 + 0.1 · a · ln(factor)``.
        attention_factor: overrides the cos/sin factor when given.
        truncate: round the ramp's ends to whole pairs.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature ``1 + 0.1 · mscale · ln(factor)`` (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_speeds(dim: int, base: float, yarn: YaRN | None = None) -> tuple[Tensor, float]:
    """The angular speed of each rotated pair and the factor on cos and sin.

    Without YaRN: ``θ_i = base ** (-2i / dim)`` and factor 1. With YaRN, fast pairs (many turns
    over the original context) keep ``θ_i``, slow ones get ``θ_i / factor``, and a linear ramp over
    the pairs in between mixes the two.

    Shapes:
        returns ``(dim/2,)`` float32 speeds and a float.
    """
    i = torch.arange(0, dim, 2, dtype=torch.float32)  # (dim/2,) = 2i
    theta = 1.0 / base ** (i / dim)  # (dim/2,)
    if yarn is None:
        return theta, 1.0
    f = yarn.factor

    def pair_of(turns: float) -> float:  # the (fractional) pair that turns `turns` times
        L0 = yarn.original_max_position_embeddings
        return dim * math.log(L0 / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(yarn.beta_fast), pair_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(
        0, 1
    )  # (dim/2,)
    theta = theta / f * ramp + theta * (1 - ramp)  # (dim/2,): slowed where ramp = 1
    if yarn.attention_factor is not None:
        factor = yarn.attention_factor
    elif yarn.mscale and yarn.mscale_all_dim:
        factor = yarn_mscale(f, yarn.mscale) / yarn_mscale(f, yarn.mscale_all_dim)
    else:
        factor = yarn_mscale(f)
    return theta, float(factor)


def rotate(
    x: Tensor, positions: Tensor, speeds: Tensor, factor: float, interleaved: bool
) -> Tensor:
    """RoPE on the rope part of queries or keys, rotate-half pairing after an optional de-interleave.

    Args:
        x: ``(..., L, R)`` rope parts.
        positions: ``(L,)`` or ``(B, L)`` integer positions (broadcast against x's leading dims by
            the caller: ``(B, 1, L)`` for ``(B, H, L, R)``).
        speeds: ``(R/2,)`` from :func:`rope_speeds`; factor multiplies cos and sin.
        interleaved: x pairs neighbours ``(2i, 2i+1)``; they are moved to ``(i, i + R/2)`` first.

    Shapes:
        ``(..., L, R) -> (..., L, R)``, in the rotate-half layout.
    """
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)  # (..., L, R): evens, then odds
    angles = positions.to(torch.float32).unsqueeze(-1) * speeds  # (..., L, R/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1) * factor  # (..., L, R)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1) * factor  # (..., L, R)
    x1, x2 = x.chunk(2, dim=-1)  # (..., L, R/2) each
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)  # (..., L, R)


class MLACache:
    """What DeepSeek's MLA caches per token: the normed latent and the shared rotated key.

    Shapes:
        latent ``(B, S, C)``, k_rope ``(B, S, R)``; ``S`` grows with every update.
    """

    def __init__(self) -> None:
        self.latent: Tensor | None = None
        self.k_rope: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: ``S · (C + R)`` elements per sequence."""
        if self.latent is None or self.k_rope is None:
            return 0
        return (self.latent.numel() + self.k_rope.numel()) * self.latent.element_size()

    def update(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``(B, S_new, C)`` latents and ``(B, S_new, R)`` keys; return everything cached."""
        if self.latent is None or self.k_rope is None:
            self.latent, self.k_rope = latent, k_rope
        else:
            if latent.shape[0] != self.latent.shape[0]:
                raise ValueError(
                    f"new latents {validate.shape(latent)} do not match the cached batch "
                    f"{validate.shape(self.latent)}"
                )
            self.latent = torch.cat([self.latent, latent], dim=1)  # (B, S_old + S_new, C)
            self.k_rope = torch.cat([self.k_rope, k_rope], dim=1)  # (B, S_old + S_new, R)
        return self.latent, self.k_rope


class DeepSeekMLA(nn.Module):
    """DeepSeek-V2/V3's attention layer (MLA with low-rank query, latent RMSNorm, decoupled RoPE).

    Args:
        hidden_size: model width ``E``.
        num_heads: heads ``H``.
        kv_lora_rank: latent width ``C`` (512 in V2 and V3).
        qk_nope_head_dim: ``Dn``, the query/key numbers per head without position (128).
        qk_rope_head_dim: ``R``, the rotated numbers per head (64); the rotated key is shared.
        v_head_dim: ``Dv`` per head (128).
        q_lora_rank: the query's bottleneck (1536 in V3); ``None`` for one ``q_proj``.
        rope_theta: RoPE's base.
        rope_interleave: the rope part pairs neighbouring coordinates (V3's checkpoints).
        yarn: YaRN scaling, or ``None`` for plain RoPE.
        rms_norm_eps: the RMSNorms' epsilon.
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``, as Hugging Face's
            ``attention_bias`` (never on ``q_proj``, ``q_b_proj``, ``kv_b_proj``).

    Shapes:
        x ``(B, L, E)`` -> ``(B, L, E)``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope_theta: float = 10000.0,
        rope_interleave: bool = True,
        yarn: YaRN | None = None,
        rms_norm_eps: float = 1e-6,
        bias: bool = False,
    ) -> None:
        super().__init__()
        E = validate.positive_int("hidden_size", hidden_size)
        H = validate.positive_int("num_heads", num_heads)
        C = validate.positive_int("kv_lora_rank", kv_lora_rank)
        Dn = validate.positive_int("qk_nope_head_dim", qk_nope_head_dim)
        R = validate.positive_int("qk_rope_head_dim", qk_rope_head_dim)
        Dv = validate.positive_int("v_head_dim", v_head_dim)
        if R % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {R}")
        self.hidden_size, self.num_heads, self.kv_lora_rank = E, H, C
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = Dn, R, Dv
        self.q_lora_rank, self.rope_interleave = (
            q_lora_rank,
            validate.flag("rope_interleave", rope_interleave),
        )
        if q_lora_rank is None:
            self.q_proj = nn.Linear(E, H * (Dn + R), bias=False)  # W_Q
        else:
            Cq = validate.positive_int("q_lora_rank", q_lora_rank)
            self.q_a_proj = nn.Linear(E, Cq, bias=bias)  # W_DQ
            self.q_a_layernorm = nn.RMSNorm(Cq, eps=rms_norm_eps)
            self.q_b_proj = nn.Linear(Cq, H * (Dn + R), bias=False)  # W_UQ (and W_QR)
        self.kv_a_proj_with_mqa = nn.Linear(E, C + R, bias=bias)  # W_DKV and W_KR side by side
        self.kv_a_layernorm = nn.RMSNorm(C, eps=rms_norm_eps)
        self.kv_b_proj = nn.Linear(C, H * (Dn + Dv), bias=False)  # per head: W_UK rows, W_UV rows
        self.o_proj = nn.Linear(H * Dv, E, bias=bias)  # W_O
        speeds, self.rope_factor = rope_speeds(
            R, validate.positive_float("rope_theta", rope_theta), yarn
        )
        self.register_buffer("rope_speeds", speeds, persistent=False)  # not in HF's state_dict
        self.scale = (Dn + R) ** -0.5  # the softmax scale of a (Dn + R)-number head ...
        if yarn is not None and yarn.mscale_all_dim:  # ... times YaRN's temperature, squared
            self.scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.v_head_dim}, rope_interleave={self.rope_interleave}"
        )

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        return rotate(
            x, positions, cast(Tensor, self.rope_speeds), self.rope_factor, self.rope_interleave
        )

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Each head's query: the part without position and the rotated part.

        Shapes:
            x ``(B, L, E)``, positions ``(B, L)`` -> ``(B, H, L, Dn)``, ``(B, H, L, R)``.
        """
        B, L, _ = x.shape
        H, Dn, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # (B, L, H·(Dn + R))
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, L, H·(Dn + R))
        q = q.view(B, L, H, Dn + R).transpose(1, 2)  # (B, H, L, Dn + R)
        q_nope, q_rope = q.split([Dn, R], dim=-1)  # (B, H, L, Dn), (B, H, L, R)
        return q_nope, self._rotate(q_rope, positions.unsqueeze(1))  # positions (B, 1, L)

    def compress(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """What the cache stores for each token: the normed latent and the shared rotated key.

        Shapes:
            x ``(B, L, E)``, positions ``(B, L)`` -> ``(B, L, C)``, ``(B, L, R)``.
        """
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], -1
        )
        return self.kv_a_layernorm(latent), self._rotate(k_rope, positions)  # (B, L, C), (B, L, R)

    def _check(self, x: Tensor, positions: Tensor | None, start: int) -> Tensor:
        """Check ``x`` ``(B, L, E)``; return the positions as ``(B, L)`` (default: ``start …``)."""
        validate.tensor("x", x, floating=True, ndim=3, layout="(B, L, E)")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x must have width {self.hidden_size} (hidden_size), got shape {validate.shape(x)}"
            )
        validate.matches_parameters("x", x, self.kv_a_proj_with_mqa.weight)
        B, L, _ = x.shape
        if positions is None:
            positions = torch.arange(start, start + L, device=x.device)  # (L,)
        positions = validate.integer_tensor("positions", positions)
        if positions.shape not in ((L,), (B, L)):
            raise ValueError(
                f"positions must have shape ({L},) or ({B}, {L}) for x {validate.shape(x)}, "
                f"got {validate.shape(positions)}"
            )
        return positions.to(x.device).expand(B, L)  # (B, L)

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        *,
        cache: MLACache | None = None,
        absorbed: bool = False,
    ) -> Tensor:
        """Causal self-attention over ``x`` (after the cached tokens, with a ``cache``).

        Args:
            x: the new tokens.
            positions: integer positions ``(L,)`` or ``(B, L)`` for RoPE; by default the tokens
                follow the cached ones (``len(cache) … len(cache) + L - 1``). The causal mask
                follows token order, whatever the positions.
            cache: an :class:`MLACache` to append this call's latents and rope keys to.
            absorbed: attend in the latent space (``W_UK`` absorbed into the query, ``W_UV``
                applied after the weighted sum): the decoding form, same output.

        Shapes:
            x ``(B, L, E)`` -> ``(B, L, E)``.
        """
        validate.flag("absorbed", absorbed)
        if cache is not None and not isinstance(cache, MLACache):
            raise TypeError(f"cache must be an MLACache, got {type(cache).__name__}")
        positions = self._check(x, positions, 0 if cache is None else len(cache))  # (B, L)
        B, L, _ = x.shape
        q_nope, q_rope = self.queries(x, positions)  # (B, H, L, Dn), (B, H, L, R)
        latent, k_rope = self.compress(x, positions)  # (B, L, C), (B, L, R)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope)  # (B, S, C), (B, S, R)
        S = latent.shape[1]
        keep = _causal_mask(L, S, diagonal=S - L, device=x.device)  # (L, S), bottom-right
        attend = self._attend_absorbed if absorbed else self._attend_expanded
        out = attend(q_nope, q_rope, latent, k_rope, keep)  # (B, H, L, Dv)
        out = out.transpose(1, 2).reshape(B, L, self.num_heads * self.v_head_dim)  # (B, L, H·Dv)
        return cast(Tensor, self.o_proj(out))  # (B, L, E)

    def _attend_expanded(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, keep: Tensor
    ) -> Tensor:
        """Rebuild every head's key and value from the latents (the training / prefill form).

        Shapes:
            q_nope ``(B, H, L, Dn)``, q_rope ``(B, H, L, R)``, latent ``(B, S, C)``,
            k_rope ``(B, S, R)`` -> ``(B, H, L, Dv)``.
        """
        B, S, _ = latent.shape
        H, Dn, R, Dv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        kv = self.kv_b_proj(latent).view(B, S, H, Dn + Dv).transpose(1, 2)  # (B, H, S, Dn + Dv)
        k_nope, v = kv.split([Dn, Dv], dim=-1)  # (B, H, S, Dn), (B, H, S, Dv)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(B, H, S, R)], dim=-1)  # (B, H, S, Dn + R)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, L, Dn + R)
        return cast(Tensor, _attention(q, k, v, keep, 0.0, False, self.scale))  # (B, H, L, Dv)

    def _attend_absorbed(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, keep: Tensor
    ) -> Tensor:
        """Attend to the cache as it is: multi-query attention over ``[latent, k_rope]``.

        ``q_nope · k_nope = q_nope · (W_UK c) = (W_UKᵀ q_nope) · c``: each head's query moves into
        the latent space, and ``Σ p v = W_UV (Σ p c)``: values are expanded once, after the sum.
        The rope parts cannot move: ``R_i`` and ``R_j`` sit between them.

        Shapes:
            as :meth:`_attend_expanded`.
        """
        H, Dn, Dv, C = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, Dn + Dv, C)  # head h: rows of W_UK, then of W_UV
        w_uk, w_uv = w.split([Dn, Dv], dim=1)  # (H, Dn, C), (H, Dv, C)
        q_lat = q_nope @ w_uk  # (B, H, L, Dn) @ (H, Dn, C) -> (B, H, L, C)
        q = torch.cat([q_lat, q_rope], dim=-1)  # (B, H, L, C + R)
        k = torch.cat([latent, k_rope], dim=-1).unsqueeze(1)  # (B, 1, S, C + R): the cache entry
        v = latent.unsqueeze(1)  # (B, 1, S, C): the latent is also every head's value
        pc = _attention(q, k, v, keep, 0.0, False, self.scale, groups=H)  # (B, H, L, C)
        return cast(Tensor, pc) @ w_uv.transpose(
            -2, -1
        )  # (B, H, L, C) @ (H, C, Dv) -> (B, H, L, Dv)


def absorbed_decode_cost(
    num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, *, bytes_per_element: int = 2
) -> tuple[int, int]:
    """FLOPs and bytes per cached token of one absorbed decode step (one query per sequence).

    Every head scores the ``C + R``-number cache entry (a multiply and an add each) and adds the
    ``C``-number latent into its weighted sum; the entry is read once for all heads. Projections
    and the softmax are left out: they do not grow with the context.

    Returns:
        ``(flops, bytes)`` per cached token; their ratio is the step's arithmetic intensity.
    """
    H, C, R = num_heads, kv_lora_rank, qk_rope_head_dim
    flops = H * (2 * (C + R) + 2 * C)  # scores, then the weighted sum of latents
    return flops, (C + R) * bytes_per_element


# ------------------------------------------------------------------------------------------------
# from_hf: a Hugging Face DeepseekV3Attention's config and state_dict -> DeepSeekMLA
# ------------------------------------------------------------------------------------------------

_REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def _rope_config(config: Mapping[str, Any]) -> tuple[float, YaRN | None]:
    """RoPE's base and YaRN from a config in either spelling: ``rope_parameters`` (transformers
    5) or ``rope_theta`` + ``rope_scaling`` (the checkpoints' ``config.json``)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(base), None
    if kind != "yarn":
        raise ValueError(
            f"rope type {kind!r} is not supported for deepseek_v3 (only 'default' and 'yarn')"
        )
    original = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    factor = params.get("factor")
    if original is None or (factor is None and "max_position_embeddings" not in config):
        raise ValueError("a yarn rope config needs factor and original_max_position_embeddings")
    if factor is None:  # as transformers: the ratio of the context to the pretraining context
        factor = config["max_position_embeddings"] / original
    yarn = YaRN(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
    return float(base), yarn


def _mla_arguments(
    config: Mapping[str, Any], family: str, need: Sequence[str], layer_idx: int
) -> dict[str, Any]:
    """Check that ``config`` has every key of ``need`` and a layer ``layer_idx``; return the
    keyword arguments of :class:`DeepSeekMLA` it sets (all but ``hidden_size`` and
    ``num_heads``)."""
    _hf.require(config, family, *need)
    _hf.check_layer_idx(config, layer_idx)
    base, yarn = _rope_config(config)
    return {
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_nope_head_dim": config["qk_nope_head_dim"],
        "qk_rope_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        "q_lora_rank": config.get("q_lora_rank"),
        "rope_theta": base,
        "rope_interleave": bool(config.get("rope_interleave", True)),
        "yarn": yarn,
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "bias": bool(config.get("attention_bias", False)),
    }


def from_hf(
    config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int = 0
) -> DeepSeekMLA:
    """A :class:`DeepSeekMLA` from a Hugging Face ``DeepseekV3Attention``'s config and weights.

    Every layer of DeepSeek-V2/V3 has the same attention, so ``layer_idx`` only has to exist.
    """
    mla = _mla_arguments(config, "deepseek_v3", _REQUIRED, layer_idx)
    module = DeepSeekMLA(config["hidden_size"], config["num_attention_heads"], **mla)
    load_weights(module, state_dict)
    return module


def load_weights(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Copy Hugging Face weights (tensors or numpy arrays) into ``module``, checking every name
    and shape: ``ValueError`` names the missing, unexpected and misshapen ones."""
    own = module.state_dict()
    _hf.check_keys(own, state_dict, "state_dict")
    weights = {
        k: torch.as_tensor(np.asarray(v)) if not isinstance(v, Tensor) else v
        for k, v in state_dict.items()
    }
    wrong = [
        f"{k}: expected {tuple(own[k].shape)}, got {tuple(weights[k].shape)}"
        for k in own
        if weights[k].shape != own[k].shape
    ]
    if wrong:
        raise ValueError(f"state_dict shapes do not fit the config: {'; '.join(wrong)}")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(weights[k].to(v.dtype))


def hf_reference() -> dict[str, Any]:
    """A small DeepSeek-V3-style layer as Hugging Face ran it: package data for the chapter.

    ``tools/hf_fixtures.py`` built it from transformers' ``DeepseekV3Attention`` (q LoRA,
    interleaved rope, YaRN, eager attention) and stored, as JSON: ``config`` (its
    ``to_dict()``), the module's ``state_dict`` (its own keys), the input ``x`` ``(1, 6, 16)``,
    its ``positions`` and HF's output ``out``. Tensors come back as float32 tensors.
    """
    text = resources.files(__package__).joinpath("deepseek_v3_hf.json").read_text()
    data = json.loads(text)
    data["state_dict"] = {k: torch.tensor(v) for k, v in data["state_dict"].items()}
    for key in ("x", "out", "positions"):
        data[key] = torch.tensor(data[key])
    return cast(dict[str, Any], data)
