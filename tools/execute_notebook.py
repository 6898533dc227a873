"""Execute chapter notebooks top to bottom in place, the way they are committed.

Usage: python tools/execute_notebook.py chapters/01_queries_keys_values.ipynb [...]

Runs each notebook in a fresh kernel with its directory as the working directory, keeps cells
tagged ``skip-execution`` unexecuted, stops at the first error (a deliberate error is shown with
``mha.expect_error``, never by a cell that raises: Colab's "Run all" honours no tags), folds the
exercise solutions for Colab and JupyterLab (tools/fold_solutions.py), and strips the per-cell
metadata (timings, widgets state) that nbval does not need.

Tracebacks are stored in IPython's ``Minimal`` mode ("ValueError: message"), so that an error
never prints file paths of the machine that ran it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from fold_solutions import fold
from nbclient import NotebookClient

# tags: nbval, myst-nb and nbclient read them; cellView (Colab) and jupyter.source_hidden
# (JupyterLab) fold the solutions.
KEEP_CELL_METADATA = {"tags", "cellView", "jupyter", "mystnb"}


def clean(nb: nbformat.NotebookNode) -> None:
    nb.metadata = nbformat.from_dict(
        {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
            **({"colab": nb.metadata["colab"]} if "colab" in nb.metadata else {}),
        }
    )
    for cell in nb.cells:
        cell.metadata = nbformat.from_dict(
            {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        )
        if cell.cell_type == "code" and "skip-execution" in cell.metadata.get("tags", []):
            cell.outputs = []
            cell.execution_count = None


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    fold(nb)  # before running: the stored source is the source that ran
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
        skip_cells_with_tag="skip-execution",
        allow_error_names=[],
        extra_arguments=["--InteractiveShell.xmode=Minimal"],
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    # A fresh kernel numbers the executed cells 1..N; tests/test_notebooks.py relies on it.
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code" and c.execution_count]
    if counts != list(range(1, len(counts) + 1)):
        raise RuntimeError(f"{path}: unexpected execution counts {counts}")
    clean(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for name in argv:
        elapsed = execute(Path(name))
        print(f"{name}: executed in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
