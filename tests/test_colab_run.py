"""Run every chapter the way Colab's "Run all" does, and require that it reaches the end.

Colab honours no cell tags: it runs the exercise stubs (which the book and nbval skip), and it stops
at the first error, deliberate or not. It also has no checkout: the setup cell's Colab
branch `%pip install`s mha from the repository, in a kernel whose working directory holds nothing
of the course. This test reproduces all of it, offline:

* GitHub stand-in: a git repository whose one commit is this *working tree* (tracked files and
  untracked ones that git does not ignore), so uncommitted changes are tested too. The setup cell's
  URL is pointed at it; nothing else of the notebook changes, except that its tags are removed.
* Colab stand-in: a fresh virtual environment on the Python running this test. It sees the test's
  packages (torch, numpy, matplotlib, ipykernel ...) as "preinstalled" through a `.pth` file, minus
  mha, and imports a fake `google.colab` module at kernel start, so the setup cell takes its Colab
  branch. `%pip` installs into it (never into the test's own environment), with no index: offline.
* Every code cell runs in order, stopping at the first error, which fails the test with the
  chapter, the cell's position and the error. After a complete run the test checks that mha came
  from the installed copy, and that every unattempted exercise stub printed "not attempted yet".

`make test-colab` runs it (part of `make test`); `make test-newest` runs it on the newest releases.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from conftest import REPO, preinstalled_venv, run, skip_or_fail

pytestmark = pytest.mark.slow

CHAPTERS = sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
SETUP_CELL = REPO / "tools" / "setup_cell.txt"
GIT_URL_RE = re.compile(r"git\+https://[^\s\"']+")
CHECKER_CALL_RE = re.compile(r"\bmha\.exercises\.check_\w+\s*\(")
NOT_ATTEMPTED = "not attempted yet"
CELL_TIMEOUT = 600  # seconds; a chapter takes about a minute on 2 CPU cores

# The stand-in for the module Colab's kernel has always imported.
FAKE_COLAB = (
    '"""Stand-in for Colab\'s google.colab (tests/test_colab_run.py): its presence is all."""\n'
)

# The last cell appended to every chapter: where mha came from, and that the kernel was "Colab".
PROBE = """import json, sys
import mha
print("COLAB-PROBE " + json.dumps({"mha": mha.__file__, "colab": "google.colab" in sys.modules}))"""


@dataclass
class ColabStandIn:
    repository: Path  # what the setup cell installs from
    python: Path  # the stand-in's interpreter
    purelib: Path  # where %pip installs mha
    kernel_dirs: Path  # holds the kernelspec "colab-standin"
    content: Path  # the kernel's working directory, like Colab's /content


def snapshot_working_tree(dest: Path) -> Path:
    """A git repository with one commit holding the working tree as git sees it (no ignored files)."""
    if shutil.which("git") is None:
        skip_or_fail("git is not installed; the Colab-path test installs mha from a git repository")
    probe = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        skip_or_fail(f"{REPO} is not a git checkout: {probe.stderr.strip()}")
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO)
    dest.mkdir(parents=True)
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is listed but gone
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    identity = ["-c", "user.name=Colab stand-in", "-c", "user.email=colab@localhost"]
    run(["git", "init", "--quiet", "--initial-branch=main"], dest)
    run(["git", "add", "--all"], dest)
    run(["git", *identity, "commit", "--quiet", "--no-verify", "-m", "working tree"], dest)
    return dest


def make_standin(root: Path, repository: Path) -> ColabStandIn:
    # No pip of its own: the linked one runs in it and installs into it (ensurepip would take long).
    python, purelib, preinstalled = preinstalled_venv(root, with_pip=False)
    fake = root / "fake-colab" / "google" / "colab"  # google/ stays a namespace package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_COLAB)
    (purelib / "colab_standin.pth").write_text(f"{preinstalled}\n{root / 'fake-colab'}\n")

    kernel_dirs = root / "kernels"
    spec = kernel_dirs / "colab-standin"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [
                    str(python),
                    "-m",
                    "ipykernel_launcher",
                    "-f",
                    "{connection_file}",
                    # Colab's kernel has google.colab loaded before the first cell runs.
                    "--IPKernelApp.exec_lines=import google.colab",
                    "--InteractiveShell.xmode=Minimal",
                ],
                "display_name": "Colab stand-in",
                "language": "python",
                # %pip in the kernel: offline (no index; mha's dependencies are "preinstalled"),
                # and building mha with the preinstalled setuptools instead of fetching one.
                "env": {
                    "PIP_NO_INDEX": "1",
                    "PIP_NO_BUILD_ISOLATION": "0",
                    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                },
            },
            indent=1,
        )
    )
    content = root / "content"
    content.mkdir()
    probe = subprocess.run(
        [str(python), "-c", "import mha"], check=False, cwd=content, capture_output=True
    )
    assert probe.returncode != 0, "mha is importable in the stand-in before %pip install"
    return ColabStandIn(repository, python, purelib, kernel_dirs, content)


@pytest.fixture(scope="module")
def colab(tmp_path_factory) -> ColabStandIn:
    root = tmp_path_factory.mktemp("colab")
    return make_standin(root, snapshot_working_tree(root / "repository"))


def colab_notebook(path: Path, repository: Path) -> nbformat.NotebookNode:
    """The chapter as Colab runs it: no tags, setup cell installing from the local repository."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    setup = nb.cells[1]  # the chapter opens with its title, then the setup cell
    urls = GIT_URL_RE.findall(setup.source)
    assert len(urls) == 1 and "google.colab" in setup.source, (
        f"{path.name}: the second cell is not the setup cell with one `%pip install ... git+https://...`"
    )
    # "localhost" keeps pip's URL check happy; git reads it as a local path.
    setup.source = setup.source.replace(urls[0], f"git+file://localhost{repository}")
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    return nb


def stdout_of(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


def where_it_stopped(nb: nbformat.NotebookNode) -> str:
    code = [c for c in nb.cells if c.cell_type == "code"]
    for n, cell in enumerate(code, start=1):
        for out in cell.outputs:
            if out.output_type == "error":
                first = cell.source.strip().splitlines()[0]
                printed = stdout_of(cell)[-800:]
                return (
                    f"code cell {n} of {len(code) - 1} ({first!r}) raised {out.ename}: {out.evalue}"
                    + (f"\nafter printing:\n{printed}" if printed else "")
                )
    return "no cell shows an error"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_run_all_as_in_colab_completes(path, colab):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    stored = nbformat.read(path, as_version=4)
    nb = colab_notebook(path, colab.repository)
    # Every chapter is a fresh Colab runtime: mha is not installed yet.
    subprocess.run(
        [str(colab.python), "-m", "pip", "uninstall", "--yes", "--quiet", "mha"],
        cwd=colab.content,
        capture_output=True,
        check=False,
    )
    km = KernelManager(
        kernel_name="colab-standin",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(colab.kernel_dirs)]),
    )
    client = NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT,
        allow_errors=False,  # stop at the first error, as Run all does (the tags are gone)
        resources={"metadata": {"path": str(colab.content)}},
    )
    start = time.perf_counter()
    stopped = None
    try:
        client.execute()
    except CellExecutionError:
        stopped = where_it_stopped(nb)
    finally:
        if km.has_kernel:  # nbclient leaves a kernel it was handed running
            km.shutdown_kernel(now=True)
    if stopped:
        pytest.fail(f"{path.name}: Colab's Run all stops: {stopped}", pytrace=False)
    elapsed = time.perf_counter() - start
    print(f"{path.name}: ran to the end as in Colab in {elapsed:.1f} s")

    probe = stdout_of(nb.cells[-1])
    facts = json.loads(probe.split("COLAB-PROBE ", 1)[1])
    assert facts["colab"], "the kernel had no google.colab: the setup cell took its local branch"
    assert Path(facts["mha"]).is_relative_to(colab.purelib), (
        f"mha was imported from {facts['mha']}, not from the copy %pip installed"
    )

    # Every exercise stub ran and its checker said, once per call, that it was not attempted.
    for i, cell in enumerate(stored.cells):
        if cell.cell_type != "code" or "skip-execution" not in cell.metadata.get("tags", []):
            continue
        calls = len(CHECKER_CALL_RE.findall(cell.source))
        printed = stdout_of(nb.cells[i])
        lines = [ln for ln in printed.splitlines() if NOT_ATTEMPTED in ln]
        assert len(lines) == calls, (
            f"{path.name}, cell {i}: the unattempted stub made {calls} checker call(s) but printed "
            f"{len(lines)} '{NOT_ATTEMPTED}' line(s); output: {printed[-500:]!r}"
        )


def test_setup_cell_has_a_colab_branch():
    """The test above relies on it; a plain message here beats a puzzling failure there."""
    text = SETUP_CELL.read_text(encoding="utf-8")
    assert '"google.colab" in sys.modules' in text and len(GIT_URL_RE.findall(text)) == 1, text
