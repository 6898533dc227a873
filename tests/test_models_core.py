"""The pieces 2026's models add to the core: sinks, YaRN and partial RoPE, RMSNorm."""

import math

import pytest
import torch
import torch.nn.functional as F

import mha


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_sink_scales_torch_attention_by_the_mass_it_leaves():
    q, k, v = rand(2, 3, 5, 8, seed=1), rand(2, 3, 7, 8, seed=2), rand(2, 3, 7, 4, seed=3)
    sinks = rand(3, seed=4) * 2
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(5)) > 0.3
    out, weights = mha.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, sinks=sinks, return_weights=True
    )
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~mask, -torch.inf)
    lse = torch.logsumexp(scores, -1, keepdim=True)  # (B, H, L, 1)
    kept = torch.sigmoid(lse - sinks[:, None, None])  # the mass the keys keep, 1 - p_sink
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref * kept)
    torch.testing.assert_close(weights.sum(-1, keepdim=True), kept)


def test_sink_of_minus_infinity_is_plain_attention_and_gqa_works():
    q, k, v = rand(1, 4, 6, 8, seed=1), rand(1, 2, 6, 8, seed=2), rand(1, 2, 6, 8, seed=3)
    out = mha.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, sinks=torch.full((4,), -torch.inf)
    )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)


def test_sinks_bad_input():
    q = rand(2, 3, 5, 8)
    with pytest.raises(ValueError, match=r"sinks of shape \(4,\) must broadcast .* \(2, 3\)"):
        mha.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(4))
    with pytest.raises(TypeError, match="sinks must have a floating dtype"):
        mha.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3, dtype=torch.long))


def test_yarn_without_scaling_is_rope_and_keeps_fast_pairs():
    theta = mha.rope_frequencies(64, base=150000.0)
    same, factor = mha.yarn_frequencies(
        64, base=150000.0, factor=1.0, original_max_position_embeddings=4096
    )
    torch.testing.assert_close(same, theta)
    assert factor == 1.0
    yarn, factor = mha.yarn_frequencies(
        64, base=150000.0, factor=32.0, original_max_position_embeddings=4096, truncate=False
    )
    torch.testing.assert_close(yarn[:8], theta[:8])  # turn > 32 times over 4096 tokens: kept
    torch.testing.assert_close(yarn[18:], theta[18:] / 32)  # turn < once: interpolated
    assert factor == pytest.approx(0.1 * math.log(32) + 1)


def test_partial_rope_rotates_only_the_first_dims():
    x = rand(2, 3, 5, 16)
    out = mha.apply_rope(x, rotary_dim=4)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], mha.apply_rope(x[..., :4]))
    # lengths are kept: a rotation, scaled only by attention_factor
    scaled = mha.apply_rope(x, rotary_dim=4, attention_factor=2.0)
    torch.testing.assert_close(scaled[..., :4].norm(dim=-1), 2 * x[..., :4].norm(dim=-1))
    with pytest.raises(
        ValueError, match="rotary_dim must be even and at most D, got rotary_dim 18"
    ):
        mha.apply_rope(x, rotary_dim=18)
    with pytest.raises(ValueError, match=r"frequencies must have shape \(rotary_dim/2,\) = \(2,\)"):
        mha.apply_rope(x, rotary_dim=4, frequencies=torch.ones(8))


def test_rms_norm_equals_torch():
    x, w = rand(2, 5, 3, 16, seed=1), rand(16, seed=2)
    torch.testing.assert_close(mha.rms_norm(x, w, eps=1e-6), F.rms_norm(x, (16,), w, eps=1e-6))
    torch.testing.assert_close(mha.rms_norm(x), F.rms_norm(x, (16,), eps=1e-6))
    norm = mha.RMSNorm(16, zero_centered=True)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), eps=1e-6))  # gain 1 + 0
    with pytest.raises(
        ValueError, match=r"weight must have shape \(D,\).*\(8,\) and x \(2, 5, 3, 16\)"
    ):
        mha.rms_norm(x, torch.ones(8))
