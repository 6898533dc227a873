"""paged_varlen_attention: a mixed batch of prompt chunks and decode steps over the paged pool
equals, per sequence, SDPA over that sequence's keys with the causal mask aligned bottom-right."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

import mha


def shuffled_pool(lengths, Hkv, D, Dv, block_size, seed=0, dtype=torch.float64, spare=3):
    """A pool whose blocks are handed out in a random order, and its table (-1 past the end)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in lengths]
    N = sum(need) + spare
    key_pool = torch.randn(N, Hkv, block_size, D, generator=g, dtype=dtype)
    value_pool = torch.randn(N, Hkv, block_size, Dv, generator=g, dtype=dtype)
    perm = torch.randperm(N, generator=g)
    table = torch.full((len(lengths), max(need, default=0) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    return key_pool, value_pool, table


def keys_of(pool, table, b, n):
    """Sequence ``b``'s first ``n`` keys, read out of the pool: (Hkv, n, D)."""
    bs = pool.shape[2]
    blocks = table[b, : math.ceil(n / bs)].long()
    return pool[blocks].transpose(0, 1).flatten(1, 2)[:, :n]  # (Hkv, n, D)


def reference(
    query, key_pool, value_pool, table, counts, lens, scale=None, sinks=None, window=None
):
    """Per sequence: SDPA of its queries (the last n_b positions) over its first seq_lens keys,
    causal bottom-right (and the window), torch's SDPA or, with sinks, mha's."""
    outs, start = [], 0
    for b, (n, S) in enumerate(zip(counts, lens)):
        q = query[start : start + n].transpose(0, 1)  # (H, n, D)
        start += n
        if n == 0:
            continue
        k, v = keys_of(key_pool, table, b, S), keys_of(value_pool, table, b, S)
        i = torch.arange(S - n, S)[:, None]  # the queries' positions
        j = torch.arange(S)[None, :]
        keep = j <= i
        if window is not None:
            keep &= j > i - window
        if sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, keep, scale=scale, enable_gqa=True)
        else:
            out = mha.scaled_dot_product_attention(
                q, k, v, keep, scale=scale, enable_gqa=True, sinks=sinks
            )
        outs.append(out.transpose(0, 1))  # (n, H, Dv)
    H, Dv = query.shape[1], value_pool.shape[-1]
    return torch.cat(outs) if outs else query.new_zeros(0, H, Dv)


def batch(counts, lens, H, Hkv, D=8, Dv=6, block_size=4, seed=0, dtype=torch.float64):
    """Packed queries and a pool holding the sequences' keys."""
    key_pool, value_pool, table = shuffled_pool(lens, Hkv, D, Dv, block_size, seed, dtype)
    query = randn(sum(counts), H, D, seed=seed + 1, dtype=dtype)  # (total_q, H, D)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_pool, value_pool, table, cu, torch.tensor(lens)


# A sequence of the batch: (cached positions, new queries); n = 0 sits the step out, n = 1 is a
# decode step, n > 1 a prompt chunk (the whole prompt when nothing is cached).
sequence = st.tuples(st.integers(0, 40), st.sampled_from([0, 1, 1, 2, 5, 17]))


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(sequence, min_size=1, max_size=5),
    groups=st.sampled_from([1, 2, 4]),
    Hkv=st.sampled_from([1, 2]),
    block_size=st.sampled_from([1, 3, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mixed_batch_equals_sdpa_over_each_sequence(
    seqs, groups, Hkv, block_size, window, with_sinks, seed
):
    counts = [n for _, n in seqs]
    lens = [c + n for c, n in seqs]
    H = Hkv * groups
    args = batch(counts, lens, H, Hkv, block_size=block_size, seed=seed)
    sinks = randn(H, seed=seed + 2) if with_sinks else None
    out = mha.paged_varlen_attention(*args, sinks=sinks, window=window)
    query, key_pool, value_pool, table, _, _ = args
    want = reference(query, key_pool, value_pool, table, counts, lens, None, sinks, window)
    assert out.shape == (sum(counts), H, 6)
    assert_close(out, want)


def test_scale_and_a_shuffled_pool_of_long_sequences():
    """More blocks than one step of the loop reads, a chunk crossing block boundaries."""
    counts, lens = [1, 300, 0, 1, 37], [700, 640, 5, 1, 37]
    args = batch(counts, lens, H=4, Hkv=1, D=16, Dv=16, block_size=8, seed=5)
    assert math.ceil(700 / 8) > 2 * mha.chunked_prefill.MAX_BLOCKS_PER_STEP
    out = mha.paged_varlen_attention(*args, scale=0.3)
    query, key_pool, value_pool, table, _, _ = args
    assert_close(out, reference(query, key_pool, value_pool, table, counts, lens, scale=0.3))


def test_chunked_prefill_through_a_paged_cache_equals_one_causal_pass():
    """As an engine runs it: every step writes the new tokens into the pool, then one call
    attends for prompt chunks and decode steps alike; the outputs of all the steps together
    equal one causal pass over each whole sequence."""
    H, Hkv, D = 4, 2, 8
    prompts, decodes, chunk = [13, 5, 21], 4, 6
    total = [p + decodes for p in prompts]
    keys = [randn(Hkv, n, D, seed=10 + b) for b, n in enumerate(total)]
    values = [randn(Hkv, n, D, seed=20 + b) for b, n in enumerate(total)]
    queries = [randn(n, H, D, seed=30 + b) for b, n in enumerate(total)]
    cache = mha.PagedKVCache(block_size=4)
    for _ in prompts:
        cache.add_sequence()
    done, outs = [0, 0, 0], [[], [], []]
    while done != total:
        # prompts advance by chunks of 6, then decode one token per step
        new = [min(chunk if d < p else 1, t - d) for d, p, t in zip(done, prompts, total)]
        rows = [b for b, n in enumerate(new) if n]
        for b in rows:  # (a sequence's step written on its own: lengths differ)
            k, v = keys[b][:, done[b] : done[b] + new[b]], values[b][:, done[b] : done[b] + new[b]]
            cache.update(k[None], v[None], sequences=[b])
        q = torch.cat([queries[b][done[b] : done[b] + new[b]] for b in range(3)])
        cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        out = mha.paged_varlen_attention(
            q, cache.key_pool, cache.value_pool, cache.block_table, cu, cache.seq_lens
        )
        for b, part in enumerate(out.split(new)):
            outs[b].append(part)
            done[b] += new[b]
    for b in range(3):
        want = F.scaled_dot_product_attention(
            queries[b].transpose(0, 1), keys[b], values[b], is_causal=True, enable_gqa=True
        ).transpose(0, 1)
        assert_close(torch.cat(outs[b]), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_as_close_as_sdpa(dtype):
    """Float16/bfloat16: statistics in float32, an error against float64 no worse than SDPA's."""
    counts, lens = [1, 9, 1], [37, 30, 5]
    args = batch(counts, lens, H=4, Hkv=2, D=16, Dv=16, seed=7)
    query, key_pool, value_pool, table, cu, seq_lens = args
    gold = reference(query, key_pool, value_pool, table, counts, lens)
    low = [t.to(dtype) for t in (query, key_pool, value_pool)]
    out = mha.paged_varlen_attention(low[0], low[1], low[2], table, cu, seq_lens)
    ref = reference(low[0], low[1], low[2], table, counts, lens)
    assert out.dtype == dtype
    err, ref_err = (out.double() - gold).abs().max(), (ref.double() - gold).abs().max()
    assert err <= 2 * ref_err + 1e-3


def test_a_window_reads_no_block_before_it():
    """Blocks that fell out of every query's window may be freed (-1 in the table)."""
    counts, lens = [1, 3], [40, 23]
    args = batch(counts, lens, H=2, Hkv=1, block_size=4, seed=3)
    query, key_pool, value_pool, table, cu, seq_lens = args
    want = mha.paged_varlen_attention(*args, window=6)
    freed = table.clone()
    freed[0, : (40 - 6) // 4] = -1  # sequence 0's query at 39 sees 34..39: blocks 8 and 9
    freed[1, : (23 - 3 - 6 + 1) // 4] = -1  # sequence 1's first query at 20 sees 15..20
    assert_close(
        mha.paged_varlen_attention(query, key_pool, value_pool, freed, cu, seq_lens, window=6), want
    )


class _NewMemory(TorchFunctionMode):
    """Records the largest tensor made inside that is not a view of ``inputs`` (a view of the
    pool, e.g. the pool seen as rows, costs no memory)."""

    def __init__(self, inputs) -> None:
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.largest: tuple[int, tuple[int, ...]] = (0, ())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.inputs:
                self.largest = max(self.largest, (t.numel(), tuple(t.shape)))
        return out


def test_working_memory_never_holds_a_whole_sequence():
    """No tensor made inside is as large as one sequence's keys (or one chunk's scores)."""
    H, Hkv, D, S = 2, 1, 8, 4096
    counts, lens = [1, 32, 1], [S, S, 100]
    args = batch(counts, lens, H, Hkv, D=D, Dv=D, block_size=16, dtype=torch.float32)
    query, key_pool, value_pool, table, _, _ = args
    with _NewMemory(args) as seen:
        out = mha.paged_varlen_attention(*args)
    whole = S * Hkv * D  # one sequence's keys; the chunk's scores, 2·32·4096, are more still
    assert 0 < seen.largest[0] < whole, seen.largest  # a tile: 64 score rows by 256 keys
    assert_close(out, reference(query, key_pool, value_pool, table, counts, lens))
    with _NewMemory(args) as seen:  # the guard does see a whole sequence gathered at once
        keys_of(key_pool, table, 0, S).contiguous()
    assert seen.largest[0] >= whole


class _CountMatmuls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_decode_steps_of_all_sequences_run_together():
    """Eight decode steps cost the loop of one: the same number of matrix products."""

    def matmuls(B):
        args = batch([1] * B, [200] * B, H=4, Hkv=2, block_size=16)
        with _CountMatmuls() as mode:
            mha.paged_varlen_attention(*args)
        return mode.calls

    assert matmuls(8) == matmuls(1)


def _args():
    """Valid arguments: two sequences, a chunk of 3 and a decode step, H 4, Hkv 2, D 8."""
    key_pool, value_pool = torch.zeros(6, 2, 4, 8), torch.zeros(6, 2, 4, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    return [torch.randn(4, 4, 8), key_pool, value_pool, table, cu, torch.tensor([9, 12])]


def replace(i, value):
    args = _args()
    args[i] = value
    return args


ERRORS = [
    (replace(0, torch.randn(4, 4, 1, 8)), ValueError, r"query must have 3 dims \(total_q, H, D\)"),
    (replace(0, torch.randn(4, 3, 8)), ValueError, r"query heads \(3\) must be a multiple.*\(2\)"),
    (replace(0, torch.randn(4, 4, 16)), ValueError, r"query's D.*query \(4, 4, 16\)"),
    (replace(0, torch.randn(4, 4, 8).double()), TypeError, "one dtype, got torch.float64"),
    (replace(0, torch.randn(5, 4, 8)), ValueError, r"cu_seqlens_q must end at.*query \(5\)"),
    (replace(1, torch.zeros(6, 2, 8)), ValueError, r"key_pool must have 4 dims"),
    (replace(2, torch.zeros(6, 2, 5, 8)), ValueError, r"value_pool \(6, 2, 5, 8\)"),
    (replace(3, torch.zeros(2, 3)), TypeError, "block_table must be an integer tensor"),
    (replace(3, torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"B = 2.*block_table \(3, 3\)"),
    (
        replace(3, torch.tensor([[0, 1, 2], [3, 6, 0]], dtype=torch.int32)),
        ValueError,
        r"block numbers in \[0, 6\).*from 0 to 6",
    ),
    (replace(4, torch.tensor([0, 3, 4])), TypeError, "cu_seqlens_q must be an int32 tensor"),
    (
        replace(4, torch.tensor([0, 4, 3], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_q must be non-decreasing",
    ),
    (replace(5, torch.tensor([9, 13])), ValueError, r"seq_lens must be in \[0, 12\].*\[9, 13\]"),
    (replace(5, torch.tensor([2, 12])), ValueError, r"sequence 0 has 3 queries.*seq_lens\[0\] = 2"),
    (replace(5, torch.tensor([9.0, 12.0])), TypeError, "seq_lens must be an integer tensor"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), ERRORS)
def test_bad_inputs(arguments, error, message):
    with pytest.raises(error, match=message):
        mha.paged_varlen_attention(*arguments)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"window": 0}, ValueError, "window must be positive, got 0"),
        ({"window": 2.0}, TypeError, "window must be an int"),
        (
            {"sinks": torch.zeros(2)},
            ValueError,
            r"sinks must hold one logit per query head, shape \(4,\), got \(2,\)",
        ),
        (
            {"sinks": torch.zeros(4, dtype=torch.int64)},
            TypeError,
            "sinks must have a floating dtype",
        ),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ],
)
def test_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        mha.paged_varlen_attention(*_args(), **options)


def test_a_strided_pool_and_gradients():
    """A pool that is a slice of a larger one is read without copying it whole; the output is
    differentiable in the query and the pools, with SDPA's gradients."""
    counts, lens = [2, 1], [9, 6]
    query, key_pool, value_pool, table, cu, seq_lens = batch(counts, lens, H=4, Hkv=2)
    wide = torch.cat([key_pool, key_pool], -1)[..., :8]  # (N, Hkv, bs, 8), not contiguous
    assert not wide.is_contiguous()
    inputs = [t.clone().requires_grad_() for t in (query, wide, value_pool)]
    out = mha.paged_varlen_attention(inputs[0], inputs[1], inputs[2], table, cu, seq_lens)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_inputs = [t.clone().requires_grad_() for t in (query, key_pool, value_pool)]
    want = reference(*ref_inputs, table, counts, lens)
    assert_close(out, want)
    for got, expected in zip(grads, torch.autograd.grad(want.square().sum(), ref_inputs)):
        assert_close(got, expected)
