"""The paged KV cache is a pool written in place; paged_attention equals SDPA over each sequence."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import mha


def sdpa_per_sequence(query, keys, values):
    """torch's SDPA over each sequence's own keys: the reference, one sequence at a time."""
    return torch.cat(
        [
            F.scaled_dot_product_attention(query[b : b + 1], k, v, enable_gqa=True)
            for b, (k, v) in enumerate(zip(keys, values))
        ]
    )  # (B, H, 1, Dv)


def filled_cache(lengths, Hkv=2, D=8, Dv=8, block_size=4, seed=0, **kwargs):
    """A paged cache whose sequences hold ``lengths`` random tokens, written in ragged steps."""
    cache = mha.PagedKVCache(block_size, **kwargs)
    keys, values = [], []
    for b, n in enumerate(lengths):
        cache.add_sequence()
        k, v = randn(1, Hkv, n, D, seed=seed + 2 * b), randn(1, Hkv, n, Dv, seed=seed + 2 * b + 1)
        for i in range(0, n, 3):  # chunks of 3, so that writes cross block boundaries
            cache.update(k[:, :, i : i + 3], v[:, :, i : i + 3], sequences=[b])
        keys.append(k)
        values.append(v)
    return cache, keys, values


# --- paged_attention against SDPA --------------------------------------------------------------

# paged_attention's two methods: whole rows of scores in two passes, when they fit in one tile
# (chunked_prefill._paged_attention_rows), else the running state over tiles (an online softmax).
PATHS = ["whole rows", "running state"]


@contextlib.contextmanager
def on_path(path):
    """Run paged_attention by ``path``: the running state by making the two-pass method decline;
    the whole rows by checking that the two-pass method gave the result."""
    real = mha.chunked_prefill._paged_attention_rows
    results = []

    def rows(*args):
        results.append(None if path == "running state" else real(*args))
        return results[-1]

    with mock.patch.object(mha.paged, "_paged_attention_rows", rows):
        yield
    assert results, "paged_attention did not ask the two-pass method"
    assert path == "running state" or None not in results, "the two-pass method declined"


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    groups=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([1, 4, 16]),
)
@pytest.mark.parametrize("path", PATHS)
def test_paged_attention_equals_sdpa_over_each_sequence(path, lengths, groups, block_size):
    assume(any(lengths))  # (a cache that never stored a token has no pool yet)
    cache, keys, values = filled_cache(lengths, Hkv=2, D=8, Dv=6, block_size=block_size)
    query = randn(len(lengths), 2 * groups, 1, 8, seed=99)  # (B, H, 1, D)
    with on_path(path):
        out = mha.paged_attention(
            query, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
        )
    assert_close(out, sdpa_per_sequence(query, keys, values))


@pytest.mark.parametrize("path", PATHS)
def test_paged_attention_reads_a_shuffled_pool_and_long_sequences(monkeypatch, path):
    """Blocks anywhere in the pool, tables with -1 past the end, more blocks than one step reads."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, D, bs = 3, 4, 1, 16, 8
    lengths = [1, 300, 700]  # 700 positions: 88 blocks, three steps of 32 blocks, the last short
    for module in (mha.paged, mha.chunked_prefill):  # 32 blocks per step, by either method
        monkeypatch.setattr(module, "TILE_KEYS", B * Hkv * bs * D * 32)
    pool_k, pool_v = randn(400, Hkv, bs, D, seed=1), randn(400, Hkv, bs, D, seed=2)
    perm = torch.randperm(400, generator=g)
    table = torch.full((B, 280), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(lengths):
        need = -(-n // bs)
        table[b, :need] = perm[used : used + need]
        used += need
    keys = [
        pool_k[table[b, : -(-n // bs)]].transpose(0, 1).flatten(1, 2)[None, :, :n]
        for b, n in enumerate(lengths)
    ]
    values = [
        pool_v[table[b, : -(-n // bs)]].transpose(0, 1).flatten(1, 2)[None, :, :n]
        for b, n in enumerate(lengths)
    ]
    query = randn(B, H, 1, D, seed=4)
    lens = torch.tensor(lengths)
    with on_path(path):
        out = mha.paged_attention(query, pool_k, pool_v, table.int(), lens, scale=0.3)
    want = torch.cat(
        [
            F.scaled_dot_product_attention(query[b : b + 1], k, v, scale=0.3, enable_gqa=True)
            for b, (k, v) in enumerate(zip(keys, values))
        ]
    )
    assert_close(out, want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_low_precision_is_as_close_as_sdpa(dtype, path):
    """In float16/bfloat16 the error against a float64 run is no worse than SDPA's own."""
    cache, keys, values = filled_cache([37, 5], Hkv=2, D=16, Dv=16)
    query = randn(2, 4, 1, 16, seed=7)
    gold = sdpa_per_sequence(query, keys, values)
    low = [t.to(dtype) for t in (query, cache.key_pool, cache.value_pool)]
    with on_path(path):
        out = mha.paged_attention(*low, cache.block_table, cache.seq_lens)
    ref = sdpa_per_sequence(low[0], [k.to(dtype) for k in keys], [v.to(dtype) for v in values])
    assert out.dtype == dtype
    err, ref_err = (out.double() - gold).abs().max(), (ref.double() - gold).abs().max()
    assert err <= 2 * ref_err + 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_empty_sequence_gives_zeros_like_sdpa(path):
    cache, _, _ = filled_cache([0, 3])
    query = randn(2, 2, 1, 8, seed=1)
    with on_path(path):
        out = mha.paged_attention(
            query, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
        )
    empty = torch.empty(1, 2, 0, 8, dtype=torch.float64)
    assert_close(out[:1], F.scaled_dot_product_attention(query[:1], empty, empty))


# --- the pool ---------------------------------------------------------------------------------


def test_update_writes_in_place_into_the_same_storage():
    cache = mha.PagedKVCache(block_size=4, num_blocks=16)
    k = randn(2, 1, 10, 3, seed=5)  # two sequences, one head, 10 positions
    key_pool, _ = cache.update(k, k)
    storage = cache.key_pool.untyped_storage().data_ptr()
    assert key_pool is cache.key_pool and cache.key_pool.shape == (16, 1, 4, 3)
    for _ in range(20):
        cache.update(k[:, :, :1], k[:, :, :1])
        assert cache.key_pool.untyped_storage().data_ptr() == storage  # never reallocated
    assert cache.seq_lens.tolist() == [30, 30] and cache.seq_lens.dtype == torch.int64
    table = cache.block_table
    assert table.dtype == torch.int32 and table.shape == (2, 8)
    pool = cache.key_pool.flatten(0, 2)  # (blocks·Hkv·block_size, D) with Hkv = 1
    for b in range(2):
        for t in range(10):
            slot = cache.slot(b, t)
            assert slot == table[b, t // 4].item() * 4 + t % 4
            assert_close(pool[slot], k[b, 0, t])
    assert cache.nbytes == 16 * 4 * 3 * 8 * 2  # 16 used blocks of keys and values


def test_zero_new_tokens_store_nothing():
    cache = mha.PagedKVCache(block_size=4)
    k = randn(2, 3, 5, 8, seed=1)
    cache.update(k[:, :, :0], k[:, :, :0])  # a first update with no token: two empty rows
    assert cache.seq_lens.tolist() == [0, 0] and cache.blocks_in_use == 0 and len(cache) == 0
    cache.update(k[:, :, :3], k[:, :, :3])
    cache.update(k[:, :, 3:3], k[:, :, 3:3])
    assert cache.seq_lens.tolist() == [3, 3] and cache.blocks_in_use == 2


def test_truncate_gives_blocks_back():
    cache, keys, values = filled_cache([13, 6], block_size=4)
    cache.truncate(0, 5)  # 13 -> 5 positions: 4 blocks -> 2
    assert cache.seq_lens.tolist() == [5, 6] and cache.blocks_in_use == 4
    query = randn(2, 2, 1, 8, seed=3)
    out = mha.paged_attention(
        query, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
    )
    want = sdpa_per_sequence(query, [keys[0][:, :, :5], keys[1]], [values[0][:, :, :5], values[1]])
    assert_close(out, want)
    with pytest.raises(ValueError, match=r"length \(7\) must be at most sequence 1's 6"):
        cache.truncate(1, 7)


def test_block_table_has_minus_one_past_each_sequence():
    cache, _, _ = filled_cache([5, 13, 0], block_size=4)
    table = cache.block_table
    assert table.shape == (3, 4)
    assert (table >= 0).sum(1).tolist() == [2, 4, 0]
    assert table[0, 2:].tolist() == [-1, -1] and table[2].tolist() == [-1] * 4
    assert len(set(table[table >= 0].tolist())) == 6  # no block shared


def test_unbounded_pool_grows_by_whole_blocks():
    cache = mha.PagedKVCache(block_size=4)
    cache.update(randn(1, 2, 3, 8), randn(1, 2, 3, 8))
    assert cache.key_pool.shape[0] == 1
    cache.update(randn(1, 2, 30, 8), randn(1, 2, 30, 8))
    assert cache.key_pool.shape[0] >= 9 and cache.blocks_in_use == 9  # ceil(33 / 4)


def test_blocks_on_demand_freed_and_reused():
    cache = mha.PagedKVCache(block_size=4, num_blocks=4)
    for t in range(8):
        cache.update(randn(1, 2, 1, 8, seed=t), randn(1, 2, 1, 8, seed=t))
        assert (cache.block_table[0] >= 0).sum() == t // 4 + 1  # new blocks at 0 and 4
    with pytest.raises(
        ValueError, match=r"out of blocks: 4 more needed, 2 free of num_blocks \(4\)"
    ):
        cache.update(randn(1, 2, 13, 8), randn(1, 2, 13, 8))
    assert len(cache) == 8 and cache.blocks_in_use == 2  # nothing changed
    second = cache.add_sequence()
    cache.update(randn(1, 2, 8, 8), randn(1, 2, 8, 8), sequences=[second])
    assert cache.blocks_in_use == 4
    cache.free_sequence(0)  # the first sequence ends: its two blocks go back
    assert cache.blocks_in_use == 2 and cache.seq_lens.tolist() == [8]
    third = cache.add_sequence()
    cache.update(randn(1, 2, 8, 8), randn(1, 2, 8, 8), sequences=[third])  # reuses them
    assert cache.blocks_in_use == 4
    cache.reset()
    assert cache.block_table.shape == (0, 0) and cache.nbytes == 0


def test_prefix_sharing_counts_references_and_copies_on_write():
    cache = mha.PagedKVCache(block_size=4, num_blocks=8)
    prompt_k, prompt_v = randn(1, 2, 6, 8, seed=1), randn(1, 2, 6, 8, seed=2)
    cache.update(prompt_k, prompt_v)  # sequence 0: 6 positions, blocks [a, b (half full)]
    child = cache.fork(0)
    assert cache.blocks_in_use == 2  # shared, not copied
    assert cache.block_table[1].tolist() == cache.block_table[0].tolist()
    before = cache.key_pool.clone()
    new_k, new_v = randn(2, 2, 1, 8, seed=3), randn(2, 2, 1, 8, seed=4)
    cache.update(new_k, new_v)  # both write position 6, into the shared half-full block
    assert cache.blocks_in_use == 3  # one copy of the written block; the full one still shared
    assert cache.key_pool.shape[0] == 8 and len(cache._free) == 5  # copied once, not twice
    t0, t1 = cache.block_table[0].tolist(), cache.block_table[1].tolist()
    assert t0[0] == t1[0] and t0[1] != t1[1]
    # the shared prompt is unchanged, each sequence sees its own new token
    query = randn(2, 4, 1, 8, seed=5)
    keys = [torch.cat([prompt_k, new_k[b : b + 1]], 2) for b in range(2)]
    values = [torch.cat([prompt_v, new_v[b : b + 1]], 2) for b in range(2)]
    out = mha.paged_attention(
        query, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
    )
    assert_close(out, sdpa_per_sequence(query, keys, values))
    assert_close(cache.key_pool[t0[0]], before[t0[0]])
    cache.free_sequence(child)  # the shared block stays: sequence 0 still uses it
    assert cache.blocks_in_use == 2
    short = cache.fork(0, length=4)  # shares one full block only
    assert cache.seq_lens.tolist() == [7, 4] and cache.blocks_in_use == 2
    cache.update(new_k[:1], new_v[:1], sequences=[short])  # a new block, no copy needed
    assert cache.blocks_in_use == 3


@pytest.mark.parametrize("chunks", [[1] * 17, [5, 5, 5, 2], [17], [7, 1, 1, 8]])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_multihead_attention_through_the_paged_cache_equals_one_causal_pass(chunks, num_kv_heads):
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rope=True)
    layer = layer.to(torch.float64).eval()
    x = randn(3, 17, 32, seed=20)
    cache = mha.PagedKVCache(block_size=4)
    outs, start = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(layer(x[:, start : start + n], is_causal=True, kv_cache=cache)[0])
            start += n
        # the reference: one causal pass through torch's SDPA, no cache
        ref = mha.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rope=True, backend="sdpa")
        ref.load_state_dict(layer.state_dict())
        ref = ref.to(torch.float64).eval()
        assert_close(torch.cat(outs, 1), ref(x, is_causal=True)[0])


def test_every_causal_step_is_one_paged_varlen_call_over_the_pool(monkeypatch):
    """A prompt chunk and a decode step each read the pool through the block table in one
    paged_varlen_attention call (no gathered copy), as an engine's mixed batch does."""
    import mha.paged as paged

    calls = []
    real = paged._paged_varlen_attention

    def spy(q, key_pool, value_pool, table, starts, lens, *rest):
        calls.append((tuple(q.shape), key_pool.data_ptr(), starts, lens))
        return real(q, key_pool, value_pool, table, starts, lens, *rest)

    monkeypatch.setattr(paged, "_paged_varlen_attention", spy)
    layer = mha.MultiHeadAttention(16, 2).eval()
    cache = mha.PagedKVCache(block_size=4)
    with torch.no_grad():
        layer(torch.randn(2, 3, 16), is_causal=True, kv_cache=cache)
        layer(torch.randn(2, 1, 16), is_causal=True, kv_cache=cache)
    pool = cache.key_pool.data_ptr()
    assert calls == [((6, 2, 8), pool, [0, 3, 6], [3, 3]), ((2, 2, 8), pool, [0, 1, 2], [4, 4])]


# --- errors -------------------------------------------------------------------------------------


def args(B=2, H=4, Hkv=2, D=8, N=6, bs=4, M=3, lens=(5, 9)):
    return (
        torch.randn(B, H, 1, D),
        torch.zeros(N, Hkv, bs, D),
        torch.zeros(N, Hkv, bs, D),
        torch.arange(B * M, dtype=torch.int32).view(B, M) % N,
        torch.tensor(lens),
    )


def replace(i, value):
    a = list(args())
    a[i] = value
    return a


ERRORS = [
    (replace(0, torch.randn(2, 4, 8)), ValueError, r"query must have 4 dims \(B, H, L, D\)"),
    (
        replace(0, torch.randn(2, 4, 2, 8)),
        ValueError,
        r"one decode step \(B, H, 1, D\), got query \(2, 4, 2, 8\)",
    ),
    (
        replace(0, torch.randn(2, 3, 1, 8)),
        ValueError,
        r"query heads \(3\) must be a multiple of the pools' key/value heads \(2\)",
    ),
    (
        replace(0, torch.randn(2, 4, 1, 16)),
        ValueError,
        r"query's D.*query \(2, 4, 1, 16\), key_pool \(6, 2, 4, 8\)",
    ),
    (
        replace(0, torch.randn(2, 4, 1, 8, dtype=torch.float64)),
        TypeError,
        "one dtype, got torch.float64, torch.float32",
    ),
    (
        replace(1, torch.zeros(6, 2, 4)),
        ValueError,
        r"key_pool must have 4 dims \(N, Hkv, block_size, D\)",
    ),
    (replace(2, torch.zeros(6, 2, 5, 8)), ValueError, r"value_pool \(6, 2, 5, 8\)"),
    (
        replace(3, torch.zeros(2, 3)),
        TypeError,
        "block_table must be an integer tensor, got dtype torch.float32",
    ),
    (
        replace(3, torch.zeros(3, 3, dtype=torch.int32)),
        ValueError,
        r"query's batch B = 2, got block_table \(3, 3\)",
    ),
    (
        replace(3, torch.tensor([[0, 1, 2], [3, 6, 0]], dtype=torch.int32)),
        ValueError,
        r"block numbers in \[0, 6\).*from 0 to 6",
    ),
    (
        replace(3, torch.tensor([[0, -1, 2], [3, 4, 5]], dtype=torch.int32)),
        ValueError,
        r"block numbers in \[0, 6\).*from -1 to 5",
    ),
    (
        replace(4, torch.tensor([5, 13])),
        ValueError,
        r"seq_lens must be in \[0, 12\].*got \[5, 13\]",
    ),
    (replace(4, torch.tensor([-1, 3])), ValueError, r"seq_lens must be in \[0, 12\]"),
    (replace(4, torch.tensor([5.0, 3.0])), TypeError, "seq_lens must be an integer tensor"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), ERRORS)
def test_paged_attention_bad_inputs(arguments, error, message):
    with pytest.raises(error, match=message):
        mha.paged_attention(*arguments)


def test_paged_cache_bad_inputs():
    cache, _, _ = filled_cache([3, 3])
    with pytest.raises(ValueError, match=r"the cache holds 2 sequences, got keys for 1"):
        cache.update(randn(1, 2, 1, 8), randn(1, 2, 1, 8))
    with pytest.raises(ValueError, match=r"sequences must be in \[0, 2\), got 2"):
        cache.update(randn(1, 2, 1, 8), randn(1, 2, 1, 8), sequences=[2])
    with pytest.raises(ValueError, match=r"name each sequence once, got \[0, 0\]"):
        cache.update(randn(2, 2, 1, 8), randn(2, 2, 1, 8), sequences=[0, 0])
    with pytest.raises(ValueError, match=r"length \(4\) must be at most sequence 1's 3"):
        cache.fork(1, length=4)
    with pytest.raises(ValueError, match=r"sequence must be in \[0, 2\), got 5"):
        cache.free_sequence(5)
    with pytest.raises(ValueError, match="block_size must be positive"):
        mha.PagedKVCache(block_size=0)
    small = mha.PagedKVCache(block_size=2, num_blocks=2)
    with pytest.raises(ValueError, match=r"out of blocks: 5 needed, num_blocks \(2\)"):
        small.update(randn(1, 1, 9, 4), randn(1, 1, 9, 4))
    assert small.seq_lens.tolist() == [] and small.block_table.shape == (0, 0)  # unchanged
    layer = mha.MultiHeadAttention(16, 2).eval()
    with pytest.raises(ValueError, match="PagedKVCache is read through paged_attention"):
        layer(torch.randn(1, 2, 16), need_weights=True, kv_cache=mha.PagedKVCache())
    rope = mha.MultiHeadAttention(16, 2, rope=True).eval()
    ragged = mha.PagedKVCache(block_size=4)
    for n in (2, 3):
        ragged.update(
            torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), sequences=[ragged.add_sequence()]
        )
    with pytest.raises(ValueError, match=r"different numbers of positions \(\[2, 3\]\)"):
        rope(torch.randn(2, 1, 16), kv_cache=ragged)  # RoPE's positions go on after len(cache)
    plain = mha.MultiHeadAttention(16, 2).eval()  # without RoPE a ragged batch is fine
    assert plain(torch.randn(2, 1, 16), is_causal=True, kv_cache=ragged)[0].shape == (2, 1, 16)
    assert ragged.seq_lens.tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"serves inference: attention dropout must be 0"):
        mha.MultiHeadAttention(16, 2, dropout=0.5)(torch.randn(2, 1, 16), kv_cache=ragged)
    assert ragged.seq_lens.tolist() == [3, 4]  # refused before anything was stored


# --- any sequence of operations ------------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "fork", "decode", "chunk", "free", "truncate"]),
        st.integers(0, 10),
        st.integers(0, 10),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 3, 4]))
def test_any_sequence_of_operations_reads_back_each_sequence(ops, block_size):
    """Admit, fork, decode, write chunks, free and truncate in any order: every live sequence
    reads back as its own keys (SDPA over a plain list of them), and the blocks in use are
    exactly the distinct blocks the table names."""
    cache = mha.PagedKVCache(block_size)
    mine: list[tuple[torch.Tensor, torch.Tensor]] = []  # each live sequence's keys and values
    seed = 0
    for op, a, b in ops:
        seed += 1
        n = len(mine)
        if op == "add" or n == 0:
            cache.add_sequence()
            mine.append((randn(1, 2, 0, 4), randn(1, 2, 0, 4)))
        elif op == "fork":
            src = a % n
            length = b % (mine[src][0].shape[2] + 1)
            cache.fork(src, length)
            mine.append(tuple(t[:, :, :length] for t in mine[src]))
        elif op in ("decode", "chunk"):
            rows = list(range(n)) if op == "decode" else [a % n]
            S_new = 1 if op == "decode" else b % 6
            k = randn(len(rows), 2, S_new, 4, seed=seed)
            v = randn(len(rows), 2, S_new, 4, seed=seed + 1000)
            cache.update(k, v, sequences=rows)
            for i, r in enumerate(rows):
                mine[r] = (
                    torch.cat([mine[r][0], k[i : i + 1]], 2),
                    torch.cat([mine[r][1], v[i : i + 1]], 2),
                )
        elif op == "free":
            cache.free_sequence(a % n)
            mine.pop(a % n)
        else:  # truncate
            r = a % n
            length = b % (mine[r][0].shape[2] + 1)
            cache.truncate(r, length)
            mine[r] = tuple(t[:, :, :length] for t in mine[r])
        assert cache.seq_lens.tolist() == [k.shape[2] for k, _ in mine]
        table = cache.block_table
        assert cache.blocks_in_use == len(set(table[table >= 0].tolist()))
    if mine and cache.key_pool is not None:
        query = randn(len(mine), 4, 1, 4, seed=7)
        out = mha.paged_attention(
            query, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
        )
        assert_close(out, sdpa_per_sequence(query, [k for k, _ in mine], [v for _, v in mine]))


def test_paged_attention_takes_a_strided_pool_and_int32_lengths():
    cache, keys, values = filled_cache([6, 11])
    wide = torch.zeros(cache.key_pool.shape[0], 2, 4, 16, dtype=torch.float64)
    wide[..., ::2] = cache.key_pool  # a pool that is a strided view
    query = randn(2, 2, 1, 8, seed=2)
    out = mha.paged_attention(
        query, wide[..., ::2], cache.value_pool, cache.block_table, cache.seq_lens.int()
    )
    assert_close(out, sdpa_per_sequence(query, keys, values))


def test_paged_attention_gradients_match_finite_differences():
    """The tiles are gathered into reused buffers only when autograd does not need them (and the
    two-pass method, whose products write into its scores with ``out=``, declines)."""
    g = torch.Generator().manual_seed(5)
    opts = {"dtype": torch.float64, "requires_grad": True}
    query = torch.randn(2, 4, 1, 8, generator=g, **opts)
    key_pool = torch.randn(6, 2, 4, 8, generator=g, **opts)
    value_pool = torch.randn(6, 2, 4, 8, generator=g, **opts)
    table, lens = torch.tensor([[0, 3], [5, 1]]), torch.tensor([5, 8])
    assert torch.autograd.gradcheck(
        lambda q, k, v: mha.paged_attention(q, k, v, table, lens), (query, key_pool, value_pool)
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("S", [4096, 16384])
def test_paged_attention_working_memory_is_one_tile_at_any_length(S, path):
    """No tensor made inside holds a whole sequence's keys, and the largest stays the same size
    (one tile of TILE_KEYS numbers) when the sequences grow four times longer, by either method
    (the whole rows of scores are at most one tile too)."""
    from test_paged_varlen import _NewMemory

    B, H, Hkv, D = 2, 4, 2, 64
    cache = mha.PagedKVCache(block_size=16)
    cache.update(randn(B, Hkv, S, D, seed=1), randn(B, Hkv, S, D, seed=2))
    args = (randn(B, H, 1, D, seed=3), cache.key_pool, cache.value_pool)
    with _NewMemory(args[1:]) as seen, on_path(path):
        mha.paged_attention(*args, cache.block_table, cache.seq_lens)
    assert seen.largest[0] == mha.paged.TILE_KEYS < S * Hkv * D, seen.largest


def test_whole_rows_only_where_the_scores_fit_in_one_tile():
    """The two-pass method takes a decode step whose scores fit in TILE_KEYS numbers and declines
    one that does not (the running state then runs), and a step that autograd must see."""
    rows = mha.chunked_prefill._paged_attention_rows
    cache, _, _ = filled_cache([40, 7], Hkv=2, D=8, Dv=8)
    args = (cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens, 0.3)
    assert rows(randn(2, 4, 1, 8, seed=1), *args) is not None
    fits = mha.chunked_prefill.TILE_KEYS // (2 * 4 * 40)  # query rows whose scores still fit
    assert rows(randn(2, 4, fits // 2, 8, seed=1), *args) is not None
    assert rows(randn(2, 4, fits + 1, 8, seed=1), *args) is None
    assert rows(randn(2, 4, 1, 8, seed=1).requires_grad_(), *args) is None
