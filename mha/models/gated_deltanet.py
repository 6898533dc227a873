"""Qwen3-Next's linear-attention layer: Gated DeltaNet with everything around the rule.

Section 10.5 builds the gated delta rule itself (:func:`mha.gated_delta_rule`). A model does not
call the rule on its input directly; Qwen3-Next's ``Qwen3NextGatedDeltaNet`` wraps it in five
parts, all of them here:

1. **projections** — ``in_proj_qkvz`` makes a query and a key per query/key head and a value and
   an output gate ``z`` per value head; ``in_proj_ba`` makes each value head's writing strength
   ``b`` and decay input ``a``. Hugging Face's weights group the rows per query/key head (each
   serving ``Hv // Hk`` value heads), so the split follows that grouping;
2. **a short causal convolution** — depthwise, ``K`` taps (4 in Qwen3-Next), over the
   concatenated query, key and value channels, then SiLU: each token mixes in the last ``K - 1``;
3. **the gates** — ``β = sigmoid(b)`` and the log-decay ``g = -exp(A_log) · softplus(a + dt_bias)``
   (≤ 0, a learned rate per head times a positive, input-dependent step);
4. **the rule** — the queries and keys L2-normalised, repeated to the value heads;
5. **a gated RMSNorm** — each head's output normalised, times a gain, times ``silu(z)``; then
   ``out_proj``.

Decoding keeps, per request, two fixed-size states instead of a cache that grows with the text:
the convolution's last ``K - 1`` inputs and the rule's ``(Dk, Dv)`` memory per head
(:class:`RecurrentState`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import validation as validate
from ..gated_delta import gated_delta_rule
from . import _hf

FAMILY = "qwen3_next"


class RecurrentState:
    """What a linear-attention layer keeps per request while decoding: fixed-size, whatever the
    length (a softmax layer's KV cache grows by a key and a value per token).

    Pass one (empty) object as ``kv_cache=`` to a :class:`GatedDeltaNet` and keep passing it:
    a prompt chunk, then tokens one at a time, give what one pass over the whole text gives.

    Attributes:
        conv: the convolution's last ``K - 1`` inputs, ``(B, C, K - 1)`` (zeros before the first
            token), or None before the first call.
        memory: the delta rule's state, ``(B, Hv, Dk, Dv)``, or None before the first call.
        tokens: how many tokens have gone through.
    """

    def __init__(self) -> None:
        self.conv: Tensor | None = None
        self.memory: Tensor | None = None
        self.tokens = 0

    def __len__(self) -> int:
        return self.tokens

    def nbytes(self) -> int:
        """Bytes held now: the same after 10 tokens and after 10,000."""
        return sum(t.numel() * t.element_size() for t in (self.conv, self.memory) if t is not None)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's ``Dv`` outputs (in float32), times a gain, times ``silu(z)``.

    Shapes:
        out and z ``(…, Dv)`` -> ``(…, Dv)``.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # (Dv,)
        self.eps = eps

    def forward(self, out: Tensor, z: Tensor) -> Tensor:
        x = out.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (…, Dv)
        x = self.weight * x.to(out.dtype)  # (…, Dv)
        return (x * F.silu(z.float())).to(out.dtype)  # (…, Dv): the output gate


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Gated DeltaNet layer (Hugging Face's ``Qwen3NextGatedDeltaNet``, torch path).

    Args:
        hidden_size: ``E``.
        num_key_heads, num_value_heads: ``Hk`` query/key heads and ``Hv`` value heads
            (``Hk`` divides ``Hv``; Qwen3-Next: 16 and 32).
        key_head_dim, value_head_dim: ``Dk`` and ``Dv``.
        conv_kernel: ``K``, the short convolution's taps.
        eps: the gated RMSNorm's epsilon.

    Shapes:
        x ``(B, L, E)`` -> ``(B, L, E)``, causal. With ``kv_cache`` (a :class:`RecurrentState`)
        the tokens of ``x`` follow the ones already seen.
    """

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        conv_kernel: int = 4,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        validate.divisible("num_value_heads", num_value_heads, "num_key_heads", num_key_heads)
        self.hidden_size, self.Hk, self.Hv = hidden_size, num_key_heads, num_value_heads
        self.Dk, self.Dv, self.K, self.eps = key_head_dim, value_head_dim, conv_kernel, eps
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.channels = 2 * key_dim + value_dim  # C: what the convolution mixes
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_value_heads, bias=False)
        # depthwise: one K-tap filter per channel (HF's Conv1d, groups = channels, no bias)
        self.conv1d = nn.Conv1d(
            self.channels, self.channels, conv_kernel, groups=self.channels, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))  # (Hv,)
        self.A_log = nn.Parameter(torch.zeros(num_value_heads))  # (Hv,) log of the decay rate
        self.norm = GatedRMSNorm(value_head_dim, eps=eps)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(
        self, x: Tensor, positions: Tensor | None = None, *, kv_cache: RecurrentState | None = None
    ) -> Tensor:
        """``positions`` is accepted for the same call as the attention layers and unused: the
        layer knows order only through its convolution and its recurrence."""
        if kv_cache is not None and not isinstance(kv_cache, RecurrentState):
            raise TypeError(
                "kv_cache of a linear-attention layer must be a RecurrentState (a fixed-size "
                f"state per request, no keys or values), got {type(kv_cache).__name__}"
            )
        _hf.check_input(x, positions, self.hidden_size)
        B, L, _ = x.shape
        q, k, v, z, b, a = self._project(x)
        mixed = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1).transpose(1, 2)  # (B, C, L)
        mixed = self._convolve(mixed, kv_cache).transpose(1, 2)  # (B, L, C)
        key_dim = self.Hk * self.Dk
        q, k, v = mixed.split([key_dim, key_dim, self.Hv * self.Dv], dim=-1)
        q = _l2norm(q.view(B, L, self.Hk, self.Dk))  # (B, L, Hk, Dk)
        k = _l2norm(k.view(B, L, self.Hk, self.Dk))  # (B, L, Hk, Dk)
        group = self.Hv // self.Hk  # each query/key head serves `group` consecutive value heads
        q, k = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (q, k))  # (B, Hv, L, Dk)
        v = v.view(B, L, self.Hv, self.Dv).transpose(1, 2)  # (B, Hv, L, Dv)
        beta = torch.sigmoid(b).transpose(1, 2)  # (B, Hv, L): how strongly each token writes
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, L, Hv) <= 0
        memory = None if kv_cache is None else kv_cache.memory
        out, memory = gated_delta_rule(
            q, k, v, g.transpose(1, 2), beta,
            chunk_size=None if L == 1 else 64,  # a decode step: one step of the recurrence
            initial_state=memory, output_final_state=True,
        )  # fmt: skip
        if kv_cache is not None:
            kv_cache.memory, kv_cache.tokens = memory, kv_cache.tokens + L
        out = self.norm(out.transpose(1, 2), z)  # (B, L, Hv, Dv)
        return self.out_proj(out.reshape(B, L, self.Hv * self.Dv))  # (B, L, E)

    def _project(self, x: Tensor) -> tuple[Tensor, ...]:
        """The two projections, split as HF's weights are laid out: per query/key head, a query,
        a key, then its group's values and gates (and its group's b, then a)."""
        B, L, _ = x.shape
        group = self.Hv // self.Hk
        qkvz = self.in_proj_qkvz(x).view(B, L, self.Hk, -1)  # (B, L, Hk, 2·Dk + 2·group·Dv)
        sizes = [self.Dk, self.Dk, group * self.Dv, group * self.Dv]
        q, k, v, z = qkvz.split(sizes, dim=-1)  # (B, L, Hk, ·) each
        ba = self.in_proj_ba(x).view(B, L, self.Hk, 2 * group)  # (B, L, Hk, 2·group)
        b, a = ba.split([group, group], dim=-1)  # (B, L, Hk, group) each
        v = v.reshape(B, L, self.Hv, self.Dv)  # (B, L, Hv, Dv)
        z = z.reshape(B, L, self.Hv, self.Dv)  # (B, L, Hv, Dv)
        return q, k, v, z, b.reshape(B, L, self.Hv), a.reshape(B, L, self.Hv)

    def _convolve(self, mixed: Tensor, cache: RecurrentState | None) -> Tensor:
        """The causal depthwise convolution and SiLU, ``(B, C, L)`` -> ``(B, C, L)``: each
        output sees its own input and the ``K - 1`` before it (zeros before the first token, or
        the ones a cache kept)."""
        B, C, L = mixed.shape
        if cache is None or cache.conv is None:
            past = mixed.new_zeros(B, C, self.K - 1)  # (B, C, K-1)
        else:
            past = cache.conv.to(mixed.dtype)  # (B, C, K-1)
        padded = torch.cat([past, mixed], dim=-1)  # (B, C, K-1+L)
        if cache is not None:
            cache.conv = padded[:, :, padded.shape[-1] - (self.K - 1) :]  # (B, C, K-1)
        return F.silu(self.conv1d(padded))  # (B, C, L): no padding, K-1 inputs of context


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(‖x‖² + eps)`` along the last dim, as Qwen3-Next (and the FLA kernels) do."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def from_hf(
    config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int
) -> nn.Module:
    """A Qwen3-Next ``linear_attention`` layer from HF's config and the layer's state_dict."""
    E, Hk, Hv, Dk, Dv, K = (
        int(v)
        for v in _hf.require(
            config,
            FAMILY,
            "hidden_size",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{FAMILY}: hidden_act must be 'silu', got {config['hidden_act']!r}")
    module = GatedDeltaNet(
        E, Hk, Hv, Dk, Dv, conv_kernel=K, eps=float(config.get("rms_norm_eps", 1e-6))
    )
    return _hf.load(module, state_dict, FAMILY)
