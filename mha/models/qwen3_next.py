"""Qwen3-Next's full-attention layer: an output gate, QK-norm and RoPE on a quarter of each head.

Qwen3-Next stacks three Gated DeltaNet (linear attention) layers per full-attention layer; this is
the full one. Three changes to the attention of chapter 3 (with GQA and RoPE):

* **an output gate** — ``q_proj`` makes a second vector per head, ``g``; the attention output is
  multiplied by ``sigmoid(g)`` coordinate-wise before ``o_proj`` (Qiu et al., 2025,
  arXiv 2505.06708: it lets a head output nothing without a sink, and removes the massive
  activations);
* **QK-norm** — an RMSNorm over each head's query and key, with a learned gain, before RoPE;
* **partial RoPE** — only the first ``partial_rotary_factor · D`` coordinates (a quarter) rotate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..attention import scaled_dot_product_attention
from ..multihead import KVCacheProtocol
from ..norms import RMSNorm
from ..rope import apply_rope
from . import _hf

FAMILY = "qwen3_next"


class GatedAttention(nn.Module):
    """Causal self-attention with a sigmoid output gate, QK-norm and partial RoPE.

    Args:
        hidden_size: ``E``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv`` (GQA), ``D``.
        frequencies: RoPE's speed per rotated pair, ``(R/2,)``.
        rotary_dim: ``R``, the rotated coordinates of each head (the first ``R``).
        attention_factor: YaRN's factor on the rotated coordinates (1 without YaRN).
        eps: the RMSNorm's epsilon.
        bias: whether the four projections have biases (Qwen3-Next: no).

    Shapes:
        x ``(B, L, E)``, positions ``(L,)`` or ``(B, L)`` -> ``(B, L, E)``. With ``kv_cache``
        (:class:`mha.KVCache`) the tokens of ``x`` follow the cached ones: the keys and values
        (after RoPE) are cached, and the default positions continue.
    """

    frequencies: Tensor  # a buffer: RoPE's speed per rotated pair

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        frequencies: Tensor,
        rotary_dim: int,
        attention_factor: float = 1.0,
        eps: float = 1e-6,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.attention_factor = attention_factor
        # per head: D query coordinates, then D gate coordinates (HF's layout)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = _hf.projections(
            hidden_size, num_heads, num_kv_heads, head_dim, bias=bias, q_parts=2
        )
        self.q_norm = RMSNorm(head_dim, eps=eps, zero_centered=True)  # one gain for all heads
        self.k_norm = RMSNorm(head_dim, eps=eps, zero_centered=True)
        self.register_buffer("frequencies", frequencies, persistent=False)  # (R/2,)

    def forward(
        self, x: Tensor, positions: Tensor | None = None, *, kv_cache: KVCacheProtocol | None = None
    ) -> Tensor:
        pos = _hf.check_input(x, positions, self.hidden_size, kv_cache)  # p0, (L,) or (B, 1, L)
        B, L, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(x).view(B, L, H, 2 * D).chunk(2, dim=-1)  # (B, L, H, D) each
        q = self.q_norm(q).transpose(1, 2)  # (B, H, L, D): QK-norm per head and token
        k = self.k_norm(self.k_proj(x).view(B, L, Hkv, D)).transpose(1, 2)  # (B, Hkv, L, D)
        v = self.v_proj(x).view(B, L, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
        q, k = self._rope(q, pos), self._rope(k, pos)  # only the first R dims turn
        if kv_cache is not None:  # the keys and values of the earlier tokens join
            k, v = kv_cache.update(k, v)  # (B, Hkv, S, D) each
        mask = _hf.causal_keep_mask(L, k.shape[-2], None, x.device)  # (L, S)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
        out = cast(Tensor, out)  # (B, H, L, D) (without return_weights, one tensor)
        out = out.transpose(1, 2).reshape(B, L, H * D)  # concat heads -> (B, L, H·D)
        out = out * torch.sigmoid(gate.reshape(B, L, H * D))  # (B, L, H·D): the output gate
        return self.o_proj(out)  # (B, L, E)

    def _rope(self, x: Tensor, pos: int | Tensor) -> Tensor:
        """Partial RoPE: ``(B, H, L, D)`` -> ``(B, H, L, D)``, the first ``R`` dims turned."""
        return apply_rope(
            x,
            pos,
            frequencies=self.frequencies,
            rotary_dim=self.rotary_dim,
            attention_factor=self.attention_factor,
        )


def from_hf(
    config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int = 0
) -> nn.Module:
    """:func:`mha.from_hf` for ``family="qwen3_next"``: a full-attention layer
    (:class:`GatedAttention`) or a linear-attention one
    (:class:`mha.models.gated_deltanet.GatedDeltaNet`), as ``layer_types`` says."""
    kind = _hf.layer_type(config, FAMILY, layer_idx)
    if kind == "linear_attention":
        from . import gated_deltanet  # the Gated DeltaNet layer, with its convolution and gates

        return gated_deltanet.from_hf(config, state_dict, layer_idx=layer_idx)
    if kind != "full_attention":
        raise ValueError(
            f"{FAMILY}: layer_types[{layer_idx}] is {kind!r}; from_hf builds full_attention and "
            f"linear_attention layers"
        )
    E, H, Hkv, D = _hf.attention_dims(config, FAMILY)
    frequencies, attention_factor, R = _hf.rope(config, FAMILY, D)
    module = GatedAttention(
        E,
        H,
        Hkv,
        D,
        frequencies=frequencies,
        rotary_dim=R,
        attention_factor=attention_factor,
        eps=float(config.get("rms_norm_eps", 1e-6)),
        bias=bool(config.get("attention_bias", False)),
    )
    return _hf.load(module, state_dict, FAMILY)
