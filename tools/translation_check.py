"""`translate.py check` and `stale`: every translation file complete, current and well formed.

Per file: no missing, stale (the English changed since) or orphaned entry, entries in notebook
order, the structure of every entry kept (tools/translation_structure.py), some Chinese text in
every cell that has English prose, and the glossary's words (tools/translation_glossary.py). Per
notebook: its code comments (tools/translation_code.py) and figure labels
(tools/translation_figures.py). Per chapter, in reading order: the first use of every glossary term
marked `first_use`. Everywhere: never 本笔记本 (FORBIDDEN; also in code comments and the setup
cell), and the closing heading of a section ("What to take away") is 小结. The landing page and
the other markdown pages are always checked; chapters only when `i18n/zh/chapters.txt` lists them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from translation_code import SETUP_CELL, chinese_setup_cell, comment_problems
from translation_figures import figure_label_problems
from translation_files import (
    I18N,
    REPO,
    chapter_groups,
    en_hash,
    english_toc,
    listed_stems,
    load_code_comments,
    load_glossary,
    load_translation,
    markdown_stems,
    translated,
    units_for,
)
from translation_glossary import (
    REDUCTION_BY_A_MULTIPLE,
    first_use_problems,
    glossary_problems,
)
from translation_printed import SHARED, load_printed, printed_problems, shared_problems
from translation_structure import figure_problems, needs_translation, structure_problems

CODE_BLOCK = re.compile(r"^(```|:::).*?^\1", re.MULTILINE | re.DOTALL)
HEADING_LINE = re.compile(r"^(#{1,6})\s+(.*)$", re.MULTILINE)


# Words the Chinese edition never uses, in prose, code comments, figure texts or the setup cell:
# the glossary says notebook (不译), and a reader of the course is not addressed as 本笔记本.
FORBIDDEN = ("本笔记本",)
# The heading that closes every section ("What to take away") is 小结, as in d2l-zh; never one of
# the variants an earlier translation used.
CLOSING_EN = "What to take away"
CLOSING_ZH = "小结"


def forbidden_problems(text: str) -> list[str]:
    return [f"uses {word!r} (write notebook: 本notebook)" for word in FORBIDDEN if word in text]


def comment_word_problems(comments: str) -> list[str]:
    """Code comments: no forbidden word and no reduction stated as a multiple."""
    return forbidden_problems(comments) + [
        f"{m.group(0)!r}: a reduction stated as a multiple (say 是原来的1/N)"
        for m in REDUCTION_BY_A_MULTIPLE.finditer(comments)
    ]


def heading_texts(markdown: str) -> list[str]:
    """The text of every heading of a markdown cell, outside code blocks, in order."""
    prose = CODE_BLOCK.sub("", markdown)
    return [m.group(2).strip() for m in HEADING_LINE.finditer(prose)]


def closing_heading_problems(english: str, chinese: str) -> list[str]:
    """The Chinese of the closing heading ("What to take away") must be 小结."""
    zh = heading_texts(chinese)
    return [
        f"the closing heading {zh[i]!r} must be {CLOSING_ZH!r}"
        for i, en in enumerate(heading_texts(english))
        if en == CLOSING_EN and i < len(zh) and zh[i] != CLOSING_ZH
    ]


def entry_text(kind: str, entry: dict) -> str:
    if kind == "figure":
        return f"{entry.get('alt', '')}\n{entry.get('caption', '')}"
    return entry.get("zh") or ""


def status(name: str, i18n: Path | None = None, units=None) -> dict[str, list[str]]:
    """Missing, stale and orphaned entry ids of one translation file."""
    units = units if units is not None else units_for(name)
    cells = load_translation(name, i18n)
    ids = {uid for uid, _, _ in units}
    result: dict[str, list[str]] = {"missing": [], "stale": [], "orphaned": []}
    for uid, _, text in units:
        if uid not in cells:
            if needs_translation(text):
                result["missing"].append(uid)
        elif cells[uid].get("en") != en_hash(text):
            result["stale"].append(uid)
    result["orphaned"] = [uid for uid in cells if uid not in ids]
    return result


def check_file(name: str, glossary: list[dict], i18n: Path | None = None, units=None) -> list[str]:
    units = units if units is not None else units_for(name)
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return [f"{name}: no translation file i18n/zh/{name}.yml"]
    problems = [
        f"{name}: {what} entry {uid}"
        for what, uids in status(name, i18n, units).items()
        for uid in uids
    ]
    cells = load_translation(name, i18n)
    order = [uid for uid, _, _ in units if uid in cells]
    if order != [uid for uid in cells if uid in order]:
        problems.append(f"{name}: entries are not in notebook order")
    for uid, kind, english in units:
        entry = cells.get(uid)
        if not entry:
            continue
        chinese = entry_text(kind, entry)
        where = f"{name}: {uid}"
        if kind == "figure":
            found = figure_problems(english, entry)
        else:
            found = structure_problems(english, chinese)
        problems += [f"{where}: {p}" for p in found]
        if needs_translation(english) and not re.search(r"[\u4e00-\u9fff]", chinese):
            problems.append(f"{where}: no Chinese text")
        problems += [f"{where}: {p}" for p in glossary_problems(chinese, glossary)]
        problems += [f"{where}: {p}" for p in forbidden_problems(chinese)]
        if kind == "markdown":
            problems += [f"{where}: {p}" for p in closing_heading_problems(english, chinese)]
    return problems


def check() -> list[str]:
    glossary = load_glossary()
    problems = []
    for term in glossary:
        problems += [
            f"glossary: {term['en']!r} avoids {bad!r}, which is part of {term['zh']!r}"
            for bad in term.get("avoid", [])
            if bad in term["zh"]
        ]
    setup = chinese_setup_cell(SETUP_CELL.read_text(encoding="utf-8"))
    problems += [
        f"the Chinese setup cell (tools/translation_code.py): {p}"
        for p in forbidden_problems(setup)
    ]
    pages = ["index", *markdown_stems(english_toc())]
    notebooks = []  # the listed notebooks, whose printed lines the shared table translates
    for name in [*pages, *listed_stems()]:
        if name not in pages and not (REPO / "chapters" / f"{name}.ipynb").exists():
            problems.append(f"i18n/zh/chapters.txt lists {name}, which is not a chapter")
            continue
        problems += check_file(name, glossary)
        if name not in pages:  # a notebook (the markdown pages have no code)
            nb = nbformat.read(REPO / "chapters" / f"{name}.ipynb", as_version=4)
            problems += comment_problems(name, nb)
            problems += [
                f"{name}: code {uid}: {p}"
                for uid, comments in load_code_comments(name).items()
                for p in comment_word_problems("\n".join(comments.values()))
            ]
            problems += figure_label_problems(name, nb, glossary)
            problems += printed_problems(name, nb)
            printed = "\n".join(load_printed(name).values())
            problems += [f"{name}: printed: {p}" for p in forbidden_problems(printed)]
            problems += [f"{name}: printed: {p}" for p in glossary_problems(printed, glossary)]
            notebooks.append(nb)
    problems += shared_problems(notebooks)
    shared = "\n".join(load_printed(SHARED).values())
    problems += [f"{SHARED}.yml: {p}" for p in forbidden_problems(shared)]
    problems += [f"{SHARED}.yml: {p}" for p in glossary_problems(shared, glossary)]
    listed = set(listed_stems())
    for group in [["index"], *chapter_groups(english_toc())]:
        chapter: list[tuple[str, list[tuple[str, str]]]] = []
        for name in group:
            if name == "index" or name in listed:
                units = units_for(name)
                cells = translated(units, load_translation(name))
                texts = [
                    (uid, cells[uid]["zh"])
                    for uid, kind, _ in units
                    if kind == "markdown" and uid in cells
                ]
                chapter.append((name, texts))
        problems += first_use_problems(chapter, glossary)
    return problems
