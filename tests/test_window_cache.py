"""SlidingWindowPagedCache: equal to sliding-window attention, and a sequence's blocks bounded."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mha
from mha.window_cache import FREED


def window_reference(q, k, v, window):
    """SDPA of the last L positions over all S keys, sliding window aligned bottom-right."""
    L, S = q.shape[-2], k.shape[-2]
    p = torch.arange(S - L, S)[:, None]  # (L, 1) query positions
    j = torch.arange(S)[None, :]  # (1, S)
    keep = (j <= p) & (j > p - window)  # (L, S)
    return mha.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


def run(window, bs, chunks, B=2, H=4, Hkv=2, D=8, seed=0):
    """Feed the chunks (lengths) through the cache's attend; compare each step with SDPA over
    everything so far; return the cache and the most blocks a sequence held after a step."""
    g = torch.Generator().manual_seed(seed)
    total = sum(chunks)
    q = torch.randn(B, H, total, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, total, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, total, D, generator=g, dtype=torch.float64)
    cache = mha.SlidingWindowPagedCache(window, bs)
    most, done = 0, 0
    for n in chunks:
        sl = slice(done, done + n)
        out, _ = cache.attend(q[..., sl, :], k[..., sl, :], v[..., sl, :], is_causal=True)
        expected = window_reference(
            q[..., sl, :], k[..., : done + n, :], v[..., : done + n, :], window
        )
        torch.testing.assert_close(out, expected)
        done += n
        most = max(most, *(cache.blocks_held(b) for b in range(B)))
    return cache, most


def test_decoding_equals_sliding_window_attention_and_holds_a_bounded_number_of_blocks():
    cache, most = run(window=20, bs=4, chunks=[13] + [1] * 70)
    assert most <= math.ceil(20 / 4) + 1 == cache.bound()
    assert cache.freed_blocks > 0
    table = cache.block_table
    assert (table[:, :10] == FREED).all()  # the old blocks are gone from the table
    assert cache.blocks_in_use == sum(cache.blocks_held(b) for b in range(2))


@settings(max_examples=25, deadline=None)
@given(
    window=st.integers(1, 40),
    bs=st.sampled_from([1, 2, 4, 16]),
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    seed=st.integers(0, 100),
)
def test_any_chunking_equals_sliding_window_attention(window, bs, chunks, seed):
    cache, most = run(window, bs, chunks, seed=seed)
    # a chunk of n positions needs its first query's window and itself
    assert most <= math.ceil((window - 1 + max(chunks)) / bs) + 1


def test_a_freed_block_serves_another_sequence_and_the_pool_stops_growing():
    cache = mha.SlidingWindowPagedCache(8, 4)
    k = torch.randn(1, 1, 1, 4)
    cache.add_sequence()
    for _ in range(200):
        cache.update(k, k)
    assert (
        cache.key_pool is not None and len(cache.key_pool) <= 4
    )  # ceil(8/4) + 1 in use, grown by doubling
    assert cache.blocks_in_use <= cache.bound()
    cache.free_sequence(0)
    assert cache.blocks_in_use == 0


def test_the_layer_with_the_cache_equals_the_layer_with_a_window_mask():
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 30, 16)
    i = torch.arange(30)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 6)  # (30, 30)
    full, _ = layer(x, attn_mask=keep)
    cache = mha.SlidingWindowPagedCache(6, 4)
    steps = [layer(x[:, :10], is_causal=True, kv_cache=cache)[0]]
    steps += [layer(x[:, t : t + 1], kv_cache=cache)[0] for t in range(10, 30)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_bad_use_gets_a_clear_error():
    with pytest.raises(ValueError, match="window"):
        mha.SlidingWindowPagedCache(0)
    with pytest.raises(TypeError, match="window"):
        mha.SlidingWindowPagedCache(2.5)  # type: ignore[arg-type]
    cache = mha.SlidingWindowPagedCache(4, 2)
    k = torch.randn(1, 1, 12, 4)
    q = torch.randn(1, 2, 12, 4)
    with pytest.raises(ValueError, match="is_causal=True"):
        cache.attend(q, k, k)
    cache.attend(q, k, k, is_causal=True)
    assert cache.freed_blocks == 0  # blocks are freed before the next write, not after this one
    cache.attend(q[:, :, :1], k[:, :, :1], k[:, :, :1])  # position 12 sees 9..12: blocks 0-3 go
    assert cache.freed_blocks == 4
    with pytest.raises(ValueError, match="freed"):
        cache.slot(0, 0)
    assert cache.slot(0, 12) >= 0
    with pytest.raises(ValueError, match="does not fork"):
        cache.fork(0)
    with pytest.raises(ValueError, match="already freed"):
        cache.truncate(0, 3)
    cache.truncate(0, 12)  # the window of the next query, 9..12, is still held
    assert cache.seq_lens.tolist() == [12]
