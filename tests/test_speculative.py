"""Speculative decoding's verification: the tree mask, the greedy walk, and a tiny model whose
speculative decoding emits exactly the tokens of plain greedy decoding."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mha

# --- tree_attention_mask ---------------------------------------------------------------------


def test_a_chain_is_the_bottom_right_causal_mask():
    chain = [-1, 0, 1, 2, 3]
    for prefix in (0, 1, 7):
        want = mha.causal_mask_bottom_right(5, prefix + 5)
        assert torch.equal(mha.tree_attention_mask(chain, prefix), want)


def test_a_tree_sees_its_ancestors_and_never_a_sibling_branch():
    #      last ─┬─ 0 ── 2
    #            └─ 1 ─┬─ 3
    #                  └─ 4
    mask = mha.tree_attention_mask(torch.tensor([-1, -1, 0, 1, 1]), prefix_len=2)
    want = [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == want


@st.composite
def trees(draw):
    T = draw(st.integers(0, 12))
    return [draw(st.integers(-1, i - 1)) for i in range(T)]


@settings(max_examples=60, deadline=None)
@given(parents=trees(), prefix_len=st.integers(0, 5))
def test_each_token_sees_exactly_the_prefix_its_ancestors_and_itself(parents, prefix_len):
    mask = mha.tree_attention_mask(parents, prefix_len)
    T = len(parents)
    assert mask.shape == (T, prefix_len + T)
    assert mask[:, :prefix_len].all()
    for i in range(T):
        path, node = set(), i
        while node >= 0:  # walk up to the root
            path.add(node)
            node = parents[node]
        assert {j for j in range(T) if mask[i, prefix_len + j]} == path


@pytest.mark.parametrize(
    ("parents", "prefix_len", "error", "message"),
    [
        ([-1, 1], 0, ValueError, r"parents\[1\] must be -1 .* \[0, 1\), got 1"),
        ([-1, -2], 0, ValueError, r"parents\[1\] .* got -2"),
        ([0], 0, ValueError, r"parents\[0\] .* got 0"),
        ([-1, 0.0], 0, TypeError, r"parents must hold ints, got float \(0.0\) at index 1"),
        (torch.tensor([-1.0]), 0, TypeError, "parents must be an integer tensor"),
        (torch.tensor([[-1]]), 0, ValueError, "parents must have 1 dims"),
        ("abc", 0, TypeError, "parents must be a list of ints or a 1-D integer tensor"),
        ([-1], -1, ValueError, "prefix_len must be zero or positive, got -1"),
    ],
)
def test_tree_mask_bad_inputs(parents, prefix_len, error, message):
    with pytest.raises(error, match=message):
        mha.tree_attention_mask(parents, prefix_len)


# --- verify_greedy ---------------------------------------------------------------------------


def one_hot_logits(choices, V=10):
    """Logits whose greedy token after input ``r`` is ``choices[r]``."""
    logits = torch.zeros(len(choices), V)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return logits


def test_a_chain_accepts_its_longest_matching_prefix_and_adds_the_bonus_token():
    # drafts 5 6 7 8; the target would emit 5 6 then 9 (after 6), so 7 and 8 are rejected
    result = mha.verify_greedy([5, 6, 7, 8], [-1, 0, 1, 2], one_hot_logits([5, 6, 9, 1, 2]))
    assert (result.tokens, result.accepted, result.rejected) == ([5, 6, 9], [0, 1], 2)
    assert result.kept == [0, 1, 2]


def test_all_drafts_accepted_and_none():
    everything = mha.verify_greedy([5, 6], [-1, 0], one_hot_logits([5, 6, 3]))
    assert (everything.tokens, everything.rejected) == ([5, 6, 3], 0)
    nothing = mha.verify_greedy([5, 6], [-1, 0], one_hot_logits([4, 6, 3]))
    assert (nothing.tokens, nothing.accepted, nothing.rejected) == ([4], [], 2)
    no_draft = mha.verify_greedy([], [], one_hot_logits([7]))
    assert (no_draft.tokens, no_draft.rejected) == ([7], 0)


def test_a_tree_follows_the_branch_the_target_chooses():
    #  last ─┬─ 0:5 ── 2:7
    #        └─ 1:3 ─┬─ 3:4
    #                └─ 4:8 ── 5:2
    draft, parents = [5, 3, 7, 4, 8, 2], [-1, -1, 0, 1, 1, 4]
    # greedy after last: 3; after draft 1 (3): 8; after draft 4 (8): 2; after draft 5 (2): 6
    logits = one_hot_logits([3, 0, 0, 0, 0, 2, 6][:1] + [0, 8, 0, 0, 2, 6])
    result = mha.verify_greedy(draft, parents, logits)
    assert (result.tokens, result.accepted, result.rejected) == ([3, 8, 2, 6], [1, 4, 5], 3)
    assert result.kept == [0, 2, 5, 6]


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (([1, 2], [-1, 0], torch.zeros(2, 5)), ValueError, r"agree in T, got 2 .* logits \(2, 5\)"),
        (([1, 2], [-1], torch.zeros(3, 5)), ValueError, "got 2 draft tokens, 1 parents"),
        (([1], [-1], torch.zeros(2, 5, 1)), ValueError, r"logits must have 2 dims \(T \+ 1, V\)"),
        (
            ([1], [-1], torch.zeros(2, 5, dtype=torch.long)),
            TypeError,
            "logits must have a floating",
        ),
        (([1.5], [-1], torch.zeros(2, 5)), TypeError, "draft must be a list of token ids"),
        ((torch.tensor([1.0]), [-1], torch.zeros(2, 5)), TypeError, "draft must be an integer"),
    ],
)
def test_verify_bad_inputs(args, error, message):
    with pytest.raises(error, match=message):
        mha.verify_greedy(*args)


# --- a tiny model: speculative decoding emits what greedy decoding emits -----------------------


class TinyLM(nn.Module):
    """Token embedding, two causal attention layers with residuals, a vocabulary head."""

    def __init__(self, vocab: int = 24, width: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            mha.MultiHeadAttention(width, heads, num_kv_heads=kv_heads) for _ in range(2)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: list[int], caches=None, attn_mask=None) -> torch.Tensor:
        """Logits ``(L, V)`` after each of ``tokens``; with caches, the tokens come after them."""
        caches = caches or [None] * len(self.layers)
        x = self.embed(torch.tensor([tokens]))  # (1, L, E)
        for layer, cache in zip(self.layers, caches):
            out, _ = layer(x, attn_mask=attn_mask, is_causal=attn_mask is None, kv_cache=cache)
            x = x + out
        return self.head(x)[0]  # (L, V)


def models():
    """The target, and a draft that is the target with noisy weights (it agrees often)."""
    torch.manual_seed(0)
    target = TinyLM().double().eval()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    return target, draft


PROMPT, STEPS = [3, 1, 4, 1, 5, 9, 2, 6], 24


def greedy(model, steps=STEPS):
    caches = [mha.KVCache() for _ in model.layers]
    out = [int(model(PROMPT, caches)[-1].argmax())]
    while len(out) < steps:
        out.append(int(model([out[-1]], caches)[-1].argmax()))
    return out


def draft_chain(draft, context, k):
    tokens = []
    for _ in range(k):
        tokens.append(int(draft(context + tokens)[-1].argmax()))
    return tokens


def draft_tree(draft, context):
    """Two candidates after the context, each followed by its greedy chain of two."""
    draft_tokens, parents = [], []
    for first in draft(context)[-1].topk(2).indices.tolist():
        draft_tokens.append(first)
        parents.append(-1)
        for token in draft_chain(draft, context + [first], 2):
            parents.append(len(draft_tokens) - 1)
            draft_tokens.append(token)
    return draft_tokens, parents


@torch.no_grad()
def test_speculative_decoding_with_a_chain_through_a_paged_cache_emits_greedy_tokens():
    target, draft = models()
    caches = [mha.PagedKVCache(block_size=4) for _ in target.layers]
    out = [int(target(PROMPT, caches)[-1].argmax())]
    cached, accepted, rejected = len(PROMPT), 0, 0
    while len(out) < STEPS:
        drafts = draft_chain(draft, PROMPT + out, 4)
        logits = target([out[-1], *drafts], caches)  # causal, bottom-right after the cache
        step = mha.verify_greedy(drafts, [-1, 0, 1, 2], logits)
        cached += len(step.kept)  # the last token and the accepted drafts stay
        for cache in caches:
            cache.truncate(0, cached)
        out += step.tokens
        accepted, rejected = accepted + len(step.accepted), rejected + step.rejected
    assert out[:STEPS] == greedy(target)
    assert accepted and rejected  # both paths of the walk were taken


@torch.no_grad()
def test_speculative_decoding_with_a_tree_emits_greedy_tokens():
    target, draft = models()
    caches = [mha.KVCache() for _ in target.layers]
    out = [int(target(PROMPT, caches)[-1].argmax())]
    cached, second_branch = len(PROMPT), 0
    while len(out) < STEPS:
        drafts, parents = draft_tree(draft, PROMPT + out)
        mask = mha.tree_attention_mask([-1] + [p + 1 for p in parents], prefix_len=cached)
        logits = target([out[-1], *drafts], caches, attn_mask=mask)
        step = mha.verify_greedy(drafts, parents, logits)
        keep = torch.tensor(list(range(cached)) + [cached + k for k in step.kept])
        for cache in caches:  # the accepted branch's entries move up, the rest go
            cache.key, cache.value = cache.key[:, :, keep], cache.value[:, :, keep]
        cached += len(step.kept)
        out += step.tokens
        second_branch += bool(step.accepted) and step.accepted[0] != 0
    assert out[:STEPS] == greedy(target)
    assert second_branch  # the target sometimes chose the draft's second candidate
