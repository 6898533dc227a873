"""Multi-head latent attention: materialised ≡ absorbed ≡ torch's SDPA, and a latent-only cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch.testing import assert_close

import mha


def _layer(E: int = 32, H: int = 4, C: int = 12, **kwargs: object) -> mha.MultiHeadLatentAttention:
    torch.manual_seed(0)
    return mha.MultiHeadLatentAttention(E, H, C, dtype=torch.float64, **kwargs)  # type: ignore[arg-type]


def _reference(
    layer: mha.MultiHeadLatentAttention, x: torch.Tensor, is_causal: bool
) -> torch.Tensor:
    """The materialised form written with torch's own operators."""
    B, L, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    c = F.linear(x, layer.kv_down.weight, layer.kv_down.bias)  # (B, L, C)
    q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias).view(B, L, H, D).transpose(1, 2)
    k = F.linear(c, layer.k_up.weight).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    v = F.linear(c, layer.v_up.weight).view(B, L, H, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H, L, D)
    return F.linear(
        out.transpose(1, 2).reshape(B, L, H * D), layer.out_proj.weight, layer.out_proj.bias
    )


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("head_dim", [None, 5])
def test_materialised_equals_absorbed_and_torch(
    is_causal: bool, bias: bool, head_dim: int | None
) -> None:
    layer = _layer(bias=bias, head_dim=head_dim)
    x = randn(2, 9, 32, seed=1)
    materialised = layer(x, is_causal=is_causal)
    absorbed = layer(x, is_causal=is_causal, absorbed=True)
    assert materialised.shape == (2, 9, 32)
    assert_close(materialised, _reference(layer, x, is_causal))
    assert_close(absorbed, materialised)


def test_absorbed_scale_is_that_of_the_heads() -> None:
    # C != D: scaling the latent scores by 1/sqrt(C) would give another result
    layer = _layer(C=64)
    x = randn(1, 6, 32, seed=2)
    assert layer.head_dim == 8 and layer.kv_latent_dim == 64 and math.sqrt(64) != math.sqrt(8)
    assert_close(layer(x, absorbed=True), layer(x))


@pytest.mark.parametrize("absorbed", [False, True])
def test_decoding_with_latent_cache_equals_one_causal_pass(absorbed: bool) -> None:
    layer = _layer()
    x = randn(2, 10, 32, seed=3)
    full = layer(x, is_causal=True)
    cache = mha.LatentCache()
    steps = [layer(x[:, :4], is_causal=True, absorbed=absorbed, cache=cache)]  # prefill
    steps += [
        layer(x[:, t : t + 1], is_causal=True, absorbed=absorbed, cache=cache) for t in range(4, 10)
    ]
    assert_close(torch.cat(steps, dim=1), full)
    assert len(cache) == 10 and cache.latent is not None
    assert cache.latent.shape == (2, 10, 12)  # (B, S, C): nothing per head
    assert cache.nbytes == 2 * 10 * 12 * 8


def test_cache_is_smaller_than_mha_per_token() -> None:
    # per token and layer: C numbers against 2·H·D for multi-head attention
    layer = _layer(E=64, H=8, C=16)
    x = randn(1, 5, 64, seed=4)
    latent = layer.compress(x)  # (1, 5, 16)
    cache = mha.KVCache()
    ref = mha.MultiHeadAttention(64, 8, dtype=torch.float64)
    ref(x, is_causal=True, kv_cache=cache)
    mla_bytes = latent.numel() * latent.element_size()
    assert cache.nbytes == 2 * 8 * 8 * 5 * 8 and mla_bytes == 16 * 5 * 8
    assert cache.nbytes == 8 * mla_bytes


def test_gradients_flow_through_both_forms() -> None:
    layer = _layer()
    x = randn(1, 5, 32, seed=5).requires_grad_()
    for absorbed in (False, True):
        layer.zero_grad()
        layer(x, is_causal=True, absorbed=absorbed).sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    grads = {}
    for absorbed in (False, True):
        layer.zero_grad()
        layer(x, absorbed=absorbed).square().sum().backward()
        grads[absorbed] = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    for a, b in zip(grads[False], grads[True]):
        assert_close(a, b)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        mha.MultiHeadLatentAttention(10, 3, 4)
    with pytest.raises(ValueError, match="kv_latent_dim must be positive, got 0"):
        mha.MultiHeadLatentAttention(12, 3, 0)
    assert mha.MultiHeadLatentAttention(10, 3, 4, head_dim=7).q_proj.out_features == 21
    layer = _layer()
    with pytest.raises(
        ValueError, match=r"x must have width 32 \(embed_dim\), got shape \(2, 3, 16\)"
    ):
        layer(randn(2, 3, 16))
    with pytest.raises(ValueError, match=r"x must have 3 dims \(B, L, E\), got shape \(3, 32\)"):
        layer(randn(3, 32))
    with pytest.raises(TypeError, match="absorbed must be a bool, got int"):
        layer(randn(1, 3, 32), absorbed=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache must be a LatentCache, got KVCache"):
        layer(randn(1, 3, 32), cache=mha.KVCache())  # type: ignore[arg-type]
    cache = mha.LatentCache()
    layer(randn(1, 3, 32), cache=cache)
    with pytest.raises(
        ValueError, match=r"new latents \(2, 1, 12\) do not match the cached latents \(1, 3, 12\)"
    ):
        layer(randn(2, 1, 32), cache=cache)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_new_tokens(absorbed: bool, is_causal: bool) -> None:
    """L = 0 gives an empty output, as torch's SDPA; with a cache it is a step that adds nothing."""
    layer = _layer()
    x = randn(2, 5, 32, seed=3)
    with torch.no_grad():
        assert_close(layer(x[:, :0], is_causal=is_causal, absorbed=absorbed), x[:, :0])
        cache = mha.LatentCache()
        empty = layer(x[:, :0], is_causal=is_causal, absorbed=absorbed, cache=cache)
        assert empty.shape == (2, 0, 32) and len(cache) == 0
        head = layer(x[:, :3], is_causal=is_causal, absorbed=absorbed, cache=cache)
        layer(x[:, 3:3], is_causal=is_causal, absorbed=absorbed, cache=cache)
        tail = layer(x[:, 3:], is_causal=is_causal, absorbed=absorbed, cache=cache)
        whole = layer(x, is_causal=is_causal, absorbed=absorbed)
    if is_causal:  # without a mask the first 3 tokens did not see the last 2
        assert_close(torch.cat([head, tail], 1), whole)
    assert len(cache) == 5
