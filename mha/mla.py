"""Multi-head latent attention (MLA), the attention of DeepSeek-V2 and V3, without its RoPE part.

MLA caches one small *latent* vector per token instead of a key and a value per head. Each token
``x`` is compressed to ``c = x W_DKV`` (``C`` numbers, e.g. 512, against ``2 · H · D`` = 32768 for
DeepSeek-V2's 128 heads of 128); every head rebuilds its key and value from it with its own
up-projections, ``k_h = c W_UK_h`` and ``v_h = c W_UV_h``.

Rebuilding the keys of every cached token at every decoding step would cost more than the cache
saves. It is not needed: the up-projections can be *absorbed*. A score is
``q_h · k_h = q_h · (W_UK_h c) = (W_UK_hᵀ q_h) · c``, so the query is mapped into the latent space
once (``q̃_h = q_h W_UK_h``, ``C`` numbers) and attends to the cached latents directly; the output
``Σ_j p_j v_h,j = (Σ_j p_j c_j) W_UV_h`` applies the value up-projection once, after the weighted
sum (and ``W_UV_h`` can be folded into ``W_O``). The absorbed form is multi-query attention over
the latents: one shared "head" ``c`` is both key and value. That makes a decoding step far less
memory-bound than MHA's: every cached number is used by all ``H`` heads, so DeepSeek-V3's 128
heads over a 576-number cache entry (latent and RoPE key) do about 242 FLOPs per byte read in
16-bit, near an H100's ridge point (about 295), where the step is limited by arithmetic rather
than by memory.

Why DeepSeek needs a decoupled RoPE key: RoPE rotates a query at position ``i`` and a key at
position ``j`` by ``R_i`` and ``R_j``, so the score is ``q_hᵀ R_iᵀ R_j W_UK_h c_j``. The matrix
between ``q_h`` and ``c_j`` now depends on the positions and can no longer be absorbed into a fixed
query projection. DeepSeek-V2 therefore leaves the compressed keys without RoPE and adds a small
separate part: per head a RoPE query of ``qk_rope_head_dim`` (64) numbers and one RoPE key of 64
numbers *shared by all heads* (cached next to ``c``, so 512 + 64 numbers per token and layer). The
score is the sum of the two parts. This module implements the compressed part only; the
released layer, with the RoPE part, the low-rank query, the latent's RMSNorm and YaRN, is
:class:`mha.models.deepseek_v3.DeepSeekMLA` (section 10.3).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn

from . import validation as validate
from .attention import _attention
from .masks import _causal_mask


class LatentCache:
    """The latents of the tokens seen so far: all that MLA caches for decoding.

    Shapes:
        latent ``(B, S, C)``, where ``S`` grows with every update.
    """

    def __init__(self) -> None:
        self.latent: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached latents."""
        return 0 if self.latent is None else self.latent.numel() * self.latent.element_size()

    def update(self, c: Tensor) -> Tensor:
        """Append this step's latents ``(B, S_new, C)``; return all ``(B, S_old + S_new, C)``.

        ``S_new = 0`` adds nothing and returns what the cache holds.
        """
        validate.tensor("c", c, floating=True, ndim=3, layout="(B, S_new, C)")
        return self._append(c)

    def _append(self, c: Tensor) -> Tensor:
        """:meth:`update` on a checked ``(B, S_new, C)`` tensor (what
        :meth:`MultiHeadLatentAttention.forward` computes); it must still fit the cached latents."""
        if self.latent is None:
            self.latent = c
        else:
            if c.shape[0] != self.latent.shape[0] or c.shape[2] != self.latent.shape[2]:
                raise ValueError(
                    f"new latents {validate.shape(c)} do not match the cached latents "
                    f"{validate.shape(self.latent)} (batch and latent dim must agree)"
                )
            if c.dtype != self.latent.dtype:
                raise TypeError(
                    f"new latents must have the cached latents' dtype {self.latent.dtype}, "
                    f"got {c.dtype}"
                )
            if c.device != self.latent.device:
                raise ValueError(
                    f"new latents must be on the cached latents' device {self.latent.device}, "
                    f"got {c.device}"
                )
            self.latent = torch.cat([self.latent, c], dim=1)  # (B, S_old + S_new, C)
        return self.latent


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2's formulation without the decoupled RoPE key).

    Args:
        embed_dim: model width ``E``.
        num_heads: heads ``H``.
        kv_latent_dim: latent width ``C``; the cache holds ``C`` numbers per token.
        head_dim: ``D`` per head; defaults to ``embed_dim // num_heads``.
        bias: biases on the query, down- and output projections. The up-projections never have
            one, so that absorbing them is exact.

    Shapes:
        x ``(B, L, E)`` -> out ``(B, L, E)``; latent ``c`` ``(B, S, C)``.

    Parameters: ``q_proj`` (``W_Q``, E -> H·D), ``kv_down`` (``W_DKV``, E -> C), ``k_up`` and
    ``v_up`` (``W_UK``, ``W_UV``, C -> H·D), ``out_proj`` (``W_O``, H·D -> E).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kv_latent_dim: int,
        *,
        head_dim: int | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        E, H, D = validate.head_split(
            embed_dim, num_heads, head_dim, hint="unless head_dim is given"
        )
        C = validate.positive_int("kv_latent_dim", kv_latent_dim)
        validate.flag("bias", bias)
        validate.floating_dtype("dtype", dtype)
        self.embed_dim, self.num_heads, self.kv_latent_dim, self.head_dim = E, H, C, D
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(E, H * D, bias=bias, **factory)  # W_Q
        self.kv_down = nn.Linear(E, C, bias=bias, **factory)  # W_DKV: the only cached output
        self.k_up = nn.Linear(C, H * D, bias=False, **factory)  # W_UK
        self.v_up = nn.Linear(C, H * D, bias=False, **factory)  # W_UV
        self.out_proj = nn.Linear(H * D, E, bias=bias, **factory)  # W_O

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"kv_latent_dim={self.kv_latent_dim}, head_dim={self.head_dim}"
        )

    def _check_x(self, x: Tensor) -> None:
        """``x`` ``(B, L, E)`` of the parameters' dtype and device (else nn.Linear raises deep)."""
        validate.tensor("x", x, floating=True, ndim=3, layout="(B, L, E)")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have width {self.embed_dim} (embed_dim), got shape {validate.shape(x)}"
            )
        validate.matches_parameters("x", x, self.kv_down.weight)

    def compress(self, x: Tensor) -> Tensor:
        """The latents of ``x``: ``(B, S, E) -> (B, S, C)``; what a cache stores."""
        self._check_x(x)
        return self.kv_down(x)  # (B, S, C)

    def forward(
        self,
        x: Tensor,
        *,
        is_causal: bool = False,
        absorbed: bool = False,
        cache: LatentCache | None = None,
    ) -> Tensor:
        """Self-attention over ``x`` (and the cached tokens, with a ``cache``).

        Args:
            x: the new tokens.
            is_causal: hide future tokens; with a cache aligned bottom-right (the ``L`` new
                tokens are the last ``L`` of the ``S`` positions), as in :class:`mha.KVCache`.
            absorbed: attend in the latent space (the decoding form) instead of rebuilding every
                head's keys and values; both give the same output.
            cache: a :class:`LatentCache` to append this call's latents to.

        Shapes:
            x ``(B, L, E)`` -> ``(B, L, E)``.
        """
        self._check_x(x)
        validate.flag("is_causal", is_causal)
        validate.flag("absorbed", absorbed)
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache, got {type(cache).__name__}")
        B, L, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        c = self.kv_down(x)  # (B, L, C): what compress(x) gives; x is checked above
        mask = None
        if cache is not None:
            c = cache._append(c)  # (B, S, C), S = cached + L
            if is_causal and L:  # the new queries are the last L positions (none: nothing to hide)
                S = c.shape[1]
                mask = _causal_mask(L, S, diagonal=S - L, device=x.device)  # (L, S), bottom-right
            is_causal = False
        attend = self._attend_absorbed if absorbed else self._attend_materialised
        out = attend(q, c, mask, is_causal)  # (B, H, L, D)
        out = out.transpose(1, 2).reshape(B, L, H * D)  # concat heads -> (B, L, H·D)
        return self.out_proj(out)  # (B, L, E)

    def _attend_materialised(
        self, q: Tensor, c: Tensor, mask: Tensor | None, is_causal: bool
    ) -> Tensor:
        """Rebuild every head's keys and values from the latents, then ordinary attention.

        Shapes:
            q ``(B, H, L, D)``, c ``(B, S, C)`` -> ``(B, H, L, D)``.
        """
        B, S, _ = c.shape
        H, D = self.num_heads, self.head_dim
        k = self.k_up(c).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        v = self.v_up(c).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        out = _attention(q, k, v, mask, dropout_p=0.0, is_causal=is_causal, scale=1 / math.sqrt(D))
        return cast(Tensor, out)  # (B, H, L, D)

    def _attend_absorbed(
        self, q: Tensor, c: Tensor, mask: Tensor | None, is_causal: bool
    ) -> Tensor:
        """Attend in the latent space: ``W_UK`` moves into the query, ``W_UV`` after the sum.

        Shapes:
            q ``(B, H, L, D)``, c ``(B, S, C)`` -> ``(B, H, L, D)``.
        """
        H, D, C = self.num_heads, self.head_dim, self.kv_latent_dim
        w_uk = self.k_up.weight.view(H, D, C)  # head h: k_h = c @ w_uk[h].T
        w_uv = self.v_up.weight.view(H, D, C)  # head h: v_h = c @ w_uv[h].T
        q_lat = q @ w_uk  # (B, H, L, D) @ (H, D, C) -> (B, H, L, C)
        c_head = c.unsqueeze(1)  # (B, 1, S, C): one head, shared by all H queries (as in MQA)
        # The scale is 1/sqrt(D), that of the rebuilt heads, not 1/sqrt(C).
        pc = _attention(
            q_lat,
            c_head,
            c_head,
            mask,
            dropout_p=0.0,
            is_causal=is_causal,
            scale=1 / math.sqrt(D),
            groups=H,
        )  # (B, H, L, C): the weighted sum of latents, P c
        return cast(Tensor, pc) @ w_uv.transpose(-2, -1)  # (B, H, L, C) @ (H, C, D) -> (B, H, L, D)
