"""The checkers of chapter 1 accept correct answers and reject the typical wrong ones with the
hint aimed at that mistake."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mha.exercises
from mha.exercises import ExerciseError, ch01

# --------------------------------------------------------------------------------------------
# check_lookup_weights
# --------------------------------------------------------------------------------------------


def weights_ok(query, key):
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])  # (..., L, S)
    return torch.softmax(scores, dim=-1)


def weights_no_scale(query, key):
    return torch.softmax(query @ key.transpose(-2, -1), dim=-1)


def weights_divide_by_d(query, key):
    return torch.softmax(query @ key.transpose(-2, -1) / query.shape[-1], dim=-1)


def weights_wrong_axis(query, key):
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])
    return torch.softmax(scores, dim=-2)


def weights_no_softmax(query, key):
    return query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])


def weights_hard(query, key):
    scores = query @ key.transpose(-2, -1)
    return F.one_hot(scores.argmax(-1), scores.shape[-1]).float()


def weights_dot_t(query, key):
    return torch.softmax(query @ key.T / math.sqrt(query.shape[-1]), dim=-1)


def weights_numpy(query, key):
    return (query @ key.transpose(-2, -1)).numpy()


def test_lookup_weights_accepts_reference(capsys):
    ch01.check_lookup_weights(weights_ok)
    assert "check_lookup_weights: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (weights_no_scale, r"scale is missing: divide the scores by sqrt\(D\)"),
        (weights_divide_by_d, r"divided the scores by D; the scale is 1/sqrt\(D\)"),
        (weights_wrong_axis, r"wrong axis.*dim=-1"),
        (weights_no_softmax, r"scaled scores, not weights yet"),
        (weights_hard, r"hard lookup"),
        pytest.param(
            weights_dot_t,
            r"key.transpose\(-2, -1\) \(not key.T\)",
            # torch warns that .T on a 4-D tensor is deprecated: that is the learner's mistake.
            marks=pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning"),
        ),
        (weights_numpy, r"should return a torch.Tensor"),
    ],
)
def test_lookup_weights_rejects(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_lookup_weights(fn)


# --------------------------------------------------------------------------------------------
# check_seed_head_fix
# --------------------------------------------------------------------------------------------


def head_ok(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return torch.softmax(q @ k.T / math.sqrt(w_q.shape[1]), dim=-1) @ v


def head_seed(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return (q @ k.T) @ v


def head_no_scale(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return torch.softmax(q @ k.T, dim=-1) @ v


def head_no_softmax(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return (q @ k.T / math.sqrt(w_q.shape[1])) @ v


def head_argmax(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    scores = q @ k.T / math.sqrt(w_q.shape[1])
    return F.one_hot(scores.argmax(-1), scores.shape[-1]).float() @ v


def head_scale_by_width(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return torch.softmax(q @ k.T / math.sqrt(x.shape[1]), dim=-1) @ v


def head_wrong_axis(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return torch.softmax(q @ k.T / math.sqrt(w_q.shape[1]), dim=0) @ v


def head_one_projection(x, w_q, w_k, w_v):
    q = x @ w_q
    return torch.softmax(q @ q.T / math.sqrt(w_q.shape[1]), dim=-1) @ q


def test_seed_head_fix_accepts_reference(capsys):
    ch01.check_seed_head_fix(head_ok)
    assert "check_seed_head_fix: correct" in capsys.readouterr().out


def test_seed_head_reproduces_the_seed():
    """The buggy code shown in the chapter really prints the seed's head 1."""
    w1 = ch01.HEAD_PROJECTIONS[0]
    out = head_seed(ch01.CAT_EATS_FISH, w1, w1, w1)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (head_seed, r"still the seed's computation"),
        (head_no_scale, r"the scale is not"),
        (head_no_softmax, r"the softmax is not"),
        (head_argmax, r"hard argmax"),
        (head_wrong_axis, r"wrong axis"),
        (head_scale_by_width, r"not the model width"),
        (head_one_projection, r"own projection"),
    ],
)
def test_seed_head_fix_rejects(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_seed_head_fix(fn)


def test_seed_head_fix_skips_hints_that_coincide_with_the_answer(capsys):
    """On the seed's example E == D and w_q == w_k == w_v, so two 'wrong' recipes are right
    there; they must only be caught on the second (random) case, with their own hint."""
    calls = []

    def spy(x, w_q, w_k, w_v):
        calls.append(tuple(x.shape))
        return head_scale_by_width(x, w_q, w_k, w_v)

    with pytest.raises(ExerciseError, match="not the model width"):
        ch01.check_seed_head_fix(spy)
    assert calls == [(3, 2), (4, 6)]


# --------------------------------------------------------------------------------------------
# check_head2_prediction
# --------------------------------------------------------------------------------------------


def test_head2_prediction_accepts_rounded_and_exact(capsys):
    ch01.check_head2_prediction([[0, 0.33], [0, 0.50], [0, 0.33]])
    ch01.check_head2_prediction(torch.tensor([[0, 1 / 3], [0, 0.5035], [0, 1 / 3]]))
    assert capsys.readouterr().out.count("check_head2_prediction: correct") == 2


@pytest.mark.parametrize(
    ("answer", "hint"),
    [
        ([[0, 0], [0, 1], [0, 0]], r"seed's recipe"),
        ([[0, 1 / 3], [0, 0.58], [0, 1 / 3]], r"not scaled"),
        ([[0, 0], [0, 0.50], [0, 0]], r"uniform"),
        ([[0.50, 0], [0.33, 0], [0.33, 0]], r"That is head 1"),
        ([[0.33, 0], [0.50, 0], [0.33, 0]], r"columns are swapped"),
        ([[0, 0.33, 0], [0.50, 0, 0.33]], r"shape \(2, 3\)"),
        ([[0, 0.25], [0, 0.50], [0, 0.25]], r"is not head 2"),
        ("half", r"nested list of numbers"),
    ],
)
def test_head2_prediction_rejects(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_head2_prediction(answer)


# --------------------------------------------------------------------------------------------
# check_permuted_outputs
# --------------------------------------------------------------------------------------------


def test_permuted_outputs_accepts_reference(capsys):
    ch01.check_permuted_outputs(lambda out, perm: out[perm])
    assert "check_permuted_outputs: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (lambda out, perm: out, r"do not stay in place"),
        (lambda out, perm: out[torch.argsort(perm)], r"inverse permutation"),
        (lambda out, perm: out.flip(0), r"wrong values"),
        (lambda out, perm: out[perm].T, r"has shape \(8, 5\)"),
        (lambda out, perm: out[perm.tolist() + [0]], r"raised IndexError|has shape"),
    ],
)
def test_permuted_outputs_rejects(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch01.check_permuted_outputs(fn)


def test_permuted_outputs_leaves_global_rng_alone():
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    ch01.check_permuted_outputs(lambda out, perm: out[perm])
    assert torch.equal(torch.random.get_rng_state(), before)


# --------------------------------------------------------------------------------------------
# Re-export
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ch01.__all__)
def test_checkers_are_reexported(name):
    assert getattr(mha.exercises, name) is getattr(ch01, name)
