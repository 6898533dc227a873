"""Every chapter notebook has an up-to-date text twin in chapters/text/ (what reviewers read)."""

from __future__ import annotations

import re
import sys

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import chapter_text  # noqa: E402 (tools/ is not a package: it joins the path first)


def test_every_notebook_has_a_twin_in_step():
    problems = chapter_text.stale()
    assert not problems, "\n".join([*problems, "run: python tools/chapter_text.py write"])


@pytest.mark.parametrize("notebook", chapter_text.notebooks(), ids=lambda p: p.stem)
def test_the_twin_holds_every_cell_and_no_output(notebook):
    twin = chapter_text.twin(notebook).read_text(encoding="utf-8")
    nb = nbformat.read(notebook, as_version=4)
    code_cells = re.findall(r"^`{3,}\{code-cell\}", twin, flags=re.MULTILINE)
    assert len(code_cells) == sum(c.cell_type == "code" for c in nb.cells)
    assert "image/png" not in twin and '"outputs"' not in twin
