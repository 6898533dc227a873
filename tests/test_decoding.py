"""The serving caches give the same outputs as KVCache; split-KV decoding equals one pass."""

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
from mha.multihead import KVCacheProtocol

CACHES = {
    "preallocated": lambda: mha.PreallocatedKVCache(64),
    "paged": lambda: mha.PagedKVCache(block_size=4),
    "paged-fixed-pool": lambda: mha.PagedKVCache(block_size=3, num_blocks=40),
}


def decode(layer: mha.MultiHeadAttention, x: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Feed ``x`` chunk by chunk through ``layer`` with ``cache``; concatenate the outputs."""
    L = x.shape[1]
    with torch.no_grad():
        steps = [
            layer(x[:, i : i + chunk], is_causal=True, kv_cache=cache)[0]
            for i in range(0, L, chunk)
        ]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("make", CACHES.values(), ids=CACHES.keys())
@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize(("num_kv_heads", "rope"), [(None, False), (2, True), (1, True)])
def test_serving_caches_equal_kv_cache(make, chunk, num_kv_heads, rope):
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rope=rope)
    layer = layer.to(torch.float64).eval()
    x = randn(3, 17, 32, seed=20)
    cache = make()
    assert isinstance(cache, KVCacheProtocol)
    want = decode(layer, x, mha.KVCache(), chunk)
    assert_close(decode(layer, x, cache, chunk), want)
    assert len(cache) == 17
    with torch.no_grad():
        assert_close(want, layer(x, is_causal=True)[0])
    cache.reset()  # a second sequence reuses the memory and gives the same outputs
    assert len(cache) == 0
    assert_close(decode(layer, x, cache, chunk), want)


def test_preallocated_cache_writes_in_place_and_reports_its_buffer():
    cache = mha.PreallocatedKVCache(10)
    k, v = randn(2, 3, 4, 8, seed=1), randn(2, 3, 4, 6, seed=2)
    keys, values = cache.update(k, v)
    buffer = cache.key_buffer
    assert keys.data_ptr() == buffer.data_ptr() and keys.shape == (2, 3, 4, 8)
    keys, values = cache.update(k[:, :, :1], v[:, :, :1])
    assert cache.key_buffer is buffer and keys.shape == (2, 3, 5, 8)  # no new allocation
    assert_close(keys[:, :, 4], k[:, :, 0])
    assert cache.nbytes == 2 * 3 * 10 * (8 + 6) * 8  # every position, used or not
    cache.reset()
    cache.update(k, v)
    assert cache.key_buffer is buffer  # same shapes: the buffer is reused


def test_preallocated_cache_full_and_mismatch_errors():
    cache = mha.PreallocatedKVCache(5)
    cache.update(randn(1, 2, 4, 8), randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"full: max_len \(5\) positions, 4 stored, 2 more"):
        cache.update(randn(1, 2, 2, 8), randn(1, 2, 2, 8))
    with pytest.raises(ValueError, match=r"\(B, Hkv\) and the head dims must agree"):
        cache.update(randn(1, 3, 1, 8), randn(1, 3, 1, 8))
    with pytest.raises(TypeError, match="cache's dtype torch.float64"):
        cache.update(randn(1, 2, 1, 8).float(), randn(1, 2, 1, 8).float())
    with pytest.raises(ValueError, match=r"key must have 4 dims \(B, Hkv, S_new, D\)"):
        cache.update(randn(2, 1, 8), randn(2, 1, 8))
    with pytest.raises(ValueError, match="max_len must be positive"):
        mha.PreallocatedKVCache(0)


# --- split-KV decoding ------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    S=st.integers(1, 300),
    num_splits=st.integers(1, 9),
    L=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_flash_decoding_equals_one_pass(S, num_splits, L, groups, seed):
    q = randn(2, 4, L, 16, seed=seed)
    k, v = randn(2, 4 // groups, S, 16, seed=seed + 1), randn(2, 4 // groups, S, 8, seed=seed + 2)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1)
    got = mha.flash_decoding(q, k, v, num_splits=num_splits, enable_gqa=groups > 1)
    assert_close(got, want)


def test_flash_decoding_with_fewer_keys_than_splits_and_a_scale():
    q, k, v = randn(1, 2, 1, 8, seed=1), randn(1, 2, 3, 8, seed=2), randn(1, 2, 3, 4, seed=3)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert_close(mha.flash_decoding(q, k, v, num_splits=8, scale=0.3), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_decoding_low_precision_keeps_float32_statistics(dtype):
    q, k, v = (randn(2, 4, n, 64, seed=s).mul(3).to(dtype) for s, n in ((1, 1), (2, 500), (3, 500)))
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    got = mha.flash_decoding(q, k, v, num_splits=7)
    assert got.dtype == dtype
    ours = (got.double() - golden).abs().max()
    torch_err = (F.scaled_dot_product_attention(q, k, v).double() - golden).abs().max()
    assert ours <= 2 * torch_err + torch.finfo(dtype).eps  # as accurate as torch's own kernel


def test_merge_partials_is_exact_and_handles_empty_splits():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 10, generator=g, dtype=torch.float64) * 30  # large: exp overflows
    v = torch.randn(10, 4, generator=g, dtype=torch.float64)
    parts = [slice(0, 4), slice(4, 10)]
    outs = torch.stack([torch.softmax(scores[:, p], -1) @ v[p] for p in parts])  # (2, 3, 4)
    lses = torch.stack([torch.logsumexp(scores[:, p], -1) for p in parts])  # (2, 3)
    out, lse = mha.merge_partials(outs, lses)
    assert_close(out, torch.softmax(scores, -1) @ v)
    assert_close(lse, torch.logsumexp(scores, -1))
    empty = torch.full((1, 3), float("-inf"), dtype=torch.float64)
    out2, _ = mha.merge_partials(
        torch.cat([outs, torch.zeros(1, 3, 4).double()]), torch.cat([lses, empty])
    )
    assert_close(out2, out)  # a split with no key counts 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_splits": 0}, ValueError, "num_splits must be positive"),
        ({"num_splits": 2.0}, TypeError, "num_splits must be an int"),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ],
)
def test_flash_decoding_errors(kwargs, error, match):
    q, k, v = randn(1, 2, 1, 8), randn(1, 2, 3, 8), randn(1, 2, 3, 8)
    with pytest.raises(error, match=match):
        mha.flash_decoding(q, k, v, **kwargs)


def test_flash_decoding_shape_errors():
    with pytest.raises(ValueError, match=r"same head dim, got query \(1, 2, 1, 8\) and key"):
        mha.flash_decoding(randn(1, 2, 1, 8), randn(1, 2, 3, 9), randn(1, 2, 3, 9))


# --- zero lengths -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("L", "S"), [(0, 5), (1, 0), (3, 0), (0, 0)])
def test_flash_decoding_zero_lengths_match_torch(L, S, groups, num_splits):
    """L = 0: an empty output; S = 0: zeros, what torch's SDPA returns (no key to attend to)."""
    q = randn(2, 4, L, 8, seed=1)
    k, v = randn(2, 4 // groups, S, 8, seed=2), randn(2, 4 // groups, S, 6, seed=3)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1)
    got = mha.flash_decoding(q, k, v, num_splits=num_splits, enable_gqa=groups > 1)
    assert got.shape == want.shape == (2, 4, L, 6)
    assert_close(got, want, rtol=0, atol=0)


def test_merge_partials_takes_float32_statistics_of_low_precision_outputs():
    q, k, v = (randn(1, 2, n, 8, seed=s).half() for s, n in ((1, 3), (2, 10), (3, 10)))
    parts = [
        mha.flash_attention(q, k[..., p, :], v[..., p, :], return_lse=True)
        for p in (slice(0, 4), slice(4, 10))
    ]  # (out float16, lse float32) each
    outs, lses = (torch.stack(t) for t in zip(*parts))
    out, _ = mha.merge_partials(outs, lses)
    assert_close(out.half(), mha.flash_attention(q, k, v), atol=1e-3, rtol=1e-3)


# --- split-KV decoding with a learned sink ------------------------------------------------------


def sdpa_with_sink_column(q, k, v, sinks, *, scale=None, groups=1):
    """torch's SDPA over one more key with score ``sinks[h]`` and a zero value, built by hand:
    a zero key (score 0) and a float mask adding the sink's logit to its column."""
    B, Hkv, S, D = k.shape
    k1 = torch.cat([k, k.new_zeros(B, Hkv, 1, D)], dim=-2)  # (B, Hkv, S + 1, D)
    v1 = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[-1])], dim=-2)  # (B, Hkv, S + 1, Dv)
    bias = torch.zeros(sinks.shape[0], 1, S + 1, dtype=q.dtype)  # (H, 1, S + 1)
    bias[..., -1] = sinks.to(q.dtype)[:, None]
    return F.scaled_dot_product_attention(
        q, k1, v1, attn_mask=bias, scale=scale, enable_gqa=groups > 1
    )


def sink_inputs(S, groups, seed, L=1, dtype=torch.float64):
    q = randn(2, 4, L, 16, seed=seed, dtype=dtype)
    k = randn(2, 4 // groups, S, 16, seed=seed + 1, dtype=dtype)
    v = randn(2, 4 // groups, S, 8, seed=seed + 2, dtype=dtype)
    sinks = randn(4, seed=seed + 3, dtype=dtype) * 2  # (H,): a fair share of each row
    return q, k, v, sinks


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_flash_decoding_with_sinks_equals_one_pass_for_every_split_count(groups):
    S = 11
    q, k, v, sinks = sink_inputs(S, groups, seed=5)
    want = mha.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1, sinks=sinks)
    assert_close(sdpa_with_sink_column(q, k, v, sinks, groups=groups), want)
    for num_splits in range(1, S + 2):  # one split, ..., one key per split, and more splits
        got = mha.flash_decoding(q, k, v, num_splits=num_splits, enable_gqa=groups > 1, sinks=sinks)
        assert_close(got, want, msg=f"num_splits={num_splits}")


@settings(max_examples=30, deadline=None)
@given(
    S=st.integers(0, 200),
    num_splits=st.integers(1, 9),
    L=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    sink_size=st.sampled_from([-30.0, 0.0, 3.0, 30.0]),
    seed=st.integers(0, 1000),
)
def test_flash_decoding_with_sinks_equals_an_extra_column(
    S, num_splits, L, groups, sink_size, seed
):
    q, k, v, sinks = sink_inputs(S, groups, seed, L=L)
    sinks = sinks + sink_size  # from a sink that takes nothing to one that takes nearly all
    want = sdpa_with_sink_column(q, k, v, sinks, scale=0.3, groups=groups)
    got = mha.flash_decoding(
        q, k, v, num_splits=num_splits, scale=0.3, enable_gqa=groups > 1, sinks=sinks
    )
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_decoding_with_sinks_in_low_precision_against_a_float64_golden(dtype):
    q, k, v = (randn(2, 4, n, 64, seed=s).mul(3).to(dtype) for s, n in ((1, 1), (2, 500), (3, 500)))
    sinks = (randn(4, seed=4) * 3).to(dtype)
    golden = sdpa_with_sink_column(q.double(), k.double(), v.double(), sinks.double())
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert_close(golden, mha.scaled_dot_product_attention(q64, k64, v64, sinks=sinks.double()))
    got = mha.flash_decoding(q, k, v, num_splits=7, sinks=sinks)
    assert got.dtype == dtype
    ours = (got.double() - golden).abs().max()
    torch_err = (sdpa_with_sink_column(q, k, v, sinks).double() - golden).abs().max()
    assert ours <= 2 * torch_err + torch.finfo(dtype).eps  # as accurate as torch's own kernel


def test_a_sink_added_in_every_split_is_a_sink_of_sigma_plus_log_splits():
    """The classic bug: each split's softmax gets the sink's column, so the merged denominator
    counts exp(sigma) once per split, num_splits times: a sink of sigma + ln(num_splits)."""
    q, k, v, _ = sink_inputs(40, 1, seed=9)
    sinks = torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=torch.float64)  # near each row's lse
    want = mha.scaled_dot_product_attention(q, k, v, sinks=sinks)
    chunks = [slice(i, i + 10) for i in range(0, 40, 10)]  # 4 splits
    parts = [mha.flash_attention(q, k[..., c, :], v[..., c, :], return_lse=True) for c in chunks]
    outs, lses = (torch.stack(t) for t in zip(*parts))  # (4, B, H, L, Dv), (4, B, H, L)
    assert_close(mha.merge_partials(outs, lses, sinks=sinks)[0], want)  # the sink once: right
    per_split = [mha.merge_partials(o[None], l[None], sinks=sinks) for o, l in zip(outs, lses)]
    wrong, _ = mha.merge_partials(*(torch.stack(t) for t in zip(*per_split)))
    assert (wrong - want).norm() > 0.2 * want.norm()  # not a rounding error: 20% of the output
    assert_close(wrong, mha.scaled_dot_product_attention(q, k, v, sinks=sinks + math.log(4)))


def test_merge_partials_with_sinks_handles_empty_splits_and_rows_without_keys():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 10, generator=g, dtype=torch.float64) * 30  # (H, L, S), large
    v = torch.randn(2, 10, 4, generator=g, dtype=torch.float64)  # (H, S, Dv)
    sinks = torch.tensor([40.0, -5.0], dtype=torch.float64)  # (H,)
    column = sinks[:, None, None].expand(2, 3, 1)  # (H, L, 1)
    weights = torch.softmax(torch.cat([scores, column], -1), -1)  # (H, L, S + 1)
    parts = [slice(0, 0), slice(0, 4), slice(4, 10)]  # the first split saw no key
    outs = torch.stack([torch.softmax(scores[..., p], -1).nan_to_num() @ v[:, p] for p in parts])
    lses = torch.stack([torch.logsumexp(scores[..., p], -1) for p in parts])  # (3, H, L)
    out, lse = mha.merge_partials(outs, lses, sinks=sinks)
    assert_close(out, weights[..., :-1] @ v)
    assert_close(lse, torch.logsumexp(torch.cat([scores, column], -1), -1))  # sink counted
    none_seen = mha.merge_partials(outs[:1], lses[:1], sinks=sinks)  # no key at all
    assert_close(none_seen[0], torch.zeros(2, 3, 4, dtype=torch.float64), rtol=0, atol=0)
    assert_close(none_seen[1], column[..., 0])  # only the sink is left in the row
    no_sink = torch.full((2,), float("-inf"), dtype=torch.float64)  # a sink of -inf: no sink
    assert_close(mha.merge_partials(outs, lses, sinks=no_sink), mha.merge_partials(outs, lses))
    assert not mha.merge_partials(outs[:1], lses[:1], sinks=no_sink)[0].isnan().any()


def test_merge_partials_with_sinks_keeps_float32_statistics_of_low_precision_outputs():
    q, k, v = (randn(1, 2, n, 8, seed=s).half() for s, n in ((1, 3), (2, 10), (3, 10)))
    sinks = torch.tensor([1.0, -1.0], dtype=torch.float16)
    parts = [
        mha.flash_attention(q, k[..., p, :], v[..., p, :], return_lse=True)
        for p in (slice(0, 4), slice(4, 10))
    ]  # (out float16, lse float32) each
    outs, lses = (torch.stack(t) for t in zip(*parts))
    out, lse = mha.merge_partials(outs, lses, sinks=sinks)
    assert lse.dtype == torch.float32
    want = mha.scaled_dot_product_attention(q, k, v, sinks=sinks)
    assert_close(out.half(), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (
            randn(3),
            ValueError,
            r"sinks of shape \(3,\) must broadcast to the partials' dims .*"
            r"\(2, 4\) \(out \(5, 2, 4, 1, 8\)\)",
        ),
        (randn(5, 4), ValueError, r"sinks of shape \(5, 4\) must broadcast"),
        (randn(4, 1), ValueError, r"sinks of shape \(4, 1\) must broadcast"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "sinks must have a floating dtype"),
        ([0.0] * 4, TypeError, "sinks must be a torch.Tensor, got list"),
    ],
)
def test_merge_partials_rejects_bad_sinks(sinks, error, match):
    out, lse = randn(5, 2, 4, 1, 8), randn(5, 2, 4, 1)  # 5 splits, B = 2, H = 4, L = 1
    with pytest.raises(error, match=match):
        mha.merge_partials(out, lse, sinks=sinks)


@pytest.mark.parametrize(
    ("sinks", "match"),
    [
        (randn(2), r"sinks of shape \(2,\) must broadcast to the query's leading dims \(2, 4\)"),
        (randn(4, 1), r"sinks of shape \(4, 1\) must broadcast .* \(query \(2, 4, 1, 16\)\)"),
    ],
)
def test_flash_decoding_rejects_bad_sinks(sinks, match):
    q, k, v, _ = sink_inputs(6, 2, seed=1)
    with pytest.raises(ValueError, match=match):
        mha.flash_decoding(q, k, v, enable_gqa=True, sinks=sinks)


ALL_CACHES = {"kv": mha.KVCache, **CACHES}
# The caches whose update returns the keys so far (a paged cache returns its pools instead:
# tests/test_paged.py).
RETURNING_CACHES = {"kv": mha.KVCache, "preallocated": CACHES["preallocated"]}


@pytest.mark.parametrize("make", RETURNING_CACHES.values(), ids=RETURNING_CACHES.keys())
def test_zero_new_tokens_are_a_no_op_update(make):
    cache = make()
    k, v = randn(2, 3, 5, 8, seed=1), randn(2, 3, 5, 6, seed=2)
    keys, values = cache.update(k[:, :, :0], v[:, :, :0])  # a first update with no token
    assert keys.shape == (2, 3, 0, 8) and values.shape == (2, 3, 0, 6) and len(cache) == 0
    cache.update(k[:, :, :3], v[:, :, :3])
    keys, values = cache.update(k[:, :, 3:3], v[:, :, 3:3])  # none in the middle
    assert len(cache) == 3
    assert_close(keys, k[:, :, :3], rtol=0, atol=0)
    assert_close(values, v[:, :, :3], rtol=0, atol=0)
    keys, values = cache.update(k[:, :, 3:], v[:, :, 3:])
    assert_close(keys, k, rtol=0, atol=0)
    assert_close(values, v, rtol=0, atol=0)


def test_latent_cache_zero_new_tokens():
    cache, c = mha.LatentCache(), randn(2, 4, 16, seed=1)
    assert cache.update(c[:, :0]).shape == (2, 0, 16) and len(cache) == 0
    cache.update(c[:, :3])
    assert_close(cache.update(c[:, 3:3]), c[:, :3], rtol=0, atol=0)
    assert_close(cache.update(c[:, 3:]), c, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize("make", ALL_CACHES.values(), ids=ALL_CACHES.keys())
def test_module_step_with_no_token_keeps_decoding_exact(make, backend):
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=2, rope=True, backend=backend)
    layer = layer.to(torch.float64).eval()
    x = randn(2, 6, 32, seed=3)
    cache = make()
    with torch.no_grad():
        first = layer(x[:, :0], is_causal=True, kv_cache=cache)[0]  # nothing yet, nothing new
        assert first.shape == (2, 0, 32) and len(cache) == 0
        head = layer(x[:, :4], is_causal=True, kv_cache=cache)[0]
        assert layer(x[:, 4:4], is_causal=True, kv_cache=cache)[0].shape == (2, 0, 32)
        tail = layer(x[:, 4:], is_causal=True, kv_cache=cache)[0]
        assert_close(torch.cat([head, tail], 1), layer(x, is_causal=True)[0])


EVERY_CACHE = {
    "kv": mha.KVCache,
    **CACHES,
    "quantized": lambda: mha.QuantizedKVCache(torch.int8),
}


@pytest.mark.parametrize("make", EVERY_CACHE.values(), ids=EVERY_CACHE.keys())
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 4], [9]])
def test_every_cache_attends_over_itself_bottom_right(make, chunks):
    """cache.attend(q, k, v, is_causal=True), chunk by chunk, is one causal pass over the
    sequence (GQA: 4 query heads on 2 key/value heads), whatever the cache's storage."""
    q, k, v = randn(2, 4, 9, 8, seed=1), randn(2, 2, 9, 8, seed=2), randn(2, 2, 9, 8, seed=3)
    cache, outs, start = make(), [], 0
    for n in chunks:
        new = slice(start, start + n)
        out, weights = cache.attend(q[:, :, new], k[:, :, new], v[:, :, new], is_causal=True)
        assert weights is None and out.shape == (2, 4, n, 8)
        outs.append(out)
        start += n
    if isinstance(cache, mha.QuantizedKVCache):  # attention sees the keys read back
        k, v = (mha.quantize_kv(t, dtype=torch.int8).dequantize(t.dtype) for t in (k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(torch.cat(outs, 2), want)
    assert len(cache) == 9


@pytest.mark.parametrize("make", EVERY_CACHE.values(), ids=EVERY_CACHE.keys())
def test_attend_bad_input_is_refused_before_anything_is_stored(make):
    cache = make()
    q, k = randn(1, 4, 2, 8, seed=1), randn(1, 2, 2, 8, seed=2)
    with pytest.raises(ValueError, match=r"query must have one row per new key and value"):
        cache.attend(q[:, :, :1], k, k)
    with pytest.raises(ValueError, match=r"head count \(dim -3\) that is a multiple"):
        cache.attend(randn(1, 3, 2, 8, seed=3), k, k)
    with pytest.raises(ValueError, match=r"query must have 4 dims"):
        cache.attend(q[0], k, k)
    assert len(cache) == 0
