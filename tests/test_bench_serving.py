"""tools/bench_serving.py: the prefix-caching prediction and FlexAttention's paged attention."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import mha

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_serving  # noqa: E402 (tools/ is not a package: it joins the path first)


def test_predicted_reuse_counts_whole_shared_blocks_and_leaves_one_token():
    system = list(range(100, 110))  # 10 tokens: 2 whole blocks of 4
    prompts = [
        system + [1, 2],  # first: nothing cached
        system + [3],  # shares 10 tokens: 2 whole blocks
        system[:8],  # 8 tokens, all cached, but its last token is computed: 1 block
        [0] + system[1:] + [1, 2],  # differs at token 0: nothing
        system + [1, 2, 5, 6, 7],  # shares 12 tokens with the first prompt: 3 blocks
    ]
    assert bench_serving.predicted_reuse(prompts, 4) == [0, 8, 4, 0, 12]


def _ragged_cache(g: torch.Generator) -> tuple[mha.PagedKVCache, list, list]:
    """Four sequences of 5, 12, 1 and 9 positions, written token by token in turns, so their
    blocks interleave in the pool; their keys and values as contiguous tensors too."""
    cache = mha.PagedKVCache(block_size=4)
    lens, Hkv, D = [5, 12, 1, 9], 2, 8
    ks = [torch.randn(1, Hkv, n, D, generator=g) for n in lens]
    vs = [torch.randn(1, Hkv, n, D, generator=g) for n in lens]
    for _ in lens:
        cache.add_sequence()
    for t in range(max(lens)):
        for b, n in enumerate(lens):
            if t < n:
                cache.update(ks[b][:, :, t : t + 1], vs[b][:, :, t : t + 1], sequences=[b])
    return cache, ks, vs


def test_flex_paged_attention_equals_sdpa_per_sequence():
    g = torch.Generator().manual_seed(0)
    cache, ks, vs = _ragged_cache(g)
    assert cache.block_table[1].tolist() == [1, 5, 7]  # scattered: the test means something
    q = torch.randn(len(ks), 4, 1, 8, generator=g)  # H=4 query heads on Hkv=2
    assert cache.key_pool is not None and cache.value_pool is not None
    with warnings.catch_warnings():  # eager flex_attention: "without torch.compile" warnings
        warnings.simplefilter("ignore")
        out = bench_serving.flex_paged_attention(
            q, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
        )
    for b, (k, v) in enumerate(zip(ks, vs)):
        want = F.scaled_dot_product_attention(q[b : b + 1], k, v, enable_gqa=True)
        torch.testing.assert_close(out[b : b + 1], want)


def test_flex_block_mask_lists_exactly_each_sequences_blocks():
    cache, _, _ = _ragged_cache(torch.Generator().manual_seed(0))
    table, lens = cache.block_table, cache.seq_lens
    N, Hkv, bs = 9, 2, 4
    mask = bench_serving.flex_paged_block_mask(table, lens, N, Hkv, bs, 2)
    dense = mask.to_dense()[:, :, 0]  # (B, Hkv, N·Hkv): which mask blocks each row reads
    for b, n in enumerate(lens.tolist()):
        blocks = table[b, : -(-n // bs)].tolist()
        for h in range(Hkv):
            want = sorted(p * Hkv + h for p in blocks)  # head h of each of b's blocks
            assert dense[b, h].nonzero().flatten().tolist() == want, (b, h)
    assert mask.full_kv_num_blocks is not None
    assert mask.full_kv_num_blocks[:, 0, 0].tolist() == [1, 3, 0, 2]  # blocks read unmasked


def _decode_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mha.PagedKVCache]:
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 32, 8, generator=g), torch.randn(2, 2, 32, 8, generator=g)
    cache = mha.PagedKVCache(block_size=16)
    cache.update(k, v)
    return torch.randn(2, 4, 1, 8, generator=g), k, v, cache


def test_flex_peer_is_skipped_with_a_reason_in_quick_mode():
    lines = bench_serving.flex_paged_decode(*_decode_inputs(), quick=True, pairs=1, run_time=0.01)
    assert len(lines) == 1 and isinstance(lines[0], str)
    assert (
        lines[0].startswith("[SKIP] FlexAttention paged (compiled) / SDPA")
        and "--quick" in lines[0]
    )


def test_flex_peer_is_skipped_when_compiling_fails(monkeypatch):
    def no_compiler(fn, **kwargs):
        def fails(*args, **kw):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    lines = bench_serving.flex_paged_decode(*_decode_inputs(), quick=False, pairs=1, run_time=0.01)
    assert lines == [
        "[SKIP] FlexAttention paged (compiled) / SDPA over a contiguous cache time, B=2 H=4 "
        "Hkv=2 D=8 S=32: torch.compile failed on this machine (RuntimeError: no C++ compiler "
        "found)"
    ]
