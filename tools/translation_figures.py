"""Figure labels: the words drawn inside figures, their Chinese, and the Chinese drawings.

A figure's texts are drawn in English by the code; make execute draws every figure with English
words once more in Chinese, from the notebook's table (``figures:``, English: Chinese; ``{}``
stands for a number) and stores that drawing in the output's metadata (tools/figure_text.py).
`check` requires every English word drawn in a figure to have its Chinese in ``figures:``, each
Chinese drawing to be made with today's table, and no unused entry; `build` puts the Chinese
drawing in place of the English PNG.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from figure_text import matches as label_matches
from figure_text import needs_translation as label_needs_translation
from figure_text import translate as translate_label
from translation_files import REPO, load_figure_labels
from translation_glossary import glossary_problems


def figure_outputs(nb) -> list[tuple[int, dict]]:
    """The PNG outputs of ``nb`` in page order, numbered from 1 as a reader counts figures."""
    pngs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return list(enumerate((o for o in pngs if "image/png" in o.get("data", {})), 1))


def figure_words(recorded: dict | None) -> list[str]:
    """The texts of a figure's English drawing that need Chinese, from what make execute
    recorded in its output's metadata (``mha_text``)."""
    return [s for s in (recorded or {}).get("strings", []) if label_needs_translation(s)]


def figure_label_problems(
    name: str, nb, glossary: list[dict], i18n: Path | None = None
) -> list[str]:
    """Every English word a figure draws has its Chinese in the table, the stored Chinese
    drawing was made with today's table, and the table has no entry that no figure draws."""
    table = load_figure_labels(name, i18n) or {}
    problems: list[str] = []
    used: set[str] = set()
    for number, output in figure_outputs(nb):
        needed = figure_words(output.get("metadata", {}).get("mha_text"))
        if not needed:
            continue
        where = f"{name}: figure {number}"
        used.update(key for s in needed for key in table if label_matches(key, s))
        drawn = output["metadata"].get("mha_zh")
        if drawn is None:
            problems.append(f"{where}: no Chinese drawing (make execute)")
            continue
        for english in needed:
            chinese = translate_label(english, table)
            if chinese is None:
                problems.append(f"{where}: no Chinese for the label {english!r} (figures:)")
            elif chinese not in drawn["strings"]:
                problems.append(
                    f"{where}: drawn before the label {english!r} became {chinese!r}: make execute"
                )
    for english, chinese in table.items():
        if english not in used:
            problems.append(f"{name}: figures: {english!r} is drawn by no figure")
        elif chinese != english and not re.search(r"[\u4e00-\u9fff]", chinese):
            problems.append(f"{name}: figures: {english!r} has no Chinese ({chinese!r})")
        elif re.search(r"\$", chinese) and re.search(r"[\u4e00-\u9fff]", chinese):
            problems.append(
                f"{name}: figures: {chinese!r}: matplotlib draws a text with $…$ math all in its "
                "math font, which has no Chinese; write the math as plain text (Wᴼ, kⱼ)"
            )
        elif english.count("{}") != chinese.count("{}"):
            problems.append(f"{name}: figures: {english!r} and {chinese!r} differ in {{}}")
        problems += [
            f"{name}: figures: {chinese!r} {p}" for p in glossary_problems(chinese, glossary)
        ]
    return problems


def missing_figure_labels(name: str) -> list[str]:
    """The English figure texts of ``name`` that its table does not translate, each once."""
    nb = nbformat.read(REPO / "chapters" / f"{name}.ipynb", as_version=4)
    table = load_figure_labels(name) or {}
    return list(
        dict.fromkeys(
            s
            for _, output in figure_outputs(nb)
            for s in figure_words(output.get("metadata", {}).get("mha_text"))
            if translate_label(s, table) is None
        )
    )


def chinese_figure(output) -> None:
    """Put the Chinese drawing that make execute stored in place of the English PNG."""
    drawn = output.get("metadata", {}).pop("mha_zh", None)
    if drawn is not None:
        output.data["image/png"] = drawn["image/png"]
        output.metadata["image/png"] = drawn["size"]
        output.metadata["mha_text"] = {**drawn["mha_text"], "strings": drawn["strings"]}
