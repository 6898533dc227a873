"""mha.flex: the course's masks as FlexAttention mask_mods/score_mods, checked against mha.masks
and against mha.flash_attention with the same mask as a dense tensor."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import randn
from torch.nn.attention.flex_attention import and_masks, create_mask, flex_attention
from torch.testing import assert_close

import mha
from mha import flex


def dense(mask_mod, L, S=None, B=1):
    """The mask_mod evaluated on every (b, q, kv): (B, 1, L, S) bool."""
    return create_mask(mask_mod, B, 1, L, L if S is None else S, device="cpu")


def flex_eager(*args, **kwargs):
    # The uncompiled FlexAttention warns that it is slow; it is the reference semantics here.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=UserWarning, module=r"torch\.nn\.attention\.flex_attention"
        )
        return flex_attention(*args, **kwargs)


def test_causal_equals_causal_mask():
    assert torch.equal(dense(flex.causal, 7, 9)[0, 0], mha.causal_mask(7, 9))


@pytest.mark.parametrize("window", [1, 3, torch.tensor(3)])
def test_sliding_window_equals_sliding_window_mask(window):
    expected = mha.sliding_window_mask(10, window=int(window), causal=True)
    assert torch.equal(dense(flex.sliding_window(window), 10)[0, 0], expected)


def test_sliding_window_reads_its_tensor_when_called():
    window = torch.tensor(2)
    mod = flex.sliding_window(window)
    window.fill_(4)  # changed in place: the same mask_mod now has a wider window
    expected = mha.sliding_window_mask(8, window=4)
    assert torch.equal(dense(mod, 8)[0, 0], expected)


def test_padding_equals_padding_mask():
    lengths = torch.tensor([3, 6, 1])
    got = dense(flex.padding(lengths), 5, 6, B=3)  # (B, 1, L, S)
    assert torch.equal(got, mha.padding_mask(lengths, 6).expand(3, 1, 5, 6))


def test_document_keeps_pairs_of_one_document():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    got = dense(and_masks(flex.causal, flex.document(ids)), 6)[0, 0]
    expected = (ids[:, None] == ids[None, :]) & mha.causal_mask(6)
    assert torch.equal(got, expected)
    assert not got[2, 1] and got[4, 2]  # a new document starts afresh at position 2


def test_block_pattern_expands_blocks():
    pattern = torch.tensor([[True, False], [True, True]])
    got = dense(flex.block_pattern(pattern, 3), 5)[0, 0]  # ragged last block
    expected = pattern.repeat_interleave(3, 0).repeat_interleave(3, 1)[:5, :5]
    assert torch.equal(got, expected)


def test_alibi_slopes_and_bias():
    assert_close(flex.alibi_slopes(4), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]))
    slopes = flex.alibi_slopes(2)
    q, k, v = (randn(1, 2, 6, 4, seed=s) for s in range(3))
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    bias = -slopes[:, None, None].double() * (i - j)  # (H, L, S)
    bias = bias.masked_fill(j > i, float("-inf"))
    mask = torch.nn.attention.flex_attention.create_block_mask(
        flex.causal, None, None, 6, 6, device="cpu"
    )
    got = flex_eager(q, k, v, score_mod=flex.alibi(slopes), block_mask=mask)
    assert_close(got, mha.flash_attention(q, k, v, attn_mask=bias, block_size=4))


def alibi_reference(H: int) -> list[float]:
    """ALiBi's slopes as the paper's code computes them, written out with plain Python floats.

    For a power of two, a geometric sequence starting at 2**(-8/H) with that ratio; otherwise
    the sequence of the largest power of two p <= H, then every other slope (the 1st, 3rd, ...)
    of the sequence for 2p, until there are H.
    """

    def geometric(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start**k for k in range(1, n + 1)]

    p = 1
    while 2 * p <= H:
        p *= 2
    return geometric(p) + geometric(2 * p)[0::2][: H - p]


@pytest.mark.parametrize("H", range(1, 131))
def test_alibi_slopes_follow_the_reference_for_every_head_count(H):
    got = flex.alibi_slopes(H)
    assert got.shape == (H,) and got.dtype == torch.float32
    assert_close(got.double(), torch.tensor(alibi_reference(H), dtype=torch.float64))
    if H & (H - 1) == 0:  # a power of two: the plain formula, bit for bit as before
        assert torch.equal(got, 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H))


def test_alibi_slopes_by_hand():
    # H = 12: n = 8 gives 2^-1 ... 2^-8, then 2^(-8i/16) for i = 1, 3, 5, 7
    twelve = [2.0**-k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
    assert_close(flex.alibi_slopes(12), torch.tensor(twelve))
    # BLOOM's 112 heads: n = 64, so slope 1 is 2^(-8/64) and slope 65 is 2^(-8/128)
    bloom = flex.alibi_slopes(112)
    assert_close(bloom[0].item(), 0.9170040432046712)
    assert_close(bloom[63].item(), 2.0**-8)
    assert_close(bloom[64].item(), 0.9576032806985737)
    assert_close(bloom[111].item(), 2 ** (-8 * 95 / 128))  # i = 2·47 + 1 of the 128-sequence
    assert len(set(bloom.tolist())) == 112  # no slope repeats


def test_every_mask_matches_flash_attention_with_a_dense_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, L, D = 2, 2, 24, 8
    q, k, v = (randn(B, H, L, D, seed=s) for s in range(3))
    ids = torch.tensor([0] * 10 + [1] * 9 + [2] * 5)
    mods = {
        "causal": flex.causal,
        "window": flex.sliding_window(5),
        "padding": flex.padding(torch.tensor([24, 11])),
        "document": and_masks(flex.causal, flex.document(ids)),
        "blocks": flex.block_pattern(torch.eye(3, dtype=torch.bool), 8),
    }
    for name, mod in mods.items():
        block_mask = create_block_mask(mod, B, None, L, L, device="cpu", BLOCK_SIZE=8)
        expected = mha.flash_attention(q, k, v, attn_mask=dense(mod, L, B=B), block_size=8)
        assert_close(flex_eager(q, k, v, block_mask=block_mask), expected, msg=name)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="window"):
        flex.sliding_window(0)
    with pytest.raises(TypeError, match="lengths must be an integer tensor"):
        flex.padding(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"doc_ids must have 1 dims.*\(2, 3\)"):
        flex.document(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="pattern must be a bool tensor"):
        flex.block_pattern(torch.ones(2, 2), 4)
    with pytest.raises(TypeError, match="slopes must have a floating dtype"):
        flex.alibi(torch.arange(3))
