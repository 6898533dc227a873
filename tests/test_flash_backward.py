"""mha.flash_attention trains: its backward pass rebuilds tiles from the saved logsumexp and gives
torch's gradients (autograd through torch's SDPA, float64), zeros for fully masked rows, and keeps
no (L, S) tensor between the passes."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch.testing import assert_close

import mha


def leaves(L, S, H=4, Hkv=4, D=16, Dv=8, B=2, dtype=torch.float64):
    q = randn(B, H, L, D, dtype=dtype, seed=1).requires_grad_()
    k = randn(B, Hkv, S, D, dtype=dtype, seed=2).requires_grad_()
    v = randn(B, Hkv, S, Dv, dtype=dtype, seed=3).requires_grad_()
    return q, k, v


def grads(fn, q, k, v, d_out, **kwargs):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v, **kwargs).backward(d_out)
    return [t.grad.clone() for t in (q, k, v)]


def torch_sdpa(q, k, v, attn_mask=None, is_causal=False, **kwargs):
    if attn_mask is not None and is_causal:  # torch takes one or the other: fold causal in
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        attn_mask, is_causal = attn_mask.masked_fill(~causal, float("-inf")), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal, **kwargs)


def check_against_torch(L, S, H=4, Hkv=4, block_size=16, **kwargs):
    q, k, v = leaves(L, S, H=H, Hkv=Hkv)
    d_out = randn(2, H, L, v.shape[-1], seed=4)
    if Hkv != H:
        kwargs["enable_gqa"] = True
    ours = grads(mha.flash_attention, q, k, v, d_out, block_size=block_size, **kwargs)
    theirs = grads(torch_sdpa, q, k, v, d_out, **kwargs)
    for name, a, b in zip("qkv", ours, theirs, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has NaN/inf"
        assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")
    return ours


@pytest.mark.parametrize("L,S", [(37, 37), (37, 45), (45, 37), (1, 30), (30, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("block_size", [5, 16, 64])
def test_gradients_match_torch(L, S, is_causal, block_size):
    check_against_torch(L, S, is_causal=is_causal, block_size=block_size)


@pytest.mark.parametrize("Hkv", [1, 2])
@pytest.mark.parametrize("is_causal", [False, True])
def test_grouped_query_gradients_match_torch(Hkv, is_causal):
    check_against_torch(40, 52, H=4, Hkv=Hkv, is_causal=is_causal)


def test_bool_mask_with_fully_masked_rows_gives_zero_gradients_for_them():
    L, S = 40, 50
    mask = randn(2, 1, L, S, seed=5) > -0.5  # about 70 % of the keys kept
    mask[:, :, 7] = False  # row 7 sees no key in any batch or head
    dq, _, _ = check_against_torch(L, S, attn_mask=mask)
    assert dq[:, :, 7].abs().max() == 0


def test_float_mask_and_causal_together():
    L = S = 48
    bias = randn(1, 4, L, S, seed=6)
    check_against_torch(L, S, attn_mask=bias, is_causal=True, block_size=8)


def test_gradcheck():
    q, k, v = leaves(9, 11, H=2, Hkv=2, D=4, Dv=3, B=1)
    assert torch.autograd.gradcheck(
        lambda q, k, v: mha.flash_attention(q, k, v, is_causal=True, block_size=4), (q, k, v)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_return_lse_is_the_logsumexp_of_the_scaled_masked_scores(dtype):
    L, S, D = 20, 30, 8
    q, k, v = (t.detach().to(dtype) for t in leaves(L, S, D=D))
    mask = randn(1, 1, L, S, seed=7) > 0
    mask[..., 3, :] = False
    out, lse = mha.flash_attention(q, k, v, mask, block_size=8, return_lse=True)
    assert_close(out, mha.flash_attention(q, k, v, mask, block_size=8))
    assert lse.shape == (2, 4, L)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    scores = (q.double() @ k.double().transpose(-2, -1) / math.sqrt(D)).masked_fill(
        ~mask, float("-inf")
    )
    expected = torch.logsumexp(scores, -1)
    assert torch.isneginf(lse[..., 3]).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert_close(lse.double(), expected, atol=tol, rtol=tol)


def test_saves_no_L_by_S_tensor():
    """Between the passes autograd keeps only what the Function saves: inputs, out and lse."""
    L, S = 48, 80
    q, k, v = leaves(L, S, D=16, Dv=8)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mha.flash_attention(q, k, v, is_causal=True, block_size=16)
    assert saved, "nothing was saved for the backward pass"
    assert all(not (len(s) >= 2 and s[-2:] == (L, S)) for s in saved), saved
    assert sum(math.prod(s) for s in saved) < 2 * 2 * 4 * (L + S) * 16 + 2 * 4 * L * 9, saved
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_bfloat16_gradients_are_as_accurate_as_torchs():
    """bfloat16 in, float32 inside: the gradients' error against a float64 run is within 3x of
    torch's own bfloat16 backward on the same inputs."""
    q64, k64, v64 = leaves(64, 64, D=32, Dv=32)
    d_out = randn(2, 4, 64, 32, seed=8)
    golden = grads(torch_sdpa, q64, k64, v64, d_out, is_causal=True)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q64, k64, v64)]
    d_low = d_out.to(torch.bfloat16)
    ours = grads(mha.flash_attention, *low, d_low, is_causal=True, block_size=16)
    theirs = grads(torch_sdpa, *low, d_low, is_causal=True)
    for a, b, g in zip(ours, theirs, golden, strict=True):
        err_ours = (a.double() - g).abs().max().item()
        err_torch = (b.double() - g).abs().max().item()
        assert err_ours <= 3 * err_torch + 1e-6, (err_ours, err_torch)


def test_mask_that_requires_grad_is_refused():
    q, k, v = leaves(8, 8)
    bias = torch.zeros(8, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"attn_mask.*\(8, 8\)"):
        mha.flash_attention(q, k, v, bias)


def test_multihead_flash_backend_trains_like_math():
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=2).double()
    x = randn(2, 24, 32, seed=9)
    results = {}
    for backend in ("math", "flash"):
        layer.backend = backend
        layer.zero_grad()
        out, _ = layer(x, is_causal=True)
        out.square().sum().backward()
        results[backend] = [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(results["flash"], results["math"], strict=True):
        assert_close(a, b)


def test_second_derivatives_are_refused_not_wrong():
    q, k, v = leaves(8, 8, H=1, Hkv=1, D=4, Dv=4, B=1)
    (dq,) = torch.autograd.grad(mha.flash_attention(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dq.sum().backward()


def test_mask_changed_between_the_passes_is_an_error():
    q, k, v = leaves(8, 8, H=1, Hkv=1, D=4, Dv=4, B=1)
    mask = torch.ones(8, 8, dtype=torch.bool)
    out = mha.flash_attention(q, k, v, mask)
    mask[0, 0] = False
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
