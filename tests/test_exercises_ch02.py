"""The chapter 2 checkers accept correct answers and reject the typical wrong ones with the right hint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mha.exercises
from mha.exercises import ExerciseError
from mha.exercises.ch02 import (
    check_qk_variance_prediction,
    check_sdpa,
    check_shape_prediction,
    check_softmax,
)

# ---------------------------------------------------------------------------------------------
# check_softmax
# ---------------------------------------------------------------------------------------------


def stable_softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def naive_softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def global_max_softmax(x, dim=-1):
    e = torch.exp(x - x.max())
    return e / e.sum(dim=dim, keepdim=True)


def last_axis_softmax(x, dim=-1):
    return stable_softmax(x, dim=-1)


def whole_tensor_softmax(x, dim=-1):
    e = torch.exp(x - x.max())
    return e / e.sum()


def no_keepdim_softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim))
    return e / e.sum(dim=dim)


def upcasting_softmax(x, dim=-1):
    return stable_softmax(x.float(), dim=dim)


def calls_torch_softmax(x, dim=-1):
    return torch.softmax(x, dim=dim)


def calls_tensor_softmax(x, dim=-1):
    return x.softmax(dim)


def calls_mha_softmax(x, dim=-1):
    return mha.softmax(x, dim=dim)


def test_check_softmax_accepts_a_stable_softmax(capsys):
    check_softmax(stable_softmax)
    assert capsys.readouterr().out.startswith("✅ check_softmax: correct")


def test_check_softmax_is_reexported():
    assert mha.exercises.check_softmax is check_softmax


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (naive_softmax, "Subtract the maximum along `dim` before exponentiating"),
        (global_max_softmax, "not one global maximum"),
        (last_axis_softmax, "You normalised along dim=2, not dim=1"),
        (whole_tensor_softmax, "divided by the sum of the whole tensor"),
        (no_keepdim_softmax, "keepdim=True"),
        (upcasting_softmax, "keep the input's dtype"),
        (calls_torch_softmax, "without calling torch.softmax"),
        (calls_tensor_softmax, "without calling torch.softmax"),
        (calls_mha_softmax, "without calling torch.softmax"),
    ],
)
def test_check_softmax_rejects_with_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint) as info:
        check_softmax(wrong)
    assert isinstance(info.value, AssertionError)


def test_check_softmax_restores_torch_softmax():
    with pytest.raises(ExerciseError):
        check_softmax(calls_tensor_softmax)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    torch.testing.assert_close(x.softmax(-1), torch.softmax(x, -1))
    torch.testing.assert_close(F.softmax(x, -1), stable_softmax(x))
    assert "softmax" not in vars(torch.Tensor)


def test_naive_softmax_really_fails_in_float16():
    # the float16 case of the checker is a real trap: exp(12) overflows float16
    x = torch.tensor([12.0, 10.0], dtype=torch.float16)
    assert torch.isnan(naive_softmax(x)).any()
    assert torch.isfinite(stable_softmax(x)).all()


# ---------------------------------------------------------------------------------------------
# check_sdpa
# ---------------------------------------------------------------------------------------------


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., L, S)
    return torch.softmax(scores, dim=-1) @ v  # (..., L, Dv)


def attention_mT(q, k, v):
    return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5, dim=-1) @ v


def no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def scale_by_d(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def scale_multiplied(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1]), dim=-1) @ v


def softmax_over_queries(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-2) @ v


def missing_transpose(q, k, v):
    return torch.softmax(q @ k / math.sqrt(q.shape[-1]), dim=-1) @ v


def fixed_dims_transpose(q, k, v):
    scores = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def returns_weights(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def returns_tuple(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def calls_torch_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def calls_mha_sdpa(q, k, v):
    return mha.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("right", [attention, attention_mT])
def test_check_sdpa_accepts_correct_attention(right, capsys):
    check_sdpa(right)
    assert capsys.readouterr().out.startswith("✅ check_sdpa: correct")


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (no_scale, r"Scale the scores by 1/√D"),
        (scale_by_d, r"The scale is 1/√D, not 1/D"),
        (scale_multiplied, r"you multiplied by it"),
        (softmax_over_queries, r"normalised over the queries \(dim=-2\)"),
        (missing_transpose, r"use k.transpose\(-2, -1\)"),
        (fixed_dims_transpose, r"raised IndexError.*negative dims"),
        (returns_weights, r"the shape of the weights"),
        (returns_tuple, r"returned a tuple"),
        (calls_torch_sdpa, r"without calling a ready-made"),
    ],
)
def test_check_sdpa_rejects_with_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_sdpa(wrong)


def test_check_sdpa_forbids_the_course_implementation_and_restores_it():
    original = mha.scaled_dot_product_attention
    with pytest.raises(ExerciseError, match="without calling a ready-made"):
        check_sdpa(calls_mha_sdpa)
    assert mha.scaled_dot_product_attention is original
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


# ---------------------------------------------------------------------------------------------
# Predictions
# ---------------------------------------------------------------------------------------------


def test_check_qk_variance_prediction_accepts_the_theory(capsys):
    check_qk_variance_prediction(unscaled=64, scaled=1)
    assert capsys.readouterr().out.startswith("✅ check_qk_variance_prediction: correct")


@pytest.mark.parametrize(
    ("unscaled", "scaled", "hint"),
    [
        (8, 1, "standard deviation"),
        (1, 1, "variances of the 64 independent terms add up"),
        (512, 1, "sum of d_k independent products"),
        (64, 8, "divides its variance by c²"),
        (64, 0.125, "divides its variance by c²"),
        (64, 64, r"Var\(x / c\)"),
    ],
)
def test_check_qk_variance_prediction_rejects_with_hint(unscaled, scaled, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_qk_variance_prediction(unscaled=unscaled, scaled=scaled)


def test_check_qk_variance_prediction_rejects_non_numbers():
    with pytest.raises(ExerciseError, match="should be a number"):
        check_qk_variance_prediction(unscaled=..., scaled=1)


def test_check_shape_prediction_accepts_the_right_shapes(capsys):
    check_shape_prediction(weights=(2, 8, 10, 7), out=(2, 8, 10, 32))
    assert "✅ check_shape_prediction: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("weights", "out", "hint"),
    [
        ((2, 8, 7, 10), (2, 8, 10, 32), "rows are queries"),
        ((2, 8, 10, 64), (2, 8, 10, 32), "summed away"),
        ((2, 8, 10, 7), (2, 8, 10, 64), "value dim Dv = 32"),
        ((2, 8, 10, 7), (2, 8, 7, 32), "one output row per query"),
        ((2, 8, 10, 7), (8, 10, 32), r"\(B, H, L, Dv\)"),
    ],
)
def test_check_shape_prediction_rejects_with_hint(weights, out, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_shape_prediction(weights=weights, out=out)


def test_check_shape_prediction_rejects_non_tuples():
    with pytest.raises(ExerciseError, match="tuple of ints"):
        check_shape_prediction(weights=..., out=(2, 8, 10, 32))
