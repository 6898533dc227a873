"""The Chinese edition (tools/translate.py): complete, up to date, and the same code as the English.

`translate.py check` must pass for the landing page and every chapter listed in
i18n/zh/chapters.txt (coverage, no stale or orphaned entries, MyST structure kept, glossary
respected); the generated book in zh/ must equal what `translate.py build` writes now; and every
Chinese notebook must carry the English notebook's code cells and outputs unchanged.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
import yaml
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import sphinx_language_switch  # noqa: E402 (tools/ is not a package: it joins the path first)
import translation_book  # noqa: E402
import translation_check  # noqa: E402
import translation_code  # noqa: E402
import translation_figures  # noqa: E402
import translation_files  # noqa: E402
import translation_glossary  # noqa: E402
import translation_printed  # noqa: E402
import translation_structure  # noqa: E402

FIX = "edit i18n/zh/, then run: python tools/translate.py build (see python tools/translate.py todo <stem>)"


def test_every_listed_translation_is_complete_current_and_well_formed():
    problems = translation_check.check()
    assert not problems, "\n".join([*problems, FIX])


def test_the_listed_chapters_are_chapters_of_the_book():
    stems = translation_files.toc_stems(translation_files.english_toc())
    listed = translation_files.listed_stems()
    assert listed and set(listed) <= set(stems), (
        f"{sorted(set(listed) - set(stems))} not in _toc.yml"
    )


def test_the_generated_chinese_book_is_up_to_date():
    files = translation_book.generated_files()
    stale = [
        str(path.relative_to(REPO))
        for path, text in files.items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    extra = [
        str(p.relative_to(REPO))
        for p in (translation_files.ZH / "chapters").iterdir()
        if p not in files
    ]
    assert not stale and not extra, (
        f"out of date: {stale}; not generated: {extra}; run: python tools/translate.py build"
    )


CHECKER_LINE_EN = re.compile(r"^✓ (check_\w+): correct — \S.*$")
CHECKER_LINE_ZH = re.compile(r"^✓ (check_\w+)：正确——\S.*$")


def without_translated_text(cell, printed: list | None = None) -> dict:
    """A cell without what a Chinese notebook translates: markdown, a figure's alt text and
    caption, code comments, the setup cell's source (tested below), and the checkers' lines, which
    become the `check_*` name alone (what the checker prints in Chinese is tested below); a
    figure is its Chinese drawing (what make execute stored beside the English one); printed
    lines are put in Chinese by the `printed` tables (tools/translation_printed.py)."""
    cell = nbformat.from_dict(dict(cell))
    for output in cell.get("outputs", []) if printed else []:
        translation_printed.translate_output(output, printed)
    if cell.cell_type == "markdown":
        cell.source = ""
    if cell.cell_type == "code" and "import mha\n" in cell.source and "%pip install" in cell.source:
        cell.source = ""
    elif cell.cell_type == "code":  # comments may be translated (`code:` in i18n/zh/<stem>.yml)
        cell.source = repr(translation_code.code_tokens(cell.source))
    for output in cell.get("outputs", []):
        translation_figures.chinese_figure(output)  # an English figure becomes its Chinese drawing
        if output.output_type == "stream":
            lines = output.text.split("\n")
            for pattern in (CHECKER_LINE_EN, CHECKER_LINE_ZH):
                lines = [pattern.sub(r"\1 passed", line) for line in lines]
            output.text = "\n".join(lines)
    if "mystnb" in cell.metadata:
        cell.metadata["mystnb"]["image"].pop("alt", None)
        cell.metadata["mystnb"]["figure"].pop("caption", None)
    return cell


@pytest.mark.parametrize("stem", translation_files.toc_stems(translation_files.english_toc()))
def test_a_chinese_notebook_has_the_english_code_and_outputs(stem):
    english = nbformat.read(REPO / "chapters" / f"{stem}.ipynb", as_version=4)
    chinese = nbformat.read(translation_files.ZH / "chapters" / f"{stem}.ipynb", as_version=4)
    cells = [c for c in chinese.cells if c.id != "zh-untranslated-note"]
    assert [c.id for c in cells] == [c.id for c in english.cells]
    listed = stem in translation_files.listed_stems()
    printed = translation_printed.tables(stem) if listed else []
    for en, zh in zip(english.cells, cells):
        assert without_translated_text(zh) == without_translated_text(en, printed), (
            f"{stem}: cell {en.id} differs from the English beyond its translated text"
        )
    assert chinese.metadata.pop("language") == translation_book.LANG
    assert chinese.metadata == english.metadata
    assert listed == (len(cells) == len(chinese.cells)), (
        f"{stem}: the 'not translated yet' note belongs exactly on the unlisted chapters"
    )
    if not listed:  # published in English until listed in i18n/zh/chapters.txt
        assert [translation_book.deeper_paths(c.source) for c in english.cells] == [
            c.source for c in cells
        ]
        return
    setup = translation_code.chinese_setup_cell(
        translation_code.SETUP_CELL.read_text(encoding="utf-8")
    )
    assert cells[1].source.rstrip("\n") == setup.rstrip("\n"), f"{stem}: not the Chinese setup cell"
    for en, zh in zip(english.cells, cells):
        if en.cell_type == "code":
            english_lines = [line for o in en.outputs for line in o.get("text", "").split("\n")]
            chinese_lines = [line for o in zh.outputs for line in o.get("text", "").split("\n")]
            assert not any(CHECKER_LINE_EN.match(line) for line in chinese_lines), (
                f"{stem}: cell {en.id}: an English checker line in the Chinese notebook"
            )
            assert sum(map(bool, map(CHECKER_LINE_ZH.match, chinese_lines))) == sum(
                map(bool, map(CHECKER_LINE_EN.match, english_lines))
            )


def test_the_chinese_setup_cell_is_the_english_one_with_chinese_comments_and_checkers():
    english = translation_code.SETUP_CELL.read_text(encoding="utf-8")
    chinese = translation_code.chinese_setup_cell(english)
    assert 'mha.exercises.set_language("zh")' in chinese
    assert "pathlib.Path.cwd().parents[1]" in chinese  # zh/chapters/ is one folder deeper
    code = [ln for ln in english.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    kept = set(chinese.splitlines())
    assert [ln for ln in code if ln not in kept] == [translation_code.SETUP_PATH[0]]
    comments = [ln.split("#", 1)[1] for ln in chinese.splitlines() if "# " in ln]
    assert all(re.search(r"[\u4e00-\u9fff]", c) for c in comments), comments


def test_the_chinese_checker_lines_are_what_the_checkers_print_in_chinese():
    """The checker lines of the Chinese notebooks come from running each checker in Chinese
    (a fresh interpreter, mha.exercises.set_language("zh")) on an answer it accepts; the same run
    in English prints exactly the English notebook's line."""
    lines = translation_code.run_checkers()  # the checkout's mha, every exercise
    for name in lines:
        en, zh = lines[name]["en"], lines[name]["zh"]
        assert CHECKER_LINE_EN.match(en) and CHECKER_LINE_ZH.match(zh), (en, zh)
    shown = {}
    for path in sorted((translation_files.ZH / "chapters").glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        shown.update((name, line) for line, name in re.findall(r'"(✓ (check_\w+)：[^"\\]*)', text))
    assert shown, "no checker line in the Chinese notebooks"
    for name, line in shown.items():
        assert lines[name]["zh"] == line, (name, line)


def test_a_stale_checker_line_stops_the_build():
    with pytest.raises(ValueError, match="re-execute"):
        translation_code.chinese_checker_output("✓ check_softmax: correct — made up\n", "demo")


def test_the_chinese_toc_mirrors_the_english_one():
    english = translation_files.english_toc()
    chinese = yaml.safe_load((translation_files.ZH / "_toc.yml").read_text(encoding="utf-8"))
    assert chinese["root"] == english["root"]
    # The same pages: the glossary is one of them (English and Chinese, both generated).
    assert translation_files.all_toc_stems(chinese) == translation_files.all_toc_stems(english)
    assert translation_files.GLOSSARY_STEM in translation_files.all_toc_stems(english)
    captions = [p["caption"] for p in english["parts"]]
    missing = [c for c in captions if c not in translation_book.PART_CAPTIONS]
    assert not missing, (
        f"add Chinese captions to PART_CAPTIONS in tools/translation_book.py: {missing}"
    )


def test_the_chinese_config_points_colab_at_the_chinese_notebooks():
    config = yaml.safe_load((translation_files.ZH / "_config.yml").read_text(encoding="utf-8"))
    assert config["repository"]["path_to_book"] == "zh"
    assert config["sphinx"]["config"]["language"] == "zh_CN"


# --- the machinery, on small made-up cases -----------------------------------------------------


def write_translation(folder, name: str, cells: dict) -> None:
    (folder / f"{name}.yml").write_text(
        yaml.safe_dump({"source": "x", "cells": cells}, allow_unicode=True), encoding="utf-8"
    )


def test_a_changed_english_cell_is_stale_and_a_new_one_missing(tmp_path):
    units = [
        ("a1", "markdown", "Attention is a soft lookup."),
        ("b2", "markdown", "Every key gets some weight."),
        ("c3", "markdown", ":::{solution-end}\n:::"),  # structure only: nothing to translate
    ]
    old = "Attention is a lookup."
    write_translation(
        tmp_path,
        "demo",
        {
            "a1": {"en": translation_files.en_hash(old), "zh": "注意力是一次查找。"},
            "gone": {"en": "0" * 12, "zh": "已删除的单元格。"},
        },
    )
    state = translation_check.status("demo", tmp_path, units)
    assert state == {"missing": ["b2"], "stale": ["a1"], "orphaned": ["gone"]}
    problems = translation_check.check_file("demo", [], tmp_path, units)
    assert any("stale entry a1" in p for p in problems)
    assert any("missing entry b2" in p for p in problems)
    assert any("orphaned entry gone" in p for p in problems)


def test_ids_and_hashes_of_digits_are_read_as_text(tmp_path):
    # Unquoted, plain YAML would read 01234567 as an octal number and 123456789012 as an int.
    (tmp_path / "demo.yml").write_text(
        "cells:\n  01234567:\n    en: 123456789012\n    zh: 头\n", encoding="utf-8"
    )
    cells = translation_files.load_translation("demo", tmp_path)
    assert list(cells) == ["01234567"] and cells["01234567"]["en"] == "123456789012"


ENGLISH = """\
(ch99)=
## Scores, as in {ref}`the masking chapter <ch04>`

The scores $s_{ij} = q_i \\cdot k_j$ of `mha.scaled_dot_product_attention`, see
{numref}`fig-scores` and [the paper](https://arxiv.org/abs/1706.03762).

```{literalinclude} ../mha/attention.py
:pyobject: scaled_dot_product_attention
```

:::{exercise} Predict the shape
:label: ch99-ex
What is the shape of $QK^\\top$?
:::
"""

CHINESE = """\
(ch99)=
## 分数，与{ref}`掩码一章 <ch04>`相同

`mha.scaled_dot_product_attention`的分数$s_{ij} = q_i \\cdot k_j$，见{numref}`fig-scores`
和[论文](https://arxiv.org/abs/1706.03762)。

```{literalinclude} ../mha/attention.py
:pyobject: scaled_dot_product_attention
```

:::{exercise} 预测形状
:label: ch99-ex
$QK^\\top$的形状是什么？
:::
"""


def test_a_faithful_translation_keeps_the_structure():
    assert translation_structure.structure_problems(ENGLISH, CHINESE) == []


@pytest.mark.parametrize(
    ("what", "old", "new"),
    [
        ("roles and their targets", "<ch04>", ""),  # a dropped {ref} target
        ("roles and their targets", "{numref}`fig-scores`", "图"),  # a dropped numref
        ("math", "s_{ij} = q_i", "s_{ij}=q_i"),  # altered math
        ("inline code", "`mha.scaled_dot_product_attention`", "`mha.sdpa`"),
        ("URLs", "1706.03762", "1706.03763"),
        ("labels", "(ch99)=", "(ch98)="),
        ("heading levels", "## 分数", "### 分数"),
        ("list items", "$QK^\\top$的形状", "- $QK^\\top$的形状"),
        ("directive and option lines", ":pyobject: scaled_dot", ":pyobject: Scaled_dot"),
        ("directive and option lines", ":label: ch99-ex", ":label: ch99-exercise"),
    ],
)
def test_a_structure_violation_is_caught(what, old, new):
    assert old in CHINESE
    problems = translation_structure.structure_problems(ENGLISH, CHINESE.replace(old, new, 1))
    assert any(p.startswith(what) for p in problems), problems


MATH_EN = """\
The weights $w = \\text{scores} / \\text{rows}$ and
$$\\text{bytes} = 2 \\cdot \\textrm{in 16-bit.}$$

```{math}
t = \\mbox{time per step} + \\text{acc}_{\\text{new}}
```
"""
MATH_ZH = """\
权重$w = \\text{分数} / \\text{行数}$，以及
$$\\text{字节数} = 2 \\cdot \\textrm{（16位）。}$$

```{math}
t = \\mbox{每步时间} + \\text{acc}_{\\text{new}}
```
"""


def test_the_words_of_text_in_math_may_be_translated():
    assert translation_structure.structure_problems(MATH_EN, MATH_ZH) == []
    assert translation_structure.math_words("a_{\\text{x {y}}} + \\mbox{z}") == ["x {y}", "z"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("w = ", "w="),  # inline math outside \text
        ("2 \\cdot", "2\\cdot"),  # display math outside \text
        ("+ \\text{acc}", "- \\text{acc}"),  # a {math} block outside \text
        ("/ \\text{行数}", ""),  # a dropped \text group
        ("\\text{分数}", "\\text{分}\\text{数}"),  # an added one
        ("\\text{分数} / \\text{行数}", "\\text{分数}\\text{行数} /"),  # a group moved
        ("\\textrm{（16位）。}", "\\text{（16位）。}"),  # another command
        ("_{\\text{new}}", "_{new}"),  # \text removed around the word
    ],
)
def test_math_outside_the_words_of_text_must_not_change(old, new):
    assert old in MATH_ZH
    problems = translation_structure.structure_problems(MATH_EN, MATH_ZH.replace(old, new, 1))
    assert any(p.startswith(("math", "code or math blocks")) for p in problems), problems


def test_the_glossary_applies_to_the_words_of_text_in_math():
    glossary = [{"en": "FLOP/byte (unit)", "zh": "FLOP/字节", "avoid": ["FLOP/byte"]}]
    assert translation_glossary.glossary_problems("$I = 2\\,\\text{FLOP/byte}$", glossary)
    assert not translation_glossary.glossary_problems("$I = 2\\,\\text{FLOP/字节}$", glossary)
    assert not translation_glossary.glossary_problems(
        "$\\mathrm{FLOP/byte}$", glossary
    )  # not words


def test_emphasis_that_does_not_render_is_caught():
    # CommonMark does not close ** after full-width punctuation that precedes a letter.
    english = "The **first pair** turns fast."
    assert translation_structure.structure_problems(english, "**第一对**转得快。") == []
    assert translation_structure.structure_problems(english, "**第一对，**转得快。")[0].startswith(
        "emphasis"
    )


def test_an_avoided_term_is_caught_and_code_is_exempt():
    glossary = [{"en": "mask", "zh": "掩码", "avoid": ["遮罩"]}]
    assert translation_glossary.glossary_problems("填充遮罩把这些位置去掉。", glossary)
    assert not translation_glossary.glossary_problems("填充掩码把`遮罩`这些位置去掉。", glossary)


def test_the_glossary_has_the_course_terms_once_each():
    terms = translation_files.load_glossary()
    english = [t["en"] for t in terms]
    assert len(english) == len(set(english))
    for required in ("query", "key", "value", "head", "mask", "tile", "KV cache"):
        assert required in english


def test_includes_reach_the_package_from_one_folder_deeper():
    line = "```{literalinclude} ../mha/attention.py\n:pyobject: f\n```"
    assert translation_book.deeper_paths(line).startswith(
        "```{literalinclude} ../../mha/attention.py\n"
    )


def test_the_language_switch_links_the_same_page_or_the_landing_page():
    zh = translation_files.ZH
    assert sphinx_language_switch.counterpart(zh, "chapters/index", "chapters/04_masking") == (
        "chapters/04_masking"
    )
    # Both editions have a glossary page (generated from the same file): the switch links them.
    assert sphinx_language_switch.counterpart(REPO, "chapters/index", "chapters/glossary") == (
        "chapters/glossary"
    )
    assert sphinx_language_switch.counterpart(REPO, "chapters/index", "chapters/no_such_page") == (
        "chapters/index"
    )


def test_every_glossary_term_is_defined_and_points_at_a_label_of_the_book():
    labels = set()
    for path in (REPO / "chapters").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        labels |= set(re.findall(r"^\(([^()\s]+)\)=\s*$", text, re.MULTILINE))
    for path in (REPO / "chapters").glob("*.md"):
        text = path.read_text(encoding="utf-8")
        labels |= set(re.findall(r"^\(([^()\s]+)\)=\s*$", text, re.MULTILINE))
    for term in translation_files.load_glossary():
        assert term.get("define") and term.get("taught"), (
            f"glossary: {term['en']!r} lacks define/taught"
        )
        assert term["taught"] in labels, (
            f"glossary: {term['en']!r} taught in unknown {term['taught']!r}"
        )


@pytest.mark.slow
def test_a_chinese_notebook_runs_from_a_clone_and_its_checkers_speak_chinese():
    """The Chinese setup cell's local branch, as in a clone's Jupyter: from zh/chapters/, mha comes
    from the checkout two folders up, and a checker prints the line stored in the notebook."""
    import json

    import execute_notebook

    stored = nbformat.read(
        translation_files.ZH / "chapters" / "01_1_soft_lookup.ipynb", as_version=4
    )
    setup = stored.cells[1].source
    line = next(
        o.text
        for c in stored.cells
        for o in c.get("outputs", [])
        if "✓ check_" in o.get("text", "")
    )
    probe = (
        "import json\nimport mha.exercises\n"
        "print(json.dumps([mha.__file__, mha.exercises.get_language()]))\n"
        "mha.exercises.check_lookup_weights(lambda x, k, w: ((x[..., :, None, :] - "
        "k[..., None, :, :]) ** 2).sum(-1).div(-2 * w**2).softmax(-1))"
    )
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(setup), nbformat.v4.new_code_cell(probe)]
    )
    result = execute_notebook.run(nb, cwd=translation_files.ZH / "chapters")
    assert result.passed, result.error
    first, checker = execute_notebook.stdout_of(nb.cells[1]).split("\n", 1)
    where, language = json.loads(first)
    assert Path(where).is_relative_to(REPO / "mha") and language == "zh"
    assert checker == line, (checker, line)


def test_chinese_search_indexes_one_character_words_and_edit_links_open_the_translation():
    import sphinx_zh

    search = sphinx_zh.SearchChineseWords({})
    assert [w for w in ("键", "值", "头", "的", "a", "qk") if search.word_filter(w)] == [
        "键",
        "值",
        "头",
        "qk",
    ]
    repo = "https://github.com/o/r/edit/main"
    assert sphinx_zh.edit_url(f"{repo}/zh/chapters/04_masking.ipynb") == (
        f"{repo}/i18n/zh/04_masking.yml"
    )
    assert sphinx_zh.edit_url(f"{repo}/zh/chapters/index.md") == f"{repo}/i18n/zh/index.yml"
    assert sphinx_zh.edit_url(f"{repo}/zh/chapters/glossary.md") == f"{repo}/i18n/zh/glossary.yml"
    config = yaml.safe_load((translation_files.ZH / "_config.yml").read_text(encoding="utf-8"))
    assert config["sphinx"]["local_extensions"]["sphinx_zh"] == "../tools/"


def test_an_allowed_word_and_an_english_gloss_are_not_avoided_terms():
    glossary = [{"en": "notebook", "zh": "notebook", "avoid": ["笔记本"], "allow": ["笔记本电脑"]}]
    assert not translation_glossary.glossary_problems("这个notebook在笔记本电脑上运行。", glossary)
    assert translation_glossary.glossary_problems("这个笔记本在笔记本电脑上运行。", glossary)
    online = [{"en": "online softmax", "zh": "在线softmax", "avoid": ["online softmax"]}]
    assert not translation_glossary.glossary_problems("*在线softmax*（online softmax）", online)
    assert translation_glossary.glossary_problems("一个分块的online softmax", online)


@pytest.mark.parametrize(
    "text, ambiguous",
    [
        ("它旧的值被缩小了$\\alpha < 1$倍", True),
        ("softmax的FLOPs比乘积少25倍", True),
        ("它的缓存恰好小4倍", True),
        ("比预填充低五十倍以上", True),
        ("softmax的FLOPs只有乘积的1/25", False),
        # A slower speed is a reduction too (of the speed): 慢, 放慢, 降 and 减 before 倍 ...
        ("它比GPU慢几千倍", True),
        ("快的对现在慢了32倍", True),
        ("转得慢的数对被放慢40倍", True),
        ("吞吐量降低了约3倍", True),
        ("融合内核把字节数削减多少倍", True),
        ("把序列缩短4倍", True),
        # ... or a verb of decrease after 倍 / 倍数.
        ("把慢的对按上下文倍数放慢", True),
        ("把这些速度按8倍地减小", True),
        ("它的速度只有GPU的几千分之一", False),
        ("快的对现在转速降为原来的1/32", False),
        ("保存的字节数变为原来的多少倍", False),
        ("提高到组的大小那么多倍", False),
        ("在这台CPU上分段形式快好几倍", False),  # growth
        ("误差相差不超过一个小的倍数", False),  # 倍数 after 小: no reduction
        ("缩放后的2到8倍", False),  # 缩放 (scaling) is no 缩小
        ("至少两倍", False),
        ("在D较小时，梯度是2到8倍", False),  # another clause
    ],
)
def test_a_reduction_stated_as_a_multiple_is_caught(text, ambiguous):
    assert bool(translation_glossary.glossary_problems(text, [])) == ambiguous, text


def test_a_reduction_stated_as_a_multiple_is_caught_in_code_comments():
    assert translation_check.comment_word_problems("转速降为原来的1/32") == []
    assert translation_check.comment_word_problems("慢了32倍")


def test_the_forbidden_words_are_caught_in_prose_comments_and_the_setup_cell(tmp_path):
    assert translation_check.forbidden_problems("使用本笔记本所在的检出目录")
    assert translation_check.forbidden_problems("使用本notebook所在的检出目录") == []
    assert translation_check.comment_word_problems("本笔记本的缓存")
    setup = translation_code.chinese_setup_cell(
        translation_code.SETUP_CELL.read_text(encoding="utf-8")
    )
    assert "本笔记本" not in setup and "本notebook" in setup
    units = [("a1", "markdown", "This notebook runs on a CPU.")]
    text = "本笔记本在CPU上运行。"
    write_translation(
        tmp_path, "demo", {"a1": {"en": translation_files.en_hash(units[0][2]), "zh": text}}
    )
    problems = translation_check.check_file("demo", [], tmp_path, units)
    assert any("本笔记本" in p for p in problems), problems


@pytest.mark.parametrize(
    "chinese, ok",
    [
        ("## 小结\n\n- 注意力是软查找。", True),
        ("## 要点\n\n- 注意力是软查找。", False),
        ("## 要点回顾\n\n- 注意力是软查找。", False),
        ("## 本节要点\n\n- 注意力是软查找。", False),
        ("## 总结\n\n- 注意力是软查找。", False),
    ],
)
def test_the_closing_heading_is_xiaojie(tmp_path, chinese, ok):
    english = "## What to take away\n\n- Attention is a soft lookup."
    assert (translation_check.closing_heading_problems(english, chinese) == []) == ok
    # Another heading may say what it likes; a heading inside a code block is no heading.
    assert translation_check.closing_heading_problems("## Exercises", "## 要点") == []
    units = [("a1", "markdown", english)]
    write_translation(
        tmp_path, "demo", {"a1": {"en": translation_files.en_hash(english), "zh": chinese}}
    )
    problems = translation_check.check_file("demo", [], tmp_path, units)
    assert any("closing heading" in p for p in problems) != ok, problems


def test_the_glossary_has_the_terms_of_chapters_9_to_11_with_their_english_at_first_use():
    terms = {t["en"]: t for t in translation_files.load_glossary()}
    first_use = {
        "attention sink": "注意力汇",
        "ring attention": "环形注意力",
        "continuous batching": "连续批处理",
        "copy-on-write": "写时复制",
        "block table": "块表",
        "quantise": "量化",
        "dequantise": "反量化",
        "gate": "门控",
        "latent vector": "潜在向量",
        "linear attention": "线性注意力",
        "delta rule": "delta规则",
        "chunk": "分段",
        "prefix caching": "前缀缓存",
    }
    for english, chinese in first_use.items():
        assert english in terms and terms[english]["zh"] == chinese, english
        assert terms[english].get("first_use"), english
    # chunk, tile and block: three words for three things.
    assert [terms[e]["zh"] for e in ("chunk", "tile", "block (of a paged cache)")] == [
        "分段",
        "分块",
        "块",
    ]
    assert "前k个" in terms["top-k"]["avoid"]


def test_a_quantised_word_inside_another_is_not_a_first_use():
    glossary = [{"en": "quantise", "zh": "量化", "allow": ["反量化", "向量化"], "first_use": True}]
    pages = [("a", [("c1", "向量化地求值，再反量化。"), ("c2", "量化（quantise）到int8。")])]
    assert translation_glossary.first_use_problems(pages, glossary) == []


def test_a_chapter_gives_the_english_at_the_first_use_of_a_term():
    glossary = [{"en": "query", "zh": "查询", "first_use": True}]
    glossed = [("a", [("c1", "# 查询\n\n每个查询（query）都看到键。"), ("c2", "查询再次出现。")])]
    assert translation_glossary.first_use_problems(glossed, glossary) == []
    bare = [("a", [("c1", "每个`查询`和$查询$不算。每个查询都看到键（key）。")])]
    assert translation_glossary.first_use_problems(bare, glossary) == [
        "a: c1: the chapter's first '查询' needs its English: 查询（query）"
    ]
    later = [("a", [("c1", "没有这个词。")]), ("b", [("c2", "**查询**（query）")])]
    assert translation_glossary.first_use_problems(later, glossary) == []


def test_a_code_comment_translation_changes_comments_only(tmp_path):
    cell = nbformat.v4.new_code_cell("x = 1  # one\n# add\ny = x + 1\n")
    cell.id = "c1"
    nb = nbformat.v4.new_notebook(cells=[cell])

    def problems(comments: dict) -> list[str]:
        (tmp_path / "demo.yml").write_text(
            yaml.safe_dump({"code": {"c1": {"comments": comments}}}, allow_unicode=True),
            encoding="utf-8",
        )
        return translation_code.comment_problems("demo", nb, tmp_path)

    assert problems({"one": "一", "add": "加一"}) == []
    assert (
        translation_code.with_comments(cell.source, {"one": "一"})
        == "x = 1  # 一\n# add\ny = x + 1\n"
    )
    assert any("stale" in p for p in problems({"two": "二"}))
    assert any("changes code" in p for p in problems({"add\ny = x + 1": "加一\ny = x + 2"}))


def test_chinese_search_makes_the_words_sphinx_makes_without_its_quadratic_list():
    """tools/sphinx_zh.py keeps the Latin words it has seen in a set (Sphinx 7.4: a list that every
    stemmed word is looked up in); the words it indexes are Sphinx's own. "ids" stems to "id" unless
    it was seen as a word of the text (then it is kept whole); a fresh index has seen nothing."""
    import sphinx_zh
    from sphinx.search.zh import SearchChinese

    text = "缓存 KV ids were cached 注意力 heads"
    ours, sphinx = sphinx_zh.SearchChineseWords({}), SearchChinese({})
    assert sphinx_zh.SearchChineseWords({}).stem("ids") == "id"
    assert ours.split(text) == sphinx.split(text)
    assert [ours.stem(w) for w in ("ids", "heads", "cached", "GQA")] == [
        "ids",
        "head",
        "cach",
        "gqa",
    ]
    assert [ours.stem(w) for w in ("ids", "heads", "cached")] == [
        sphinx.stem(w) for w in ("ids", "heads", "cached")
    ]
    assert isinstance(ours.latin_terms, set)
