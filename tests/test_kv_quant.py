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


# --- per tensor and static scales (vLLM's --kv-cache-dtype fp8) -----------------------------------

FP8 = torch.float8_e4m3fn


def _fp8_bound(x, scale):
    """e4m3's rounding bound: 2^-4 of each number, down to half the subnormal step."""
    return torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5) + 1e-7


def test_per_tensor_scale_and_fp8_bound():
    x = _kv(seed=10, outliers=True)
    q = quantize_kv(x, granularity="tensor", dtype=FP8)
    assert q.scale.shape == (1, 1, 1, 1) and q.data.dtype == FP8
    torch.testing.assert_close(q.scale, (x.abs().max() / 448).reshape(1, 1, 1, 1))
    assert bool(((q.dequantize() - x).abs() <= _fp8_bound(x, q.scale)).all())
    assert q.nbytes == x.numel() + 4  # one float32 scale in all
    q8 = quantize_kv(x, granularity="tensor")  # int8: half a step of the one scale
    assert bool(((q8.dequantize() - x).abs() <= q8.scale / 2 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("dtype, q_max", [(FP8, 448.0), (torch.int8, 127.0)])
def test_static_scale_saturates_beyond_the_grid(dtype, q_max):
    x = _kv(seed=11)
    scale = x.abs().max().item() / q_max / 2  # calibrated on numbers half as large
    q = quantize_kv(x, dtype=dtype, scale=scale)  # granularity "tensor" by default with scale=
    assert q.scale.shape == (1, 1, 1, 1) and q.scale.item() == pytest.approx(scale)
    read = q.dequantize()
    beyond = x.abs() / scale > q_max
    assert 0 < int(beyond.sum()) < x.numel()
    assert mha.kv_quant.count_saturated(x, scale, dtype=dtype) == int(beyond.sum())
    assert not read.isnan().any()
    # beyond the grid: clamped to ±q_max steps, the sign kept
    torch.testing.assert_close(read[beyond], x[beyond].sign() * q_max * scale)
    inside = ~beyond
    if dtype == FP8:
        bound = _fp8_bound(x, torch.tensor(scale))
    else:
        bound = torch.full_like(x, scale / 2 * (1 + 1e-5) + 1e-7)
    assert bool(((read - x).abs()[inside] <= bound[inside]).all())


def test_tensor_cache_calibrates_on_the_first_update_then_keeps_its_scales():
    key, value = _kv(seed=12), _kv(seed=13)
    cache = mha.QuantizedKVCache(FP8, granularity="tensor")
    assert cache.k_scale is None and cache.v_scale is None
    cache.update(key[..., :20, :], value[..., :20, :])
    k_scale = key[..., :20, :].abs().max().item() / 448  # vLLM: amax of the first batch
    assert cache.k_scale == pytest.approx(k_scale)
    assert cache.v_scale == pytest.approx(value[..., :20, :].abs().max().item() / 448)
    assert cache.saturated == {"key": 0, "value": 0}
    later = 3 * key[..., 20:, :]  # later tokens larger than the calibration
    k_all, _ = cache.update(later, value[..., 20:, :])
    assert cache.k_scale == pytest.approx(k_scale)  # fixed
    beyond = later.abs() / k_scale > 448
    assert cache.saturated["key"] == int(beyond.sum()) > 0
    assert k_all[..., 20:, :].abs().max().item() == pytest.approx(448 * k_scale)
    cache.reset()
    assert len(cache) == 0 and cache.k_scale == pytest.approx(k_scale)  # scales stay
    assert cache.saturated == {"key": 0, "value": 0}


def test_tensor_cache_equals_one_pass_over_the_dequantised_cache():
    g = torch.Generator().manual_seed(14)
    query = torch.randn(2, 6, 40, 16, generator=g)
    key, value = _kv(seed=15), _kv(seed=16)
    cache = mha.QuantizedKVCache(FP8, granularity="tensor", k_scale=0.004, v_scale=0.005)
    outs = [cache.attend(query[..., :25, :], key[..., :25, :], value[..., :25, :], is_causal=True)]
    for t in range(25, 40):
        s = slice(t, t + 1)
        outs.append(cache.attend(query[..., s, :], key[..., s, :], value[..., s, :]))
    stepwise = torch.cat([out for out, _ in outs], dim=-2)
    k_hat = quantize_kv(key, dtype=FP8, scale=0.004).dequantize()
    v_hat = quantize_kv(value, dtype=FP8, scale=0.005).dequantize()
    one_pass = F.scaled_dot_product_attention(query, k_hat, v_hat, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(stepwise, one_pass, atol=1e-5, rtol=1e-5)
    assert cache.saturated["key"] == mha.kv_quant.count_saturated(key, 0.004)


def test_tensor_cache_bytes_two_scales_in_all():
    key = _kv(seed=17, shape=(2, 4, 128, 64))
    per_tensor = mha.QuantizedKVCache(FP8, granularity="tensor")
    per_token = mha.QuantizedKVCache(FP8)
    for cache in (per_tensor, per_token):
        cache.update(key[..., :100, :], key[..., :100, :])
        cache.update(key[..., 100:, :], key[..., 100:, :])
    assert per_tensor.nbytes == 2 * key.numel() + 2 * 4  # a k_scale and a v_scale
    assert per_token.nbytes == 2 * (key.numel() + 4 * 2 * 4 * 128)  # a float32 per token


def test_static_scale_errors():
    x = _kv()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            quantize_kv(x, dtype=FP8, scale=bad)
    with pytest.raises(ValueError, match=r"scale must be one number .* shape \(2,\)"):
        quantize_kv(x, scale=torch.ones(2))
    with pytest.raises(TypeError, match="scale must be a number, got str"):
        quantize_kv(x, scale="1")
    with pytest.raises(ValueError, match="granularity must be 'tensor', got 'token'"):
        quantize_kv(x, granularity="token", scale=0.1)
    with pytest.raises(ValueError, match="k_scale is a static per-tensor scale"):
        mha.QuantizedKVCache(FP8, k_scale=0.1)
    with pytest.raises(ValueError, match="v_scale must be a positive finite number, got 0"):
        mha.QuantizedKVCache(FP8, granularity="tensor", v_scale=0)
    with pytest.raises(ValueError, match="granularity must be 'token' or 'tensor' for a cache"):
        mha.QuantizedKVCache(FP8, granularity="channel")
    with pytest.raises(ValueError, match="unknown granularity 'head'"):
        mha.QuantizedKVCache(FP8, granularity="head")
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        mha.kv_quant.count_saturated(x, -2.0)
    assert float(quantize_kv(x, dtype=FP8, scale=torch.tensor(0.5)).scale) == 0.5
