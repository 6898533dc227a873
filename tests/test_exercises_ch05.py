"""The chapter 5 checkers accept correct answers and reject the usual mistakes with the right hint."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mha
from mha.exercises import ExerciseError, ch05


def test_checkers_are_reexported():
    for name in [
        "check_online_softmax_update",
        "check_kv_cache_step",
        "check_sdpa_backend_prediction",
    ]:
        assert getattr(mha.exercises, name) is getattr(ch05, name)


# --- online softmax update ----------------------------------------------------------------------


def good_update(m, l, acc, scores, value):
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - shift)
    alpha = torch.exp(m - shift)
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ value


def no_acc_rescale(m, l, acc, scores, value):
    m_new, l_new, _ = good_update(m, l, acc, scores, value)
    shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, l_new, acc + torch.exp(scores - shift) @ value


def no_l_rescale(m, l, acc, scores, value):
    m_new, _, acc_new = good_update(m, l, acc, scores, value)
    shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, l + torch.exp(scores - shift).sum(-1, keepdim=True), acc_new


def normalised_acc(m, l, acc, scores, value):
    # FlashAttention-1 style output kept normalised, but stored in the slot of acc.
    m_new, l_new, acc_new = good_update(m, l, acc, scores, value)
    return m_new, l_new, acc_new / l_new.clamp_min(1e-30)


def no_nan_guard(m, l, acc, scores, value):
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    p = torch.exp(scores - m_new)
    alpha = torch.exp(m - m_new)
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ value


def tile_max_only(m, l, acc, scores, value):
    m_tile = scores.amax(-1, keepdim=True)
    return (m_tile, *good_update(m, l, acc, scores, value)[1:])


def test_online_softmax_accepts_reference(capsys):
    ch05.check_online_softmax_update(good_update)
    assert "check_online_softmax_update: correct" in capsys.readouterr().out


def test_online_softmax_accepts_mha():
    ch05.check_online_softmax_update(mha.online_softmax_update)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (no_acc_rescale, "rescale it by exp\\(m - m_new\\) before adding"),
        (no_l_rescale, "l was measured relative to the old maximum"),
        (normalised_acc, "\\*unnormalised\\* numerator"),
        (no_nan_guard, "exp\\(-inf - \\(-inf\\)\\) is NaN"),
        (tile_max_only, "m is the running maximum"),
        (lambda m, l, acc, scores, value: (m, l), "should return a tuple \\(m, l, acc\\)"),
        (lambda m, l, acc, scores, value: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_online_softmax_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_online_softmax_update(wrong)


# --- KV-cache decoding step ---------------------------------------------------------------------


def good_step(q, k_new, v_new, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k_new], dim=-2)
    v_cache = torch.cat([v_cache, v_new], dim=-2)
    T, S = q.shape[-2], k_cache.shape[-2]
    keep = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=keep), k_cache, v_cache


def module_step(q, k_new, v_new, k_cache, v_cache):
    # The same step through mha.KVCache and mha.causal_mask_bottom_right.
    cache = mha.KVCache()
    if k_cache.shape[-2]:
        cache.update(k_cache, v_cache)
    k, v = cache.update(k_new, v_new)
    keep = mha.causal_mask_bottom_right(q.shape[-2], k.shape[-2])
    return mha.scaled_dot_product_attention(q, k, v, keep), k, v


def not_appending(q, k_new, v_new, k_cache, v_cache):
    k = torch.cat([k_cache, k_new], dim=-2)
    v = torch.cat([v_cache, v_new], dim=-2)
    T, S = q.shape[-2], k.shape[-2]
    keep = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep), k_cache, v_cache


def only_new(q, k_new, v_new, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k_new], dim=-2)
    v_cache = torch.cat([v_cache, v_new], dim=-2)
    return F.scaled_dot_product_attention(q, k_new, v_new, is_causal=True), k_cache, v_cache


def top_left(q, k_new, v_new, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k_new], dim=-2)
    v_cache = torch.cat([v_cache, v_new], dim=-2)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True), k_cache, v_cache


def no_mask(q, k_new, v_new, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k_new], dim=-2)
    v_cache = torch.cat([v_cache, v_new], dim=-2)
    return F.scaled_dot_product_attention(q, k_cache, v_cache), k_cache, v_cache


def test_kv_step_accepts_reference(capsys):
    ch05.check_kv_cache_step(good_step)
    assert "check_kv_cache_step: correct" in capsys.readouterr().out


def test_kv_step_accepts_mha_pieces():
    ch05.check_kv_cache_step(module_step)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (not_appending, "Append this step's keys and values"),
        (only_new, "attended only to this step's tokens"),
        (top_left, "aligned top-left"),
        (no_mask, "must not see the new tokens after it"),
        (lambda q, k, v, kc, vc: q, "should return a tuple \\(out, k_cache, v_cache\\)"),
    ],
)
def test_kv_step_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_kv_cache_step(wrong)


# --- which SDPA kernel runs ---------------------------------------------------------------------

RIGHT = {
    "plain": "flash",
    "bool_mask": "flash",
    "causal": "flash",
    "bfloat16": "flash",
    "three_dims": "math",
    "dropout": "math",
    "value_dim": "math",
    "strided_last_dim": "math",
}


def test_backend_prediction_accepts_truth(capsys):
    ch05.check_sdpa_backend_prediction(RIGHT)
    assert "all 8 predictions right (4 flash, 4 math)" in capsys.readouterr().out


def test_backend_prediction_matches_a_forced_run():
    # Independent of mha.hardware: flash must succeed exactly where the answer says "flash".
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for case, picked in RIGHT.items():
        args, kwargs = ch05.sdpa_case_inputs(case)
        try:
            with warnings.catch_warnings(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                warnings.simplefilter("ignore")  # torch explains its refusals in warnings
                F.scaled_dot_product_attention(*args, **kwargs)
            ran = "flash"
        except RuntimeError:
            ran = "math"
        assert ran == picked, case


@pytest.mark.parametrize(
    "wrong, hint",
    [
        ({**RIGHT, "three_dims": "flash"}, "4 dimensional"),
        ({**RIGHT, "dropout": "flash"}, "non-zero dropout"),
        ({**RIGHT, "value_dim": "flash"}, "same last dimension"),
        ({**RIGHT, "strided_last_dim": "flash"}, "stride 1"),
        ({**RIGHT, "bool_mask": "math"}, "accepts masks"),
        ({**RIGHT, "bfloat16": "math", "causal": "math"}, "2 of 8 predictions are wrong"),
        ({**RIGHT, "plain": "fast"}, "should be 'flash' or 'math'"),
        ({k: v for k, v in RIGHT.items() if k != "plain"}, "missing \\['plain'\\]"),
        (["flash"] * 8, "should be a dict"),
    ],
)
def test_backend_prediction_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_sdpa_backend_prediction(wrong)


def test_case_inputs_rejects_unknown_name():
    with pytest.raises(ValueError, match="name must be one of"):
        ch05.sdpa_case_inputs("nope")
