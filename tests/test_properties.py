"""Property-based tests (hypothesis) over shapes and masks."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import mha

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def problems(draw, square=False):
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    L = draw(st.integers(1, 12))
    S = L if square else draw(st.integers(1, 12))
    D = draw(st.integers(1, 8))
    Dv = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, Dv, generator=g, dtype=torch.float64)
    keep = torch.rand(B, 1, L, S, generator=g) < draw(st.floats(0.2, 1.0))
    return q, k, v, keep, g


@SETTINGS
@given(problems(), st.integers(1, 9), st.booleans())
def test_backends_agree_with_each_other_and_torch(problem, block_size, is_causal):
    q, k, v, keep, _ = problem
    ref = mha.scaled_dot_product_attention(q, k, v, keep, is_causal=is_causal)
    assert_close(
        mha.flash_attention(q, k, v, keep, is_causal=is_causal, block_size=block_size), ref
    )
    L, S = q.shape[-2], k.shape[-2]
    visible = keep & mha.causal_mask(L, S) if is_causal else keep
    rows_with_keys = visible.any(-1, keepdim=True).expand_as(
        visible[..., :1]
    )  # torch gives NaN or 0 elsewhere
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    assert_close(
        ref.masked_select(rows_with_keys.expand_as(ref)),
        torch_out.masked_select(rows_with_keys.expand_as(ref)),
    )
    assert not torch.isnan(ref).any()


@SETTINGS
@given(problems())
def test_permutation_equivariance_without_positions(problem):
    q, k, v, _, g = problem
    L, S = q.shape[-2], k.shape[-2]
    pq, pk = torch.randperm(L, generator=g), torch.randperm(S, generator=g)
    out = mha.scaled_dot_product_attention(q, k, v)
    # permuting the queries permutes the outputs; permuting keys and values together changes nothing
    assert_close(mha.scaled_dot_product_attention(q[..., pq, :], k, v), out[..., pq, :])
    assert_close(mha.scaled_dot_product_attention(q, k[..., pk, :], v[..., pk, :]), out)


@SETTINGS
@given(problems(square=True), st.integers(0, 11))
def test_causal_prefix_invariance(problem, t):
    q, k, v, _, g = problem
    L = q.shape[-2]
    t = t % L
    out = mha.flash_attention(q, k, v, is_causal=True, block_size=4)
    k2, v2 = k.clone(), v.clone()
    k2[..., t:, :] = torch.randn(k2[..., t:, :].shape, generator=g, dtype=k.dtype)
    v2[..., t:, :] = torch.randn(v2[..., t:, :].shape, generator=g, dtype=v.dtype)
    out2 = mha.flash_attention(q, k2, v2, is_causal=True, block_size=4)
    assert_close(out2[..., :t, :], out[..., :t, :])  # positions before t never see the change


@SETTINGS
@given(problems(), st.integers(1, 6))
def test_padding_invariance(problem, pad):
    q, k, v, _, g = problem
    B, S = q.shape[0], k.shape[-2]
    out = mha.scaled_dot_product_attention(q, k, v)
    junk_k = torch.randn(*k.shape[:-2], pad, k.shape[-1], generator=g, dtype=k.dtype) * 100
    junk_v = torch.randn(*v.shape[:-2], pad, v.shape[-1], generator=g, dtype=v.dtype) * 100
    keep = mha.padding_mask(torch.full((B,), S), S + pad)
    padded_k, padded_v = torch.cat([k, junk_k], -2), torch.cat([v, junk_v], -2)
    for fn in (mha.scaled_dot_product_attention, mha.flash_attention):
        assert_close(fn(q, padded_k, padded_v, keep), out)


@SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 9),
    st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3)]),
    st.integers(0, 999),
)
def test_module_backends_agree(B, L, heads, seed):
    H, Hkv = heads
    torch.manual_seed(seed)
    model = mha.MultiHeadAttention(H * 3, H, num_kv_heads=Hkv, dtype=torch.float64)
    x = torch.randn(B, L, H * 3, dtype=torch.float64)
    outs = {}
    for backend in ("math", "sdpa", "flash"):
        model.backend = backend
        outs[backend] = model(x, is_causal=True)[0]
    assert_close(outs["sdpa"], outs["math"])
    assert_close(outs["flash"], outs["math"])
