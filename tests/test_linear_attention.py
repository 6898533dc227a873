"""mha.linear_attention: the O(L) regrouping equals its quadratic form, and is not softmax."""

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

import mha
from mha.lab.memory import peak_memory
from mha.linear_attention import elu_feature_map, linear_attention_weights


def qkv(batch=(2, 3), L=5, S=7, D=8, Dv=6, dtype=torch.float64):
    return (
        randn(*batch, L, D, dtype=dtype, seed=1),
        randn(*batch, S, D, dtype=dtype, seed=2),
        randn(*batch, S, Dv, dtype=dtype, seed=3),
    )


def reference(q, k, v):
    """out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j), one query and one key at a time."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for i in range(q.shape[-2]):
        num = torch.zeros(*q.shape[:-2], v.shape[-1], dtype=q.dtype)
        den = torch.zeros(*q.shape[:-2], 1, dtype=q.dtype)
        for j in range(k.shape[-2]):
            sim = (elu_feature_map(q[..., i, :]) * elu_feature_map(k[..., j, :])).sum(-1)
            num += sim.unsqueeze(-1) * v[..., j, :]
            den += sim.unsqueeze(-1)
        out[..., i, :] = num / den
    return out


@pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
@pytest.mark.parametrize("L,S,D,Dv", [(5, 7, 8, 6), (1, 1, 3, 2), (9, 4, 2, 5)])
def test_matches_the_sum_over_keys(batch, L, S, D, Dv):
    q, k, v = qkv(batch, L, S, D, Dv)
    assert_close(mha.linear_attention(q, k, v), reference(q, k, v))


def test_equals_its_quadratic_form():
    q, k, v = qkv()
    w = linear_attention_weights(q, k)  # (2, 3, L, S)
    assert w.shape == (2, 3, 5, 7)
    assert bool((w > 0).all())
    assert_close(w.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    assert_close(mha.linear_attention(q, k, v), w @ v)


def test_is_not_softmax_attention():
    q, k, v = qkv()
    diff = (mha.linear_attention(q, k, v) - F.scaled_dot_product_attention(q, k, v)).abs().max()
    assert diff > 0.05
    w_soft = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1)
    assert (linear_attention_weights(q, k) - w_soft).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computes_in_float32(dtype):
    q, k, v = (t.to(dtype) for t in qkv(dtype=torch.float32))
    out = mha.linear_attention(q, k, v)
    assert out.dtype == dtype
    golden = mha.linear_attention(q.double(), k.double(), v.double())
    # one rounding of the output: within the format's precision of the float64 result
    assert_close(out.double(), golden, atol=0, rtol=torch.finfo(dtype).eps)


def test_no_nan_when_the_features_underflow():
    q, k, v = qkv(dtype=torch.float32)
    out = mha.linear_attention(q, k - 200.0, v)  # φ(k) = exp(k) underflows to 0 everywhere
    assert bool(out.isfinite().all())
    assert bool(linear_attention_weights(q, k - 200.0).isfinite().all())


def test_flops_grow_linearly_in_the_length():
    flops = []
    for n in (256, 512, 1024):
        q, k, v = (torch.empty(1, 2, n, 16, device="meta") for _ in range(3))
        with FlopCounterMode(display=False) as counter:
            mha.linear_attention(q, k, v)
        flops.append(counter.get_total_flops())
    assert flops[1] == 2 * flops[0] and flops[2] == 2 * flops[1]


@pytest.mark.serial  # measures memory
def test_no_length_by_length_matrix_in_memory():
    n = 2048
    q, k, v = qkv((1,), n, n, 16, 16, dtype=torch.float32)
    with torch.no_grad():
        peak = peak_memory(mha.linear_attention, q, k, v)
    assert peak < (n * n * 4) / 16  # far below one (L, S) float32 matrix


def test_bad_input():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"query and key must have the same head dim.*\(2, 3, 7, 9\)"
    ):
        mha.linear_attention(q, randn(2, 3, 7, 9), v)
    with pytest.raises(ValueError, match="key and value must have the same length S"):
        mha.linear_attention(q, k, v[..., :4, :])
    with pytest.raises(ValueError, match="same leading"):
        mha.linear_attention(q[:1], k, v)
    with pytest.raises(TypeError, match="query must have a floating dtype"):
        mha.linear_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        mha.linear_attention(q, k.tolist(), v)
