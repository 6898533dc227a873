"""The Chinese edition (tools/translate.py): complete, up to date, and the same code as the English.

`translate.py check` must pass for the landing page and every chapter listed in
i18n/zh/chapters.txt (coverage, no stale or orphaned entries, MyST structure kept, glossary
respected); the generated book in zh/ must equal what `translate.py build` writes now; and every
Chinese notebook must carry the English notebook's code cells and outputs unchanged.
"""

from __future__ import annotations

import re
import sys

import nbformat
import pytest
import yaml
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import sphinx_language_switch  # noqa: E402 (tools/ is not a package: it joins the path first)
import translate  # noqa: E402

FIX = "edit i18n/zh/, then run: python tools/translate.py build (see python tools/translate.py todo <stem>)"


def test_every_listed_translation_is_complete_current_and_well_formed():
    problems = translate.check()
    assert not problems, "\n".join([*problems, FIX])


def test_the_listed_chapters_are_chapters_of_the_book():
    stems = translate.toc_stems(translate.english_toc())
    listed = translate.listed_stems()
    assert listed and set(listed) <= set(stems), (
        f"{sorted(set(listed) - set(stems))} not in _toc.yml"
    )


def test_the_generated_chinese_book_is_up_to_date():
    files = translate.generated_files()
    stale = [
        str(path.relative_to(REPO))
        for path, text in files.items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    extra = [
        str(p.relative_to(REPO)) for p in (translate.ZH / "chapters").iterdir() if p not in files
    ]
    assert not stale and not extra, (
        f"out of date: {stale}; not generated: {extra}; run: python tools/translate.py build"
    )


def without_translated_text(cell) -> dict:
    cell = nbformat.from_dict(dict(cell))
    if cell.cell_type == "markdown":
        cell.source = ""
    if "mystnb" in cell.metadata:
        cell.metadata["mystnb"]["image"].pop("alt", None)
        cell.metadata["mystnb"]["figure"].pop("caption", None)
    return cell


@pytest.mark.parametrize("stem", translate.toc_stems(translate.english_toc()))
def test_a_chinese_notebook_has_the_english_code_and_outputs(stem):
    english = nbformat.read(REPO / "chapters" / f"{stem}.ipynb", as_version=4)
    chinese = nbformat.read(translate.ZH / "chapters" / f"{stem}.ipynb", as_version=4)
    cells = [c for c in chinese.cells if c.id != "zh-untranslated-note"]
    assert [c.id for c in cells] == [c.id for c in english.cells]
    for en, zh in zip(english.cells, cells):
        assert without_translated_text(zh) == without_translated_text(en), (
            f"{stem}: cell {en.id} differs from the English beyond its translated text"
        )
    assert chinese.metadata.pop("language") == translate.LANG
    assert chinese.metadata == english.metadata
    listed = stem in translate.listed_stems()
    assert listed == (len(cells) == len(chinese.cells)), (
        f"{stem}: the 'not translated yet' note belongs exactly on the unlisted chapters"
    )
    if not listed:  # published in English until listed in i18n/zh/chapters.txt
        assert [translate.deeper_paths(c.source) for c in english.cells] == [
            c.source for c in cells
        ]


def test_the_chinese_toc_mirrors_the_english_one():
    english = translate.english_toc()
    chinese = yaml.safe_load((translate.ZH / "_toc.yml").read_text(encoding="utf-8"))
    assert chinese["root"] == english["root"]
    # The same pages: the glossary is one of them (English and Chinese, both generated).
    assert translate.all_toc_stems(chinese) == translate.all_toc_stems(english)
    assert translate.GLOSSARY_STEM in translate.all_toc_stems(english)
    captions = [p["caption"] for p in english["parts"]]
    missing = [c for c in captions if c not in translate.PART_CAPTIONS]
    assert not missing, f"add Chinese captions to PART_CAPTIONS in tools/translate.py: {missing}"


def test_the_chinese_config_points_colab_at_the_chinese_notebooks():
    config = yaml.safe_load((translate.ZH / "_config.yml").read_text(encoding="utf-8"))
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
            "a1": {"en": translate.en_hash(old), "zh": "注意力是一次查找。"},
            "gone": {"en": "0" * 12, "zh": "已删除的单元格。"},
        },
    )
    state = translate.status("demo", tmp_path, units)
    assert state == {"missing": ["b2"], "stale": ["a1"], "orphaned": ["gone"]}
    problems = translate.check_file("demo", [], tmp_path, units)
    assert any("stale entry a1" in p for p in problems)
    assert any("missing entry b2" in p for p in problems)
    assert any("orphaned entry gone" in p for p in problems)


def test_ids_and_hashes_of_digits_are_read_as_text(tmp_path):
    # Unquoted, plain YAML would read 01234567 as an octal number and 123456789012 as an int.
    (tmp_path / "demo.yml").write_text(
        "cells:\n  01234567:\n    en: 123456789012\n    zh: 头\n", encoding="utf-8"
    )
    cells = translate.load_translation("demo", tmp_path)
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
    assert translate.structure_problems(ENGLISH, CHINESE) == []


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
    problems = translate.structure_problems(ENGLISH, CHINESE.replace(old, new, 1))
    assert any(p.startswith(what) for p in problems), problems


def test_emphasis_that_does_not_render_is_caught():
    # CommonMark does not close ** after full-width punctuation that precedes a letter.
    english = "The **first pair** turns fast."
    assert translate.structure_problems(english, "**第一对**转得快。") == []
    assert translate.structure_problems(english, "**第一对，**转得快。")[0].startswith("emphasis")


def test_an_avoided_term_is_caught_and_code_is_exempt():
    glossary = [{"en": "mask", "zh": "掩码", "avoid": ["遮罩"]}]
    assert translate.glossary_problems("填充遮罩把这些位置去掉。", glossary)
    assert not translate.glossary_problems("填充掩码把`遮罩`这些位置去掉。", glossary)


def test_the_glossary_has_the_course_terms_once_each():
    terms = translate.load_glossary()
    english = [t["en"] for t in terms]
    assert len(english) == len(set(english))
    for required in ("query", "key", "value", "head", "mask", "tile", "KV cache"):
        assert required in english


def test_includes_reach_the_package_from_one_folder_deeper():
    line = "```{literalinclude} ../mha/attention.py\n:pyobject: f\n```"
    assert translate.deeper_paths(line).startswith("```{literalinclude} ../../mha/attention.py\n")


def test_the_language_switch_links_the_same_page_or_the_landing_page():
    zh = translate.ZH
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
    for term in translate.load_glossary():
        assert term.get("define") and term.get("taught"), (
            f"glossary: {term['en']!r} lacks define/taught"
        )
        assert term["taught"] in labels, (
            f"glossary: {term['en']!r} taught in unknown {term['taught']!r}"
        )
