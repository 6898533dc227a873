"""The Chinese edition (中文版): translation files, their checks, and the generated Chinese book.

Markdown is translated, with code comments and the words drawn in figures. Per English notebook `chapters/<stem>.ipynb` (a chapter, or a section
of one: every file of _toc.yml, `sections:` included) there is one translation file `i18n/zh/<stem>.yml`; it maps every markdown cell id to its Chinese text, and
every figure cell id to its Chinese alt text and caption, each with `en:`, the first 12 hex digits
of the SHA-256 of the English text it translates (for a figure: alt + "\\n" + caption). When an
English cell changes, its hash no longer matches and the entry is *stale*. The landing page
`chapters/index.md` is translated the same way in `i18n/zh/index.yml`, one entry per `##` section,
and so is every other markdown page of the table of contents (`chapters/posts.md` in
`i18n/zh/posts.yml`); these pages are always checked, listed in `chapters.txt` or not. Beside
`cells:`, a notebook's file may translate code comments (`code:`, per code cell id) and has a
table of the texts its figures draw (`figures:`, English as drawn: Chinese, `{}` a number), from
which make execute draws each figure again in Chinese (tools/figure_text.py).

The glossary is one file, `i18n/zh/glossary.yml`: each term's English, its Chinese, a short English
definition (`define:`) and the label of the section that teaches it (`taught:`). `build` turns it
into two pages, the English glossary `chapters/glossary.md` and the Chinese `zh/chapters/glossary.md`.

    python tools/translate.py todo <stem>   English text of every missing or stale entry (for translators)
    python tools/translate.py stale         list missing, stale and orphaned entries of every file
    python tools/translate.py check         coverage, staleness, MyST structure, glossary; exit 1 on a problem
    python tools/translate.py build         write the Chinese book: zh/_config.yml, zh/_toc.yml,
                                            zh/chapters/*.ipynb, zh/chapters/*.md (index, posts,
                                            glossary); and the English glossary, chapters/glossary.md

Which chapters `check` requires to be fully translated is listed in `i18n/zh/chapters.txt` (plus
the landing page, always); a chapter's sections are listed one by one. Add a stem there when its
translation lands. `build` writes every chapter and section of the English table of contents: a listed chapter from its translation, any other one as
an English copy under a note saying it is not translated yet (so the Chinese book's links resolve;
a draft translation file of an unlisted chapter is ignored until the chapter is listed). A missing
or stale cell falls back to its English text (and `check` fails until it is translated).

The structure rules `check` enforces, cell by cell against the English: the same directive and
option lines (an exercise's title excepted), code and math blocks, `(label)=` targets, heading
levels, list items, table columns, role targets ({ref}, {numref}, {doc}, {eq}, {cite}), inline
math, inline code spans, URLs and link targets; some Chinese text in every cell that has English
prose; and no word that i18n/zh/glossary.yml lists under `avoid`. In math (inline, display, `{math}`
blocks and roles) only the words of `\\text{…}` (`\\textrm`, `\\mbox`) may differ: the same groups,
in the same order, and everything around them byte for byte; the glossary's `avoid` applies to them.

The generated notebooks equal the English ones except for markdown sources, figure alt texts and
captions, the `language` entry of the notebook metadata, `{literalinclude}` paths (one level
deeper: zh/chapters/ instead of chapters/), and in a listed chapter the setup cell (chinese_setup_cell:
Chinese comments, the checkout two folders up, `mha.exercises.set_language("zh")`) and every checker's
success line, replaced by what that checker prints in Chinese (run_checkers: each checker run on an
answer it accepts, in a fresh interpreter, in both languages; the English line must equal the stored
one, else the notebook is stale), comments translated under `code:`, and every figure that draws
English words replaced by its Chinese drawing. Other code cells, outputs, cell ids and tags are
copied.

`check` also enforces, in every listed file: no reduction stated as a multiple (比B少N倍, 缩小N倍), and
per chapter (opening page and sections, in reading order) the English in full-width parentheses at
the first use of every glossary term marked `first_use`; every English word drawn in a figure has its
Chinese in `figures:`, each Chinese drawing was made with today's table, and no entry is unused.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

import nbformat
import yaml
from figure_text import matches as label_matches
from figure_text import needs_translation as label_needs_translation
from figure_text import translate as translate_label
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin

REPO = Path(__file__).resolve().parents[1]
I18N = REPO / "i18n" / "zh"
ZH = REPO / "zh"
LISTED = I18N / "chapters.txt"
GLOSSARY = I18N / "glossary.yml"
INDEX_SOURCE = "chapters/index.md"
# Pages of the book generated from i18n/zh/glossary.yml (not translated cell by cell).
GLOSSARY_STEM = "glossary"
LANG = "zh-CN"
TITLE = "多头注意力：从直觉到GPU"
# The English table of contents' part captions, in Chinese.
PART_CAPTIONS = {
    "Foundations": "基础",
    "Multi-head attention": "多头注意力",
    "Making it fast": "让它跑得快",
    "Training and serving": "训练与推理服务",
    "Today's open models": "当今的开放模型",
    "Appendix": "附录",
}
GLOSSARY_PART = "参考"
AUTHOR = "多头注意力课程的作者们"
UNTRANSLATED_NOTE = (
    ":::{note}\n本章尚未译成中文，下面是英文原文。"
    "术语的中文译法见{ref}`术语表 <zh-glossary>`。\n:::"
)
GENERATED = "# Generated by tools/translate.py build from the English book: do not edit.\n"


def en_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


# --- what is translated ------------------------------------------------------------------------


def figure_text(cell) -> tuple[str, str] | None:
    m = cell.metadata.get("mystnb")
    if cell.cell_type != "code" or not m or "image" not in m or "figure" not in m:
        return None
    return m["image"]["alt"], m["figure"]["caption"]


def notebook_units(nb) -> list[tuple[str, str, str]]:
    """(id, kind, English text) for every translatable cell, in notebook order."""
    units = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            units.append((cell.id, "markdown", cell.source))
        elif (fig := figure_text(cell)) is not None:
            units.append((cell.id, "figure", fig[0] + "\n" + fig[1]))
    return units


def heading_slug(line: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")


def index_blocks(text: str) -> list[tuple[str, str]]:
    """The landing page cut before every `## ` heading: (key, text); the first block is "title"."""
    blocks: list[tuple[str, list[str]]] = [("title", [])]
    fence = None
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*(`{3,}|:{3,})", line)
        if m:
            fence = None if fence and m.group(1).startswith(fence) else (fence or m.group(1))
        if fence is None and line.startswith("## "):
            # A heading with no Latin letters or digits (a post's Chinese title) is keyed by its
            # place on the page; keys stay unique.
            key = heading_slug(line) or f"section-{len(blocks)}"
            while key in {k for k, _ in blocks}:
                key += "-again"
            blocks.append((key, []))
        blocks[-1][1].append(line)
    return [(key, "".join(lines)) for key, lines in blocks]


def index_units(name: str = "index") -> list[tuple[str, str, str]]:
    """The translation units of a markdown page (the landing page by default): its `##` blocks."""
    text = (REPO / "chapters" / f"{name}.md").read_text(encoding="utf-8")
    return [(key, "markdown", block) for key, block in index_blocks(text)]


def listed_stems() -> list[str]:
    lines = LISTED.read_text(encoding="utf-8").splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def english_toc() -> dict:
    return yaml.safe_load((REPO / "_toc.yml").read_text(encoding="utf-8"))


def toc_files(entries: list[dict]) -> list[str]:
    """The files of toc entries and of their `sections:`, in reading order."""
    files = []
    for entry in entries or []:
        files += [entry["file"]] if "file" in entry else []
        files += toc_files(entry.get("sections", []))
    return files


def all_toc_stems(toc: dict) -> list[str]:
    """Every page of the table of contents under chapters/, notebooks and markdown pages."""
    files = [f for part in toc.get("parts", []) for f in toc_files(part.get("chapters", []))]
    return [f.removeprefix("chapters/") for f in files if f.startswith("chapters/")]


def toc_stems(toc: dict) -> list[str]:
    """The notebooks of the table of contents: chapters and their sections."""
    return [s for s in all_toc_stems(toc) if (REPO / "chapters" / f"{s}.ipynb").exists()]


def markdown_stems(toc: dict) -> list[str]:
    """The markdown pages of the table of contents translated by `##` blocks (not the glossary)."""
    return [
        s
        for s in all_toc_stems(toc)
        if s != GLOSSARY_STEM and not (REPO / "chapters" / f"{s}.ipynb").exists()
    ]


def units_for(name: str) -> list[tuple[str, str, str]]:
    if name == "index" or (REPO / "chapters" / f"{name}.md").exists():
        return index_units(name)
    return notebook_units(nbformat.read(REPO / "chapters" / f"{name}.ipynb", as_version=4))


def load_translation(name: str, i18n: Path | None = None) -> dict:
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return {}
    # BaseLoader reads every scalar as a string: a hash or cell id of digits stays text.
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return data.get("cells") or {}


def load_figure_labels(name: str, i18n: Path | None = None) -> dict[str, str] | None:
    """The Chinese of the texts ``name``'s figures draw (``figures:``, English text: Chinese;
    ``{}`` in both stands for a number; read tools/figure_text.py), or None without a file."""
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return None
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return dict(data.get("figures") or {})


# --- structure: what a translation must keep byte for byte ---------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|:{3,})(.*)$")
OPTION = re.compile(r"^\s*:[\w-]+:")
LABEL = re.compile(r"^\s*\(([^()\s]+)\)=\s*$")
HEADING = re.compile(r"^(#{1,6})\s")
LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s")
ROLE = re.compile(r"\{([\w:.-]+)\}(`+)(.+?)\2", re.DOTALL)
TARGET_ROLES = {"ref", "numref", "doc", "eq", "download", "term", "cite", "cite:p", "cite:t"}
CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.DOTALL)
# Inline math may wrap onto the next line, never across a blank line.
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\$)((?:[^$\n]|\n(?!\s*\n))+?)(?<![\\$])\$")
URL = re.compile(r"https?://[^\s<>()\[\]\"'`]+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Directives whose argument is a title (translated); any other directive line is kept whole.
TITLED = re.compile(
    r"^(\s*(?:`{3,}|:{3,})\{(?:exercise|exercise-start|admonition|dropdown|topic|sidebar|card|tab-item)\})\s.*$"
)
# Directive bodies that are code or math, not prose.
VERBATIM = re.compile(r"^\{(math|code|code-block|code-cell|raw|literalinclude)\}|^[\w+-]*$")
# Words in a formula: the argument of \text{…} (\textrm, \mbox) is prose and may be translated.
TEXT_IN_MATH = re.compile(r"\\(?:text|textrm|mbox)\s*\{")


def text_groups(math: str) -> list[tuple[int, int]]:
    """(start, end) of the argument of every \\text{…} group of a formula, outermost only.

    An unbalanced group ends the search: the rest of the formula is kept as it is."""
    groups: list[tuple[int, int]] = []
    end = 0
    for m in TEXT_IN_MATH.finditer(math):
        if m.start() < end:
            continue  # inside the previous group
        depth, i = 1, m.end()
        while i < len(math) and depth:
            if math[i] == "\\":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(math[i], 0)
            i += 1
        if depth:
            break
        groups.append((m.end(), i - 1))
        end = i
    return groups


def math_skeleton(math: str) -> str:
    """A formula as a translation must keep it: every \\text{…} argument replaced by `…`."""
    out, at = [], 0
    for start, end in text_groups(math):
        out.append(math[at:start] + "…")
        at = end
    return "".join(out) + math[at:]


def math_words(math: str) -> list[str]:
    """The arguments of a formula's \\text{…} groups: the words a translation may change."""
    return [math[start:end] for start, end in text_groups(math)]


def structure(text: str) -> dict:
    """The parts of a markdown cell that a translation keeps unchanged."""
    directives: list[str] = []
    verbatim: list[str] = []
    prose: list[str] = []
    stack: list[tuple[str, str | None]] = []  # (fence, "math" or "code" body, or None: prose)
    after_opener = False
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and stack and m.group(1)[0] == stack[-1][0][0] and not m.group(2).strip():
            if len(m.group(1)) >= len(stack[-1][0]):
                stack.pop()
                directives.append(line.strip())
                after_opener = False
                continue
        if after_opener and OPTION.match(line):
            directives.append(line.strip())
            continue
        after_opener = False
        if stack and stack[-1][1]:
            line = line.rstrip()
            verbatim.append(math_skeleton(line) if stack[-1][1] == "math" else line)
            continue
        if m:
            info = m.group(2).strip()
            body = VERBATIM.match(info)
            kind = None if body is None else "math" if body.group(1) == "math" else "code"
            stack.append((m.group(1), kind))
            directives.append(TITLED.sub(r"\1 <title>", line).strip())
            after_opener = True
            continue
        prose.append(line)
    body = "\n".join(prose)
    labels = [m.group(1) for ln in prose if (m := LABEL.match(ln))]
    headings = [len(m.group(1)) for ln in prose if (m := HEADING.match(ln))]
    items = [(len(m.group(1)), m.group(2)[-1]) for ln in prose if (m := LIST_ITEM.match(ln))]

    roles: Counter = Counter()
    for m in ROLE.finditer(body):
        content = m.group(3)
        target = re.search(r"<([^<>]+)>\s*$", content)
        # {ref}`text <target>`: the target is kept, the text translated; any other role
        # (e.g. {math}`...`) is kept whole.
        keep = target.group(1) if target and m.group(1) in TARGET_ROLES else content
        roles[(m.group(1), math_skeleton(keep) if m.group(1) == "math" else keep)] += 1
    body = ROLE.sub(" ", body)
    code = Counter(m.group(2) for m in CODE.finditer(body))
    body = CODE.sub(" ", body)
    math = Counter(math_skeleton(m.group(1).strip()) for m in DISPLAY_MATH.finditer(body))
    body = DISPLAY_MATH.sub(" ", body)
    math.update(math_skeleton(m.group(1).strip()) for m in INLINE_MATH.finditer(body))
    body = INLINE_MATH.sub(" ", body)
    urls = Counter(u.rstrip(".,;:") for u in URL.findall(body))
    links = Counter(LINK.findall(body))
    tables = [ln.count("|") for ln in body.splitlines() if ln.lstrip().startswith("|")]
    return {
        "directive and option lines": directives,
        "code or math blocks": verbatim,
        "labels": labels,
        "heading levels": headings,
        "list items (indent, marker)": items,
        "table columns": tables,
        "roles and their targets": roles,
        "inline code": code,
        "math": math,
        "URLs": urls,
        "link targets": links,
        "rest": body,
    }


def needs_translation(text: str) -> bool:
    """False for a cell that is only structure (e.g. a lone `:::{solution-end}` marker)."""
    return bool(re.search(r"[A-Za-z]{2}", structure(text)["rest"]))


MARKDOWN = MarkdownIt("commonmark").enable("table").use(dollarmath_plugin)


def stray_asterisks(text: str) -> int:
    """Asterisks that render as text: emphasis that failed to open or close.

    CommonMark does not close ``**`` that follows punctuation and precedes a letter, and full-width
    punctuation counts, so ``**加粗。**后`` stays literal while ``**加粗**。后`` renders.
    """
    tokens = MARKDOWN.parse(text)
    return sum(
        child.content.count("*")
        for token in tokens
        for child in token.children or []
        if child.type == "text"
    )


def structure_problems(english: str, chinese: str) -> list[str]:
    en, zh = structure(english), structure(chinese)
    problems = []
    if stray_asterisks(chinese) > stray_asterisks(english):
        problems.append(
            "emphasis: a * or ** renders as text (keep full-width punctuation outside the "
            "markers: **加粗**。 not **加粗。**)"
        )
    for key in en:
        if key == "rest" or en[key] == zh[key]:
            continue
        if isinstance(en[key], Counter):
            # Each segment must survive unchanged; Chinese word order may repeat one.
            lost, added = sorted(set(en[key]) - set(zh[key])), sorted(set(zh[key]) - set(en[key]))
            if lost or added:
                problems.append(f"{key}: missing {lost}, not in the English {added}")
        else:
            problems.append(f"{key}: English {en[key]}, Chinese {zh[key]}")
    return problems


def figure_problems(english: str, entry: dict) -> list[str]:
    alt, caption = entry.get("alt"), entry.get("caption")
    if not alt or not caption:
        return ["a figure entry needs both alt and caption"]
    return structure_problems(english, f"{alt}\n{caption}")


# --- the glossary ---------------------------------------------------------------------------------


def load_glossary(path: Path | None = None) -> list[dict]:
    return yaml.safe_load((path or GLOSSARY).read_text(encoding="utf-8"))["terms"]


# An English gloss after a term, in full-width parentheses: 查询（query）, 在线softmax（online softmax）.
GLOSS = re.compile(
    r"（[^（）\u3000-\u9fff\uff01-\uff5e]*[A-Za-z][^（）\u3000-\u9fff\uff01-\uff5e]*）"
)
# At a term's first use: its English (and maybe more) in full-width parentheses: 多查询注意力（MQA，…）.
FIRST_USE_GLOSS = re.compile(r"（\s*[A-Za-z]")
# "A 比 B 少/小/低 N 倍", "缩小 N 倍": ambiguous in Chinese (a reduction stated as a multiple);
# write what it comes to instead: 只有B的四分之一, 是原来的1/25, 乘以α.
REDUCTION_BY_A_MULTIPLE = re.compile(
    r"(?:(?<!多)少|(?<!大)小|低|缩小|减少|降低)(?:了|约|近|到|至)?[^，。；：（）\n]{0,16}?倍(?!数)"
)


def without_allowed(text: str, term: dict) -> str:
    for word in term.get("allow", []):
        text = text.replace(word, " ")
    return text


def only_words(formula: re.Match) -> str:
    return " " + " ".join(math_words(formula.group(1))) + " "


def glossary_problems(chinese: str, glossary: list[dict]) -> list[str]:
    text = CODE.sub(" ", ROLE.sub(" ", chinese))
    # A formula is exempt, except the words of its \text{…} groups, which are translated.
    text = GLOSS.sub(" ", INLINE_MATH.sub(only_words, DISPLAY_MATH.sub(only_words, text)))
    problems = [
        f"uses {bad!r}; the glossary translates {term['en']!r} as {term['zh']!r}"
        for term in glossary
        for bad in term.get("avoid", [])
        if bad in without_allowed(text, term)
    ]
    problems += [
        f"{m.group(0)!r}: a reduction stated as a multiple is ambiguous in Chinese; say what it "
        "comes to (只有……的四分之一, 是原来的1/25, 乘以……)"
        for m in REDUCTION_BY_A_MULTIPLE.finditer(text)
    ]
    return problems


def prose(chinese: str) -> str:
    """A markdown cell's running text: no code, math, roles, directive lines or headings."""
    rest = structure(chinese)["rest"]
    return "\n".join(ln for ln in rest.splitlines() if not HEADING.match(ln))


def chapter_groups(toc: dict) -> list[list[str]]:
    """Each chapter's pages (its opening page, then its sections), in reading order."""
    groups = []
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            files = toc_files([chapter])
            groups.append([f.removeprefix("chapters/") for f in files if f.startswith("chapters/")])
    return [g for g in groups if g]


def first_use_problems(pages: list[tuple[str, list[tuple[str, str]]]], glossary: list[dict]):
    """Where a chapter first uses a `first_use` term without its English in parentheses.

    pages: (name, [(cell id, Chinese markdown), ...]) of one chapter, in reading order.
    """
    problems = []
    for term in (t for t in glossary if t.get("first_use")):
        zh = term["zh"]
        for name, cells in pages:
            found = None
            for uid, chinese in cells:
                text = without_allowed(prose(chinese), term)
                at = text.find(zh)
                if at >= 0:
                    found = (uid, text[at + len(zh) :].lstrip('*”"_ '))
                    break
            if found:
                uid, after = found
                if not FIRST_USE_GLOSS.match(after):
                    problems.append(
                        f"{name}: {uid}: the chapter's first {zh!r} needs its English: "
                        f"{zh}（{term['en']}）"
                    )
                break
    return problems


# --- code comments ------------------------------------------------------------------------------
#
# A translation file may translate the comments of code cells, under `code:` (beside `cells:`):
#
#     code:
#       73adc9b5:               # a code cell's id
#         comments:             # the text after "# " in the English cell -> the Chinese text
#           model width: 模型维度
#
# Only comments change: `check` tokenizes both versions and requires every other token to be the
# same. A comment that the English cell no longer has is reported (and the cell keeps its English).


def load_code_comments(name: str, i18n: Path | None = None) -> dict[str, dict[str, str]]:
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return {}
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return {uid: entry.get("comments") or {} for uid, entry in (data.get("code") or {}).items()}


def with_comments(source: str, comments: dict[str, str]) -> str:
    for english, chinese in comments.items():
        source = source.replace(f"# {english}", f"# {chinese}")
    return source


def code_tokens(source: str) -> list[tuple[int, str]]:
    """The tokens of a code cell without its comments (IPython magics tokenize as operators)."""
    import io
    import tokenize

    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    try:
        return [(t.type, t.string) for t in tokens if t.type != tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [(-1, re.sub(r"#.*", "", source))]


def comment_problems(name: str, nb, i18n: Path | None = None) -> list[str]:
    code = {cell.id: cell for cell in nb.cells if cell.cell_type == "code"}
    problems = []
    for uid, comments in load_code_comments(name, i18n).items():
        cell = code.get(uid)
        if cell is None:
            problems.append(f"{name}: code {uid}: no such code cell")
            continue
        problems += [
            f"{name}: code {uid}: the cell has no comment '# {english}' (stale)"
            for english in comments
            if f"# {english}" not in cell.source
        ]
        if code_tokens(with_comments(cell.source, comments)) != code_tokens(cell.source):
            problems.append(f"{name}: code {uid}: the translation changes code, not only comments")
    return problems


# --- status and checks --------------------------------------------------------------------------


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
    pages = ["index", *markdown_stems(english_toc())]
    for name in [*pages, *listed_stems()]:
        if name not in pages and not (REPO / "chapters" / f"{name}.ipynb").exists():
            problems.append(f"i18n/zh/chapters.txt lists {name}, which is not a chapter")
            continue
        problems += check_file(name, glossary)
        if name not in pages:  # a notebook (the markdown pages have no code)
            nb = nbformat.read(REPO / "chapters" / f"{name}.ipynb", as_version=4)
            problems += comment_problems(name, nb)
            problems += figure_label_problems(name, nb, glossary)
    listed = set(listed_stems())
    for group in [["index"], *chapter_groups(english_toc())]:
        pages = []
        for name in group:
            if name == "index" or name in listed:
                units = units_for(name)
                cells = translated(units, load_translation(name))
                texts = [
                    (uid, cells[uid]["zh"])
                    for uid, kind, _ in units
                    if kind == "markdown" and uid in cells
                ]
                pages.append((name, texts))
        problems += first_use_problems(pages, glossary)
    return problems


# --- figure labels: the words drawn inside figures ------------------------------------------------
#
# A figure's texts are drawn in English by the code; make execute draws every figure with English
# words once more in Chinese, from the notebook's table (``figures:``, English: Chinese; ``{}``
# stands for a number) and stores that drawing in the output's metadata (tools/figure_text.py).


def figure_outputs(nb) -> list[tuple[int, dict]]:
    """The PNG outputs of ``nb`` in page order, numbered from 1 as a reader counts figures."""
    pngs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return list(enumerate((o for o in pngs if "image/png" in o.get("data", {})), 1))


def figure_words(recorded: dict | None) -> list[str]:
    """The texts of a figure's English drawing that need Chinese, from what make execute
    recorded in its output's metadata (``mha_text``)."""
    return [s for s in (recorded or {}).get("strings", []) if label_needs_translation(s)]


def figure_label_problems(name: str, nb, glossary: list[dict], i18n: Path | None = None):
    """Every English word a figure draws has its Chinese in the table, the stored Chinese
    drawing was made with today's table, and the table has no entry that no figure draws."""
    table = load_figure_labels(name, i18n) or {}
    problems, used = [], set()
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


# --- build ----------------------------------------------------------------------------------------

INCLUDE_PATH = re.compile(
    r"^(\s*(?:`{3,}|:{3,})\{(?:literalinclude|include|image|figure)\}\s+)\.\./"
)


def deeper_paths(text: str) -> str:
    """zh/chapters/ is one folder deeper than chapters/: `../mha/x.py` -> `../../mha/x.py`."""
    return "\n".join(INCLUDE_PATH.sub(r"\1../../", ln) for ln in text.split("\n"))


def translated(units, cells: dict) -> dict[str, dict]:
    """The up-to-date entries only: a missing or stale cell keeps its English text."""
    return {
        uid: cells[uid] for uid, _, text in units if cells.get(uid, {}).get("en") == en_hash(text)
    }


# --- the code cells a Chinese reader runs: the setup cell and the checkers' output ---------------

SETUP_CELL = REPO / "tools" / "setup_cell.txt"
# Every comment line of tools/setup_cell.txt, in Chinese (a new English comment fails the build
# until it is added here); code lines are kept, except the two rewritten below.
SETUP_COMMENTS = {
    "# Setup. On Colab: install the course package `mha` from the repository": (
        "# 准备工作。在Colab上：从代码仓库安装课程的Python包`mha`"
    ),
    "# (Colab's own torch and numpy stay untouched). Locally: use the checkout": (
        "# （Colab自带的torch和numpy保持不变）。在本地：使用本笔记本所在的"
    ),
    "# this notebook lives in.": "# 检出目录（zh/chapters/的上两级）。",
    "# Figures at twice their size: sharp on high-density screens. Their text is": (
        "# 图以两倍尺寸绘制：在高分辨率屏幕上也清晰。图中文字为"
    ),
    "# 12 pt, and a figure 5.4 inches wide unless it says otherwise: on a phone, where": (
        "# 12磅，图宽5.4英寸（另有说明的除外）：在手机上，图会缩小到屏幕宽度，"
    ),
    "# a figure shrinks to the screen, its smallest label stays about 9 px tall.": (
        "# 其中最小的标签仍有约9像素高。"
    ),
}
# zh/chapters/ is one folder deeper than chapters/: the checkout is two folders up.
SETUP_PATH = (
    "    sys.path.insert(0, str(pathlib.Path.cwd().parent))",
    "    sys.path.insert(0, str(pathlib.Path.cwd().parents[1]))",
)
# The checkers speak Chinese in the Chinese notebooks (mha.exercises.set_language).
SETUP_LANGUAGE = (
    "import torch",
    'import torch\n\nimport mha.exercises\n\nmha.exercises.set_language("zh")  # 练习检查器用中文给出提示',
)


def chinese_setup_cell(english: str) -> str:
    """The setup cell of a Chinese notebook: tools/setup_cell.txt with Chinese comments, the
    checkout found from zh/chapters/, and the checkers switched to Chinese."""
    lines = []
    for line in english.split("\n"):
        if line.lstrip().startswith("# ") and line not in SETUP_COMMENTS:
            raise ValueError(
                f"translate this comment of tools/setup_cell.txt in SETUP_COMMENTS: {line!r}"
            )
        line = SETUP_COMMENTS.get(line, line)
        for old, new in (SETUP_PATH, SETUP_LANGUAGE):
            line = new if line == old else line
        lines.append(line)
    text = "\n".join(lines)
    missing = [new for _, new in (SETUP_PATH, SETUP_LANGUAGE) if new not in text]
    if missing:
        raise ValueError(
            f"tools/setup_cell.txt changed: cannot place {missing} (tools/translate.py)"
        )
    return text


CHECKER_LINE = re.compile(r"^✓ (check_\w+): correct — .*$", re.MULTILINE)


def run_checkers() -> dict[str, dict[str, str]]:
    """What every exercise checker prints for an answer it accepts, in English and in Chinese.

    Run in a fresh interpreter (`translate.py checker-lines`) on the checkout's `mha`, with Triton
    interpreted, so that the language switch and Triton's mode stay out of the caller's process.
    """
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MHA_LANG"}
    env.update(PYTHONPATH=str(REPO), TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "checker-lines"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"running the checkers failed:\n{result.stderr}")
    return json.loads(result.stdout)


def checker_lines_here() -> dict[str, dict[str, str]]:
    """`translate.py checker-lines`: each checker run on its first declared variant, per language."""
    import contextlib
    import io

    import mha.exercises as exercises

    lines: dict[str, dict[str, str]] = {}
    for exercise in exercises.EXERCISES:
        lines[exercise.name] = {}
        for language in ("en", "zh"):
            exercises.set_language(language)
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exercise.check(exercise.accepted_answer())
            except Exception as err:  # noqa: BLE001 (reported where a notebook needs the line)
                out.write(f"(could not run: {type(err).__name__}: {err})")
            # The success line only (a checker may print more before it).
            printed = out.getvalue().rstrip("\n").split("\n")
            lines[exercise.name][language] = next(
                (ln for ln in printed if ln.startswith("✓ ")), "\n".join(printed)
            )
    exercises.set_language("en")
    return lines


_CHECKERS: dict[str, dict[str, str]] = {}


def chinese_checker_output(text: str, where: str) -> str:
    """A stored stdout with every checker's success line replaced by what that checker prints in
    Chinese. The English line must be exactly what the checker prints now in English (else the
    stored notebook is out of date: make execute), so both lines are one result, two languages."""

    def swap(m: re.Match) -> str:
        if not _CHECKERS:
            _CHECKERS.update(run_checkers())
        lines = _CHECKERS.get(m.group(1))
        if lines is None or lines["en"] != m.group(0):
            raise ValueError(
                f"{where}: the stored line {m.group(0)!r} is not what {m.group(1)} prints now "
                f"({lines and lines['en']!r}); re-execute the notebook (make execute)"
            )
        return lines["zh"]

    return CHECKER_LINE.sub(swap, text)


def chinese_code_cell(cell, stem: str, setup: str) -> None:
    if cell.source.rstrip("\n") == setup.rstrip("\n"):
        cell.source = chinese_setup_cell(cell.source)
    for output in cell.get("outputs", []):
        if output.output_type == "stream" and output.name == "stdout":
            output.text = chinese_checker_output(output.text, f"{stem}: cell {cell.id}")
        chinese_figure(output)


def chinese_notebook(stem: str, *, listed: bool):
    nb = nbformat.read(REPO / "chapters" / f"{stem}.ipynb", as_version=4)
    # An unlisted chapter is published in English, even where a (draft) translation exists.
    cells = translated(notebook_units(nb), load_translation(stem)) if listed else {}
    setup = SETUP_CELL.read_text(encoding="utf-8")
    comments = load_code_comments(stem) if listed else {}
    for cell in nb.cells:
        entry = cells.get(cell.id)
        if cell.cell_type == "code" and listed:
            chinese_code_cell(cell, stem, setup)
            cell.source = with_comments(cell.source, comments.get(cell.id, {}))
        if cell.cell_type == "markdown":
            cell.source = deeper_paths(entry["zh"].rstrip("\n") if entry else cell.source)
        elif entry and figure_text(cell) is not None:
            cell.metadata["mystnb"]["image"]["alt"] = entry["alt"].strip()
            cell.metadata["mystnb"]["figure"]["caption"] = entry["caption"].strip()
    if not listed:
        note = nbformat.v4.new_markdown_cell(UNTRANSLATED_NOTE)
        note.id = "zh-untranslated-note"
        nb.cells.insert(1, note)
    nb.metadata["language"] = LANG
    return nb


def chinese_index(name: str = "index") -> str:
    """The Chinese text of a markdown page (the landing page by default)."""
    units = index_units(name)
    cells = translated(units, load_translation(name))
    parts = [cells[uid]["zh"] if uid in cells else text for uid, _, text in units]
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


def english_glossary_page() -> str:
    """chapters/glossary.md: every term, alphabetically, with its definition and where it is taught."""
    terms = sorted(load_glossary(), key=lambda t: t["en"].lower())
    entries = [
        f"{t['en']}\n: {t['define']} Taught in {{ref}}`{t['taught']}`. 中文：{t['zh']}"
        for t in terms
    ]
    return (
        "(glossary)=\n# Glossary\n\n"
        "The terms the course uses, each with a short definition, the section that teaches it and "
        "its Chinese name in the Chinese edition. Shape letters ($B$, $H$, $L$, $S$, $D$, $E$) are "
        "in the {ref}`notation table <index>`.\n\n"
        "% Generated by tools/translate.py build from i18n/zh/glossary.yml: edit that file.\n\n"
        + "\n\n".join(entries)
        + "\n"
    )


def glossary_page() -> str:
    rows = []
    for term in load_glossary():
        note = term.get("note", "")
        if term.get("avoid"):
            note += "不用" + "、".join(term["avoid"]) + "。"
        note += f"见{{ref}}`{term['taught']}`。"
        rows.append(f"| {term['en']} | {term['zh']} | {note} |")
    return (
        # Both labels: the English pages' {ref}`glossary` and the Chinese notes' zh-glossary.
        "(zh-glossary)=\n(glossary)=\n# 术语表\n\n"
        "中文版统一使用下列译法。代码中的标识符（函数名、参数名、表示形状的字母）保持英文，"
        "与`mha`的代码和PyTorch的文档一致。\n\n"
        "| English | 中文 | 说明 |\n|:--|:--|:--|\n" + "\n".join(rows) + "\n"
    )


def chinese_toc(toc: dict) -> dict:
    zh = copy.deepcopy(toc)
    for part in zh.get("parts", []):
        part["caption"] = PART_CAPTIONS.get(part["caption"], part["caption"])
    if GLOSSARY_STEM not in all_toc_stems(toc):
        zh["parts"].append({"caption": GLOSSARY_PART, "chapters": [{"file": "chapters/glossary"}]})
    return zh


def chinese_config(config: dict) -> dict:
    zh = copy.deepcopy(config)
    zh["title"] = TITLE
    zh["repository"]["path_to_book"] = "zh"
    zh["html"]["baseurl"] = zh["html"]["baseurl"].rstrip("/") + "/zh/"
    zh["bibtex_bibfiles"] = [f"../{p}" for p in config["bibtex_bibfiles"]]
    outside = {"mha", "tests", "tools", "README.md", "chapters/text", "zh", "i18n"}
    zh["exclude_patterns"] = [p for p in config["exclude_patterns"] if p not in outside]
    sphinx = zh["sphinx"]
    sphinx["local_extensions"] = {k: f"../{v}" for k, v in sphinx["local_extensions"].items()}
    # Chinese search (one-character words indexed, the query split as the index was), zh_CN
    # interface strings, "Suggest edit" opening the translation file.
    sphinx["local_extensions"]["sphinx_zh"] = "../tools/"
    conf = sphinx["config"]
    conf["language"] = "zh_CN"
    # Interface strings that are configuration, not catalogue entries (tools/sphinx_zh.py has those).
    zh["author"] = AUTHOR
    conf["togglebutton_hint"] = "点击显示"
    conf["togglebutton_hint_hide"] = "点击隐藏"
    # The book hides only code cells' source (tag hide-input): the toggle shows the code.
    conf["nb_code_prompt_show"] = "显示代码"
    conf["nb_code_prompt_hide"] = "隐藏代码"
    conf["html_theme_options"]["search_bar_text"] = "在本书中搜索……"
    conf["html_static_path"] = [f"../{p}" for p in conf["html_static_path"]]
    conf["language_switch"] = {"root": "..", "url": "../", "label": "English", "lang": "en"}
    # Sphinx's Chinese search splits words with jieba (requirements.txt), as tools/sphinx_zh_search.py
    # adapts it.
    conf["html_search_language"] = "zh"
    return zh


def write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def dump(data: dict) -> str:
    return GENERATED + yaml.safe_dump(data, allow_unicode=True, sort_keys=False, width=100)


def generated_files() -> dict[Path, str]:
    """Every file of the Chinese book, path -> content."""
    toc = english_toc()
    config = yaml.safe_load((REPO / "_config.yml").read_text(encoding="utf-8"))
    files = {
        ZH / "_config.yml": dump(chinese_config(config)),
        ZH / "_toc.yml": dump(chinese_toc(toc)),
        ZH / "chapters" / "index.md": chinese_index(),
        ZH / "chapters" / "glossary.md": glossary_page(),
        REPO / "chapters" / "glossary.md": english_glossary_page(),
    }
    for name in markdown_stems(toc):
        files[ZH / "chapters" / f"{name}.md"] = chinese_index(name)
    listed = set(listed_stems())
    for stem in toc_stems(toc):
        nb = chinese_notebook(stem, listed=stem in listed)
        files[ZH / "chapters" / f"{stem}.ipynb"] = nbformat.writes(nb) + "\n"
    return files


def build() -> list[Path]:
    files = generated_files()
    changed = [path for path, text in files.items() if write_if_changed(path, text)]
    for old in (ZH / "chapters").glob("*"):
        if old not in files:
            old.unlink()
            changed.append(old)
    return changed


# --- command line ---------------------------------------------------------------------------------


def todo(name: str) -> None:
    state = status(name)
    print(
        f"# {name}: {len(state['missing'])} missing, {len(state['stale'])} stale, "
        f"{len(state['orphaned'])} orphaned (delete those: {state['orphaned']})"
    )
    for uid, kind, text in units_for(name):
        for what in ("missing", "stale"):
            if uid in state[what]:
                print(f"\n## {uid} ({kind}, {what}) en: {en_hash(text)}\n{text}")
    if (REPO / "chapters" / f"{name}.ipynb").exists():
        labels = missing_figure_labels(name)
        print(f"\n## figure labels without Chinese (figures:): {len(labels)}")
        print("".join(f"  {json.dumps(label, ensure_ascii=False)}: \n" for label in labels), end="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("todo").add_argument(
        "stem", help="a chapter's file name without .ipynb, or index"
    )
    sub.add_parser("stale")
    sub.add_parser("check")
    sub.add_parser("build")
    sub.add_parser("checker-lines", help="(internal) what every checker prints, as JSON")
    args = parser.parse_args(argv)
    if args.command == "checker-lines":
        import json

        print(json.dumps(checker_lines_here(), ensure_ascii=False))
    elif args.command == "todo":
        todo(args.stem)
    elif args.command == "stale":
        names = ["index", *markdown_stems(english_toc()), *toc_stems(english_toc())]
        for name in names:
            state = status(name)
            always = name == "index" or name in markdown_stems(english_toc())
            listed = "" if always or name in listed_stems() else " (not listed)"
            print(f"{name}{listed}: " + ", ".join(f"{len(v)} {k}" for k, v in state.items()))
    elif args.command == "check":
        problems = check()
        print("\n".join(problems) or f"ok: index and {len(listed_stems())} chapters translated")
        return 1 if problems else 0
    else:
        for path in build():
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
