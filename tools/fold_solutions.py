"""Fold the exercise solutions of chapter notebooks in Colab and JupyterLab, as the book does.

Usage: python tools/fold_solutions.py chapters/*.ipynb   (tools/execute_notebook.py also applies it)

In the book a solution sits in a dropdown between ``{solution-start}`` and ``{solution-end}``.
Notebook frontends know nothing of that, so every cell in between is folded where it is opened:

* code cells start with ``# @title Solution`` and carry ``cellView: form``: Colab shows the title
  and hides the code behind "Show code"; the book leaves the ``# @title`` line out
  (tools/sphinx_colab_title.py);
* code and markdown cells carry ``jupyter.source_hidden``: JupyterLab and Notebook 7 collapse them.

The marker cells themselves stay visible as signposts. Idempotent.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

# A MyST directive opening, with backticks or colons: ```{solution-start} label / :::{solution-end}
START_RE = re.compile(r"^[ \t]*(?:`{3,}|:{3,})\{solution-start\}", re.MULTILINE)
END_RE = re.compile(r"^[ \t]*(?:`{3,}|:{3,})\{solution-end\}", re.MULTILINE)
TITLE_RE = re.compile(r"^#\s*@title\b")
TITLE = "# @title Solution"


def solution_ranges(nb: nbformat.NotebookNode) -> list[tuple[int, int]]:
    """(start, end) cell indices of each solution: the cells strictly between are its body."""
    ranges, start = [], None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        if start is None and START_RE.search(cell.source):
            start = i
        elif start is not None and END_RE.search(cell.source):
            ranges.append((start, i))
            start = None
    return ranges


def solution_cells(nb: nbformat.NotebookNode) -> set[int]:
    """Indices of the cells inside a solution (the markers excluded)."""
    return {i for start, end in solution_ranges(nb) for i in range(start + 1, end)}


def fold_cell(cell: nbformat.NotebookNode) -> None:
    """Give one solution cell its title line (code) and its folding metadata."""
    if cell.cell_type == "code":
        if not TITLE_RE.match(cell.source):
            cell.source = f"{TITLE}\n{cell.source}"
        cell.metadata["cellView"] = "form"
    cell.metadata.setdefault("jupyter", {})["source_hidden"] = True


def fold(nb: nbformat.NotebookNode) -> int:
    """Fold every solution cell of ``nb`` in place; return how many cells are solution cells."""
    inside = solution_cells(nb)
    for i in inside:
        fold_cell(nb.cells[i])
    return len(inside)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for name in argv:
        nb = nbformat.read(name, as_version=4)
        count = fold(nb)
        nbformat.write(nb, name)
        print(f"{Path(name).name}: {count} solution cells folded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
