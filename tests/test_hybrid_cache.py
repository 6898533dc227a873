"""HybridCache: each kind of layer gets its cache, requests are admitted and freed in all of them
at once, and the bytes per kind follow the rules of each (full grows, sliding is bounded, linear
is constant)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mha
from mha.hybrid_cache import LAYER_KINDS
from mha.models.gated_deltanet import GatedDeltaNet

Hkv, D, E = 2, 4, 16


def linear_layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    net = GatedDeltaNet(E, 2, 4, 8, 6, conv_kernel=4).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return net


def feed(cache: mha.HybridCache, nets: dict[int, GatedDeltaNet], request: int, n: int) -> None:
    """Write n new positions of ``request`` into every layer (random keys, values and inputs)."""
    for i in range(len(cache)):
        layer_cache = cache[i]
        if isinstance(layer_cache, mha.RecurrentStatePool):
            x = torch.randn(1, n, E, dtype=torch.float64)
            with torch.no_grad():
                layer_cache.step(nets[i], x, [cache.slot(request)])
        else:
            k = torch.randn(1, Hkv, n, D, dtype=torch.float64)
            layer_cache.update(k, k, sequences=[cache.row(request)])


def test_each_kind_of_layer_gets_its_cache_and_its_bytes():
    cache = mha.HybridCache(["sliding", "full", "linear", "full"], window=8, block_size=4)
    assert isinstance(cache[0], mha.SlidingWindowPagedCache) and cache[0].window == 8
    assert type(cache[1]) is mha.PagedKVCache and type(cache[3]) is mha.PagedKVCache
    assert isinstance(cache[2], mha.RecurrentStatePool) and len(cache) == 4
    nets = {2: linear_layer()}
    a = cache.add_sequence()
    feed(cache, nets, a, 5)
    sizes = []
    for _ in range(60):  # decode
        feed(cache, nets, a, 1)
        sizes.append(cache.nbytes_by_kind())
    per_block = 2 * Hkv * 4 * D * 8  # a block of keys and values, float64
    assert sizes[-1]["full"] == 2 * math.ceil(66 / 4) * per_block  # two full layers, all blocks
    assert max(s["sliding"] for s in sizes) <= (math.ceil(8 / 4) + 1) * per_block
    assert len({s["linear"] for s in sizes}) == 1 and sizes[0]["linear"] > 0  # constant
    assert cache.nbytes == sum(sizes[-1].values())


def test_requests_admitted_at_different_times_and_freed_reuse_rows_slots_and_blocks():
    cache = mha.HybridCache(["linear", "linear", "sliding", "full"], window=6, block_size=2)
    nets = {0: linear_layer(0), 1: linear_layer(1)}
    a = cache.add_sequence()
    feed(cache, nets, a, 7)
    b = cache.add_sequence()
    feed(cache, nets, b, 3)
    for _ in range(10):  # both decode
        feed(cache, nets, a, 1)
        feed(cache, nets, b, 1)
    assert (cache.row(a), cache.row(b)) == (0, 1) and cache.slot(a) != cache.slot(b)
    for layer in (cache[2], cache[3]):
        assert isinstance(layer, mha.PagedKVCache)
        assert layer.seq_lens.tolist() == [17, 13]
    sliding = cache[2]
    assert isinstance(sliding, mha.SlidingWindowPagedCache) and sliding.freed_blocks > 0
    pool = cache[0]
    assert isinstance(pool, mha.RecurrentStatePool)
    assert (pool.tokens(cache.slot(a)), pool.tokens(cache.slot(b))) == (17, 13)
    slot_a, table_b = cache.slot(a), sliding.block_table[1].tolist()
    cache.free_sequence(a)
    assert cache.requests == [b] and cache.row(b) == 0  # b's row moved up, in every table
    assert sliding.block_table[0].tolist() == table_b[: sliding.block_table.shape[1]]
    assert pool.nbytes == cache.nbytes_by_kind()["linear"] // 2  # one request in each of two
    c = cache.add_sequence()
    assert cache.slot(c) == slot_a and pool.tokens(slot_a) == 0  # a's slot, started afresh
    assert sliding.key_pool is not None
    size, held_by_b = len(sliding.key_pool), {x for x in table_b if x >= 0}
    feed(cache, nets, c, 2)
    assert sliding.block_table[1, 0].item() not in held_by_b  # a block given back earlier ...
    assert len(sliding.key_pool) == size  # ... taken from the pool, which did not grow
    with pytest.raises(ValueError, match="live request"):
        cache.row(a)


@settings(max_examples=20, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(LAYER_KINDS), min_size=1, max_size=4),
    window=st.integers(1, 12),
    bs=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "free", "feed"]), st.integers(0, 9)), max_size=30
    ),
)
def test_any_admissions_and_frees_keep_every_layer_in_step(kinds, window, bs, ops):
    cache = mha.HybridCache(kinds, window=window, block_size=bs, num_slots=3)
    nets = {i: linear_layer(i) for i, k in enumerate(kinds) if k == "linear"}
    fed: dict[int, int] = {}
    for op, n in ops:
        live = cache.requests
        if op == "add" and ("linear" not in kinds or len(live) < 3):
            fed[cache.add_sequence()] = 0
        elif op == "free" and live:
            cache.free_sequence(live[n % len(live)])
        elif op == "feed" and live:
            r = live[n % len(live)]
            feed(cache, nets, r, n % 3 + 1)
            fed[r] += n % 3 + 1
        live = cache.requests
        for layer in cache.layers:
            if isinstance(layer, mha.PagedKVCache):
                assert layer.seq_lens.tolist() == [fed[r] for r in live]
            else:
                assert [layer.tokens(cache.slot(r)) for r in live] == [fed[r] for r in live]
            if isinstance(layer, mha.SlidingWindowPagedCache):  # a chunk of up to 3 added
                bound = math.ceil((window - 1 + 3) / bs) + 1
                assert all(layer.blocks_held(row) <= bound for row in range(len(live)))
    if not cache.requests:
        assert cache.nbytes == 0


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="layer_types"):
        mha.HybridCache(["full", "mamba"])
    with pytest.raises(TypeError, match="layer_types"):
        mha.HybridCache("full")
    with pytest.raises(ValueError, match="at least one layer"):
        mha.HybridCache([])
    with pytest.raises(ValueError, match="window"):
        mha.HybridCache(["sliding", "full"])
    with pytest.raises(ValueError, match="window"):
        mha.HybridCache(["sliding"], window=0)
    with pytest.raises(ValueError, match="num_slots"):
        mha.HybridCache(["linear"], num_slots=0)
    cache = mha.HybridCache(["linear", "full"], num_slots=1)
    cache.add_sequence()
    with pytest.raises(ValueError, match="all 1 state slots"):
        cache.add_sequence()
    paged = cache[1]
    assert isinstance(paged, mha.PagedKVCache) and paged.block_table.shape[0] == 1  # not admitted
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        cache[2]
    with pytest.raises(ValueError, match="live request"):
        cache.free_sequence(7)
    with pytest.raises(ValueError, match="no linear layers"):
        full = mha.HybridCache(["full"])
        full.slot(full.add_sequence())


def test_the_exercises_references_count_what_the_caches_do():
    from mha.exercises.ch09 import hybrid

    cache = mha.SlidingWindowPagedCache(10, 4)
    cache.add_sequence()
    for n in [7, 1, 3, 1, 1, 5, 1, 12, 1, 1, 2]:
        table, seq_len = cache.block_table[0].tolist(), int(cache.seq_lens[0])
        want = hybrid._free_reference(table, seq_len, n, 10, 4)
        k = torch.randn(1, Hkv, n, D)
        cache.update(k, k)
        now = cache.block_table[0].tolist()
        assert [b for b, c in zip(table, now) if b >= 0 and c < 0] == want
    kinds = ["linear", "sliding", "full", "sliding"]
    stack = mha.HybridCache(kinds, window=9, block_size=4)
    nets = {0: linear_layer()}
    r = stack.add_sequence()
    feed(stack, nets, r, 11)
    for seq_len in range(12, 40):
        feed(stack, nets, r, 1)
        pool = stack[0]
        assert isinstance(pool, mha.RecurrentStatePool)
        expected = hybrid._bytes_reference(kinds, seq_len, 9, 4, 2 * Hkv * D * 8, pool.nbytes)
        assert stack.nbytes_by_kind() == expected
