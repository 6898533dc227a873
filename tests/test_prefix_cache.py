"""Prefix caching in PagedKVCache: full blocks known by a chained hash of their tokens, reused by
later prompts, kept after their sequence ends and evicted least recently used first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import mha

HKV, D = 2, 4


def kv(tokens, seed=0):
    """Keys and values that depend on (token id, position) only, as a model's first layer's do
    without attention: the same prefix always gives the same cache."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(2, 50, HKV, D, generator=g, dtype=torch.float64)  # per token id
    pos = torch.randn(2, 1, HKV, D, generator=g, dtype=torch.float64)  # times position
    ids = torch.as_tensor(tokens, dtype=torch.long)
    t = torch.arange(len(tokens), dtype=torch.float64)[:, None, None]
    k, v = table[:, ids] + torch.sin(t * pos)  # (2, T, Hkv, D) each
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, Hkv, T, D)


def admit(cache, tokens):
    """Admit a prompt with its token ids and write what the cache did not have."""
    row = cache.add_sequence(tokens)
    start = int(cache.seq_lens[row])
    k, v = kv(tokens)
    cache.update(k[:, :, start:], v[:, :, start:], sequences=[row])
    return row, start


def reads_back(cache, row, tokens):
    """paged_attention over the row equals SDPA over the keys of its tokens."""
    q = randn(1, 2 * HKV, 1, D, seed=len(tokens))
    k, v = kv(tokens)
    got = mha.paged_attention(
        q,
        cache.key_pool,
        cache.value_pool,
        cache.block_table[row : row + 1],
        cache.seq_lens[row : row + 1],
    )
    assert_close(got, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_hashes_chain_over_the_whole_prefix():
    cache = mha.PagedKVCache(block_size=4, prefix_caching=True)
    a = cache.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # two full blocks; the ninth token's block is partial
    b = cache.block_hashes([1, 2, 3, 4, 5, 6, 7, 0])
    assert a[0] == b[0] and a[1] != b[1]
    c = cache.block_hashes([0, 2, 3, 4, 5, 6, 7, 8])  # block 1 equal, block 0 not
    assert c[0] != a[0] and c[1] != a[1]  # block 1's hash names the prefix before it too
    assert cache.block_hashes(torch.tensor([1, 2, 3, 4])) == a[:1]
    assert cache.block_hashes([1, 2, 3]) == []


def test_reuse_finds_the_longest_whole_block_prefix_and_counts_hits():
    cache = mha.PagedKVCache(block_size=4, prefix_caching=True)
    first = list(range(11))  # blocks [0..3], [4..7] full, [8, 9, 10] partial
    row, start = admit(cache, first)
    assert start == 0 and cache.cached_blocks == 2
    assert (cache.prefix_queries, cache.prefix_hits) == (2, 0)
    cases = [  # (prompt, positions reused)
        (first[:6] + [40, 41, 42], 4),  # the second block differs
        (first[:8] + [30, 31], 8),  # both full blocks
        (first[:8], 4),  # the whole prompt is cached: its last block is computed again
        (first[:9], 8),
        (first[:3], 0),  # shorter than a block
        ([5] + first[1:11], 0),  # the first token differs: nothing is shared
    ]
    for prompt, reused in cases:
        assert cache.cached_prefix(prompt) == reused
        r, start = admit(cache, prompt)
        assert start == reused
        shared = reused // 4
        assert cache.block_table[r, :shared].tolist() == cache.block_table[row, :shared].tolist()
        reads_back(cache, r, prompt)
    reads_back(cache, row, first)
    assert cache.prefix_hits == 1 + 2 + 1 + 2
    assert cache.prefix_queries == 2 + (2 + 2 + 1 + 2 + 0 + 2)


def test_finished_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    cache = mha.PagedKVCache(block_size=2, num_blocks=8, prefix_caching=True)
    prompts = {name: [i, i + 1, i + 2, i + 3, i + 4] for name, i in (("x", 0), ("y", 10))}
    rows = {name: admit(cache, p)[0] for name, p in prompts.items()}
    tables = {name: cache.block_table[r, :2].tolist() for name, r in rows.items()}
    cache.free_sequence(rows["x"])  # x's blocks: tail first in the LRU order
    cache.free_sequence(0)  # y
    assert cache.blocks_in_use == 0 and cache.cached_blocks == 4
    x, y = tables["x"], tables["y"]
    assert cache.evictable_blocks == [x[1], x[0], y[1], y[0]]
    # y comes back: its blocks are in use again, then most recently used
    row, start = admit(cache, prompts["y"])
    assert start == 4 and cache.evictable_blocks == [x[1], x[0]]
    cache.free_sequence(row)
    assert cache.evictable_blocks == [x[1], x[0], y[1], y[0]]
    # 4 free blocks hold nothing cached (2 never used, the 2 partial last blocks): taken first
    long = [40 + i for i in range(9)]
    new = cache.add_sequence(long)
    k, v = kv(long)
    cache.update(k[:, :, :8], v[:, :, :8], sequences=[new])  # 4 blocks
    assert cache.cached_blocks == 8 and cache.evictable_blocks == [x[1], x[0], y[1], y[0]]
    cache.update(k[:, :, 8:], v[:, :, 8:], sequences=[new])  # 1 more: x's tail is evicted
    assert cache.evictable_blocks == [x[0], y[1], y[0]] and cache.cached_blocks == 7
    assert cache.cached_prefix(prompts["x"]) == 2  # x's first block is still cached
    admit(cache, [30, 31, 32])  # 2 more blocks: x's head, then y's tail
    assert cache.evictable_blocks == [y[0]]
    assert cache.cached_prefix(prompts["x"]) == 0 and cache.cached_prefix(prompts["y"]) == 2
    reads_back(cache, new, long)


def test_a_block_in_use_is_never_evicted_or_overwritten():
    cache = mha.PagedKVCache(block_size=2, num_blocks=6, prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    a, _ = admit(cache, prompt)  # 3 blocks
    b, start = admit(cache, prompt[:4] + [9])  # shares 2, one of its own
    assert start == 4 and cache.blocks_in_use == 4
    cache.free_sequence(a)  # the shared blocks stay: b uses them
    b = 0
    assert cache.blocks_in_use == 3 and cache.evictable_blocks == []
    other = cache.add_sequence()
    with pytest.raises(ValueError, match=r"out of blocks: 4 more needed, 3 free"):
        cache.update(*kv([7] * 8), sequences=[other])  # needs b's blocks: refused, none taken
    cache.update(*(t[:, :, :6] for t in kv([7] * 8)), sequences=[other])
    reads_back(cache, b, prompt[:4] + [9])
    # truncating into a cached full block and writing there copies it first
    cache.free_sequence(1)
    shared_block = cache.block_table[b, 1].item()
    cache.truncate(b, 3)
    k, v = kv(prompt[:3] + [8])
    cache.update(k[:, :, 3:], v[:, :, 3:], sequences=[b])
    assert cache.block_table[b, 1].item() != shared_block  # written into a copy
    reads_back(cache, b, prompt[:3] + [8])
    again, start = admit(cache, prompt)  # the cached block kept its tokens' keys
    assert start == 4
    reads_back(cache, again, prompt)


def test_generated_tokens_given_to_update_are_cached_too():
    cache = mha.PagedKVCache(block_size=4, prefix_caching=True)
    prompt, generated = [1, 2, 3], [4, 5, 6, 7, 8]
    row, _ = admit(cache, prompt)
    k, v = kv(prompt + generated)
    for t in range(3, 8):  # decode, one token at a time, with its id
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], tokens=[[(prompt + generated)[t]]])
    assert cache.cached_blocks == 2
    cache.free_sequence(row)
    assert cache.cached_prefix(prompt + generated + [9]) == 8
    # without ids the new positions are written but not cached
    plain = cache.add_sequence(prompt)
    cache.update(k, v, sequences=[plain])
    assert cache.seq_lens[plain] == 8
    # (the growing pool took the 2 cached blocks, free, rather than grow: and cached nothing)
    assert cache.key_pool.shape[0] == 2 and cache.cached_blocks == 0
    with pytest.raises(ValueError, match=r"known for its first 3 of 8 positions only"):
        cache.update(k[:, :, :1], v[:, :, :1], sequences=[plain], tokens=[[9]])


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_a_reused_prefix_gives_the_outputs_of_recomputing_it(num_kv_heads):
    """Two requests share a 10-token system prompt: the second computes only its own tokens
    (through MultiHeadAttention with RoPE) and equals one causal pass over its whole prompt."""
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rope=True)
    layer = layer.to(torch.float64).eval()
    embed = randn(40, 32, seed=3)  # token id -> (E,)
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    first, second = system + [7, 8, 9], system + [20, 21, 22, 23, 24]
    cache = mha.PagedKVCache(block_size=4, prefix_caching=True)
    with torch.no_grad():
        cache.add_sequence(first)
        layer(embed[first][None], is_causal=True, kv_cache=cache)
        cache.free_sequence(0)
        row = cache.add_sequence(second)
        start = int(cache.seq_lens[row])
        assert start == 8  # two whole blocks of the system prompt
        x = embed[second][None]  # (1, 15, E)
        outs = [layer(x[:, start:12], is_causal=True, kv_cache=cache)[0]]  # a chunk
        outs += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache)[0] for t in (12, 13, 14)]
        full = layer(x, is_causal=True)[0]  # recomputing everything, no cache
    assert_close(torch.cat(outs, 1), full[:, start:])
    assert cache.prefix_hits == 2


def test_prefix_caching_bad_inputs():
    plain = mha.PagedKVCache(block_size=4)
    with pytest.raises(ValueError, match=r"tokens are for prefix caching: .*prefix_caching=True"):
        plain.add_sequence([1, 2])
    plain.add_sequence()
    with pytest.raises(ValueError, match=r"tokens are for prefix caching"):
        plain.update(*kv([1]), tokens=[[1]])
    assert plain.seq_lens.tolist() == [0]
    assert plain.cached_prefix([1, 2, 3, 4, 5]) == 0  # nothing is ever cached without it
    with pytest.raises(TypeError, match=r"prefix_caching must be a bool"):
        mha.PagedKVCache(prefix_caching=1)
    cache = mha.PagedKVCache(block_size=2, prefix_caching=True)
    for bad, error, message in [
        ([1, -2], ValueError, r"tokens must be non-negative int token ids, got -2"),
        ([1, 2.0], ValueError, r"non-negative int token ids, got 2\.0"),
        ([True], ValueError, r"non-negative int token ids, got True"),
        (torch.tensor([[1, 2]]), ValueError, r"tokens must have 1 dims?"),
        (torch.tensor([1.0]), TypeError, r"tokens must be an integer tensor, got dtype"),
        ("ab", TypeError, r"tokens must be token ids, a list of ints or a 1-D integer tensor"),
        (7, TypeError, r"got int"),
    ]:
        with pytest.raises(error, match=message):
            cache.add_sequence(bad)
    assert cache.seq_lens.tolist() == []
    row, _ = admit(cache, [1, 2, 3])
    k, v = kv([1, 2, 3, 4, 5])
    for tokens, message in [
        ([[4]], r"tokens\[0\] must hold S_new \(2\) token ids, got 1"),
        ([[4, 5], [6, 7]], r"tokens must hold the new token ids of each of the 1 sequences"),
        (torch.tensor([4, 5]), r"tokens must have 2 dims?"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.update(k[:, :, 3:], v[:, :, 3:], tokens=tokens)
    other = cache.add_sequence([1, 2, 3, 4])  # its ids are known ahead: 3 of 4 are new
    with pytest.raises(ValueError, match=r"disagree with sequence 1's token ids"):
        cache.update(k[:, :, 2:4], v[:, :, 2:4], sequences=[other], tokens=[[3, 9]])
    assert cache.seq_lens.tolist() == [3, 2]  # nothing written by the refused calls
    cache.update(k[:, :, 2:5], v[:, :, 2:5], sequences=[other], tokens=[[3, 4, 5]])
    assert cache.seq_lens.tolist() == [3, 5]
    reads_back(cache, other, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"no single length; read seq_lens"):
        len(cache)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "decode", "free", "truncate", "fork"]),
        st.integers(0, 3),
        st.integers(0, 12),
    ),
    min_size=1,
    max_size=30,
)


def apply(cache, live, op, a, b):
    """One operation on the cache and on ``live``, each live sequence's token ids."""
    if op == "admit" or not live:
        prompt = PREFIXES[a] + [10 + b] * (b % 4)
        row = cache.add_sequence(prompt)
        start = int(cache.seq_lens[row])
        k, v = kv(prompt)
        try:
            cache.update(k[:, :, start:], v[:, :, start:], sequences=[row])
        except ValueError:
            cache.free_sequence(row)
            raise
        live.append(prompt)
        return
    r = a % len(live)
    if op == "decode":
        token = 20 + b
        k, v = kv(live[r] + [token])
        cache.update(k[:, :, -1:], v[:, :, -1:], sequences=[r], tokens=[[token]])
        live[r] = live[r] + [token]
    elif op == "free":
        cache.free_sequence(r)
        live.pop(r)
    elif op == "truncate":
        length = b % (len(live[r]) + 1)
        cache.truncate(r, length)
        live[r] = live[r][:length]
    else:
        cache.fork(r)
        live.append(list(live[r]))


PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7, 7, 7], [1, 2]]


@settings(max_examples=40, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 2, 3]), bounded=st.booleans())
def test_any_sequence_of_operations_keeps_every_sequence_and_the_counts_right(
    ops, block_size, bounded
):
    """Admit prompts sharing prefixes, decode with token ids, free, truncate and fork in any
    order, in a small fixed pool or a growing one: every live sequence reads back its own
    keys, reference counts equal the table's entries, and a cached block holds its tokens' keys."""
    cache = mha.PagedKVCache(block_size, num_blocks=8 if bounded else None, prefix_caching=True)
    live: list[list[int]] = []
    seen: dict[str, list[int]] = {}  # every full block's hash so far -> the tokens up to it
    for op, a, b in ops:
        try:
            apply(cache, live, op, a, b)
        except ValueError as error:  # a full pool refuses, and changes nothing
            assert bounded and "out of blocks" in str(error)
        assert cache.seq_lens.tolist() == [len(t) for t in live]
        table = cache.block_table
        used = table[table >= 0].tolist()
        assert sum(cache._refs) == len(used)  # one reference per table entry
        assert cache.blocks_in_use == len(set(used))
        assert not set(cache.evictable_blocks) & set(used)  # never evictable while used
        for tokens in live:
            for j, h in enumerate(cache.block_hashes(tokens)):
                seen[h] = tokens[: (j + 1) * block_size]
    for r, tokens in enumerate(live):
        if tokens:
            reads_back(cache, r, tokens)
    assert cache.key_pool is not None or not cache._cached
    for h, block in cache._cached.items():  # a cached block holds its tokens' keys
        assert cache._block_hash[block] == h
        k, _ = kv(seen[h])
        assert_close(cache.key_pool[block], k[0, :, -block_size:], rtol=0, atol=0)
