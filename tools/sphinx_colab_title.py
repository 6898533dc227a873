"""Sphinx extension: leave Colab's ``# @title`` lines out of the book's code cells.

Solution cells start with ``# @title Solution`` so that Colab folds them under that title
(tools/fold_solutions.py). In the book they already sit in a "Solution" dropdown, where the line
would read as a stray comment; this removes it from the displayed (and copied) code. Registered in
_config.yml under ``sphinx.local_extensions``.
"""

from __future__ import annotations

import re

from docutils import nodes

TITLE_LINE = re.compile(r"\A[ \t]*#[ \t]*@title\b[^\n]*\n?")


def strip_title_lines(app, doctree: nodes.document) -> None:
    for block in list(doctree.findall(nodes.literal_block)):
        text = block.astext()
        if not TITLE_LINE.match(text):
            continue
        code = TITLE_LINE.sub("", text, count=1)
        block.rawsource = code
        block.children = []
        block += nodes.Text(code)


def setup(app):
    app.connect("doctree-read", strip_title_lines)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
