"""The exercise checkers, tested from their declarations.

Generated for every exercise of :data:`mha.exercises.EXERCISES`: it declares at least two correct
variants, each passes with the success line the notebooks store, in English and in Chinese (the
line the Chinese notebooks store), leaving the global RNG alone; every declared mistake fails with
its own hint, in English and in Chinese; and the notebook's stub prints "not attempted yet"
without raising; the checkers the chapters' solutions call are exactly the declared ones. Each
declared answer is computed once: the check runs in English, then again in Chinese on what the
English run computed (:class:`Replay`), since the language changes the words of a line, never
what the checker computes. The harness's common paths (crash, NaN, shape, dtype, non-tensor, wrong
kind of argument) are tested once; what a declaration cannot say (a crash quoted back, the generic
hint, the post's own buggy class) is tested explicitly below. Banned functions:
``test_exercises_bans.py``; the Chinese catalogue and the language switch: ``test_exercises_zh.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from torch import nn

import mha
import mha.exercises
from mha.exercises import (
    CHAPTERS,
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
from mha.exercises._harness import Case, Exercise, Lazy, publish
from mha.exercises._zh import MESSAGES

sys.path.insert(0, str(REPO / "tools"))
from fold_solutions import solution_ranges  # noqa: E402 (tools/ joins the path first)

BY_NAME = {ex.name: ex for ex in EXERCISES}
# The notebooks with exercises (the appendix has none; an opening page shares its sections' NN).
CHAPTER_NOTEBOOKS = sorted(
    p
    for p in (REPO / "chapters").glob("[0-9][0-9]_*.ipynb")
    if ":::{exercise}" in p.read_text(encoding="utf-8")
)


def _stored_lines(folder: Path) -> set[str]:
    """Every line the committed notebooks in ``folder`` print."""
    lines = set()
    for path in sorted(folder.glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            for out in cell.get("outputs", []):
                lines.update("".join(out.get("text", "")).splitlines())
    return lines


STORED_LINES = _stored_lines(REPO / "chapters")
STORED_LINES_ZH = _stored_lines(REPO / "zh" / "chapters")  # the Chinese edition's notebooks


def declared(kind: str) -> list:
    """``(exercise, index)`` of every declared variant or mistake; a Triton kernel's are marked."""
    return [
        pytest.param(ex, i, marks=[pytest.mark.triton] if ex.custom else [], id=f"{ex.name}-{i}")
        for ex in EXERCISES
        for i in range(len(ex.variants if kind == "variants" else ex.mistakes))
    ]


def _stub(*args, **kwargs): ...  # your code here


def _stub_args(ex: Exercise) -> list[object]:
    """What the notebook's stub cell passes: a function whose body is ``...``, or ``...``s."""
    return [...] * len(ex.params) if ex.prediction else [_stub]


def not_attempted_line(name: str) -> str:
    return (
        f"○ {name}: not attempted yet — write your answer in the cell above, then run it again.\n"
    )


# --- generated from the declarations --------------------------------------------------------


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_declaration_has_two_variants_and_its_mistakes(ex):
    variants = [v.build if isinstance(v, Lazy) else v for v in ex.variants]
    assert len(variants) >= 2, f"{ex.name}: declare at least two correct variants"
    assert len({id(v) for v in variants}) == len(variants), f"{ex.name}: a variant twice"
    assert all(v is not ex.reference for v in variants), f"{ex.name}: the reference as a variant"
    assert ex.mistakes and all(hint for _, hint in ex.mistakes), f"{ex.name}: no mistakes"
    if ex.forbidden:
        assert any(hint == ex.forbidden_hint for _, hint in ex.mistakes), (
            f"{ex.name}: declare a call of a banned function as a mistake"
        )


class Replay:
    """What a check computes, recorded in one run and handed back to a second run of it.

    A check asks for what it computes through an exercise's ``cases`` (its inputs) and two
    methods of :class:`Exercise`: ``_truth`` (the reference's output) and ``_output`` (what the
    learner's answer, or a known mistake it is compared with, gives on a case). While
    :meth:`recording`, their results are kept in the order they are asked for; while
    :meth:`replaying`, the same requests, in the same order (checked: which exercise, which case,
    which answer), get the recorded results instead of computing them again. A request that raised
    while recording (a banned function called, an answer of the wrong kind) runs again for real,
    so that its message is made in the language of the second run. Outside both, everything runs
    as usual.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mode: str | None = None
        self.tape: list[tuple[tuple, bool, object]] = []  # (request, returned?, result)
        self.position = 0
        truth, output = Exercise._truth, Exercise._output

        def replayed_truth(ex: Exercise, *args: object, **kwargs: object) -> object:
            request = ("reference", ex.name, len(args), tuple(kwargs))
            return self._step(request, lambda: truth(ex, *args, **kwargs))

        def replayed_output(ex: Exercise, answer: object, case: Case) -> object:
            # a function answer is itself (declared once); a value answer (a prediction) its type
            who = answer if callable(answer) else type(answer)
            return self._step(
                ("output", ex.name, case.label, who), lambda: output(ex, answer, case)
            )

        def replayed_cases(ex: Exercise, cases):
            return lambda: self._step(("cases", ex.name), lambda: list(cases()))

        monkeypatch.setattr(Exercise, "_truth", replayed_truth)
        monkeypatch.setattr(Exercise, "_output", replayed_output)
        for ex in EXERCISES:  # a field of each (frozen) exercise, not a method of the class
            monkeypatch.setitem(vars(ex), "cases", replayed_cases(ex, ex.cases))

    def _step(self, request: tuple, compute) -> object:
        if self.mode == "record":
            try:
                result = compute()
            except BaseException:
                self.tape.append((request, False, None))
                raise
            self.tape.append((request, True, result))
            return result
        if self.mode == "replay":
            assert self.position < len(self.tape), f"the second run asks for more: {request}"
            recorded, returned, result = self.tape[self.position]
            self.position += 1
            assert recorded == request, f"the second run asks for {request}, the first {recorded}"
            return result if returned else compute()
        return compute()

    @contextlib.contextmanager
    def recording(self):
        self.mode, self.tape, self.position = "record", [], 0
        try:
            yield
        finally:
            self.mode = None

    @contextlib.contextmanager
    def replaying(self):
        self.mode = "replay"
        try:
            yield
        finally:
            self.mode = None
        assert self.position == len(self.tape), "the second run asked for less than the first"


@pytest.fixture
def replay(monkeypatch) -> Replay:
    return Replay(monkeypatch)


@contextlib.contextmanager
def in_chinese():
    mha.exercises.set_language("zh")
    try:
        yield
    finally:
        mha.exercises.set_language("en")


@pytest.mark.parametrize(("ex", "index"), declared("variants"))
def test_variant_is_accepted_with_its_stored_line_in_english_and_chinese(ex, index, replay, capsys):
    answer = ex.as_answer(ex.variants[index])
    rng = torch.random.get_rng_state()
    with replay.recording():
        ex.check(answer)
    assert torch.equal(torch.random.get_rng_state(), rng), f"{ex.name} moved the global RNG"
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {ex.name}: correct — ") and out.count("\n") == 1, out
    assert out.rstrip("\n") in STORED_LINES, f"the notebooks do not print {out!r}"
    with in_chinese(), replay.replaying():
        ex.check(answer)
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {ex.name}：正确——") and out.count("\n") == 1, out
    if isinstance(ex.success, str) and ex.success:
        assert out == f"✓ {ex.name}：正确——{MESSAGES[ex.success]}\n"
    assert out.rstrip("\n") in STORED_LINES_ZH, f"the Chinese notebooks do not print {out!r}"


@pytest.mark.parametrize(("ex", "index"), declared("mistakes"))
def test_mistake_is_rejected_with_its_hint_in_english_and_chinese(ex, index, replay):
    fn, hint = ex.mistakes[index]
    answer = ex.as_answer(fn)
    with replay.recording(), pytest.raises(ExerciseError) as english:
        ex.check(answer)
    assert hint in str(english.value)
    assert isinstance(english.value, AssertionError)
    with in_chinese(), replay.replaying(), pytest.raises(ExerciseError) as chinese:
        ex.check(answer)
    assert MESSAGES[hint] in str(chinese.value), (hint, str(chinese.value))


@pytest.mark.parametrize(
    ("lines", "prefix"),
    [(STORED_LINES, ": correct — "), (STORED_LINES_ZH, "：正确——")],
    ids=["en", "zh"],
)
def test_the_notebooks_show_one_success_line_per_checker(lines, prefix):
    """With the variants' lines among the stored ones (above), the line a notebook shows for a
    checker is the one it prints."""
    shown: dict[str, set[str]] = {}
    for line in lines:
        match = re.match(rf"✓ (check_\w+){prefix}", line)
        if match:
            shown.setdefault(match.group(1), set()).add(line)
    assert set(shown) == set(BY_NAME), set(shown) ^ set(BY_NAME)
    assert {name: len(forms) for name, forms in shown.items() if len(forms) > 1} == {}


def _printed(ex: Exercise, answer: object) -> str:
    """The line a check prints, or the message it raises."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            ex.check(answer)
    except ExerciseError as err:
        return str(err)
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "kind", "index"),
    [
        ("check_sdpa", "variants", 0),
        ("check_sdpa", "mistakes", 2),  # found after trying the mistakes before it
        ("check_softmax", "mistakes", 7),  # torch.softmax: a banned call, run again for real
        ("check_mha_shape_predictions", "mistakes", 1),  # a prediction, several wrong parts
        ("check_backward_fix", "mistakes", 1),  # three outputs compared one by one
    ],
)
def test_a_replayed_check_prints_what_a_real_run_prints(name, kind, index, replay):
    ex = BY_NAME[name]
    declared_answer = getattr(ex, kind)[index]
    answer = ex.as_answer(declared_answer if kind == "variants" else declared_answer.fn)
    with in_chinese():
        real = _printed(ex, answer)
    with replay.recording():
        _printed(ex, answer)
    with in_chinese(), replay.replaying():
        assert _printed(ex, answer) == real
    assert replay.tape, "nothing was recorded"


def test_a_replay_fails_when_the_second_run_asks_for_other_outputs(replay):
    with replay.recording():
        TOY.check(TOY.variants[0])
    with pytest.raises(AssertionError, match="the second run asks for .*the first"):
        with replay.replaying():
            TOY.check(TOY.variants[1])  # another answer: its outputs were never recorded
    with replay.recording():
        TOY.check(TOY.variants[0])
    with pytest.raises(AssertionError, match="asked for less than the first"):
        with replay.replaying():
            pass  # a second run that asks for nothing


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


def _solution_checkers(path) -> set[str]:
    """The checkers a chapter's solution cells call."""
    nb = nbformat.read(path, as_version=4)
    cells = [nb.cells[i] for start, end in solution_ranges(nb) for i in range(start + 1, end)]
    code = "\n".join(cell.source for cell in cells if cell.cell_type == "code")
    return set(re.findall(r"\bmha\.exercises\.(check_\w+)\s*\(", code))


@pytest.mark.parametrize("module", CHAPTERS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_chapter_calls_exactly_its_declared_exercises(module):
    """A chapter's notebooks read together: the chapter and its sections (NN_K_name)."""
    paths = [p for p in CHAPTER_NOTEBOOKS if p.name.startswith(module.__name__[-2:] + "_")]
    assert paths, f"no notebook of chapter {module.__name__[-2:]}"
    names = ", ".join(p.name for p in paths)
    declared_names = {ex.name for ex in module.EXERCISES}
    called = set().union(*(_solution_checkers(path) for path in paths))
    assert called - declared_names == set(), f"{names} call undeclared checkers"
    assert declared_names - called == set(), f"declared but not used by {names}"


def test_every_chapter_with_exercises_has_its_module():
    chapters = sorted({p.name[:2] for p in CHAPTER_NOTEBOOKS})  # a chapter's sections share it
    assert [m.__name__[-2:] for m in CHAPTERS] == chapters
    assert [ex.name for m in CHAPTERS for ex in m.EXERCISES] == [ex.name for ex in EXERCISES]
    assert len(BY_NAME) == len(EXERCISES), "two exercises share a checker name"
    for module in CHAPTERS:  # re-exported: the chapter's own checker
        for ex in module.EXERCISES:
            assert getattr(mha.exercises, ex.name) is getattr(module, ex.name)


def test_mha_loads_exercises_lazily():
    code = "import mha, sys; print('mha.exercises' in sys.modules); mha.exercises.check_softmax"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_mha_exercises_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # import triton raises ImportError
        "import mha.exercises as ex\nex.check_softmax_kernel(None)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "check_softmax_kernel: not attempted yet" in result.stdout


# --- the harness's common paths ---------------------------------------------------------------

TOY = Exercise(
    "check_toy",
    "doubles",
    lambda x: 2 * x,
    lambda: [Case("fn(x)", (torch.arange(6.0).reshape(2, 3),)), Case("fn(y)", (torch.ones(3),))],
    variants=(lambda x: x * 2.0, lambda x: x + x),
    mistakes=((lambda x: x + 2, "You added 2."),),
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


def test_one_declaration_form_for_functions_predictions_and_lazy_answers():
    guess = Exercise(
        "check_guess",
        "ok",
        lambda: (1, 2),
        prediction=True,
        variants=(lambda t: t, lambda t: [1.0, 2]),
        mistakes=((lambda t: t[::-1], "Swapped."),),
        outputs=("a", "b"),
    )
    assert guess.params == ("a", "b") and TOY.params == ("double",)
    assert guess.right_answers() == [(1, 2), [1.0, 2]]
    assert guess.wrong_answers() == [((2, 1), "Swapped.")]
    assert guess.mistakes[0].hint == "Swapped."  # pairs become Mistakes
    lazy = Exercise("check_lazy", "ok", None, variants=(Lazy(lambda: abs),), custom=str)
    assert lazy.accepted_answer() is abs
    namespace = {"GUESS": guess, "other": 1, "TOY": TOY}
    assert publish(namespace) == (guess, TOY)
    assert namespace["check_guess"].__name__ == "check_guess"
    with pytest.raises(ExerciseError, match="Swapped"):
        namespace["check_guess"](2, 1)


def test_partial_prediction_is_an_error_not_a_skip():
    with pytest.raises(ExerciseError, match="by_width should be a number, got Ellipsis"):
        mha.exercises.check_qk_variance_prediction(by_width=..., std_two=16)
    with pytest.raises(ExerciseError, match="Replace the ... in predictions\\['out'\\]"):
        mha.exercises.check_mha_shape_predictions({**ch03._true_shapes(), "out": (2, ..., 12)})


def test_a_failing_answer_writes_nothing_to_stderr(capfd):
    def numpy_naive(x, dim=-1):  # numpy warns "overflow encountered in exp" on its own
        e = np.exp(x.numpy())
        return torch.from_numpy(e / e.sum(axis=dim, keepdims=True))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ExerciseError, match="exp"):
            mha.exercises.check_softmax(numpy_naive)
    assert caught == [] and capfd.readouterr().err == ""


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


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (lambda x, keys, w: torch.cdist(x, keys).numpy(), "gave ndarray, expected a torch.Tensor"),
        (lambda x, keys, w: (x - keys).sum(-1), r"raised RuntimeError.*broadcasts to"),
        (lambda x, keys, w: (x @ keys.mT / w**2).softmax(-1), "the key's own term"),
    ],
)
def test_lookup_weights_rejects(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_lookup_weights(fn)


def test_lookup_weights_shortcuts_fail_where_the_exercise_says():
    """exp / sum is right until every kernel value underflows (width 0.05): only there NaN."""
    cases = ch01.LOOKUP_WEIGHTS.cases()
    naive = ch01._kernel_by_exp
    assert not any(naive(*c.args).isnan().any() for c in cases[:-1])
    assert naive(*cases[-1].args).isnan().all()
    torch.testing.assert_close(
        ch01.LOOKUP_WEIGHTS.reference(*cases[-1].args), torch.eye(3)[[0, 0, 2]]
    )


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


# --- chapter 2 ----------------------------------------------------------------------------------


def stable_softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


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


def test_check_sdpa_rejects_fixed_transpose_dims():
    with pytest.raises(ExerciseError, match=r"raised IndexError.*negative dims"):
        mha.exercises.check_sdpa(
            lambda q, k, v: torch.softmax(q @ k.transpose(2, 3) / math.sqrt(q.shape[-1]), -1) @ v
        )


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"by_width": "1/8", "std_two": 16}, "by_width should be a number"),
        ({"by_width": 1, "std_two": 16}, "not the width E = 512"),
        ({"by_width": 0.125, "std_two": 4}, "variance 2²·2² = 16"),
        ({"by_width": 0.125, "std_two": 64}, r"Var\(q_i·k_i\) = Var\(q_i\)·Var\(k_i\)"),
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


def test_split_heads_quotes_a_crash():
    with pytest.raises(ExerciseError, match=r"raised RuntimeError: .*works for any B and L"):
        mha.exercises.check_split_heads(lambda x, h: x.view(h, -1, 7))


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


@pytest.mark.parametrize(
    ("name", "fn", "hint"),
    [
        ("check_padding_mask", lambda lengths, S: [1, 0], "gave list, expected a torch.Tensor"),
        (
            "check_causal_mask",
            lambda L, S, window=None: ch04._cache_slip(L, S, window, shift=L - S),
            "bottom-right",
        ),
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
        (
            "check_alibi_bias",
            lambda H, L, S: ch04._alibi(H, L, S) * 2,
            "wrong values",
        ),
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


@pytest.mark.triton
def test_softmax_kernel_rejects_a_plain_function():
    pytest.importorskip("triton")

    def softmax_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK):
        return Y

    with pytest.raises(ExerciseError, match="decorated with @triton.jit"):
        mha.exercises.check_softmax_kernel(softmax_kernel)


@pytest.mark.triton
def test_softmax_kernel_stub_and_no_max_leave_stderr_alone(capfd):
    pytest.importorskip("triton")
    import triton
    import triton.language as tl

    @triton.jit
    def stub(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr): ...  # your code here

    mha.exercises.check_softmax_kernel(stub)
    assert capfd.readouterr().out == not_attempted_line("check_softmax_kernel")
    with warnings.catch_warnings(record=True) as caught:  # the interpreter's NumPy overflows in
        warnings.simplefilter("always")  # exp (no_max): the checker keeps that off stderr
        with pytest.raises(ExerciseError, match="subtract the row maximum"):
            mha.exercises.check_softmax_kernel(ch06._kernels()["no_max"])
    assert caught == [] and capfd.readouterr().err == ""


# --- chapter 7 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "answer", "hint"),
    [
        (
            "check_sink_backward",
            lambda q, k, v, sink, d_out: ch07._sink_backward(q, k, v, sink, d_out)[::-1],
            r"dq has shape .*lse = logsumexp of the S scores and the sink",
        ),
        (
            "check_sink_backward",
            lambda q, k, v, sink, d_out: ch07._sink_backward(q, k, v, sink, d_out)[:3],
            r"should return a tuple \(dq, dk, dv, d_sink\)",
        ),
        (
            "check_backward_fix",
            ch07._buggy_backward,
            r"dq has the right shape but wrong values.*rowsum\(P \* dP\).*dS = P \* \(dP - δ\)",
        ),
        (
            "check_backward_fix",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out)[::-1],
            r"dq has shape .*dQ = dS·K·scale",
        ),
        (
            "check_backward_fix",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out)[:2],
            r"should return a tuple \(dq, dk, dv\)",
        ),
        (
            "check_key_tile_backward",
            lambda q, k, v, out, dout, lse, scale: ch07._key_tile(q, k, v, out, dout, lse, scale)[
                ::-1
            ],
            r"dq_part has shape .*P = exp\(Q·K_tileᵀ·scale",
        ),
    ],
)
def test_chapter7_checkers_reject(name, answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(answer)


def test_key_tile_cases_overflow_exp_vary_the_scale_and_cut_a_tile():
    """The text promises scores that overflow exp: above 709.8 (float64), hence 88.7 (float32),
    a scale other than 1/sqrt(D), and a tile of fewer keys than S, wider and narrower than L."""
    cases = ch07._key_tile_cases()
    scales = {case.args[-1] for case in cases}
    assert any(s != 8**-0.5 for s in scales)
    largest = max((q @ k.mT * scale).max().item() for q, k, *_, scale in (c.args for c in cases))
    assert largest > 709.8 and torch.isinf(torch.tensor(largest, dtype=torch.float64).exp())
    tiles = [(c.args[0].shape[-2], c.args[1].shape[-2]) for c in cases]  # (L, C)
    assert any(L < C for L, C in tiles) and any(L > C for L, C in tiles)


@pytest.mark.parametrize(
    ("answer", "hint"),
    [
        ((2048, 4, 2), "divide the bytes by 2\\*\\*20|4 bytes|32 heads|B·H·L·S"),
        ((8192, 2, 2), "multiplies them by 4"),
        ((8192, 4, 4), "doubling L doubles them"),
        (("8 GiB", 4, 2), "mib should be a number"),
    ],
)
def test_memory_prediction_rejects(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_memory_prediction(*answer)


# --- chapter 8 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "answer", "hint"),
    [
        ("check_rope", lambda x, positions: x, "Pair coordinate i with i \\+ D/2"),
        (
            "check_merge_partials",
            lambda out1, lse1, out2, lse2: lse1.exp() * out1 + lse2.exp() * out2,
            "raised RuntimeError.*lse\\[..., None\\]",
        ),
        (
            "check_page_lookup",
            lambda table, lens, new, free, bs: [
                table[b][t // bs] * bs + t % bs + 1
                for b in range(len(table))
                for t in range(lens[b], lens[b] + new[b])
            ],
            "raised IndexError.*append free_blocks.pop\\(\\) to block_table\\[b\\]",
        ),
        ("check_page_lookup", lambda table, lens, new, free, bs: ["slot 3"], "should be an int"),
        ("check_page_lookup", lambda table, lens, new, free, bs: 3, "a list of ints, got int"),
    ],
)
def test_chapter8_checkers_reject(name, answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(answer)


def test_rope_tolerance_is_float32_rounding_of_the_angles():
    """Hugging Face's float32 RoPE differs from the float64 reference by rounding only (~1e-7 at
    positions 0…5, ~4e-6 at position 900): accepted. A rotation off by 1e-4 radians is not."""
    (case, far) = ch08.rope._rope_cases()
    for c in (case, far):
        got, want = ch08.rope._rope_hugging_face(*c.args), ch08.rope._rope_reference(*c.args)
        assert 0 < (got - want).abs().max() < c.atol / 10
    x, positions = case.args
    off = ch08.rope._rope_reference(x, positions.double() + 1e-4 * positions.sign())
    with pytest.raises(ExerciseError):
        mha.exercises.check_rope(
            lambda x_, p_: off if x_.dim() == 4 else ch08.rope._rope_reference(x_, p_)
        )


def test_the_notebooks_buggy_backward_is_the_one_the_checker_knows():
    """Section 7.1 shows ``buggy_backward``; its three bugs are those ``ch07`` declares."""
    notebook = REPO / "chapters" / "07_1_gradients.ipynb"
    (cell,) = [c for c in nbformat.read(notebook, 4).cells if c.id == "ch07-1-buggy"]
    namespace = {"math": math, "torch": torch}
    exec(cell.source, namespace)
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64) for _ in range(4))
    for got, want in zip(
        namespace["buggy_backward"](q, k, v, d_out), ch07._buggy_backward(q, k, v, d_out)
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
