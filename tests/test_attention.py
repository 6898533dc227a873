"""mha.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch.testing import assert_close

import mha


def qkv(batch=(2, 3), L=5, S=7, D=8, Dv=6, dtype=torch.float64):
    return (
        randn(*batch, L, D, dtype=dtype, seed=1),
        randn(*batch, S, D, dtype=dtype, seed=2),
        randn(*batch, S, Dv, dtype=dtype, seed=3),
    )


@pytest.mark.parametrize("batch", [(), (4,), (2, 3), (2, 1, 3)])
def test_matches_torch_for_any_leading_dims(batch):
    q, k, v = qkv(batch)
    assert_close(mha.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("L,S", [(1, 1), (5, 5), (5, 9), (9, 5)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lengths_and_causal(L, S, is_causal):
    q, k, v = qkv(L=L, S=S)
    assert_close(
        mha.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
        F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
    )


def test_scale():
    q, k, v = qkv()
    assert_close(
        mha.scaled_dot_product_attention(q, k, v, scale=0.3),
        F.scaled_dot_product_attention(q, k, v, scale=0.3),
    )


@pytest.mark.parametrize(
    "mask_shape", [(5, 7), (1, 7), (7,), (2, 1, 5, 7), (2, 3, 5, 7), (2, 1, 1, 7)]
)
def test_bool_mask_broadcasts_like_torch(mask_shape):
    q, k, v = qkv()
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True  # torch's math path returns NaN for empty rows on some versions
    assert_close(
        mha.scaled_dot_product_attention(q, k, v, mask),
        F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.reshape(-1, 7) if mask.dim() == 1 else mask
        ),
    )


def test_float_mask_is_added_to_the_scores():
    q, k, v = qkv()
    bias = randn(5, 7, seed=5)
    assert_close(
        mha.scaled_dot_product_attention(q, k, v, bias),
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
    )
    # the same bias written out by hand
    scores = q @ k.transpose(-2, -1) / math.sqrt(8) + bias
    assert_close(mha.scaled_dot_product_attention(q, k, v, bias), torch.softmax(scores, -1) @ v)


def test_causal_combined_with_mask_equals_anded_mask():
    q, k, v = qkv(L=6, S=6)
    pad = mha.padding_mask(torch.tensor([6, 4]), 6)[:, :, :, :]  # (2, 1, 1, 6)
    combined = pad & mha.causal_mask(6)
    assert_close(
        mha.scaled_dot_product_attention(q, k, v, pad, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, attn_mask=combined),
    )


def test_return_weights_are_the_softmax_and_rows_sum_to_one():
    q, k, v = qkv()
    out, weights = mha.scaled_dot_product_attention(q, k, v, return_weights=True)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
    assert weights.shape == (2, 3, 5, 7)
    assert_close(weights, expected)
    assert_close(out, weights @ v)


def test_non_contiguous_inputs():
    base_q, base_k, base_v = (
        randn(2, 5, 3, 8, seed=1),
        randn(2, 7, 3, 8, seed=2),
        randn(2, 7, 3, 6, seed=3),
    )
    q, k, v = (t.transpose(1, 2) for t in (base_q, base_k, base_v))  # (2, 3, L, D) views
    assert not q.is_contiguous()
    assert_close(mha.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_error_is_no_worse_than_torch(dtype):
    q, k, v = qkv(L=33, S=47, D=32, Dv=32, dtype=torch.float64)
    golden = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = mha.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
    theirs = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
    assert ours.dtype == dtype
    err_ours = (ours.double() - golden).abs().max()
    err_torch = (theirs.double() - golden).abs().max()
    eps = torch.finfo(dtype).eps
    assert err_ours <= 2 * err_torch + eps, (err_ours, err_torch)


def test_gradients_match_torch_in_float64():
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = mha.sliding_window_mask(5, 7, window=3)
    grads_ours = torch.autograd.grad(
        mha.scaled_dot_product_attention(q, k, v, mask).square().sum(), (q, k, v)
    )
    grads_torch = torch.autograd.grad(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum(), (q, k, v)
    )
    for ours, theirs in zip(grads_ours, grads_torch):
        assert_close(ours, theirs)
    assert torch.autograd.gradcheck(
        lambda a, b, c: mha.scaled_dot_product_attention(a, b, c, mask), (q, k, v)
    )


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_fully_masked_rows_are_zero_forward_and_backward(mask_kind):
    q, k, v = (t.requires_grad_() for t in qkv())
    keep = torch.ones(5, 7, dtype=torch.bool)
    keep[2] = False  # query 2 may attend to nothing
    mask = (
        keep
        if mask_kind == "bool"
        else torch.zeros(5, 7, dtype=torch.float64).masked_fill(~keep, -math.inf)
    )
    out, weights = mha.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    assert torch.equal(weights[..., 2, :], torch.zeros_like(weights[..., 2, :]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert not any(torch.isnan(g).any() for g in grads)
    assert torch.equal(grads[0][..., 2, :], torch.zeros_like(grads[0][..., 2, :]))
    # the other rows agree with torch's SDPA
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = [0, 1, 3, 4]
    assert_close(out[..., rows, :], ref[..., rows, :])


def test_softmax_is_stable_and_safe():
    x = torch.tensor(
        [[1000.0, 1001.0, 1002.0], [-math.inf, -math.inf, -math.inf], [0.0, -math.inf, 1.0]]
    )
    got = mha.softmax(x)
    assert_close(got[0], torch.softmax(x[0], -1))
    assert torch.equal(got[1], torch.zeros(3))
    assert_close(got[2], torch.softmax(x[2], -1))


def test_dropout_zeroes_weights_and_rescales():
    q, k, v = qkv(L=64, S=64)
    torch.manual_seed(0)
    out, weights = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.5, return_weights=True)
    dropped = (weights == 0).double().mean()
    assert 0.4 < dropped < 0.6
    assert_close(out, weights @ v)
    # kept weights are scaled by 1 / (1 - p)
    plain = mha.scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    kept = weights != 0
    assert_close(weights[kept], 2 * plain[kept])
