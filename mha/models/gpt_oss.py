"""gpt-oss's attention layer: learned sinks, a sliding window on every other layer, YaRN RoPE.

Three changes to the attention of chapter 3 (with GQA, chapter 5, and RoPE, chapter 8):

* **a sink per head** — one learned logit joins every row of scores as an extra softmax column;
  it takes probability mass and hands over no value, so a head may attend to "nothing";
* **sliding and full layers alternating** — ``config["layer_types"]`` says which; a sliding layer
  lets query ``i`` see keys ``i - W + 1 … i`` (``W = config["sliding_window"]``, 128 in gpt-oss);
* **YaRN** — RoPE's slow pairs interpolated for a 32 times longer context
  (:func:`mha.rope.yarn_frequencies`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..attention import scaled_dot_product_attention
from ..multihead import KVCacheProtocol
from ..rope import apply_rope
from . import _hf

FAMILY = "gpt_oss"


class GptOssAttention(nn.Module):
    """Causal self-attention with learned sinks, an optional sliding window and (YaRN) RoPE.

    Args:
        hidden_size: ``E``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv`` (GQA), ``D``.
        window: ``W`` for a sliding-window layer, ``None`` for a full one.
        frequencies: RoPE's speed per pair, ``(D/2,)``.
        attention_factor: YaRN's factor on the rotated queries and keys (1 without YaRN).
        bias: whether the four projections have biases (gpt-oss: yes).

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
        window: int | None,
        frequencies: Tensor,
        attention_factor: float = 1.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.window, self.attention_factor = head_dim, window, attention_factor
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = _hf.projections(
            hidden_size, num_heads, num_kv_heads, head_dim, bias=bias
        )
        self.sinks = nn.Parameter(torch.zeros(num_heads))  # (H,): one logit per head
        self.register_buffer("frequencies", frequencies, persistent=False)  # (D/2,)

    def forward(
        self, x: Tensor, positions: Tensor | None = None, *, kv_cache: KVCacheProtocol | None = None
    ) -> Tensor:
        pos = _hf.check_input(x, positions, self.hidden_size, kv_cache)  # p0, (L,) or (B, 1, L)
        B, L, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).view(B, L, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
        v = self.v_proj(x).view(B, L, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
        q, k = self._rope(q, pos), self._rope(k, pos)  # (B, H|Hkv, L, D)
        if kv_cache is not None:  # the keys and values of the earlier tokens join
            k, v = kv_cache.update(k, v)  # (B, Hkv, S, D) each
        mask = _hf.causal_keep_mask(L, k.shape[-2], self.window, x.device)  # (L, S)
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=H != Hkv, sinks=self.sinks
        )  # (B, H, L, D)
        out = cast(Tensor, out)  # (without return_weights, one tensor)
        out = out.transpose(1, 2).reshape(B, L, H * D)  # concat heads -> (B, L, H·D)
        return self.o_proj(out)  # (B, L, E)

    def _rope(self, x: Tensor, pos: int | Tensor) -> Tensor:
        """RoPE with this layer's (YaRN) speeds: ``(B, H, L, D)`` -> ``(B, H, L, D)``."""
        return apply_rope(
            x, pos, frequencies=self.frequencies, attention_factor=self.attention_factor
        )


def from_hf(
    config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int = 0
) -> GptOssAttention:
    """:func:`mha.from_hf` for ``family="gpt_oss"``."""
    E, H, Hkv, D = _hf.attention_dims(config, FAMILY)
    kind = _hf.layer_type(config, FAMILY, layer_idx)
    if kind not in {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"{FAMILY}: layer_types[{layer_idx}] must be sliding_attention or "
            f"full_attention, got {kind!r}"
        )
    window = (
        _hf.require(config, FAMILY, "sliding_window")[0] if kind == "sliding_attention" else None
    )
    frequencies, attention_factor, R = _hf.rope(config, FAMILY, D)
    if R != D:
        raise ValueError(f"{FAMILY}: partial RoPE is not gpt-oss's (rotary dim {R}, head_dim {D})")
    module = GptOssAttention(
        E,
        H,
        Hkv,
        D,
        window=None if window is None else int(window),
        frequencies=frequencies,
        attention_factor=attention_factor,
        bias=bool(config.get("attention_bias", True)),
    )
    return _hf.load(module, state_dict, FAMILY)
