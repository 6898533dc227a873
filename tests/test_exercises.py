"""The exercise checkers, tested from the same data they run on.

For every exercise of :data:`mha.exercises.EXERCISES`: its reference is accepted with the success
line the notebooks store, every known mistake is rejected with its own hint, and the notebook's stub
prints "not attempted yet" without raising. The harness's common paths (crash, NaN, shape, dtype,
non-tensor, wrong kind of argument) are tested once; what is not expressible as data (tripwires,
the post's own buggy class, Triton kernels, answers written independently of the checker) is tested
explicitly below.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from torch import nn

import mha
import mha.exercises
from mha.exercises import (
    EXERCISES,
    ExerciseError,
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
)
from mha.exercises._harness import Case, Exercise, Mistake, exercise, prediction, publish

BY_NAME = {ex.name: ex for ex in EXERCISES}
WITH_ANSWER = [ex for ex in EXERCISES if ex.reference is not None]  # the Triton kernel: below
MISTAKES = [(ex, i) for ex in WITH_ANSWER for i in range(len(ex.mistakes))]


def _stored_lines() -> set[str]:
    """Every line the committed notebooks print."""
    lines = set()
    for path in sorted((REPO / "chapters").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            for out in cell.get("outputs", []):
                lines.update("".join(out.get("text", "")).splitlines())
    return lines


STORED_LINES = _stored_lines()


def _stub(*args, **kwargs): ...  # your code here


def _stub_args(ex: Exercise) -> list[object]:
    """What the notebook's stub cell passes: a function whose body is ``...``, or ``...``s."""
    return [...] * len(ex.params) if ex.prediction else [_stub]


def not_attempted_line(name: str) -> str:
    return (
        f"○ {name}: not attempted yet — write your answer in the cell above, then run it again.\n"
    )


# --- generated from the data ----------------------------------------------------------------


@pytest.mark.parametrize("ex", WITH_ANSWER, ids=lambda ex: ex.name)
def test_reference_is_accepted_with_the_stored_success_line(ex, capsys):
    ex.check(ex.accepted_answer())
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {ex.name}: correct — ") and out.count("\n") == 1, out
    assert out.rstrip("\n") in STORED_LINES, f"the notebooks do not print {out!r}"


@pytest.mark.parametrize(("ex", "index"), MISTAKES, ids=lambda v: getattr(v, "name", v))
def test_known_mistake_is_rejected_with_its_hint(ex, index):
    answer, hint = ex.wrong_answers()[index]
    with pytest.raises(ExerciseError) as err:
        ex.check(answer)
    assert hint in str(err.value)
    assert isinstance(err.value, AssertionError)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_stub_prints_not_attempted_and_does_not_raise(ex, capsys):
    getattr(mha.exercises, ex.name)(*_stub_args(ex))
    assert capsys.readouterr().out == not_attempted_line(ex.name)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_none_and_not_implemented_are_not_attempted(ex, capsys):
    def raises(*args):
        raise NotImplementedError

    ex.check(None)
    if not ex.prediction and ex.custom is None and ex.call is None:
        ex.check(raises)
    assert set(capsys.readouterr().out.splitlines(keepends=True)) == {not_attempted_line(ex.name)}


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_checker_is_public_with_its_signature_and_docstring(ex):
    checker = getattr(mha.exercises, ex.name)
    assert checker.__name__ == ex.name and checker.__doc__
    assert tuple(inspect.signature(checker).parameters) == ex.params


@pytest.mark.parametrize(
    "module", [ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08], ids=lambda m: m.__name__
)
def test_chapter_checkers_are_reexported(module):
    for ex in module.EXERCISES:
        assert getattr(mha.exercises, ex.name) is getattr(module, ex.name)
        assert ex in EXERCISES


def test_mha_loads_exercises_lazily():
    code = "import mha, sys; print('mha.exercises' in sys.modules); mha.exercises.check_softmax"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# --- the harness's common paths ---------------------------------------------------------------

TOY = Exercise(
    "check_toy",
    "doubles",
    lambda x: 2 * x,
    lambda: [Case("fn(x)", (torch.arange(6.0).reshape(2, 3),)), Case("fn(y)", (torch.ones(3),))],
    (Mistake(lambda x: x + 2, "You added 2."),),
    hint="Multiply by 2.",
    crash_hint="x is a tensor.",
    exact_dtype=True,
    params=("double",),
    doc="Check ``double(x)``.",
)
check_toy = TOY.checker()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (lambda x: x * 2.0, None),
        (lambda x: x + 2, r"fn\(x\) has the right shape but wrong values \(Mismatched .*added 2"),
        (lambda x: x * 3, r"wrong values .*\. Multiply by 2\.$"),
        (lambda x: x.sum() * 2, r"has shape \(\), expected \(2, 3\)\. Multiply by 2\."),
        (lambda x: (2 * x).double(), r"has dtype torch.float64, expected torch.float32"),
        (lambda x: (2 * x).tolist(), r"gave list, expected a torch.Tensor"),
        (lambda x: x / 0 * 0, r"contains NaN"),
        (lambda x: x.foo(), r"fn\(x\) raised AttributeError: .*'foo'\. x is a tensor\.$"),
        (lambda x: 2 * x if x.dim() == 2 else None, r"fn\(y\) gave NoneType"),
    ],
)
def test_harness_reports_every_kind_of_wrong_answer(answer, message, capsys):
    if message is None:
        check_toy(answer)
        assert capsys.readouterr().out == "✓ check_toy: correct — doubles\n"
    else:
        with pytest.raises(ExerciseError, match=message):
            check_toy(double=answer)


def test_harness_rejects_a_non_function_naming_the_argument():
    with pytest.raises(TypeError, match="check_toy: double should be a function, got Tensor"):
        check_toy(torch.ones(2))
    with pytest.raises(TypeError):
        check_toy()  # the signature is enforced like a plain function's


def test_harness_does_not_let_an_answer_spoil_the_next_case():
    def in_place(x):
        return x.mul_(2)

    for _ in range(2):  # the cases are rebuilt or cloned: the second run sees fresh inputs
        check_toy(in_place)


def test_exercise_and_prediction_take_mistakes_as_pairs_and_publish_finds_them():
    doubling = exercise("check_double", "doubles", TOY.reference, TOY.cases, TOY.mistakes[0])
    swapped = (lambda t: t[::-1], "Swapped.")
    guess = prediction("check_guess", "ok", lambda: (1, 2), swapped, outputs=("a", "b"))
    assert doubling.mistakes == TOY.mistakes and not doubling.prediction
    assert guess.prediction and guess.params == ("a", "b")
    assert guess.wrong_answers() == [((2, 1), "Swapped.")]
    namespace = {"GUESS": guess, "other": 1, "DOUBLING": doubling}
    assert publish(namespace) == (guess, doubling)
    assert namespace["check_guess"].__name__ == "check_guess"
    with pytest.raises(ExerciseError, match="Swapped"):
        namespace["check_guess"](2, 1)


def test_partial_prediction_is_an_error_not_a_skip():
    with pytest.raises(ExerciseError, match="unscaled should be a number, got Ellipsis"):
        mha.exercises.check_qk_variance_prediction(unscaled=..., scaled=1)
    with pytest.raises(ExerciseError, match="Replace the ... in predictions\\['out'\\]"):
        mha.exercises.check_mha_shape_predictions({**ch03._true_shapes(), "out": (2, ..., 12)})


# --- chapter 1 ----------------------------------------------------------------------------------


def test_seed_head_reproduces_the_seed():
    """The buggy recipe shown in the chapter really prints the seed's head 1."""
    w1 = ch01.HEAD_PROJECTIONS[0]
    out = ch01.SEED_HEAD_FIX.mistakes[0].fn(ch01.CAT_EATS_FISH, w1, w1, w1)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))


def test_seed_head_fix_skips_hints_that_coincide_with_the_answer():
    """On the seed's example E == D and w_q == w_k == w_v, so two 'wrong' recipes are right
    there; they must only be caught on the second (random) case, with their own hint."""
    calls = []

    def scale_by_width(x, w_q, w_k, w_v):
        calls.append(tuple(x.shape))
        q, k, v = x @ w_q, x @ w_k, x @ w_v
        return torch.softmax(q @ k.T / math.sqrt(x.shape[1]), dim=-1) @ v

    with pytest.raises(ExerciseError, match="not the model width"):
        mha.exercises.check_seed_head_fix(scale_by_width)
    assert calls == [(3, 2), (4, 6)]


@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")  # the learner's mistake
@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (lambda q, k: torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), -1), r"\(not key\.T\)"),
        (lambda q, k: (q @ k.transpose(-2, -1)).numpy(), "gave ndarray, expected a torch.Tensor"),
    ],
)
def test_lookup_weights_rejects(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_lookup_weights(fn)


@pytest.mark.parametrize(
    ("answer", "hint"),
    [
        ("half", "nested list of numbers"),
        ([[0, 0.33, 0], [0.50, 0, 0.33]], r"has shape \(2, 3\), expected \(3, 2\)"),
        ([[0, 0.25], [0, 0.50], [0, 0.25]], "That is not head 2"),
    ],
)
def test_head2_prediction_rejects(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_head2_prediction(answer)


def test_head2_prediction_accepts_rounded_and_exact(capsys):
    mha.exercises.check_head2_prediction([[0, 0.33], [0, 0.50], [0, 0.33]])
    mha.exercises.check_head2_prediction(torch.tensor([[0, 1 / 3], [0, 0.5035], [0, 1 / 3]]))
    assert capsys.readouterr().out.count("check_head2_prediction: correct") == 2


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (lambda out, perm: out.flip(0), "wrong values"),
        (lambda out, perm: out[perm].T, r"has shape \(8, 5\)"),
        (lambda out, perm: out[perm.tolist() + [0]], r"has shape \(6, 8\)"),
        (lambda out, perm: out[perm + 1], r"raised IndexError.*Index the rows of out with perm"),
    ],
)
def test_permuted_outputs_rejects(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_permuted_outputs(fn)


@pytest.mark.parametrize(
    "name",
    [
        "check_permuted_outputs",
        "check_multi_head_forward",
        "check_seed_mha_fix",
        "check_mha_shape_predictions",
    ],
)
def test_checkers_leave_the_global_rng_alone(name):
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    BY_NAME[name].check(BY_NAME[name].accepted_answer())
    assert torch.equal(torch.random.get_rng_state(), before)


# --- chapter 2 ----------------------------------------------------------------------------------


def stable_softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


@pytest.mark.parametrize(
    "calls",
    [
        lambda x, dim=-1: torch.softmax(x, dim=dim),
        lambda x, dim=-1: x.softmax(dim),
        lambda x, dim=-1: F.log_softmax(x, dim).exp(),
        lambda x, dim=-1: mha.softmax(x, dim=dim),
    ],
)
def test_check_softmax_forbids_ready_made_softmax_and_restores_it(calls):
    with pytest.raises(ExerciseError, match="without calling torch.softmax"):
        mha.exercises.check_softmax(calls)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    torch.testing.assert_close(x.softmax(-1), stable_softmax(x))
    torch.testing.assert_close(F.softmax(x, -1), mha.softmax(x))
    assert "softmax" not in vars(torch.Tensor)


def test_check_softmax_hints_keepdim_when_broadcasting_fails():
    def no_keepdim(x, dim=-1):
        e = torch.exp(x - x.amax(dim=dim))
        return e / e.sum(dim=dim)

    with pytest.raises(ExerciseError, match="raised RuntimeError: .*keepdim=True"):
        mha.exercises.check_softmax(no_keepdim)


def test_naive_softmax_really_fails_in_float16():
    x = torch.tensor([12.0, 10.0], dtype=torch.float16)  # the checker's float16 case is a trap
    (naive,) = [m.fn for m in ch02.SOFTMAX.mistakes if m.hint.startswith("exp() overflowed")]
    assert torch.isnan(naive(x)).any()
    assert torch.isfinite(stable_softmax(x)).all()


def test_check_sdpa_accepts_mT_and_rejects_fixed_transpose_dims(capsys):
    mha.exercises.check_sdpa(lambda q, k, v: torch.softmax(q @ k.mT * q.shape[-1] ** -0.5, -1) @ v)
    assert capsys.readouterr().out.startswith("✓ check_sdpa: correct")
    with pytest.raises(ExerciseError, match=r"raised IndexError.*negative dims"):
        mha.exercises.check_sdpa(
            lambda q, k, v: torch.softmax(q @ k.transpose(2, 3) / math.sqrt(q.shape[-1]), -1) @ v
        )


@pytest.mark.parametrize(
    "calls",
    [
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        lambda q, k, v: mha.scaled_dot_product_attention(q, k, v),
    ],
)
def test_check_sdpa_forbids_ready_made_attention_and_restores_it(calls):
    original = mha.scaled_dot_product_attention
    with pytest.raises(ExerciseError, match="without calling a ready-made"):
        mha.exercises.check_sdpa(calls)
    assert mha.scaled_dot_product_attention is original
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_check_qk_variance_prediction_accepts_the_theory(capsys):
    mha.exercises.check_qk_variance_prediction(unscaled=64, scaled=1)
    assert capsys.readouterr().out.startswith("✓ check_qk_variance_prediction: correct")


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"unscaled": "64", "scaled": 1}, "unscaled should be a number"),
        ({"unscaled": 512, "scaled": 1}, "sum of d_k independent products"),
        ({"unscaled": 64, "scaled": 64}, r"Var\(x / c\)"),
    ],
)
def test_check_qk_variance_prediction_rejects(kwargs, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_qk_variance_prediction(**kwargs)


@pytest.mark.parametrize(
    ("weights", "out", "hint"),
    [((2, 8, 10, 7), (8, 10, 32), r"\(B, H, L, Dv\)"), ("(2, 8, 10, 7)", (1,), "tuple of ints")],
)
def test_check_shape_prediction_rejects(weights, out, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_shape_prediction(weights=weights, out=out)


# --- chapter 3 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split",
    [
        lambda x, h: x.view(x.shape[0], x.shape[1], h, -1).transpose(1, 2),
        lambda x, h: x.unflatten(-1, (h, -1)).permute(0, 2, 1, 3),
        lambda x, h: torch.stack(x.chunk(h, dim=-1), dim=1),
    ],
)
def test_split_heads_accepts_correct_forms(split, capsys):
    mha.exercises.check_split_heads(split)
    assert "✓ check_split_heads" in capsys.readouterr().out


def test_merge_heads_accepts_transpose_reshape(capsys):
    mha.exercises.check_merge_heads(lambda x: x.transpose(1, 2).reshape(*x.shape[::2], -1))
    assert "✓ check_merge_heads" in capsys.readouterr().out


def test_split_heads_quotes_a_crash():
    with pytest.raises(ExerciseError, match=r"raised RuntimeError: .*works for any B and L"):
        mha.exercises.check_split_heads(lambda x, h: x.view(h, -1, 7))


def sdpa_forward(query, key, value, q_proj, k_proj, v_proj, o_proj, num_heads):
    """Written with view/transpose and torch's SDPA, independently of the checker's reference."""
    B, L, E = query.shape
    D = E // num_heads
    q, k, v = (
        p(t).view(B, -1, num_heads, D).transpose(1, 2)
        for p, t in ((q_proj, query), (k_proj, key), (v_proj, value))
    )
    return o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, E))


def test_multi_head_forward_accepts_an_independent_answer(capsys):
    mha.exercises.check_multi_head_forward(sdpa_forward)
    assert "✓ check_multi_head_forward" in capsys.readouterr().out


class SeedMHA(nn.Module):
    """The post's second implementation, bug included (its code, not the checker's variants)."""

    split_ok = merge_ok = False

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.d_model = num_heads, d_model
        self.query_fc = nn.Linear(d_model, d_model)
        self.key_fc = nn.Linear(d_model, d_model)
        self.value_fc = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, d_model)

    def forward(self, query, key, value):
        batch_size, d = query.size(0), self.d_model // self.num_heads
        query, key, value = self.query_fc(query), self.key_fc(key), self.value_fc(value)
        if self.split_ok:
            query, key, value = (
                t.view(batch_size, -1, self.num_heads, d)
                .transpose(1, 2)
                .reshape(batch_size * self.num_heads, -1, d)
                for t in (query, key, value)
            )
        else:
            query = query.view(batch_size * self.num_heads, -1, d)
            key = key.view(batch_size * self.num_heads, -1, d)
            value = value.view(batch_size * self.num_heads, -1, d)
        scores = torch.bmm(query, key.transpose(1, 2)) / np.sqrt(d)
        output = torch.bmm(F.softmax(scores, dim=-1), value)
        if self.merge_ok:
            output = output.view(batch_size, self.num_heads, -1, d).transpose(1, 2)
            output = output.reshape(batch_size, -1, self.d_model)
        else:
            output = output.view(batch_size, -1, self.d_model)
        return self.fc(output)


class SeedFixed(SeedMHA):
    split_ok = merge_ok = True


class SeedSplitFixedOnly(SeedMHA):
    split_ok = True


class SeedRenamed(SeedFixed):
    def __init__(self, d_model, num_heads):
        super().__init__(d_model, num_heads)
        self.W_o = self.fc
        del self.fc

    def forward(self, query, key, value):
        self.fc = self.W_o
        return super().forward(query, key, value)


class SeedNotImplemented(SeedMHA):
    def forward(self, query, key, value):
        raise NotImplementedError


def test_seed_fix_accepts_the_repaired_post(capsys):
    mha.exercises.check_seed_mha_fix(SeedFixed)
    mha.exercises.check_seed_mha_fix(SeedNotImplemented)
    assert capsys.readouterr().out == (
        "✓ check_seed_mha_fix: correct — the post's class now matches "
        "torch.nn.MultiheadAttention\n" + not_attempted_line("check_seed_mha_fix")
    )


@pytest.mark.parametrize(
    ("cls", "hint"),
    [
        (SeedMHA, "as the post's second implementation does"),
        (SeedSplitFixedOnly, "The split is right, the merge is not"),
        (SeedRenamed, "needs the post's layer fc"),
        (lambda: 0, r"raised TypeError: .*Keep the constructor"),
    ],
)
def test_seed_fix_rejects_the_post_as_written(cls, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_seed_mha_fix(cls)


RIGHT_SHAPES = {
    "q_proj.weight": (12, 12),
    "k_proj.weight": (6, 5),
    "v_proj.weight": (6, 7),
    "out_proj.weight": (12, 12),
    "weights": (2, 4, 3, 9),
    "out": (2, 3, 12),
    "num_parameters": 396,
}


def test_shape_predictions_match_the_module_and_accept_lists(capsys):
    assert ch03._true_shapes() == RIGHT_SHAPES
    mha.exercises.check_mha_shape_predictions(
        {**RIGHT_SHAPES, "out": [2, 3, 12], "weights": torch.Size([2, 4, 3, 9])}
    )
    assert "✓ check_mha_shape_predictions" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "hint"),
    [
        ({"k_proj.weight": (12, 5)}, "num_kv_heads·D"),
        ({"weights": (2, 2, 3, 9)}, r"one \(L, S\) matrix per \*query\* head"),
        (
            {"out": (2, 3, 7), "num_parameters": 4 * 12 * 12 + 4 * 12},
            r"2 of the 7 answers are wrong:\n.*one row of width E.*\n.*out_features·\(in_features",
        ),
        ({"out": "(2, 3, 12)"}, "should be a tuple of ints"),
        ({"num_parameters": 396.0}, "should be an int"),
    ],
)
def test_shape_predictions_reject(change, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_mha_shape_predictions({**RIGHT_SHAPES, **change})


@pytest.mark.parametrize(
    ("predictions", "hint"),
    [
        ({k: v for k, v in RIGHT_SHAPES.items() if k != "weights"}, r"missing \['weights'\]"),
        ([(12, 12)] * 7, "should be a dict"),
    ],
)
def test_shape_predictions_reject_the_wrong_container(predictions, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_mha_shape_predictions(predictions)


# --- chapter 4 ----------------------------------------------------------------------------------


def test_mask_checkers_accept_mha(capsys):
    mha.exercises.check_padding_mask(mha.padding_mask)
    mha.exercises.check_causal_mask(mha.causal_mask)
    assert capsys.readouterr().out.count(": correct") == 2


@pytest.mark.parametrize(
    ("name", "fn", "hint"),
    [
        ("check_padding_mask", lambda lengths, S: [1, 0], "gave list, expected a torch.Tensor"),
        ("check_causal_mask", mha.causal_mask_bottom_right, "bottom-right"),
        (
            "check_masked_attention",
            lambda q, k, v, keep: ch04._fill_safe(q, k, v, ~keep),
            "wrong values",
        ),
        (
            "check_masked_attention",
            lambda q, k, v, keep: 1.1 * ch04._fill_safe(q, k, v, keep),
            "wrong values",
        ),
        ("check_mask_conversion", lambda am: am == 0, r"should return a tuple \(key_padding_mask"),
        ("check_alibi_bias", lambda H, L: ch04.ALIBI_BIAS.reference(H, L) * 2, "wrong values"),
    ],
)
def test_mask_checkers_reject(name, fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(fn)


def test_mask_prediction_truth_matches_mha_and_rejects_ragged_rows():
    real = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    keep = real[:, None, None, :] & mha.causal_mask(4)
    shape, mask, empty = ch04._mask_truth()
    assert shape == tuple(keep.shape) and torch.equal(mask, keep[1, 0]) and empty == [0, 1]
    with pytest.raises(ExerciseError, match=r"mask has shape \(4, 3\), expected \(4, 4\)"):
        mha.exercises.check_mask_prediction((2, 1, 4, 4), [[0, 0, 1]] * 4, [0, 1])


def test_seed_attention_fails_only_in_low_precision_or_on_empty_rows():
    """The seed's code is right in float32 without empty rows: the checker must not over-reach."""
    q, k, v, keep = ch04._attention_cases()[0].args
    torch.testing.assert_close(
        ch04._fill_attention(q, k, v, keep, -1e9), F.scaled_dot_product_attention(q, k, v, keep)
    )


def test_mask_conversion_reference_agrees_with_torch_modules():
    """The reference answer really makes nn.MultiheadAttention and SDPA compute the same thing."""
    g = torch.Generator().manual_seed(0)
    kpm, sdpa_mask = ch04.MASK_CONVERSION.reference(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8, generator=g)
    torch_out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
    our_out, _ = mha.MultiHeadAttention.from_torch(module)(x, attn_mask=sdpa_mask)
    torch.testing.assert_close(our_out, torch_out)


# --- chapter 5 ----------------------------------------------------------------------------------


def test_chapter5_checkers_accept_mha(capsys):
    def module_step(q, k_new, v_new, k_cache, v_cache):  # through mha.KVCache
        cache = mha.KVCache()
        if k_cache.shape[-2]:
            cache.update(k_cache, v_cache)
        k, v = cache.update(k_new, v_new)
        keep = mha.causal_mask_bottom_right(q.shape[-2], k.shape[-2])
        return mha.scaled_dot_product_attention(q, k, v, keep), k, v

    mha.exercises.check_kv_cache_step(module_step)
    assert capsys.readouterr().out.count(": correct") == 1


@pytest.mark.parametrize(
    ("name", "fn", "hint"),
    [
        ("check_online_softmax_update", lambda m, l, acc, s, v: (m, l), r"tuple \(m, l, acc\)"),
        ("check_online_softmax_update", lambda m, l, acc, s, v: 1 / 0, "raised ZeroDivisionError"),
        ("check_kv_cache_step", lambda q, k, v, kc, vc: q, r"tuple \(out, k_cache, v_cache\)"),
    ],
)
def test_chapter5_checkers_reject(name, fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(fn)


RIGHT_BACKENDS = {
    "plain": "flash",
    "bool_mask": "flash",
    "causal": "flash",
    "bfloat16": "flash",
    "three_dims": "math",
    "dropout": "math",
    "value_dim": "math",
    "strided_last_dim": "math",
}


def test_backend_prediction_matches_a_forced_run():
    # Independent of mha.hardware: flash must succeed exactly where the answer says "flash".
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for case, picked in RIGHT_BACKENDS.items():
        args, kwargs = ch05.sdpa_case_inputs(case)
        try:
            with warnings.catch_warnings(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                warnings.simplefilter("ignore")  # torch explains its refusals in warnings
                F.scaled_dot_product_attention(*args, **kwargs)
            ran = "flash"
        except RuntimeError:
            ran = "math"
        assert ran == picked, case
    assert ch05.SDPA_BACKEND_PREDICTION.reference() == RIGHT_BACKENDS


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        ({**RIGHT_BACKENDS, "three_dims": "flash"}, "4 dimensional"),
        ({**RIGHT_BACKENDS, "dropout": "flash"}, "non-zero dropout"),
        ({**RIGHT_BACKENDS, "value_dim": "flash"}, "same last dimension"),
        ({**RIGHT_BACKENDS, "strided_last_dim": "flash"}, "stride 1"),
        ({**RIGHT_BACKENDS, "bfloat16": "math", "causal": "math"}, "2 of the 8 answers are wrong"),
        ({**RIGHT_BACKENDS, "plain": "fast"}, "should be 'flash' or 'math'"),
        ({k: v for k, v in RIGHT_BACKENDS.items() if k != "plain"}, r"missing \['plain'\]"),
        (["flash"] * 8, "should be a dict"),
    ],
)
def test_backend_prediction_rejects(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_sdpa_backend_prediction(wrong)


def test_case_inputs_rejects_unknown_name():
    with pytest.raises(ValueError, match="name must be one of"):
        ch05.sdpa_case_inputs("nope")


# --- chapter 6 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fn", "hint"),
    [
        ("check_tile_counts", lambda *args: [1, 2], r"return a tuple \(programs, kv_tiles\)"),
        ("check_tile_counts", lambda *args: (1.5, 2), "programs should be an int"),
        ("check_kv_tile_range", lambda *args: [0, 1], r"should return a tuple \(lo, hi\)"),
        (
            "check_backward_delta",
            lambda out, grad_out: (grad_out * out).mean(-1),
            r"\(grad_out \* out\)\.sum\(-1\)",
        ),
    ],
)
def test_chapter6_checkers_reject(name, fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(fn)


def test_backward_delta_accepts_keepdim(capsys):
    mha.exercises.check_backward_delta(lambda out, grad_out: (grad_out * out).sum(-1, keepdim=True))
    assert "✓ check_backward_delta" in capsys.readouterr().out


@pytest.fixture(scope="module")
def kernels():
    """Correct and wrong softmax kernels, decorated after TRITON_INTERPRET is settled."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def good(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def zero_padding(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=0.0)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def no_max(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        e = tl.exp(tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def ignores_stride(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * n_cols + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def first_row_only(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def wrong_signature(X, Y, n_cols, BLOCK: tl.constexpr):
        tl.store(Y, 0.0)

    @triton.jit
    def stub(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr): ...  # your code here

    return {
        "good": good,
        "zero_padding": zero_padding,
        "no_max": no_max,
        "ignores_stride": ignores_stride,
        "first_row_only": first_row_only,
        "wrong_signature": wrong_signature,
        "stub": stub,
    }


@pytest.mark.triton
def test_softmax_kernel_accepts_a_stable_masked_kernel(kernels, capsys):
    mha.exercises.check_softmax_kernel(kernels["good"])
    mha.exercises.check_softmax_kernel(kernels["stub"])
    assert capsys.readouterr().out == (
        "✓ check_softmax_kernel: correct — ragged rows, large logits and strided rows all right\n"
        + not_attempted_line("check_softmax_kernel")
    )


@pytest.mark.triton
@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("zero_padding", r"other=-float\('inf'\)"),
        ("no_max", "subtract the row maximum"),
        ("ignores_stride", r"X \+ r \* stride_x"),
        ("first_row_only", "never written"),
        ("wrong_signature", "Keep the signature"),
    ],
)
def test_softmax_kernel_rejects_typical_mistakes(kernels, name, hint, capfd):
    with warnings.catch_warnings(record=True) as caught:  # the interpreter's NumPy overflows in
        warnings.simplefilter("always")  # exp (no_max): the checker keeps that off stderr
        with pytest.raises(ExerciseError, match=hint):
            mha.exercises.check_softmax_kernel(kernels[name])
    assert caught == [] and capfd.readouterr().err == ""


@pytest.mark.triton
def test_softmax_kernel_rejects_a_plain_function():
    pytest.importorskip("triton")

    def softmax_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK):
        return Y

    with pytest.raises(ExerciseError, match="decorated with @triton.jit"):
        mha.exercises.check_softmax_kernel(softmax_kernel)


# --- every checker: correct answers written differently pass, shortcuts fail (issue #14) ------


def _by_logsumexp(x, dim=-1):
    return torch.exp(x - torch.logsumexp(x, dim, keepdim=True))  # 2e-5 off near 1000: allowed


def _in_float64(x, dim=-1):
    y = x.double()
    e = (y - y.max(dim, keepdim=True).values).exp()
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


def _update_out_of_place(m, l, acc, scores, value):
    m_new = torch.maximum(m, scores.max(-1, keepdim=True).values)
    safe = m_new.nan_to_num(neginf=0.0)  # 0 where no key was visible yet
    p, alpha = (scores - safe).exp(), (m - safe).exp()
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ value


def _masked_where(q, k, v, keep):  # the chapter's solution, written with torch.where
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    has_key = keep.any(-1, keepdim=True)
    scores = torch.where(keep | ~has_key, scores, float("-inf"))
    return torch.where(has_key, torch.softmax(scores, -1), 0.0) @ v.float()


def _alibi_loops(H, L):
    bias = torch.full((H, L, L), float("-inf"))
    for h in range(H):
        for i in range(L):
            for j in range(i + 1):
                bias[h, i, j] = -(2 ** (-8 * (h + 1) / H)) * (i - j)
    return bias


def _tile_counts_ceil(B, H, L, S, block_m, block_n, is_causal):
    n_m = math.ceil(L / block_m)
    hi = [min(S, L, (i + 1) * block_m) if is_causal else S for i in range(n_m)]
    return n_m * B * H, sum(math.ceil(h / block_n) for h in hi) * B * H


def _kv_range_floor(start_m, BLOCK_M, BLOCK_N, L, S, window):
    lo = max(0, start_m * BLOCK_M - window + 1)
    return math.floor(lo / BLOCK_N) * BLOCK_N, min(S, L, (start_m + 1) * BLOCK_M)


class SeedViaTorch(SeedMHA):
    """A shortcut: the post's layers fed to torch's own multi-head attention."""

    def forward(self, query, key, value):
        layer = nn.MultiheadAttention(self.d_model, self.num_heads, batch_first=True)
        return layer(self.query_fc(query), self.key_fc(key), self.value_fc(value))[0]


def _torch_layer_forward(query, key, value, q_proj, k_proj, v_proj, out_proj, num_heads):
    layer = nn.MultiheadAttention(query.shape[-1], num_heads, batch_first=True)
    return layer(q_proj(query), k_proj(key), v_proj(value), need_weights=False)[0]


def _mha_module_forward(query, key, value, q_proj, k_proj, v_proj, out_proj, num_heads):
    module = mha.MultiHeadAttention(query.shape[-1], num_heads, kdim=key.shape[-1])
    return module(query, key, value)[0]


#: For every checker, answers written unlike the reference that it must accept.
VARIANTS = {
    "check_lookup_weights": [
        lambda q, k: (q @ k.mT * q.shape[-1] ** -0.5).softmax(-1),
        lambda q, k: (
            torch.einsum("...ld,...sd->...ls", q.double(), k.double())
            .div(math.sqrt(q.shape[-1]))
            .softmax(-1)
        ),
    ],
    "check_seed_head_fix": [
        lambda x, w_q, w_k, w_v: (
            torch.softmax((x @ w_q / math.sqrt(w_k.shape[1])) @ (x @ w_k).T, dim=1) @ (x @ w_v)
        ),
    ],
    "check_head2_prediction": [
        ((0, 1 / 3), (0, 0.5), (0, 1 / 3)),
        np.array([[0, 0.33]] * 3) + [[0, 0], [0, 0.17], [0, 0]],
    ],
    "check_permuted_outputs": [
        lambda out, perm: out.index_select(0, perm),
        lambda out, perm: torch.stack([out[i] for i in perm.tolist()]),
    ],
    "check_softmax": [_by_logsumexp, _in_float64, stable_softmax],
    "check_qk_variance_prediction": [(64.0, 1.0), (np.float64(64), 1)],
    "check_shape_prediction": [(torch.Size([2, 8, 10, 7]), [2, 8, 10, 32])],
    "check_sdpa": [
        lambda q, k, v: torch.softmax((q / math.sqrt(q.shape[-1])) @ k.mT, dim=-1) @ v,
        lambda q, k, v: (
            (torch.einsum("...ld,...sd->...ls", q.double(), k.double()) / q.shape[-1] ** 0.5)
            .softmax(-1)
            .float()
            @ v
        ),
    ],
    "check_split_heads": [lambda x, h: x.unflatten(-1, (h, -1)).permute(0, 2, 1, 3)],
    "check_merge_heads": [
        lambda x: x.permute(0, 2, 1, 3).flatten(2),
        lambda x: torch.cat([x[:, h] for h in range(x.shape[1])], dim=-1),
    ],
    "check_multi_head_forward": [sdpa_forward],
    "check_seed_mha_fix": [SeedFixed],
    "check_mha_shape_predictions": [{**RIGHT_SHAPES, "out": [2, 3, 12]}],
    "check_padding_mask": [
        mha.padding_mask,
        lambda lengths, S: (torch.arange(S) < lengths.unsqueeze(-1)).view(-1, 1, 1, S),
    ],
    "check_causal_mask": [
        mha.causal_mask,
        lambda L, S=None: torch.arange(L)[:, None] >= torch.arange(S or L)[None, :],
    ],
    "check_mask_prediction": [
        ((2, 1, 4, 4), [[False] * 4, [False] * 4, [0, 0, 1, 0], [0, 0, 1, 1]], (1, 0))
    ],
    "check_masked_attention": [_masked_where],
    "check_mask_conversion": [lambda am: (~am.bool(), am.bool().view(am.shape[0], 1, 1, -1))],
    "check_alibi_bias": [_alibi_loops],
    "check_online_softmax_update": [_update_out_of_place],
    "check_kv_cache_step": [
        lambda q, kn, vn, kc, vc: (
            F.scaled_dot_product_attention(
                q,
                torch.cat([kc, kn], -2),
                torch.cat([vc, vn], -2),
                attn_mask=mha.causal_mask_bottom_right(q.shape[-2], kc.shape[-2] + kn.shape[-2]),
            ),
            torch.cat([kc, kn], -2),
            torch.cat([vc, vn], -2),
        )
    ],
    "check_sdpa_backend_prediction": [dict(reversed(RIGHT_BACKENDS.items()))],
    "check_tile_counts": [_tile_counts_ceil],
    "check_kv_tile_range": [_kv_range_floor],
    "check_backward_delta": [
        lambda out, grad_out: torch.einsum("...ld,...ld->...l", out, grad_out)
    ],
}

#: Shortcuts learners take (a library call where the exercise is to write it, a shift that is not
#: the maximum) with the hint each must get.
SHORTCUTS = [
    ("check_lookup_weights", lambda q, k: ch01._lookup_reference(q, k), "without a ready-made"),
    (
        "check_seed_head_fix",
        lambda x, w_q, w_k, w_v: F.scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v),
        "without a ready-made",
    ),
    ("check_softmax", torch.softmax, "without calling torch.softmax"),
    ("check_softmax", lambda x, dim=-1: F.softmax(x, dim), "without calling torch.softmax"),
    ("check_softmax", lambda x, dim=-1: torch.special.softmax(x, dim), "without calling"),
    (
        "check_softmax",
        lambda x, dim=-1: (
            (x - x.mean(dim, keepdim=True))
            .exp()
            .div((x - x.mean(dim, keepdim=True)).exp().sum(dim, keepdim=True))
        ),
        r"row \*maximum\* keeps exponents <= 0: \[1000, 0\] minus its mean",
    ),
    (
        "check_softmax",
        lambda x, dim=-1: (
            (x - x.select(dim, 0).unsqueeze(dim))
            .exp()
            .div((x - x.select(dim, 0).unsqueeze(dim)).exp().sum(dim, keepdim=True))
        ),
        r"not the first element: \[0, 1000\]",
    ),
    ("check_sdpa", F.scaled_dot_product_attention, "without calling a ready-made"),
    ("check_multi_head_forward", _torch_layer_forward, "without nn.MultiheadAttention"),
    ("check_multi_head_forward", _mha_module_forward, "without nn.MultiheadAttention"),
    ("check_seed_mha_fix", SeedViaTorch, "without nn.MultiheadAttention"),
    ("check_masked_attention", F.scaled_dot_product_attention, "without a ready-made attention"),
    (
        "check_masked_attention",
        lambda q, k, v, keep: mha.scaled_dot_product_attention(q, k, v, keep),
        "without a ready-made attention",
    ),
    ("check_online_softmax_update", mha.online_softmax_update, "without mha.online_softmax"),
    (
        "check_online_softmax_update",
        lambda *args: mha.online_softmax_update(*args),
        "without mha.online_softmax",
    ),
]


def test_every_checker_has_variants_and_the_shortcut_table_names_real_checkers():
    chapters_1_to_6 = (ch01, ch02, ch03, ch04, ch05, ch06)
    names = {ex.name for module in chapters_1_to_6 for ex in module.EXERCISES}
    assert set(VARIANTS) == names - {"check_softmax_kernel"}  # the kernel: tested above
    assert {name for name, _, _ in SHORTCUTS} <= set(VARIANTS)


@pytest.mark.parametrize(
    ("name", "answer"),
    [(name, answer) for name, answers in VARIANTS.items() for answer in answers],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_correct_variant_passes(name, answer, capsys):
    params = BY_NAME[name].params
    args = answer if len(params) > 1 else (answer,)
    getattr(mha.exercises, name)(*args)
    assert capsys.readouterr().out.startswith(f"✓ {name}: correct — ")


@pytest.mark.parametrize(
    ("name", "answer", "hint"), SHORTCUTS, ids=lambda v: v if isinstance(v, str) else ""
)
def test_shortcut_fails_with_its_hint_and_leaves_the_library_alone(name, answer, hint):
    originals = (torch.softmax, F.scaled_dot_product_attention, F.multi_head_attention_forward)
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(answer)
    assert (
        torch.softmax,
        F.scaled_dot_product_attention,
        F.multi_head_attention_forward,
    ) == originals
    assert mha.MultiHeadAttention.forward.__name__ == "forward"


def test_a_failing_answer_writes_nothing_to_stderr(capfd):
    def numpy_naive(x, dim=-1):  # numpy warns "overflow encountered in exp" on its own
        e = np.exp(x.numpy())
        return torch.from_numpy(e / e.sum(axis=dim, keepdims=True))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ExerciseError, match="exp"):
            mha.exercises.check_softmax(numpy_naive)
    assert caught == [] and capfd.readouterr().err == ""
