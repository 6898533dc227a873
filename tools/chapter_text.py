"""The chapters' text form: one MyST-markdown file per notebook, for review and for editing.

A chapter is a notebook (`chapters/NN_name.ipynb`): Colab opens it and nbval compares its stored
outputs. Its JSON, with base64 figures, is unreadable in a diff, so every notebook has a text twin
in `chapters/text/NN_name.md` (jupytext's MyST format: the same cells, tags and metadata, no
outputs). Reviewers read the twin; a test keeps the two in step.

    python tools/chapter_text.py write          # notebooks -> text twins (run after make execute)
    python tools/chapter_text.py check          # exit 1 if a twin is missing or out of date
    python tools/chapter_text.py apply FILE.md  # an edited twin -> its notebook (outputs kept)

The edit loop (README, "Contribute"): edit the twin or the notebook; `apply` carries a twin's edit
into the notebook; `make execute` re-runs the notebook; `write` refreshes the twin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = REPO / "chapters"
TEXT = CHAPTERS / "text"
FORMAT = "md:myst"


def notebooks() -> list[Path]:
    return sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))


def twin(notebook: Path) -> Path:
    return TEXT / notebook.with_suffix(".md").name


def text_of(notebook: Path) -> str:
    """The text form of a notebook, exactly as `write` stores it."""
    return jupytext.writes(nbformat.read(notebook, as_version=4), fmt=FORMAT)


def write() -> None:
    TEXT.mkdir(exist_ok=True)
    for nb in notebooks():
        twin(nb).write_text(text_of(nb), encoding="utf-8")
        print(f"wrote {twin(nb).relative_to(REPO)}")


def stale() -> list[str]:
    """Twins that are missing, out of date, or left over from a removed notebook."""
    problems = []
    for nb in notebooks():
        path = twin(nb)
        if not path.exists():
            problems.append(f"{path.relative_to(REPO)} is missing")
        elif path.read_text(encoding="utf-8") != text_of(nb):
            problems.append(f"{path.relative_to(REPO)} differs from {nb.relative_to(REPO)}")
    expected = {twin(nb) for nb in notebooks()}
    problems += [
        f"{p.relative_to(REPO)} has no notebook" for p in TEXT.glob("*.md") if p not in expected
    ]
    return problems


def apply(path: Path) -> None:
    """Carry the cells of an edited twin into its notebook, keeping the outputs of unchanged cells."""
    notebook = CHAPTERS / path.with_suffix(".ipynb").name
    if not notebook.exists():
        raise SystemExit(f"{path}: no notebook {notebook.relative_to(REPO)} to update")
    from jupytext.cli import jupytext as jupytext_cli

    jupytext_cli(["--update", "--to", "ipynb", "--output", str(notebook), str(path)])


def main(argv: list[str]) -> int:
    if argv == ["write"]:
        write()
        return 0
    if argv == ["check"]:
        problems = stale()
        for p in problems:
            print(p)
        if problems:
            print("run: python tools/chapter_text.py write")
        return 1 if problems else 0
    if len(argv) == 2 and argv[0] == "apply":
        apply(Path(argv[1]).resolve())
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
