"""Decoding paths: the cached QKV stack, and grouped-query attention without repeated heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch.testing import assert_close

import mha
from mha.lab import memory


def separate_projections(layer: mha.MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed with three separate projections (no stacked weight)."""
    B, L, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.q_proj(x).view(B, L, H, D).transpose(1, 2)
    k = layer.k_proj(x).view(B, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = layer.v_proj(x).view(B, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return layer.out_proj(out.transpose(1, 2).reshape(B, L, H * D))


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_decoding_with_the_cached_stack_equals_one_causal_pass(num_kv_heads):
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=torch.float64).eval()
    x = randn(2, 9, 32, seed=0)
    with torch.no_grad():
        cache = mha.KVCache()
        steps = torch.cat(
            [layer(x[:, i : i + 1], is_causal=True, kv_cache=cache)[0] for i in range(9)], 1
        )
        assert_close(steps, separate_projections(layer, x))
        assert_close(layer(x, is_causal=True)[0], separate_projections(layer, x))


def test_the_stack_is_kept_at_inference_and_rebuilt_when_a_weight_changes():
    layer = mha.MultiHeadAttention(16, 2, dtype=torch.float64).eval()
    x = randn(1, 3, 16, seed=1)
    with torch.no_grad():
        layer(x)
        first = layer._stacked_qkv()[0]
        assert layer._stacked_qkv()[0] is first  # no copy per call
        layer.k_proj.weight.mul_(2.0)  # an in-place update (as an optimizer step makes)
        assert layer._stacked_qkv()[0] is not first
        assert_close(layer(x, is_causal=True)[0], separate_projections(layer, x))
        layer.v_proj.weight = torch.nn.Parameter(randn(16, 16, seed=2))  # a new tensor
        assert_close(layer(x, is_causal=True)[0], separate_projections(layer, x))
        layer.load_state_dict(mha.MultiHeadAttention(16, 2, dtype=torch.float64).state_dict())
        assert_close(layer(x, is_causal=True)[0], separate_projections(layer, x))


def test_training_rebuilds_the_stack_so_gradients_reach_each_projection():
    layer = mha.MultiHeadAttention(16, 2, dtype=torch.float64)
    x = randn(2, 5, 16, seed=3)
    layer(x, is_causal=True)[0].square().sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    separate_projections(layer, x).square().sum().backward()
    for name, p in layer.named_parameters():
        assert_close(grads[name], p.grad, msg=name)


@pytest.mark.parametrize("fn", [mha.scaled_dot_product_attention, mha.flash_attention])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L,S", [(1, 40), (13, 13), (9, 21)])
def test_gqa_without_repetition_equals_the_repeated_heads(fn, is_causal, L, S):
    H, Hkv = 8, 2
    q = randn(2, H, L, 16, seed=4)
    k, v = randn(2, Hkv, S, 16, seed=5), randn(2, Hkv, S, 12, seed=6)
    repeated = [t.repeat_interleave(H // Hkv, dim=1) for t in (k, v)]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert_close(fn(q, k, v, is_causal=is_causal, enable_gqa=True), expected)
    assert_close(fn(q, *repeated, is_causal=is_causal), expected)


@pytest.mark.parametrize("fn", [mha.scaled_dot_product_attention, mha.flash_attention])
def test_gqa_with_a_per_head_mask(fn):
    H, Hkv, L, S = 6, 3, 10, 14
    q = randn(2, H, L, 8, seed=7)
    k, v = randn(2, Hkv, S, 8, seed=8), randn(2, Hkv, S, 8, seed=9)
    mask = torch.rand(2, H, L, S, generator=torch.Generator().manual_seed(0)) > 0.3
    bias = randn(1, H, 1, S, seed=10)
    for m in (mask, bias, mha.padding_mask(torch.tensor([14, 5]), S)):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        assert_close(
            fn(
                q,
                k,
                v,
                m,
                enable_gqa=True,
                **({"block_size": 4} if fn is mha.flash_attention else {}),
            ),
            expected,
        )


def test_gqa_needs_the_flag_and_a_dividing_head_count():
    q, k = randn(1, 8, 4, 16, seed=11), randn(1, 2, 4, 16, seed=12)
    for fn in (mha.scaled_dot_product_attention, mha.flash_attention):
        with pytest.raises(
            ValueError, match=r"same leading \(batch\) dims, got query \(1, 8, 4, 16\)"
        ):
            fn(q, k, k)
        with pytest.raises(
            ValueError, match=r"a multiple of key's, got query \(1, 8, 4, 16\), key \(1, 3, 4, 16\)"
        ):
            fn(q, k[:, :1].expand(1, 3, 4, 16), k[:, :1].expand(1, 3, 4, 16), enable_gqa=True)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
def test_module_gqa_backends_agree_with_repeated_heads(backend):
    layer = mha.MultiHeadAttention(
        32, 8, num_kv_heads=2, backend=backend, dtype=torch.float64
    ).eval()
    x = randn(2, 11, 32, seed=13)
    with torch.no_grad():
        assert_close(layer(x, is_causal=True)[0], separate_projections(layer, x))


@pytest.mark.serial  # measures memory
def test_gqa_decode_step_does_not_allocate_the_repeated_heads():
    # One query against 1024 cached keys of 1 key/value head shared by 8 query heads: repeating
    # the heads would allocate 2 · 8 · 1024 · 64 floats (4 MiB); the grouped path needs none.
    q = randn(1, 8, 1, 64, seed=14, dtype=torch.float32)
    k, v = (
        randn(1, 1, 1024, 64, seed=15, dtype=torch.float32),
        randn(1, 1, 1024, 64, seed=16, dtype=torch.float32),
    )
    repeated_bytes = 2 * 8 * 1024 * 64 * 4
    for fn in (mha.scaled_dot_product_attention, mha.flash_attention):
        grouped = memory.peak_memory(fn, q, k, v, enable_gqa=True, warmup=False)

        def with_repeated_heads(fn=fn):
            return fn(q, k.repeat_interleave(8, 1), v.repeat_interleave(8, 1))

        repeated = memory.peak_memory(with_repeated_heads, warmup=False)
        assert repeated >= repeated_bytes
        assert grouped < repeated_bytes / 4, (fn.__name__, grouped)
