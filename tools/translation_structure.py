"""What a translation must keep byte for byte: the MyST structure of a markdown cell.

`check` compares a Chinese cell with its English one, rule by rule: the same directive and option
lines (an exercise's title excepted), code and math blocks, `(label)=` targets, heading levels, list
items, table columns, role targets ({ref}, {numref}, {doc}, {eq}, {cite}), inline math, inline code
spans, URLs and link targets; and no emphasis that renders as literal asterisks. In math (inline,
display, `{math}` blocks and roles) only the words of `\\text{…}` (`\\textrm`, `\\mbox`) may
differ: the same groups, in the same order, and everything around them byte for byte.
"""

from __future__ import annotations

import re
from collections import Counter

from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin

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
            fenced = VERBATIM.match(info)  # a code or math body, or None: prose
            kind = None if fenced is None else "math" if fenced.group(1) == "math" else "code"
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
