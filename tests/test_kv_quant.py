"""KV-cache quantisation: round-trip bounds derived from the scale, attention error against SDPA
over the float cache, memory, and clear errors."""

import pytest
import torch
import torch.nn.functional as F

import mha
from mha.kv_quant import quantize_kv


def _kv(seed=0, shape=(2, 3, 40, 16), outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:  # a few channels 20x larger, as in real models' keys
        x[..., :2] *= 20
    return x


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("outliers", [False, True])
def test_int8_round_trip_within_half_a_step(granularity, outliers):
    x = _kv(outliers=outliers)
    q = quantize_kv(x, granularity=granularity)
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32
    expected_scale_shape = (2, 3, 40, 1) if granularity == "token" else (2, 3, 1, 16)
    assert q.scale.shape == expected_scale_shape
    # the scale is max|x| / 127 over its group, computed here with torch's amax
    dim = -1 if granularity == "token" else -2
    torch.testing.assert_close(q.scale, x.abs().amax(dim, keepdim=True) / 127)
    err = (q.dequantize() - x).abs()
    half_step = q.scale / 2  # broadcasts over its group
    assert bool((err <= half_step * (1 + 1e-5) + 1e-7).all())
    assert int(q.data.abs().max()) == 127  # every group uses the whole grid


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_fp8_round_trip_relative_bound(granularity):
    x = _kv(seed=1, outliers=True)
    q = quantize_kv(x, granularity=granularity, dtype=torch.float8_e4m3fn)
    assert q.data.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(
        q.scale, x.abs().amax(-1 if granularity == "token" else -2, keepdim=True) / 448
    )
    # e4m3: 3 mantissa bits, half a step is 2^-4 of the number (normal range), and the
    # subnormal step is 2^-9 (half: 2^-10), both in units of the scale
    err = (q.dequantize() - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, q.scale * 2**-10)
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())


def test_all_zero_group_and_dtypes():
    x = torch.zeros(1, 1, 3, 4, dtype=torch.float16)
    q = quantize_kv(x)
    assert torch.equal(q.dequantize(torch.float16), x)
    assert q.dequantize(torch.float16).dtype == torch.float16


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize(
    "dtype, granularity, tolerance",
    [
        (torch.int8, "token", 0.02),
        (torch.int8, "channel", 0.02),
        (torch.float8_e4m3fn, "token", 0.08),
    ],
)
def test_attention_error_against_the_float_cache(dtype, granularity, tolerance):
    g = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 1, 16, generator=g)  # one decode step, H = 6
    key, value = _kv(seed=3), _kv(seed=4)  # Hkv = 3
    exact = _sdpa(query, key, value)  # torch's SDPA over the float cache
    k8 = quantize_kv(key, granularity=granularity, dtype=dtype).dequantize()
    v8 = quantize_kv(value, dtype=dtype).dequantize()
    approx = _sdpa(query, k8, v8)
    err = (approx - exact).abs().max().item()
    assert err < tolerance * exact.abs().max().item()
    assert err > 0  # quantisation does change something


def test_per_channel_keys_beat_per_token_with_outlier_channels():
    g = torch.Generator().manual_seed(5)
    query = torch.randn(2, 3, 8, 16, generator=g)
    key, value = _kv(seed=6, outliers=True), _kv(seed=7)
    exact = _sdpa(query, key, value)
    errors = {}
    for granularity in ("token", "channel"):
        k8 = quantize_kv(key, granularity=granularity).dequantize()
        errors[granularity] = (_sdpa(query, k8, value) - exact).abs().mean().item()
    assert errors["channel"] < errors["token"] / 2


def test_memory():
    x = _kv(shape=(2, 4, 128, 64))
    assert quantize_kv(x).nbytes == x.numel() + 2 * 4 * 128 * 4  # data + a float32 per token
    assert quantize_kv(x, granularity="channel").nbytes == x.numel() + 2 * 4 * 64 * 4


def test_cache_round_trip_and_decoding():
    cache = mha.QuantizedKVCache()
    key, value = _kv(seed=8), _kv(seed=9)
    k_all, v_all = cache.update(key[..., :30, :], value[..., :30, :])
    for t in range(30, 40):  # then one token at a time
        k_all, v_all = cache.update(key[..., t : t + 1, :], value[..., t : t + 1, :])
    assert len(cache) == 40 and k_all.shape == key.shape and k_all.dtype == key.dtype
    scale_k = key.abs().amax(-1, keepdim=True) / 127  # per token: torch's amax
    scale_v = value.abs().amax(-1, keepdim=True) / 127
    assert bool(((k_all - key).abs() <= scale_k / 2 * (1 + 1e-5) + 1e-7).all())
    assert bool(((v_all - value).abs() <= scale_v / 2 * (1 + 1e-5) + 1e-7).all())
    assert cache.nbytes == 2 * (key.numel() + 2 * 3 * 40 * 4)
    cache.reset()
    assert len(cache) == 0 and cache.nbytes == 0


def test_cache_in_multihead_attention():
    torch.manual_seed(0)
    attn = mha.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        full, _ = attn(x, is_causal=True)
        cache = mha.QuantizedKVCache()
        steps = [attn(x[:, t : t + 1], kv_cache=cache, is_causal=True)[0] for t in range(12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-2, rtol=0)


def test_errors():
    x = _kv()
    with pytest.raises(ValueError, match="unknown granularity 'head'"):
        quantize_kv(x, granularity="head")
    with pytest.raises(
        TypeError, match="dtype must be torch.int8 or torch.float8_e4m3fn, got torch.int16"
    ):
        quantize_kv(x, dtype=torch.int16)
    with pytest.raises(TypeError, match="x must have a floating dtype, got torch.int64"):
        quantize_kv(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"x must have at least 2 dims \(..., S, D\), got shape \(5,\)"
    ):
        quantize_kv(torch.ones(5))
    with pytest.raises(TypeError, match="dtype must be torch.int8"):
        mha.QuantizedKVCache(torch.float16)
    cache = mha.QuantizedKVCache()
    cache.update(x, x)
    with pytest.raises(ValueError, match="do not match the cached keys"):
        cache.update(x[..., :8], x[..., :8])
    with pytest.raises(TypeError, match="must have the cache's dtype"):
        cache.update(x.double(), x.double())
