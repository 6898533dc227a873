"""The checkers in Chinese: the catalogue ``mha/exercises/_zh.py`` and the language switch.

The catalogue is checked against the code both ways: every text a learner may read from a checker
(each exercise's success line and hints, walked from :data:`mha.exercises.EXERCISES`, and every
template passed to ``tr``, found in the source) has a Chinese entry, and no entry is orphaned.
Every declared variant's Chinese success line and every known mistake's Chinese hint are tested
with their English ones, from the same run, in ``test_exercises.py``; here, with
``set_language("zh")``, the stub prints the Chinese "not attempted yet", and the harness's own
messages and a custom check speak Chinese. English stays the default, restored after every test.
"""

from __future__ import annotations

import ast
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from test_exercises import TOY, _stub_args, check_toy

import mha.exercises
from mha.exercises import EXERCISES, ExerciseError, _harness, ch06
from mha.exercises._zh import MESSAGES

SOURCES = sorted((REPO / "mha" / "exercises").rglob("*.py"))  # sections: chNN/*.py


@pytest.fixture(autouse=True)
def english_before_and_after():
    """Every test starts in English (the default) and leaves English behind."""
    assert mha.exercises.get_language() == "en"
    try:
        yield
    finally:
        mha.exercises.set_language("en")


@pytest.fixture
def chinese():
    mha.exercises.set_language("zh")


def _templates(path: Path) -> list[str]:
    """The string literals a module passes to ``tr``, directly or through a variable named
    ``message`` (the convention for a template too long for the call's line)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tr" and node.args:
            value = node.args[0]
        elif isinstance(node, ast.Assign) and any(
            getattr(target, "id", None) == "message" for target in node.targets
        ):
            value = node.value
        else:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.append(value.value)
    return found


def _translatable() -> set[str]:
    texts = {text for ex in EXERCISES for text in ex.texts()}
    return texts | {text for path in SOURCES for text in _templates(path)}


TRANSLATABLE = _translatable()


def _fields(text: str) -> list[str]:
    """The replacement fields of a template, as written ("name", "0:.1f", "value!r")."""
    return sorted(
        f"{name}{':' + spec if spec else ''}{'!' + conv if conv else ''}"
        for _, name, spec, conv in string.Formatter().parse(text)
        if name is not None
    )


# --- the catalogue ----------------------------------------------------------------------------


def test_templates_are_found_in_the_source():
    templates = {text for path in SOURCES for text in _templates(path)}
    assert "✓ {name}: correct — {detail}" in templates
    assert "{label} {problem}. {hint}" in templates
    assert "torch refuses the flash kernel here and says: {reason}." in templates  # via `message`
    assert len(TRANSLATABLE) == len(MESSAGES)


def test_every_text_a_learner_reads_has_a_chinese_entry():
    missing = sorted(TRANSLATABLE - MESSAGES.keys())
    assert not missing, f"add these to mha/exercises/_zh.py: {missing}"


def test_no_chinese_entry_is_orphaned():
    orphans = sorted(MESSAGES.keys() - TRANSLATABLE)
    assert not orphans, f"their English no longer exists: {orphans}"


def test_entries_are_chinese_and_templates_keep_every_placeholder():
    templates = {text for path in SOURCES for text in _templates(path)}
    # Chinese characters or, in a bare frame like "{label}{problem}。{hint}", Chinese punctuation
    not_chinese = [
        zh
        for zh in MESSAGES.values()
        if not re.search("[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]", zh)
    ]
    assert not not_chinese
    changed = [
        (en, zh) for en, zh in MESSAGES.items() if en in templates and _fields(en) != _fields(zh)
    ]
    assert not changed
    assert _fields("measured {0:.1f} unscaled and {1:.2f} scaled") == ["0:.1f", "1:.2f"]


# --- the switch ---------------------------------------------------------------------------------


def test_unknown_language_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"language must be one of \['en', 'zh'\], got 'fr'"):
        mha.exercises.set_language("fr")
    assert mha.exercises.get_language() == "en"


@pytest.mark.parametrize(
    ("value", "language"),
    [("zh", "zh"), ("zh_CN.UTF-8", "zh"), ("ZH-cn", "zh"), ("en", "en"), ("fr", "en"), ("", "en")],
)
def test_mha_lang_is_read_leniently(value, language, monkeypatch):
    monkeypatch.setenv("MHA_LANG", value)
    assert _harness._language_from_environment() == language


def test_mha_lang_zh_picks_chinese_on_import():
    code = (
        "import mha.exercises as ex\nprint(ex.get_language())\n"
        "def my_softmax(x, dim=-1): ...\nex.check_softmax(my_softmax)"
    )
    env = {**os.environ, "MHA_LANG": "zh", "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "zh",
        "○ check_softmax：尚未作答——在上面的单元格里写下你的答案，然后再运行一次。",
    ]


def test_english_is_the_default_and_comes_back(capsys):
    check_toy(lambda x: 2 * x)
    mha.exercises.set_language("zh")
    check_toy(lambda x: 2 * x)
    mha.exercises.set_language("en")
    check_toy(lambda x: 2 * x)
    assert capsys.readouterr().out.splitlines() == [
        "✓ check_toy: correct — doubles",
        "✓ check_toy：正确——doubles",  # no entry for the toy's text: it stays English
        "✓ check_toy: correct — doubles",
    ]


# --- every exercise in Chinese ----------------------------------------------------------------


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_stub_prints_not_attempted_in_chinese(ex, chinese, capsys):
    getattr(mha.exercises, ex.name)(*_stub_args(ex))
    line = f"○ {ex.name}：尚未作答——在上面的单元格里写下你的答案，然后再运行一次。\n"
    assert capsys.readouterr().out == line


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (lambda x: x.sum() * 2, "fn(x)的形状是()，应为(2, 3)。Multiply by 2."),
        (lambda x: (2 * x).double(), "fn(x)的dtype是torch.float64，应为torch.float32。"),
        (lambda x: (2 * x).tolist(), "fn(x)返回了list，应为torch.Tensor。"),
        (lambda x: x / 0 * 0, "fn(x)含有NaN。"),
        (lambda x: x + 2, "fn(x)形状正确，但数值错误（Mismatched"),
        (lambda x: x.foo(), "fn(x)抛出了AttributeError: "),
    ],
)
def test_harness_messages_translate_the_template_and_keep_the_values(answer, message, chinese):
    with pytest.raises(ExerciseError) as err:
        TOY.check(answer)
    assert str(err.value).startswith(message), str(err.value)


def test_argument_checks_speak_chinese(chinese):
    with pytest.raises(TypeError, match="check_toy：double应是一个函数，却得到了int"):
        check_toy(3)
    with pytest.raises(ExerciseError, match=r"shape应是由int组成的元组，却得到了'a'。"):
        _harness.as_shape("a", "shape")
    with pytest.raises(ExerciseError, match=r"^7个答案中有1个错误：\n你的预测：k_proj.weight"):
        truth = mha.exercises.ch03.MHA_SHAPE_PREDICTIONS.accepted_answer()
        mha.exercises.check_mha_shape_predictions({**truth, "k_proj.weight": (5, 6)})


def test_values_in_a_translated_success_line_are_the_measured_ones(chinese, capsys):
    mha.exercises.check_qk_variance_prediction(1 / 8, 16)
    by_width, std_two = mha.exercises.ch02._variances()
    assert capsys.readouterr().out == (
        f"✓ check_qk_variance_prediction：正确——测得除以√512时为{by_width:.3f}，"
        f"元素标准差为2时为{std_two:.1f}\n"
    )
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.triton
def test_softmax_kernel_custom_check_speaks_chinese(chinese, capsys):
    kernels = ch06._kernels()
    mha.exercises.check_softmax_kernel(kernels["stable"])
    assert capsys.readouterr().out == (
        "✓ check_softmax_kernel：正确——不完整的行、大的logits和带步长的行全部正确\n"
    )
    with pytest.raises(ExerciseError, match=r"用other=-float\('inf'\)加载它们。$"):
        mha.exercises.check_softmax_kernel(kernels["zero_padding"])
    with pytest.raises(ExerciseError, match=r"抛出了.*。请保留签名\(X, Y, stride_x"):
        mha.exercises.check_softmax_kernel(kernels["wrong_signature"])
