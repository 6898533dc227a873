"""Build ``mha/data/course_prose.txt``: the English prose of the course's own pages, the text that
section 4.4's small character-level model learns to write.

It reads ``chapters/text/*.md`` (the generated text of every chapter, ``tools/chapter_text.py``)
and keeps the paragraphs a reader reads: front matter, code cells, directives and their options,
labels, headings' markup, tables, math, links' targets and inline markup are removed; a paragraph
that still holds a character outside printable ASCII (a quoted Chinese post) is dropped. The file
is a snapshot: run ``python tools/writer_text.py`` to rebuild it. Its licence is the repository's
own (MIT), since every word in it is the course's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "chapters" / "text"
TARGET = REPO / "mha" / "data" / "course_prose.txt"
LIMIT = 1_000_000  # bytes: the package ships it

_FENCE = re.compile(r"^(`{3,}|:{3,})")
_INLINE = [
    (re.compile(r"\$\$.*?\$\$", re.S), ""),  # display math
    (re.compile(r"\$[^$\n]+\$"), ""),  # inline math
    (re.compile(r"\{(?:ref|numref|doc|cite:p|cite:t|cite|term|eq)\}`([^`<]*)<[^`]*>`"), r"\1"),
    (re.compile(r"\{(?:ref|numref|doc|cite:p|cite:t|cite|term|eq)\}`[^`]*`"), ""),
    (re.compile(r"\[([^\]]*)\]\([^)]*\)"), r"\1"),  # [text](url)
    (re.compile(r"`([^`]*)`"), r"\1"),  # inline code keeps its words
    (re.compile(r"\*\*|__|(?<!\w)\*(?!\s)|(?<!\s)\*(?!\w)"), ""),  # bold, italics
    (re.compile(r"\(\s*\)|\[\s*\]"), ""),  # what emptied brackets leave
    (re.compile(r"[ \t]+"), " "),
    (re.compile(r" ([,.;:)])"), r"\1"),
]


def paragraphs(markdown: str) -> list[str]:
    """The prose paragraphs of one page's MyST markdown, markup removed."""
    body = markdown.split("\n---\n", 1)[1] if markdown.startswith("---\n") else markdown
    kept: list[str] = []
    block: list[str] = []
    fence: str | None = None
    for line in body.splitlines():
        stripped = line.strip()
        match = _FENCE.match(stripped)
        if fence is not None:  # inside code or a directive's options: skip to its end
            if stripped == fence:
                fence = None
            continue
        if match and ("{" in stripped or stripped.startswith("`")):
            fence = match.group(1)[0] * len(match.group(1))
            # a prose directive (exercise, admonition...) keeps its body: only skip code-like ones
            if match.group(1)[0] == ":":
                fence = None
            continue
        if (
            not stripped
            or stripped.startswith(("#", "(", "+++", "|", ":", ">", "<", "%"))
            or stripped == "---"
        ):
            if block:
                kept.append(" ".join(block))
                block = []
            continue
        block.append(
            stripped.lstrip("-*0123456789. ") if stripped[:2] in ("- ", "* ") else stripped
        )
    if block:
        kept.append(" ".join(block))
    cleaned = []
    for text in kept:
        for pattern, replacement in _INLINE:
            text = pattern.sub(replacement, text)
        text = text.strip()
        if len(text) > 40 and text.isascii() and text.isprintable():
            cleaned.append(text)
    return cleaned


def build() -> str:
    pages = sorted(p for p in SOURCE.glob("[0-9][0-9]_*.md"))
    text = "\n\n".join(p for page in pages for p in paragraphs(page.read_text(encoding="utf-8")))
    return text + "\n"


def main() -> int:
    text = build()
    data = text.encode("ascii")
    if len(data) > LIMIT:
        print(f"{len(data):,} bytes: over the {LIMIT:,} bytes the package may ship")
        return 1
    TARGET.write_bytes(data)
    print(f"wrote {TARGET.relative_to(REPO)}: {len(data):,} bytes, {len(set(text))} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
