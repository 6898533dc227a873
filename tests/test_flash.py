"""mha.flash_attention: same numbers as torch's SDPA, fewer tiles under masks, float32 statistics."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch.testing import assert_close

import mha


def qkv(L, S, D=16, Dv=8, batch=(2, 3), dtype=torch.float64):
    return (
        randn(*batch, L, D, dtype=dtype, seed=1),
        randn(*batch, S, D, dtype=dtype, seed=2),
        randn(*batch, S, Dv, dtype=dtype, seed=3),
    )


@pytest.mark.parametrize("block_size", [1, 5, 16, 64, 200])
@pytest.mark.parametrize("L,S", [(37, 37), (37, 45), (45, 37), (1, 30), (30, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_for_ragged_tiles(block_size, L, S, is_causal):
    q, k, v = qkv(L, S)
    assert_close(
        mha.flash_attention(q, k, v, is_causal=is_causal, block_size=block_size),
        F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
    )


@pytest.mark.parametrize("kind", ["bool", "float", "window", "padding"])
def test_masks(kind):
    L = S = 40
    q, k, v = qkv(L, S)
    if kind == "bool":
        mask = torch.rand(L, S, generator=torch.Generator().manual_seed(0)) > 0.5
        mask[:, 0] = True
    elif kind == "float":
        mask = randn(2, 1, L, S, seed=9)
    elif kind == "window":
        mask = mha.sliding_window_mask(L, S, window=6)
    else:
        mask = mha.padding_mask(torch.tensor([40, 13]), S)
    assert_close(
        mha.flash_attention(q, k, v, mask, block_size=8),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    )


def test_causal_with_padding_and_scale():
    q, k, v = qkv(24, 24)
    pad = mha.padding_mask(torch.tensor([24, 10]), 24)
    assert_close(
        mha.flash_attention(q, k, v, pad, is_causal=True, scale=0.2, block_size=7),
        F.scaled_dot_product_attention(q, k, v, attn_mask=pad & mha.causal_mask(24), scale=0.2),
    )


def test_fully_masked_rows_are_zero():
    q, k, v = qkv(20, 20)
    keep = torch.ones(20, 20, dtype=torch.bool)
    keep[3] = False
    keep[11:17] = False  # a whole block of rows
    out = mha.flash_attention(q, k, v, keep, block_size=4)
    assert not torch.isnan(out).any()
    assert torch.equal(out[..., 3, :], torch.zeros_like(out[..., 3, :]))
    ref = mha.scaled_dot_product_attention(q, k, v, keep)
    assert_close(out, ref)


def test_tile_schedule_skips_hidden_tiles():
    full = mha.tile_schedule(256, 256, block_size=64)
    causal = mha.tile_schedule(256, 256, block_size=64, is_causal=True)
    window = mha.tile_schedule(
        256, 256, block_size=32, attn_mask=mha.sliding_window_mask(256, window=32)
    )

    def rows(tiles):
        return sum(t.q1 - t.q0 for t in tiles)

    assert len(full) == 4 and rows(full) == 4 * 256
    assert rows(causal) == 256 + 192 + 128 + 64  # each key tile is seen by the rows at or below it
    assert rows(window) == 7 * 64 + 32  # each key tile is seen by its own row block and the next
    # the schedule never drops a (row, key) pair that the mask keeps
    keep = mha.sliding_window_mask(256, window=32)
    covered = torch.zeros(256, 256, dtype=torch.bool)
    for t in window:
        covered[t.q0 : t.q1, t.k0 : t.k1] = True
    assert not (keep & ~covered).any()


def test_online_softmax_update_equals_softmax_over_all_tiles():
    scores = randn(4, 12, seed=7).float()
    values = randn(12, 3, seed=8).float()
    m = torch.full((4, 1), -math.inf)
    l = torch.zeros(4, 1)
    acc = torch.zeros(4, 3)
    for c0 in range(0, 12, 5):
        m, l, acc = mha.online_softmax_update(
            m, l, acc, scores[:, c0 : c0 + 5], values[c0 : c0 + 5]
        )
    assert_close(m, scores.amax(-1, keepdim=True))
    assert_close(acc / l, torch.softmax(scores, -1) @ values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_error_vs_float64_golden_is_no_worse_than_torch(dtype):
    q, k, v = qkv(70, 90, D=32, Dv=32)
    golden = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = mha.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, block_size=16)
    theirs = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
    assert ours.dtype == dtype
    err_ours = (ours.double() - golden).abs().max()
    err_torch = (theirs.double() - golden).abs().max()
    assert err_ours <= 3 * err_torch + torch.finfo(dtype).eps, (err_ours, err_torch)


@pytest.mark.parametrize("L,S,block", [(1000, 1000, 64), (300, 700, 32), (700, 300, 48)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_schedule_runs_query_steps_outer_and_covers_every_kept_pair(L, S, block, is_causal):
    keep = mha.sliding_window_mask(L, S, window=90) | (
        torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.999
    )
    tiles = mha.tile_schedule(L, S, block_size=block, is_causal=is_causal, attn_mask=keep)
    step = mha.flash.QUERY_BLOCKS_PER_STEP * block
    starts = [t.q0 // step for t in tiles]
    assert starts == sorted(starts)  # FlashAttention-2 order: one step of query rows at a time
    assert all(t.q1 - t.q0 <= step and (t.q1 - 1) // step == t.q0 // step for t in tiles)
    if is_causal:
        keep = keep & mha.causal_mask(L, S)
    covered = torch.zeros(L, S, dtype=torch.bool)
    for t in tiles:
        covered[t.q0 : t.q1, t.k0 : t.k1] = True
    assert not (keep & ~covered).any()
    q, k, v = qkv(L, S, batch=(1,))
    assert_close(
        mha.flash_attention(q, k, v, keep, is_causal, block_size=block),
        F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep & (mha.causal_mask(L, S) if is_causal else True)
        ),
    )


# --- zero lengths: what torch's SDPA does ----------------------------------------------------
# L = 0 gives an empty output (..., 0, Dv); S = 0 gives zeros (..., L, Dv), as every row sees no
# key (torch's SDPA returns zeros there too, with zero gradients for the queries).

ZERO_LENGTHS = [(0, 5), (4, 0), (0, 0)]
ZERO_OPTIONS = [{}, {"is_causal": True}, {"mask": True}, {"enable_gqa": True}]


def zero_length_case(L, S, options):
    q = randn(2, 4, L, 8, seed=1).requires_grad_()
    Hkv = 2 if options.get("enable_gqa") else 4
    k = randn(2, Hkv, S, 8, seed=2).requires_grad_()
    v = randn(2, Hkv, S, 6, seed=3).requires_grad_()
    kwargs = {key: value for key, value in options.items() if key != "mask"}
    if options.get("mask"):
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool)
    return (q, k, v), kwargs


@pytest.mark.parametrize("fn", [mha.scaled_dot_product_attention, mha.flash_attention])
@pytest.mark.parametrize("options", ZERO_OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("L,S", ZERO_LENGTHS)
def test_zero_lengths_match_torch_forward_and_backward(fn, L, S, options):
    inputs, kwargs = zero_length_case(L, S, options)
    want = F.scaled_dot_product_attention(*inputs, **kwargs)
    got = fn(*inputs, **kwargs)
    assert got.shape == want.shape == (2, 4, L, 6)
    assert_close(got, want, rtol=0, atol=0)
    grad = randn(*want.shape, seed=4)
    for ours, theirs in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)
    ):
        assert ours.shape == theirs.shape
        assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("L,S", ZERO_LENGTHS)
def test_zero_lengths_return_lse(L, S):
    (q, k, v), _ = zero_length_case(L, S, {})
    out, lse = mha.flash_attention(q.detach(), k.detach(), v.detach(), return_lse=True)
    assert out.shape == (2, 4, L, 6) and lse.shape == (2, 4, L)
    assert torch.isneginf(lse).all()  # no row sees a key (or there is no row)
    assert not out.isnan().any()


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize("L,S", ZERO_LENGTHS)
def test_module_with_zero_lengths_matches_torch(backend, L, S):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.out_proj.bias.normal_()  # S = 0: the output is out_proj's bias alone
    ours = mha.MultiHeadAttention.from_torch(ref, backend=backend)
    x, y = randn(2, L, 16, seed=1), randn(2, S, 16, seed=2)
    with torch.no_grad():
        got, _ = ours(x, y, y)
        assert_close(got, ref(x, y, y, need_weights=False)[0])
        assert got.shape == (2, L, 16)
        if L == S:  # self-attention, causal too
            assert_close(ours(x, is_causal=True)[0], ref(x, x, x, need_weights=False)[0])
