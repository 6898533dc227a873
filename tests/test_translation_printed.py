"""The Chinese edition's printed lines: the `printed:` tables, how build applies them, what check
refuses, and how much English the Chinese notebooks still print (tools/translation_printed.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import translation_printed as printed  # noqa: E402 (tools/ is not a package: it joins the path first)

SHARED = {
    "{}: ~{}  (claim {}, margin ~{})": "{}：约 {}（断言 {}，余量约 {}）",
}


def test_a_key_is_a_whole_line_whose_fields_the_chinese_keeps():
    table = {"{} of {} chapter runs passed": "{1} 次章节运行中有 {0} 次通过"}
    assert (
        printed.translate_line("9 of 10 chapter runs passed", [table])
        == "10 次章节运行中有 9 次通过"
    )
    assert printed.translate_line("9 of 10 chapter runs passed   ", [table]).startswith("10 次")
    assert printed.translate_line("9 of 10 chapter runs passed today", [table]) == (
        "9 of 10 chapter runs passed today"  # a key matches the whole line, not a part of it
    )


def test_the_notebook_table_comes_first_and_translates_a_claims_name():
    notebook = {"RNN loop / attention time, L = {}": "RNN 循环 / 注意力的时间，L = {}"}
    line = "RNN loop / attention time, L = 256: ~15.3  (claim > 2, margin ~7.63)"
    assert printed.translate_line(line, [notebook, SHARED]) == (
        "RNN 循环 / 注意力的时间，L = 256：约 15.3（断言 > 2，余量约 7.63）"
    )
    assert printed.translate_line(line, [{}, SHARED]).startswith("RNN loop / attention time")


def test_a_paragraph_of_wrapped_lines_is_replaced_as_a_whole():
    table = {"No GPU in this run: the kernels\nran in the interpreter, B={}.": "没有GPU：B={}。"}
    text = "before\nNo GPU in this run: the kernels\nran in the interpreter, B=2.\nafter"
    assert printed.chinese_printed_output(text, [table]) == "before\n没有GPU：B=2。\nafter"


def test_build_translates_stdout_and_displayed_markdown_only():
    table = {"{} ratios": "{} 个比值"}
    stream = nbformat.v4.new_output("stream", name="stdout", text="3 ratios\n")
    markdown = nbformat.v4.new_output("display_data", data={"text/markdown": "3 ratios"})
    stderr = nbformat.v4.new_output("stream", name="stderr", text="3 ratios\n")
    for output in (stream, markdown, stderr):
        printed.translate_output(output, [table])
    assert (stream.text, markdown.data["text/markdown"], stderr.text) == (
        "3 个比值\n",
        "3 个比值",
        "3 ratios\n",
    )


def _notebook(*lines: str):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(...)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="\n".join(lines))]
    nb.cells = [cell]
    return nb


def test_check_refuses_unused_keys_wrong_fields_and_values_without_chinese(tmp_path: Path):
    (tmp_path / "printed.yml").write_text(
        'printed:\n  "{}: ~{}  (claim {}, margin ~{})": "{}：约 {}（断言 {}，余量约 {}）"\n',
        encoding="utf-8",
    )
    (tmp_path / "x.yml").write_text(
        "printed:\n"
        '  "{} of {} passed": "{1} 中有 {0} 个通过"\n'  # right
        '  "loop time, L = {}": "循环的时间，L = {}"\n'  # a claim's name: right
        '  "{} tiles": "{} {} 个分块"\n'  # one field too many
        '  "{} steps": "{} steps"\n'  # no Chinese
        '  "{} heads": "{0} {} 个头"\n'  # {} and {0} mixed
        '  "nothing prints this": "没有这一行"\n',
        encoding="utf-8",
    )
    nb = _notebook(
        "2 of 3 passed",
        "4 tiles",
        "5 steps",
        "8 heads",
        "loop time, L = 64: ~3.1  (claim > 2, margin ~1.55)",
    )
    problems = "\n".join(printed.printed_problems("x", nb, tmp_path))
    assert "'{} of {} passed'" not in problems
    assert "loop time" not in problems
    assert "'{} tiles': the key has 1 {}, the value 2" in problems
    assert "'{} steps': the value has no Chinese" in problems
    assert "'{} heads': the value mixes" in problems
    assert "'nothing prints this': no printed line matches it" in problems


@pytest.mark.parametrize(
    ("line", "english"),
    [
        ("the loss falls by more than 70%", True),
        ("RNN 循环的时间，L = 256：约 15.3（断言 > 2，余量约 7.63）", False),
        ("pre-norm gradient norm, 2 -> 32 blocks：约 37", True),  # half translated: still English
        ("forward: row 1 = [nan, nan, nan, nan]", False),  # Python values are not words
        ("backward: [False, False, True]", False),
        ("NameError: name 'math' is not defined", False),  # an error quoted as Python prints it
        ("已发表的数字在附录中；`make gpu-check` 测得的结果", False),  # a command, not prose
        ("mha.flash_attention (2, 4, 64, 8)", False),
    ],
)
def test_what_counts_as_an_english_line(line, english):
    assert bool(printed.english_sentences(line)) is english


def test_the_chinese_notebooks_print_chinese():
    """At most 20 printed lines of English prose in all the Chinese notebooks (generated text of
    4.4's model, quoted training text and the like), none in chapter 11."""
    left = {}
    for path in sorted((REPO / "zh" / "chapters").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        lines = printed.english_sentences("\n".join(printed.printed_lines(nb)))
        if lines:
            left[path.stem] = lines
    total = sum(map(len, left.values()))
    counts = {stem: len(lines) for stem, lines in left.items()}
    assert total <= 20, f"{total} English lines: {counts}; e.g. {next(iter(left.values()))[:3]}"
    assert not any(stem.startswith("11_") for stem in left), left
