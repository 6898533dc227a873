"""The Triton paged-attention kernel (mha.triton_paged) against torch's SDPA over each sequence.

Without a GPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by the conftest before
Triton is first imported; see tests/test_triton_flash.py). Sizes stay small: the interpreter runs
every program of the grid one after the other in NumPy. Select with ``pytest -m triton``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
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
