"""RoPE against an independent formulation: each pair (x_i, x_{i+D/2}) as the complex number
x_i + j·x_{i+D/2}, multiplied by e^{j·p·θ_i} (``torch.polar``). Then the properties the chapter
uses: norms are kept, scores depend only on the offset, low precision, positions, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import mha
from mha.rope import apply_rope, rope_frequencies


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as complex multiplication, with the rotate-half pairing made explicit."""
    D = x.shape[-1]
    theta = 1.0 / base ** (torch.arange(D // 2, dtype=torch.float64) * 2 / D)  # (D/2,)
    angles = positions.to(torch.float64)[..., None] * theta  # (..., L, D/2)
    pairs = x.to(torch.float64).unflatten(-1, (2, D // 2)).transpose(-2, -1)  # (..., L, D/2, 2)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(angles), angles)
    out = torch.view_as_real(z).transpose(-2, -1).flatten(-2)  # (..., L, D), halves again
    return out.to(x.dtype)


@pytest.mark.parametrize("D", [2, 8, 64])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_matches_the_complex_formulation(D, base):
    x = randn(2, 3, 11, D, seed=D)
    assert_close(apply_rope(x, base=base), complex_rope(x, torch.arange(11), base))
    assert_close(apply_rope(x, 5, base=base), complex_rope(x, torch.arange(5, 16), base))


def test_one_pair_by_hand():
    """D = 2: one pair turning at 1 radian per position; (1, 0) at position 2 -> (cos 2, sin 2)."""
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    out = apply_rope(x)
    assert_close(out[2], torch.tensor([math.cos(2), math.sin(2)], dtype=torch.float64))
    assert_close(out[0], x[0])  # position 0 is not turned


def test_rotate_half_pairing_not_interleaved():
    """Coordinate 0 pairs with D/2 (Llama in transformers), not with 1 (RoFormer's layout)."""
    x = torch.zeros(2, 8, dtype=torch.float64)
    x[:, 0] = 1.0
    out = apply_rope(x)[1]  # position 1, pair 0 turns by 1 radian
    assert out[1].item() == 0.0 and abs(out[4].item() - math.sin(1.0)) < 1e-12


def test_frequencies():
    theta = rope_frequencies(8, base=10000.0, dtype=torch.float64)
    assert_close(theta, torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64))


def test_norm_is_preserved():
    x = randn(4, 2, 50, 16, seed=3)
    assert_close(apply_rope(x).norm(dim=-1), x.norm(dim=-1))


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    shift=st.integers(0, 3000),
    seed=st.integers(0, 10_000),
)
def test_scores_depend_only_on_the_offset(m, n, shift, seed):
    q, k = randn(2, 32, seed=seed).unbind(0)  # one query and one key vector, D = 32

    def score(i: int, j: int) -> float:
        qi = apply_rope(q[None], torch.tensor([i]))[0]
        kj = apply_rope(k[None], torch.tensor([j]))[0]
        return (qi @ kj).item()

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_keeps_dtype_and_rounds_once(dtype):
    x = randn(2, 4, 300, 16, seed=5).to(dtype)
    out = apply_rope(x, 1000)
    assert out.dtype == dtype
    golden = complex_rope(x.double(), torch.arange(1000, 1300))  # float64
    eps = torch.finfo(dtype).eps  # computed in float32, rounded once: within one ulp or so
    assert_close(out.double(), golden, atol=eps, rtol=eps)


def test_float32_matches_float64_within_float32_precision():
    """float32 angles near position 4000 are off by up to ~4000 · 2**-24 rad: errors ~1e-4."""
    x = randn(1, 2, 64, 32, seed=6)
    assert_close(apply_rope(x.float(), 4000).double(), apply_rope(x, 4000), atol=1e-3, rtol=1e-3)


def test_position_tensors_broadcast():
    x = randn(2, 3, 5, 8, seed=7)
    per_seq = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]).view(2, 1, 5)  # (B, 1, L)
    out = apply_rope(x, per_seq)
    assert_close(out[0], apply_rope(x[0]))
    assert_close(out[1], apply_rope(x[1], 7))
    assert_close(apply_rope(x, torch.arange(5)), apply_rope(x))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((randn(2, 5, 7),), {}, ValueError, r"even last dim D .* got shape \(2, 5, 7\)"),
        ((randn(5, 8), torch.arange(5.0)), {}, TypeError, r"positions must be an integer .*float"),
        ((randn(5, 8), torch.ones(5, dtype=torch.bool)), {}, TypeError, "integer tensor"),
        ((randn(5, 8), torch.arange(6)), {}, ValueError, r"positions of shape \(6,\) .*\(5,\)"),
        ((randn(2, 5, 8), torch.zeros(3, 5, dtype=torch.long)), {}, ValueError, r"\(3, 5\)"),
        ((randn(5, 8), -1), {}, ValueError, "must be >= 0, got -1"),
        ((randn(5, 8),), {"base": 0.0}, ValueError, "base must be a positive"),
        ((randn(8),), {}, ValueError, r"at least 2 dims .* \(8,\)"),
        (([[1.0, 2.0]],), {}, TypeError, "x must be a torch.Tensor"),
        ((torch.ones(3, 4, dtype=torch.long),), {}, TypeError, "floating dtype"),
    ],
)
def test_errors_name_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        mha.apply_rope(*args, **kwargs)


# --- MultiHeadAttention(rope=True) ------------------------------------------------------------


def rope_by_hand(layer: mha.MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Separate projections, RoPE on q and k after the head split, torch's causal SDPA."""
    B, L, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.q_proj(x).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    k = layer.k_proj(x).view(B, L, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
    v = layer.v_proj(x).view(B, L, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
    q, k = complex_rope(q, torch.arange(L)), complex_rope(k, torch.arange(L))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
    return layer.out_proj(out.transpose(1, 2).reshape(B, L, H * D))


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_module_applies_rope_to_queries_and_keys(backend, num_kv_heads):
    layer = mha.MultiHeadAttention(
        32, 4, num_kv_heads=num_kv_heads, rope=True, backend=backend, dtype=torch.float64
    )
    x = randn(2, 9, 32, seed=10)
    with torch.no_grad():
        assert_close(layer(x, is_causal=True)[0], rope_by_hand(layer, x))


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_cached_decoding_with_rope_equals_one_causal_pass(chunk, num_kv_heads):
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rope=True)
    layer = layer.to(torch.float64).eval()
    x = randn(2, 10, 32, seed=11)
    with torch.no_grad():
        cache = mha.KVCache()
        steps = [
            layer(x[:, i : i + chunk], is_causal=True, kv_cache=cache)[0]
            for i in range(0, 10, chunk)
        ]
        assert_close(torch.cat(steps, 1), layer(x, is_causal=True)[0])
        # the cache holds rotated keys: the keys of position 5 equal k_proj, rotated by 5
        k5 = layer.k_proj(x[:, 5:6]).view(2, 1, layer.num_kv_heads, 8).transpose(1, 2)
        assert_close(cache.key[:, :, 5:6], apply_rope(k5, 5))


def test_rope_makes_attention_see_order_and_rope_false_does_not():
    """Without RoPE (and without a mask) attention is permutation-equivariant; with it, not."""
    x = randn(1, 6, 16, seed=12)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    torch.manual_seed(0)
    plain = mha.MultiHeadAttention(16, 2, dtype=torch.float64)
    rotary = mha.MultiHeadAttention(16, 2, rope=True, dtype=torch.float64)
    rotary.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert_close(plain(x[:, perm])[0], plain(x)[0][:, perm])
        assert not torch.allclose(rotary(x[:, perm])[0], rotary(x)[0][:, perm])
        assert "rope=True, rope_base=10000" in repr(rotary) and "rope" not in repr(plain)


def test_module_rope_arguments_are_checked():
    with pytest.raises(TypeError, match="rope must be a bool"):
        mha.MultiHeadAttention(16, 2, rope=1)
    with pytest.raises(ValueError, match="rope_base must be a positive"):
        mha.MultiHeadAttention(16, 2, rope=True, rope_base=-1.0)
    with pytest.raises(
        ValueError, match=r"even head dim, got embed_dim \(9\) / num_heads \(3\) = 3"
    ):
        mha.MultiHeadAttention(9, 3, rope=True)
    with pytest.raises(TypeError, match="kv_cache must be a cache .* got dict"):
        mha.MultiHeadAttention(16, 2)(torch.zeros(1, 4, 16), kv_cache={})
