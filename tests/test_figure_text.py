"""The words drawn inside figures (tools/figure_text.py): which need Chinese, how a table gives it,
the Chinese drawing that make execute stores, and the checks and build step of
tools/translation_figures.py that use it."""

from __future__ import annotations

import base64
import json
import sys
from io import BytesIO

import matplotlib
import nbformat
import pytest
from conftest import REPO

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))

import figure_text  # noqa: E402 (tools/ is not a package: it joins the path first)
import translation_figures  # noqa: E402


@pytest.mark.parametrize(
    ("text", "needs"),
    [
        ("cat", True),
        ("attention: head 1", True),
        ("SDPA", False),  # an acronym
        ("float16", False),  # a name from code
        ("q_proj", False),
        ("torch.cat", False),
        ("L", False),
        ("1.5e-03", False),
        ("$\\mathdefault{10^{-2}}$", False),  # math
        ("$QK^T$ scores", True),  # a word beside the math
        ("猫", False),
        ("键j的权重wⱼ", False),  # Chinese around one-letter names
        ("weight wⱼ of key j", True),
    ],
)
def test_which_texts_need_chinese(text, needs):
    assert figure_text.needs_translation(text) is needs


def test_a_table_translates_whole_texts_and_numbers_in_them():
    table = {"cat": "猫", "head {}: {} keys": "头{}：{}个键", "{}× faster": "快{}倍"}
    assert figure_text.translate("cat", table) == "猫"
    assert figure_text.translate("head 3: 1,024 keys", table) == "头3：1,024个键"
    assert figure_text.translate("2.5× faster", table) == "快2.5倍"
    assert figure_text.translate("dog", table) is None
    assert figure_text.translate("head x: 3 keys", table) is None  # {} is a number only
    with pytest.raises(ValueError, match="has 1 \\{\\} for 2 numbers"):
        figure_text.translate("head 3: 4 keys", {"head {}: {} keys": "头{}"})


def figure():
    fig, ax = plt.subplots(figsize=(4.0, 3.0), layout="constrained")
    ax.plot([0, 1, 2], [1, 2, 0], label="a line")
    ax.set_xticks([0, 1, 2], labels=["cat", "eats", "fish"])
    ax.set_ylabel("weight")
    ax.set_title("SDPA: head 2")
    ax.legend()
    return fig, ax


TABLE = {"cat": "猫", "eats": "吃", "fish": "鱼", "weight": "权重", "{}: head {}": "{}：头{}"}


def test_the_chinese_drawing_translates_every_text_and_puts_the_figure_back():
    fig, ax = figure()
    before = figure_text.smallest_text(fig)["strings"]
    drawn = figure_text.chinese_drawing(fig, TABLE)
    assert {"猫", "吃", "鱼", "权重"} <= set(drawn["strings"])
    assert "SDPA：头2" not in drawn["strings"]  # {} stands for a number, not a word
    assert {"SDPA: head 2", "a line"} <= set(drawn["strings"])  # no entry: kept in English
    png = base64.b64decode(drawn["image/png"])
    image = Image.open(BytesIO(png))
    assert json.loads(image.text["Description"]) == drawn["strings"]
    assert drawn["mha_text"]["min_pt"] == 10.0 and set(drawn["size"]) == {"width", "height"}
    # The figure is English again, tick labels included, for the backend's own PNG.
    assert figure_text.smallest_text(fig)["strings"] == before
    assert [t.get_text() for t in ax.get_xticklabels()] == ["cat", "eats", "fish"]
    plt.close(fig)


def test_a_character_the_fonts_lack_stops_the_drawing(monkeypatch):
    monkeypatch.setattr(figure_text, "CJK_FONT", "DejaVu Sans")  # no Chinese glyphs
    fig, ax = figure()
    with pytest.raises(RuntimeError, match="lacks glyphs"):
        figure_text.chinese_drawing(fig, TABLE)
    assert ax.get_ylabel() == "weight"  # put back all the same
    plt.close(fig)


def notebook_with_figure(strings, drawn=None):
    output = nbformat.v4.new_output(
        "display_data",
        data={"image/png": "RU4=", "text/plain": "<Figure>"},
        metadata={"mha_text": {"min_pt": 10.0, "strings": strings}},
    )
    if drawn is not None:
        output.metadata["mha_zh"] = drawn
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("plot()", outputs=[output])])


def write_table(tmp_path, figures: dict) -> None:
    lines = ["source: x", "cells: {}", "figures:"]
    lines += [f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v)}" for k, v in figures.items()]
    (tmp_path / "x.yml").write_text("\n".join(lines) + "\n", encoding="utf-8")


def zh_drawing(strings):
    return {
        "image/png": "WkguUE5H",
        "size": {"width": 10, "height": 5},
        "strings": strings,
        "mha_text": {"min_pt": 10.0, "width_in": 1.0, "fraction": 0.1},
    }


def test_check_asks_for_every_english_label(tmp_path):
    write_table(tmp_path, {"cat": "猫", "dog": "狗"})
    nb = notebook_with_figure(["cat", "fish", "0.5"], zh_drawing(["猫", "fish", "0.5"]))
    problems = translation_figures.figure_label_problems("x", nb, [], tmp_path)
    assert problems == [
        "x: figure 1: no Chinese for the label 'fish' (figures:)",
        "x: figures: 'dog' is drawn by no figure",
    ]


def test_check_finds_a_drawing_older_than_its_table(tmp_path):
    write_table(tmp_path, {"cat": "小猫"})
    stale = notebook_with_figure(["cat"], zh_drawing(["猫"]))
    assert translation_figures.figure_label_problems("x", stale, [], tmp_path) == [
        "x: figure 1: drawn before the label 'cat' became '小猫': make execute"
    ]
    undrawn = notebook_with_figure(["cat"])
    assert translation_figures.figure_label_problems("x", undrawn, [], tmp_path) == [
        "x: figure 1: no Chinese drawing (make execute)"
    ]
    fresh = notebook_with_figure(["cat"], zh_drawing(["小猫"]))
    assert translation_figures.figure_label_problems("x", fresh, [], tmp_path) == []


def test_check_wants_chinese_in_each_entry(tmp_path):
    write_table(tmp_path, {"cat": "cat!", "softmax": "softmax"})  # kept as it is: allowed
    nb = notebook_with_figure(["cat", "softmax"], zh_drawing(["cat!", "softmax"]))
    assert translation_figures.figure_label_problems("x", nb, [], tmp_path) == [
        "x: figures: 'cat' has no Chinese ('cat!')"
    ]


def test_build_puts_the_chinese_drawing_in_place():
    nb = notebook_with_figure(["cat"], zh_drawing(["猫"]))
    output = nb.cells[0].outputs[0]
    translation_figures.chinese_figure(output)
    assert output.data["image/png"] == "WkguUE5H"
    assert output.metadata["image/png"] == {"width": 10, "height": 5}
    assert output.metadata["mha_text"]["strings"] == ["猫"] and "mha_zh" not in output.metadata


def test_math_text_with_chinese_is_refused(tmp_path, monkeypatch):
    """matplotlib draws a label with $…$ all in its math font, which has no Chinese: the drawing
    stops on the empty boxes, and the check refuses such an entry before it is drawn."""
    fig, ax = figure()
    ax.set_xlabel("mix with $W^O$")
    with pytest.raises(RuntimeError, match="lacks glyphs"):
        figure_text.chinese_drawing(fig, {**TABLE, "mix with $W^O$": "用$W^O$混合"})
    plt.close(fig)
    write_table(tmp_path, {"mix with $W^O$": "用$W^O$混合"})
    nb = notebook_with_figure(["mix with $W^O$"], zh_drawing(["用$W^O$混合"]))
    (problem,) = translation_figures.figure_label_problems("x", nb, [], tmp_path)
    assert "math font, which has no Chinese" in problem
