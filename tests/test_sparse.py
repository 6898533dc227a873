"""mha.topk_sparse_attention and mha.topk_keep_mask against torch's SDPA with the keep-mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mha


def keep_by_sorting(index_scores, topk, is_causal):
    """The keep-mask built another way: a key is kept if its score is at least the k-th best
    visible score of its row (random float scores: no ties)."""
    L, S = index_scores.shape[-2:]
    visible = torch.ones(L, S, dtype=torch.bool).tril() if is_causal else torch.ones(L, S).bool()
    ranked = index_scores.masked_fill(~visible, float("-inf"))
    kth = ranked.sort(dim=-1, descending=True).values[..., min(topk, S) - 1 : min(topk, S)]
    return (ranked >= kth) & visible


def draw(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("topk", [1, 3, 8, 40])
@pytest.mark.parametrize("is_causal", [True, False])
def test_equals_sdpa_with_the_keep_mask(topk, is_causal):
    q, k, v = draw(2, 3, 12, 8, seed=1), draw(2, 3, 12, 8, seed=2), draw(2, 3, 12, 5, seed=3)
    scores = draw(2, 1, 12, 12, seed=4)  # shared by the heads, as DeepSeek's indexer
    keep = keep_by_sorting(scores, topk, is_causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    got = mha.topk_sparse_attention(q, k, v, scores, topk, is_causal=is_causal)
    assert_close(got, want)
    assert torch.equal(mha.topk_keep_mask(scores, topk, is_causal=is_causal), keep)


def test_per_head_scores_cross_attention_and_scale():
    q, k, v = draw(2, 4, 5, 8, seed=5), draw(2, 4, 9, 8, seed=6), draw(2, 4, 9, 8, seed=7)
    scores = draw(2, 4, 5, 9, seed=8)  # one ranking per head; L != S
    keep = keep_by_sorting(scores, 4, False)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3)
    got = mha.topk_sparse_attention(q, k, v, scores, 4, is_causal=False, scale=0.3)
    assert_close(got, want)


def test_every_key_kept_is_dense_attention_and_topk_one_is_the_best_value():
    q, k, v = draw(1, 2, 10, 4, seed=9), draw(1, 2, 10, 4, seed=10), draw(1, 2, 10, 3, seed=11)
    scores = draw(10, 10, seed=12)  # (L, S) broadcasts
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(mha.topk_sparse_attention(q, k, v, scores, 10), dense)
    best = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), -torch.inf).argmax(-1)
    assert_close(mha.topk_sparse_attention(q, k, v, scores, 1), v[:, :, best])


def test_keep_mask_counts():
    keep = mha.topk_keep_mask(draw(3, 16, 16, seed=13), 5)
    counts = keep.sum(-1)  # (3, 16): min(5, i + 1) keys for query i
    assert torch.equal(counts, torch.arange(1, 17).clamp(max=5).expand(3, 16))
    assert not keep.triu(1).any()  # never a future key


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_follows_the_float32_result(dtype):
    q, k, v = (draw(2, 2, 16, 8, seed=s, dtype=torch.float32) for s in (14, 15, 16))
    scores = draw(2, 1, 16, 16, seed=17, dtype=torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep_by_sorting(scores, 6, True))
    got = mha.topk_sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), scores, 6)
    assert got.dtype == dtype
    assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_bad_input_raises_naming_the_argument():
    q, k, v = draw(1, 2, 6, 4), draw(1, 2, 6, 4), draw(1, 2, 6, 4)
    s = draw(1, 1, 6, 6)
    with pytest.raises(ValueError, match="topk"):
        mha.topk_sparse_attention(q, k, v, s, 0)
    with pytest.raises(TypeError, match="topk"):
        mha.topk_sparse_attention(q, k, v, s, 2.5)
    with pytest.raises(
        ValueError, match=r"index_scores must broadcast to \(..., L, S\) = \(1, 2, 6, 6\)"
    ):
        mha.topk_sparse_attention(q, k, v, draw(1, 1, 6, 5), 2)
    with pytest.raises(TypeError, match="index_scores"):
        mha.topk_sparse_attention(q, k, v, torch.ones(6, 6, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="same head dim"):
        mha.topk_sparse_attention(q, draw(1, 2, 6, 5), v, s, 2)
    with pytest.raises(ValueError, match="index_scores must have at least 2 dims"):
        mha.topk_keep_mask(draw(6), 2)
