"""The chapter 4 checkers accept correct answers and reject the usual mistakes with the right hint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mha
from mha.exercises import ExerciseError, ch04


def test_checkers_are_reexported():
    for name in [
        "check_padding_mask",
        "check_causal_mask",
        "check_mask_prediction",
        "check_masked_attention",
        "check_mask_conversion",
        "check_alibi_bias",
    ]:
        assert getattr(mha.exercises, name) is getattr(ch04, name)


# --- padding mask -------------------------------------------------------------------------------


def good_padding_mask(lengths, S):
    return (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]


def test_padding_mask_accepts_reference(capsys):
    ch04.check_padding_mask(good_padding_mask)
    assert "check_padding_mask: correct" in capsys.readouterr().out


def test_padding_mask_accepts_mha():
    ch04.check_padding_mask(mha.padding_mask)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda lengths, S: ~good_padding_mask(lengths, S), "inverted"),
        (
            lambda lengths, S: (torch.arange(S)[None, :] <= lengths[:, None])[:, None, None, :],
            "one too many",
        ),
        (lambda lengths, S: torch.arange(S)[None, :] < lengths[:, None], r"read as \(L, S\)"),
        (
            lambda lengths, S: (torch.arange(S)[None, :] < lengths[:, None])[:, None, :, None],
            "masks queries",
        ),
        (lambda lengths, S: good_padding_mask(lengths, S).float(), "float mask is \\*added\\*"),
        (lambda lengths, S: [1, 0], "should return a torch.Tensor"),
    ],
)
def test_padding_mask_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_padding_mask(wrong)


# --- causal mask --------------------------------------------------------------------------------


def good_causal_mask(L, S=None):
    return torch.ones(L, L if S is None else S, dtype=torch.bool).tril()


def test_causal_mask_accepts_reference_and_mha(capsys):
    ch04.check_causal_mask(good_causal_mask)
    ch04.check_causal_mask(mha.causal_mask)
    assert capsys.readouterr().out.count("check_causal_mask: correct") == 2


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda L, S=None: ~good_causal_mask(L, S), "inverted"),
        (
            lambda L, S=None: torch.ones(L, L if S is None else S, dtype=torch.bool).triu(1),
            "inverted",
        ),
        (
            lambda L, S=None: torch.ones(L, L if S is None else S, dtype=torch.bool).tril(-1),
            "diagonal must be True",
        ),
        (
            lambda L, S=None: torch.ones(L, L if S is None else S, dtype=torch.bool).tril(1),
            "shifted by one",
        ),
        (
            lambda L, S=None: torch.ones(L, L if S is None else S, dtype=torch.bool).triu(),
            "upper triangle",
        ),
        (lambda L, S=None: torch.ones(L, L, dtype=torch.bool).tril(), "Use S"),
        (lambda L, S=None: good_causal_mask(L, S).int(), "Return a bool tensor"),
        (
            lambda L, S=None: (
                mha.causal_mask_bottom_right(L, S) if (S or L) >= L else good_causal_mask(L, S)
            ),
            "bottom-right",
        ),
    ],
)
def test_causal_mask_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_causal_mask(wrong)


# --- predict, then run --------------------------------------------------------------------------

RIGHT_MASK = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_mask_prediction_accepts_truth(capsys):
    ch04.check_mask_prediction(shape=(2, 1, 4, 4), mask=RIGHT_MASK, empty_rows=[0, 1])
    assert "check_mask_prediction: correct" in capsys.readouterr().out


def test_mask_prediction_truth_matches_mha():
    real = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    keep = real[:, None, None, :] & mha.causal_mask(4)
    assert keep.shape == (2, 1, 4, 4)
    assert keep[1, 0].int().tolist() == RIGHT_MASK


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"shape": (2, 4, 4), "mask": RIGHT_MASK, "empty_rows": [0, 1]}, "aligns trailing"),
        ({"shape": (2, 8, 4, 4), "mask": RIGHT_MASK, "empty_rows": [0, 1]}, "head dim stays 1"),
        (
            {"shape": (2, 1, 4, 4), "mask": [[0, 0, 1, 1]] * 4, "empty_rows": []},
            r"Row 0 \(query 0\)",
        ),
        (
            {
                "shape": (2, 1, 4, 4),
                "mask": [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
                "empty_rows": [],
            },
            "keys 0 and 1 of sequence 1 are padding",
        ),
        ({"shape": (2, 1, 4, 4), "mask": RIGHT_MASK, "empty_rows": []}, "NaN"),
        ({"shape": (2, 1, 4, 4), "mask": [[0, 0, 1]] * 4, "empty_rows": [0, 1]}, "4 rows of 4"),
    ],
)
def test_mask_prediction_rejects(kwargs, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_mask_prediction(**kwargs)


# --- spot the bug: the seed's masked attention -------------------------------------------------


def seed_attention(Q, K, V, mask):
    """The seeds' code: masked_fill(mask == 0, -1e9), then softmax."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    scores = scores.masked_fill(mask == 0, -1e9)
    return F.softmax(scores, dim=-1) @ V


def neg_inf_attention(Q, K, V, mask):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores, dim=-1) @ V


def finfo_min_attention(Q, K, V, mask):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return F.softmax(scores, dim=-1) @ V


def nan_to_num_float_mask_attention(Q, K, V, mask):
    """Zero forward pass, but the -inf float mask lets NaN flow back into the scores."""
    bias = torch.zeros(mask.shape, dtype=Q.dtype).masked_fill(~mask, float("-inf"))
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1)) + bias
    return torch.nan_to_num(F.softmax(scores, dim=-1)) @ V


def good_attention(Q, K, V, mask):
    scores = (Q @ K.transpose(-2, -1)).float() / math.sqrt(Q.size(-1))
    scores = scores.masked_fill(~mask, float("-inf"))
    has_key = mask.any(-1, keepdim=True)
    scores = torch.where(has_key, scores, 0.0)  # an empty row becomes all zeros: no NaN
    weights = F.softmax(scores, dim=-1) * has_key
    return weights.to(V.dtype) @ V


def test_masked_attention_accepts_reference_and_mha(capsys):
    ch04.check_masked_attention(good_attention)
    ch04.check_masked_attention(
        lambda q, k, v, keep: mha.scaled_dot_product_attention(q, k, v, keep)
    )
    ch04.check_masked_attention(lambda q, k, v, keep: F.scaled_dot_product_attention(q, k, v, keep))
    assert capsys.readouterr().out.count("check_masked_attention: correct") == 3


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (seed_attention, "does not fit in float16"),
        (neg_inf_attention, "NaN for the query that may attend to no key"),
        (finfo_min_attention, "spreads the weight uniformly"),
        (nan_to_num_float_mask_attention, "gradient .* contains NaN"),
        (lambda q, k, v, keep: good_attention(q, k, v, ~keep), "wrong values"),
        (
            lambda q, k, v, keep: good_attention(q, k, v, keep) * 1.1,
            "wrong values",
        ),
        (lambda q, k, v, keep: good_attention(q, k, v, keep).detach(), "not differentiable"),
    ],
)
def test_masked_attention_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_masked_attention(wrong)


def test_seed_attention_fails_only_in_low_precision_or_on_empty_rows():
    """The seed's code is right in float32 without empty rows: the checker must not over-reach."""
    q, k, v, keep = ch04._attention_cases()[0]
    torch.testing.assert_close(
        seed_attention(q, k, v, keep), F.scaled_dot_product_attention(q, k, v, keep)
    )


# --- the convention trap ------------------------------------------------------------------------


def good_conversion(attention_mask):
    return attention_mask == 0, (attention_mask == 1)[:, None, None, :]


def test_mask_conversion_accepts_reference(capsys):
    ch04.check_mask_conversion(good_conversion)
    assert "check_mask_conversion: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda am: (am == 1, (am == 1)[:, None, None, :]), "ignore"),
        (lambda am: (am == 0, (am == 0)[:, None, None, :]), "reuse key_padding_mask"),
        (lambda am: (am == 0, am == 1), r"read as \(L, S\)"),
        (lambda am: (1 - am, (am == 1)[:, None, None, :]), "Return a bool tensor"),
        (lambda am: (am == 0, am[:, None, None, :].float()), "Return a bool tensor"),
        (lambda am: am == 0, "should return a tuple"),
    ],
)
def test_mask_conversion_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_mask_conversion(wrong)


def test_mask_conversion_reference_agrees_with_torch_modules():
    """The reference answer really makes nn.MultiheadAttention and SDPA compute the same thing."""
    g = torch.Generator().manual_seed(0)
    attention_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    kpm, sdpa_mask = good_conversion(attention_mask)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8, generator=g)
    torch_out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
    ours = mha.MultiHeadAttention.from_torch(module)
    our_out, _ = ours(x, attn_mask=sdpa_mask)
    torch.testing.assert_close(our_out, torch_out)


# --- ALiBi --------------------------------------------------------------------------------------


def good_alibi(H, L):
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)  # (H,)
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    bias = -slopes[:, None, None] * (i - j)  # (H, L, L)
    return bias.masked_fill(j > i, float("-inf"))


def test_alibi_accepts_reference(capsys):
    ch04.check_alibi_bias(good_alibi)
    assert "check_alibi_bias: correct" in capsys.readouterr().out


def _alibi_with(slopes_fn, causal=True, sign=-1.0):
    def fn(H, L):
        slopes = slopes_fn(H)
        i = torch.arange(L)[:, None]
        j = torch.arange(L)[None, :]
        bias = sign * slopes[:, None, None] * (i - j)
        return bias.masked_fill(j > i, float("-inf")) if causal else bias

    return fn


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (_alibi_with(lambda H: 2.0 ** (-8.0 * torch.arange(0, H) / H)), "running from 0"),
        (
            _alibi_with(lambda H: 2.0 ** (-8.0 * torch.arange(1, H + 1) / H).flip(0)),
            "reverse order",
        ),
        (
            _alibi_with(lambda H: 2.0 ** (-8.0 * torch.arange(1, H + 1) / H), causal=False),
            "-inf above",
        ),
        (_alibi_with(lambda H: 2.0 ** (-8.0 * torch.arange(1, H + 1) / H), sign=1.0), "penalise"),
        (_alibi_with(lambda H: 2.0 ** (-1.0 * torch.arange(1, H + 1))), "wrong values"),
        (lambda H, L: good_alibi(H, L)[0], r"one \(L, L\) bias per head"),
        (lambda H, L: torch.ones(H, L, L, dtype=torch.bool), "float mask"),
    ],
)
def test_alibi_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.check_alibi_bias(wrong)
