"""float16/bfloat16 accuracy against a float64 golden run, with torch's own error as the yardstick.

PyTorch's attention tests judge a low-precision kernel the same way: compute the exact answer in
float64, measure torch's error in the low dtype, and allow the kernel under test a small multiple
of it. Here the multiple is 3, for every spread of the logits up to ~50 and for |q·k| far beyond
float16's range (65504), in both functions and in the module with every backend.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn

import mha

LOW = [torch.float16, torch.bfloat16]
FUNCTIONS = {"reference": mha.scaled_dot_product_attention, "flash": mha.flash_attention}


def max_error(out: torch.Tensor, golden: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output"
    return (out.double() - golden).abs().max().item()


def spread_inputs(s: float, dtype: torch.dtype, D: int = 64) -> tuple[torch.Tensor, ...]:
    """q, k ~ s·N(0, 1): the scaled logits q·k/sqrt(D) then have a standard deviation of s²."""
    q, k, v = (randn(2, 4, 96, D, seed=i) for i in range(3))
    return tuple(t.to(dtype) for t in (s * q, s * k, v))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("s", [1.0, 3.0, 5.0, 7.0])  # logit spreads (std) of 1, 9, 25 and 49
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_error_is_within_3x_of_torch(name, s, dtype, is_causal):
    q, k, v = spread_inputs(s, dtype)
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal)
    ours = FUNCTIONS[name](q, k, v, is_causal=is_causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert ours.dtype == dtype
    err_ours, err_torch = max_error(ours, golden), max_error(theirs, golden)
    assert err_ours <= 3 * err_torch + torch.finfo(dtype).eps, (err_ours, err_torch)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_float16_products_beyond_its_range_stay_finite(name):
    # |q·k| reaches ~1e5 here, above float16's largest number, 65504: the product must be formed
    # in float32 (torch's SDPA is finite here, and so must we be).
    q = (30 * randn(2, 4, 64, 128, seed=0)).half()
    v = randn(2, 4, 64, 128, seed=1).half()
    assert (q.float() @ q.float().transpose(-2, -1)).abs().max() > torch.finfo(torch.float16).max
    golden = F.scaled_dot_product_attention(q.double(), q.double(), v.double())
    ours = FUNCTIONS[name](q, q, v)
    theirs = F.scaled_dot_product_attention(q, q, v)
    assert max_error(ours, golden) <= 3 * max_error(theirs, golden) + torch.finfo(torch.float16).eps


@pytest.mark.parametrize("dtype", LOW)
def test_weights_are_returned_in_the_input_dtype_and_sum_to_one(dtype):
    q, k, v = spread_inputs(3.0, dtype)
    out, weights = mha.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert out.dtype == weights.dtype == dtype
    torch.testing.assert_close(
        weights.double().sum(-1),
        torch.ones(weights.shape[:-1], dtype=torch.float64),
        atol=2e-2,
        rtol=0,
    )


def _module_pair(backend: str, dtype: torch.dtype, num_kv_heads: int | None):
    torch.manual_seed(0)
    golden = mha.MultiHeadAttention(64, 4, num_kv_heads=num_kv_heads, dtype=torch.float64).eval()
    with torch.no_grad():  # large weights: logits with a spread of tens, as in a trained model
        for p in (golden.q_proj.weight, golden.k_proj.weight):
            p.mul_(6.0)
    low = mha.MultiHeadAttention(
        64, 4, num_kv_heads=num_kv_heads, backend=backend, dtype=dtype
    ).eval()
    yardstick = mha.MultiHeadAttention(
        64, 4, num_kv_heads=num_kv_heads, backend="sdpa", dtype=dtype
    ).eval()
    low.load_state_dict(golden.state_dict())
    yardstick.load_state_dict(golden.state_dict())
    return golden, low, yardstick


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("backend", ["math", "flash"])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_module_backends_within_3x_of_the_sdpa_backend(backend, dtype, num_kv_heads):
    golden, low, yardstick = _module_pair(backend, dtype, num_kv_heads)
    x = randn(2, 40, 64, seed=5)
    with torch.no_grad():
        expected = golden(x, is_causal=True)[0]
        ours = low(x.to(dtype), is_causal=True)[0]
        theirs = yardstick(x.to(dtype), is_causal=True)[0]
    assert ours.dtype == dtype
    assert max_error(ours, expected) <= 3 * max_error(theirs, expected) + torch.finfo(dtype).eps


@pytest.mark.triton
def test_module_triton_backend_within_3x_of_the_sdpa_backend():
    pytest.importorskip("triton")
    golden, low, yardstick = _module_pair("triton", torch.float16, None)
    x = randn(1, 32, 64, seed=6)
    with torch.no_grad():
        expected = golden(x, is_causal=True)[0]
        ours = low(x.half(), is_causal=True)[0]
        theirs = yardstick(x.half(), is_causal=True)[0]
    assert (
        max_error(ours, expected)
        <= 3 * max_error(theirs, expected) + torch.finfo(torch.float16).eps
    )


def test_scale_is_applied_in_float32():
    # A tiny scale on huge products: rounding the products to float16 first would overflow.
    q = (40 * randn(1, 1, 8, 64, seed=2)).half()
    v = randn(1, 1, 8, 64, seed=3).half()
    scale = 1 / math.sqrt(64) / 10
    for fn in FUNCTIONS.values():
        out = fn(q, q, v, scale=scale)
        assert out.isfinite().all()
