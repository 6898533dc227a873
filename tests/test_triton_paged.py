"""The Triton paged-attention kernel (mha.triton_paged) against torch's SDPA over each sequence.

Without a GPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by the conftest before
Triton is first imported; see tests/test_triton_flash.py). Sizes stay small: the interpreter runs
every program of the grid one after the other in NumPy. Select with ``pytest -m triton``. The
mixed batches of triton_paged_varlen_attention are built, and checked per sequence, with the
helpers of tests/test_paged_varlen.py.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F
from test_paged_varlen import batch as varlen_batch
from test_paged_varlen import reference as varlen_reference
from torch.testing import assert_close

import mha
from mha.device import capabilities

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPS = capabilities(DEVICE)


@pytest.fixture(scope="module")
def tp(tf):
    """``mha.triton_paged``, imported under the same setting as the conftest's ``tf``."""
    if DEVICE == "cuda" and not CAPS.triton_native:
        pytest.skip(CAPS.triton_note)
    import mha.triton_paged as module

    if module.is_interpreted() != tf.is_interpreted():
        module = importlib.reload(module)
    return module


def paged_case(lengths, H, Hkv, D, Dv, block_size, dtype=torch.float32, seed=0):
    """Random pools with each sequence's blocks scattered; returns the kernel's arguments and,
    for the reference, each sequence's own keys and values."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    N = sum(need) + 3  # a few blocks no sequence uses
    key_pool = torch.randn(N, Hkv, block_size, D, generator=g)
    value_pool = torch.randn(N, Hkv, block_size, Dv, generator=g)
    order = torch.randperm(N, generator=g)
    table = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, (n, k) in enumerate(zip(lengths, need)):
        blocks = order[used : used + k]
        used += k
        table[b, :k] = blocks.int()
        keys.append(key_pool[blocks].transpose(0, 1).flatten(1, 2)[None, :, :n])  # (1, Hkv, n, D)
        values.append(value_pool[blocks].transpose(0, 1).flatten(1, 2)[None, :, :n])
    query = torch.randn(len(lengths), H, 1, D, generator=g)
    args = [query, key_pool, value_pool, table, torch.tensor(lengths)]
    args = [t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in args]
    return args, keys, values


def reference(query, keys, values, scale=None):
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                query[b : b + 1].double(), k.double(), v.double(), scale=scale, enable_gqa=True
            )
            for b, (k, v) in enumerate(zip(keys, values))
        ]
    ).float()  # (B, H, 1, Dv)


CASES = [
    # lengths,        H, Hkv, D,  Dv, block_size
    ([5, 33, 1], 4, 2, 16, 16, 16),  # GQA, ragged lengths, a partly filled last block
    ([17, 0], 2, 2, 8, 8, 4),  # an empty sequence gives zeros
    ([9, 24], 6, 2, 24, 40, 8),  # head dims that are not powers of two, Dv != D
    ([7], 3, 1, 16, 16, 5),  # MQA, a block size that is not a power of two
]


@pytest.mark.triton
@pytest.mark.parametrize(("lengths", "H", "Hkv", "D", "Dv", "block_size"), CASES)
def test_triton_paged_attention_equals_sdpa(tp, lengths, H, Hkv, D, Dv, block_size):
    args, keys, values = paged_case(lengths, H, Hkv, D, Dv, block_size)
    out = tp.triton_paged_attention(*args, scale=0.2)
    assert_close(out.cpu(), reference(args[0].cpu(), keys, values, scale=0.2), atol=1e-5, rtol=1e-4)
    assert_close(out, mha.paged_attention(*args, scale=0.2), atol=1e-5, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_paged_attention_low_precision(tp, dtype):
    args, keys, values = paged_case([13, 30], 4, 2, 16, 16, 8, dtype=dtype)
    out = tp.triton_paged_attention(*args)
    assert out.dtype == dtype
    gold = reference(args[0].cpu(), [k.to(dtype) for k in keys], [v.to(dtype) for v in values])
    assert_close(out.cpu().float(), gold, atol=2e-2, rtol=2e-2)


@pytest.mark.triton
def test_triton_paged_attention_reads_a_paged_cache(tp):
    cache = mha.PagedKVCache(block_size=4)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    cache.update(k.to(DEVICE), v.to(DEVICE))
    query = torch.randn(2, 4, 1, 8, generator=g).to(DEVICE)
    out = tp.triton_paged_attention(
        query, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens
    )
    want = F.scaled_dot_product_attention(query.cpu(), k, v, enable_gqa=True)
    assert_close(out.cpu(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
def test_triton_paged_attention_bad_inputs(tp):
    args, _, _ = paged_case([5, 9], 4, 2, 8, 8, 4)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple"):
        tp.triton_paged_attention(args[0][:, :3], *args[1:])
    with pytest.raises(ValueError, match=r"seq_lens must be in \[0, 16\]"):
        tp.triton_paged_attention(*args[:4], torch.tensor([5, 17], device=DEVICE))
    with pytest.raises(TypeError, match="query must be float16, bfloat16 or float32"):
        tp.triton_paged_attention(*(t.double() if t.is_floating_point() else t for t in args))


# --------------------------------------------- mixed batches: prompt chunks and decode steps


def varlen_case(seqs, H, Hkv, D, Dv, block_size, seed=0):
    """A mixed batch in float64 on the CPU: ``seqs`` holds (cached positions, new queries) per
    sequence; returns the kernel's arguments (the pool's blocks handed out in a random order, -1
    past each sequence) and the query counts and lengths."""
    counts = [n for _, n in seqs]
    lens = [c + n for c, n in seqs]
    return varlen_batch(counts, lens, H, Hkv, D=D, Dv=Dv, block_size=block_size, seed=seed), (
        counts,
        lens,
    )


def on_device(args, dtype=torch.float32):
    return [t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in args]


VARLEN_CASES = [
    # (cached, new) per sequence;              H, Hkv, D, Dv, block_size, window, sinks
    # a decode, a whole prompt, a sequence sitting the step out, a one-token sequence, a chunk
    ([(32, 1), (0, 40), (5, 0), (0, 1), (20, 3)], 4, 2, 8, 6, 4, None, False),
    # a chunk after a cached prefix, crossing blocks; D not a power of two, Dv != D; MQA
    ([(40, 1), (30, 37), (0, 0), (9, 2)], 4, 1, 24, 40, 16, 7, True),
    # blocks of one position; no GQA
    ([(3, 1), (0, 5), (9, 2)], 3, 3, 16, 16, 1, 3, True),
    # a chunk of several query tiles and key tiles, a block size that is not a power of two
    ([(10, 70)], 2, 2, 16, 16, 5, 20, False),
    # decode steps only (16-row tiles), eight query heads per key/value head
    ([(33, 1), (0, 1), (17, 1), (4, 0)], 8, 1, 16, 16, 16, None, True),
]


@pytest.mark.triton
@pytest.mark.parametrize(
    ("seqs", "H", "Hkv", "D", "Dv", "block_size", "window", "with_sinks"), VARLEN_CASES
)
def test_triton_paged_varlen_equals_sdpa_per_sequence(
    tp, seqs, H, Hkv, D, Dv, block_size, window, with_sinks
):
    args, (counts, lens) = varlen_case(seqs, H, Hkv, D, Dv, block_size, seed=len(seqs))
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    sinks64 = None if sinks is None else sinks.double()
    want = varlen_reference(*args[:4], counts, lens, 0.3, sinks64, window)  # float64, SDPA
    run = on_device(args)
    s = None if sinks is None else sinks.to(DEVICE)
    out = tp.triton_paged_varlen_attention(*run, scale=0.3, sinks=s, window=window)
    assert out.shape == (sum(counts), H, Dv) and out.dtype == torch.float32
    assert_close(out.cpu().double(), want, atol=1e-5, rtol=1e-4)
    lib = mha.paged_varlen_attention(*run, scale=0.3, sinks=s, window=window)
    assert_close(out, lib, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(6))
def test_triton_paged_varlen_random_mixed_batches(tp, seed):
    """Random batches of decode steps, prompt chunks (after a cached prefix or from scratch) and
    sequences sitting the step out, with random GQA, block size, head dims, window and sinks."""
    r = random.Random(seed)
    Hkv, block_size = r.choice([1, 2]), r.choice([1, 4, 16])
    H, D, Dv = Hkv * r.choice([1, 2, 4]), r.choice([8, 16, 24]), r.choice([8, 16, 40])
    seqs = [(r.randint(0, 40), r.choice([0, 1, 1, 2, 5, 17, 33])) for _ in range(r.randint(1, 5))]
    window = r.choice([None, r.randint(1, 12)])
    args, (counts, lens) = varlen_case(seqs, H, Hkv, D, Dv, block_size, seed=seed)
    sinks = torch.randn(H, dtype=torch.float64) if r.random() < 0.5 else None
    want = varlen_reference(*args[:4], counts, lens, None, sinks, window)
    s = None if sinks is None else sinks.to(DEVICE, torch.float32)
    out = tp.triton_paged_varlen_attention(*on_device(args), sinks=s, window=window)
    assert_close(out.cpu().double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_paged_varlen_low_precision_error_like_sdpa(tp, dtype):
    """Against float64 on the same rounded inputs, an error of the size of SDPA's own (one unit
    in the last place allowed for the final rounding), as the other Triton tests measure it."""
    args, (counts, lens) = varlen_case([(30, 1), (0, 21), (8, 4)], 4, 2, 32, 32, 8, seed=4)
    low = [t.to(dtype) if t.is_floating_point() else t for t in args]
    golden = varlen_reference(*[t.double() for t in low[:3]], low[3], counts, lens)
    sdpa = (varlen_reference(*low[:4], counts, lens).double() - golden).abs().max().item()
    out = tp.triton_paged_varlen_attention(*on_device(low, dtype))
    assert out.dtype == dtype
    ours = (out.cpu().double() - golden).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert ours <= 2 * sdpa + eps * golden.abs().max().item(), f"{ours:.2e} vs SDPA {sdpa:.2e}"


@pytest.mark.triton
def test_triton_paged_varlen_reads_only_the_keys_its_queries_see(tp):
    """Every block outside the keys a sequence's queries see is NaN (those before every query's
    window, those of a sequence sitting the step out, a NaN block in the table past each
    sequence's end), and so are the slots past a sequence's length in its last block: one read
    of any of them would make the output NaN (a weight of 0 times NaN is NaN). With -1 in the
    table at those entries instead, the kernel computes the same."""
    window, bs = 6, 4
    args, (counts, lens) = varlen_case([(37, 1), (20, 3), (3, 0), (0, 9)], 2, 1, 16, 16, bs)
    want = varlen_reference(*args[:4], counts, lens, None, None, window)
    query, key_pool, value_pool, table, cu, seq_lens = args
    nan = float("nan")
    spare = len(key_pool) - 1  # a block no sequence uses
    key_pool, value_pool = key_pool.clone(), value_pool.clone()
    poisoned, freed = table.clone(), table.clone()
    for b, (n, S) in enumerate(zip(counts, lens)):
        first = 0 if n == 0 else max(0, S - n - window + 1) // bs  # blocks [first, last) read
        last = first if n == 0 else -(-S // bs)
        for block in [*table[b, :first].tolist(), spare]:
            key_pool[block], value_pool[block] = nan, nan
        poisoned[b, last:] = spare
        freed[b, :first], freed[b, last:] = -1, -1
        if n and S % bs:  # the slots past the end of the last block
            key_pool[table[b, last - 1], :, S % bs :] = nan
            value_pool[table[b, last - 1], :, S % bs :] = nan
    for tab in (poisoned, freed):
        run = on_device([query, key_pool, value_pool, tab, cu, seq_lens])
        out = tp.triton_paged_varlen_attention(*run, window=window)
        assert_close(out.cpu().double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
def test_triton_paged_varlen_takes_strided_tensors(tp):
    """Query and pools are read through their strides: views need no copy."""
    args, (counts, lens) = varlen_case([(5, 1), (0, 7)], 4, 2, 16, 16, 4, seed=2)
    query, key_pool, value_pool, table, cu, seq_lens = on_device(args)
    wide = torch.zeros(*query.shape[:2], 24, device=DEVICE)
    wide[..., 4:20] = query
    pools = torch.stack([key_pool, value_pool], -1)  # (N, Hkv, bs, D, 2): strided halves
    out = tp.triton_paged_varlen_attention(
        wide[..., 4:20], pools[..., 0], pools[..., 1], table.t().contiguous().t(), cu, seq_lens
    )
    assert_close(out, mha.paged_varlen_attention(query, key_pool, value_pool, table, cu, seq_lens))


# The kernels' compile for NVIDIA GPUs without a GPU (compute capabilities 8.0 and 9.0, as
# triton_paged_attention and triton_paged_varlen_attention launch them): tests/test_triton_compile.py.


def test_varlen_tiles(tp):
    """Decode steps get 16-row tiles, prompt chunks 64 rows, a wide group one position per tile."""
    assert tp.varlen_tiles(1, 4, 64, torch.float16) == (4, 16, 64)
    assert tp.varlen_tiles(256, 4, 128, torch.float16) == (16, 64, 32)
    assert tp.varlen_tiles(3, 1, 64, torch.float32) == (16, 16, 32)
    assert tp.varlen_tiles(7, 128, 64, torch.bfloat16) == (1, 128, 64)


@pytest.mark.triton
def test_triton_paged_varlen_bad_inputs(tp):
    args, _ = varlen_case([(5, 1), (0, 9)], 4, 2, 8, 8, 4)
    query, key_pool, value_pool, table, cu, seq_lens = run = on_device(args)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple"):
        tp.triton_paged_varlen_attention(query[:, :3], *run[1:])
    with pytest.raises(ValueError, match=r"sequence 1 has 9 queries .* seq_lens\[1\] = 8"):
        tp.triton_paged_varlen_attention(*run[:5], torch.tensor([6, 8], device=DEVICE))
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 tensor"):
        tp.triton_paged_varlen_attention(*run[:4], cu.long(), seq_lens)
    with pytest.raises(TypeError, match="query must be float16, bfloat16 or float32"):
        tp.triton_paged_varlen_attention(*on_device(args, torch.float64))
    wide = on_device(varlen_case([(5, 1)], 2, 2, 136, 8, 4)[0])
    with pytest.raises(ValueError, match=r"head dim must be in \[1, 128\], got key_pool"):
        tp.triton_paged_varlen_attention(*wide)
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head"):
        tp.triton_paged_varlen_attention(*run, sinks=torch.zeros(2, device=DEVICE))
