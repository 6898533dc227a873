"""Every chapter, executed once: as Colab's "Run all" runs it, compared with its stored outputs.

This is `make test-notebooks` (part of `make test`): the one test that executes the chapters. Each
chapter runs once, under Colab's conditions, and that one run is checked two ways. An opening page
whose only code is the setup cell is not executed: every executed notebook runs that same cell, and
its output is never compared (`nbval-ignore-output`); a guard checks such a page statically (its one
code cell is tools/setup_cell.txt, with the setup output every executed chapter stores). An opening
page with any other code cell is executed like a section.

Colab's conditions. Colab honours no cell tags: it runs the exercise stubs (which the book skips),
and it stops at the first error, deliberate or not. It also has no checkout: the setup cell's Colab
branch `%pip install`s mha from the repository, in a kernel whose working directory holds nothing
of the course. This test reproduces all of it, offline:

* GitHub stand-in: a git repository whose one commit is this *working tree* (tracked files and
  untracked ones that git does not ignore), so uncommitted changes are tested too. The setup cell's
  URL is pointed at that commit; nothing else of the notebook changes, except that its tags are
  removed.
* Colab stand-in: a fresh virtual environment on the Python running this test. It sees the test's
  packages (torch, numpy, matplotlib, ipykernel ...) as "preinstalled" through a `.pth` file, minus
  mha, and imports a fake `google.colab` module at kernel start, so the setup cell takes its Colab
  branch. `%pip` installs into it (never into the test's own environment), with no index: offline.
  The kernel's environment has none of the course's variables (`TRITON_INTERPRET`, `MHA_*`): a
  Colab runtime has none.
* mha is installed in the stand-in once, before the first notebook, by the setup cell's own
  `pip install` command (pip clones the commit and builds mha). Each notebook's setup cell still runs
  its `%pip install`, which finds mha installed from that URL and commit and installs nothing (the
  wheel pip cached gives it mha's metadata without a clone); the test checks that the installed copy
  is left as it was. As nothing is installed, the kernels' pip skips its check for conflicts among
  the installed packages (it would read every package's metadata, about 1.5 s of CPU, to check
  nothing: it checks only the packages an install changes).
* Kernels started one ahead (execute_notebook.WarmKernels): the next notebook's kernel boots, and
  imports torch, numpy and matplotlib (PRELOAD), while the current notebook runs. Each notebook
  still gets a fresh kernel of its own, shut down after it.

The checks, all reported together for a chapter:

* Colab: every code cell runs in order and none raises (else: the chapter, the cell's position and
  the error); the kernel had `google.colab`, the setup cell ran its `%pip install` (IPython's note
  after it) and pip exited with 0; mha came from the copy installed from the commit's URL, which
  no `%pip` changed; every unattempted exercise stub printed "not attempted yet", once per checker
  call.
* nbval's (what `pytest --nbval` checked before): every cell stored as executed shows the outputs
  stored in the notebook, after the sanitize rules of tests/sanitize.cfg (measured numbers printed
  as `~12.3` and object addresses are masked), except in cells tagged `nbval-ignore-output` (the
  setup cell); no cell writes to stderr or shows an output field it did not have; a cell stored
  unexecuted has no outputs. tools/execute_notebook.py compares (`compare_outputs`);
  tests/test_execute_notebook.py shows that it fails exactly where nbval fails. With the
  environment variable MHA_COMPARE_OUTPUTS=0 (`make test-newest`: newer releases may print
  differently) the outputs are not compared.

The tests at the end feed a deliberately broken notebook through the same path and check that
each failure is caught.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from conftest import REPO, preinstalled_venv, run, skip_or_fail

sys.path.insert(0, str(REPO / "tools"))
import execute_notebook  # noqa: E402 (tools/ is not a package: it joins the path first)
import translation_printed  # noqa: E402

pytestmark = pytest.mark.slow

CHAPTERS = sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
# Chinese notebooks (tools/translate.py), run the same way: their setup cell switches the checkers
# to Chinese, and the Chinese checker lines stored in them must be what the run prints; the other
# printed lines stored in Chinese must be what the run prints, put in Chinese by the translation
# file's `printed:` table (tools/translation_printed.py).
ZH_CHAPTERS = [REPO / "zh" / "chapters" / f"{stem}.ipynb" for stem in ("01_2_cat_eats_fish",)]
SETUP_CELL = REPO / "tools" / "setup_cell.txt"
SANITIZE = REPO / "tests" / "sanitize.cfg"
GIT_URL_RE = re.compile(r"git\+https://[^\s\"']+")
PIP_LINE_RE = re.compile(r"^\s*%pip (install .*)$", re.MULTILINE)
# What IPython's %pip prints after pip has run: the sign that the setup cell's Colab branch ran.
PIP_NOTE = "Note: you may need to restart the kernel to use updated packages."
CHECKER_CALL_RE = re.compile(r"\bmha\.exercises\.check_\w+\s*\(")
NOT_ATTEMPTED = "not attempted yet"
NOT_ATTEMPTED_ZH = "尚未作答"  # the same line in a Chinese notebook (mha.exercises.set_language)
CELL_TIMEOUT = 600  # seconds; a chapter takes about a minute on 2 CPU cores
COMPARE = os.environ.get("MHA_COMPARE_OUTPUTS", "1").strip() != "0"

# The stand-in for the module Colab's kernel has always imported.
FAKE_COLAB = (
    '"""Stand-in for Colab\'s google.colab (tests/test_colab_run.py): its presence is all."""\n'
)

# The last cell appended to every chapter: where mha came from (the file, and the URL and commit
# pip recorded when it installed it), that the kernel was "Colab", and the exit status of the last
# shell command, the setup cell's %pip (no chapter runs another).
PROBE = """import importlib.metadata, json, sys
import mha
print("COLAB-PROBE " + json.dumps({
    "mha": mha.__file__,
    "installed_from": importlib.metadata.distribution("mha").read_text("direct_url.json"),
    "colab": "google.colab" in sys.modules,
    "pip_exit_code": globals().get("_exit_code"),
}))"""

# pip's settings in the stand-in, for the one install of mha and in the kernels: offline (no
# index; mha's dependencies are "preinstalled"), building mha with the preinstalled setuptools
# instead of fetching one (pip reads "0" as --no-build-isolation), and a cache of this run's own:
# the URL names a commit, so pip caches the wheel it builds, which gives a notebook's %pip mha's
# metadata without cloning the repository again.
PIP_ENV = {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
# In the kernels mha is already installed: %pip installs nothing, and the check for conflicts
# that pip runs after an install would read every installed package's metadata to check none
# (it checks only the packages an install changes). "0" reads as --no-warn-conflicts; the test
# checks that no notebook's %pip changed the installed mha.
KERNEL_PIP_ENV = {**PIP_ENV, "PIP_NO_WARN_CONFLICTS": "0"}


@dataclass
class ColabStandIn:
    repository: Path  # what the setup cell installs from
    commit: str  # its one commit, which the setup cell's URL names
    python: Path  # the stand-in's interpreter
    purelib: Path  # where %pip installs mha
    kernel_dirs: Path  # holds the kernelspec "colab-standin"
    content: Path  # the kernel's working directory, like Colab's /content
    pip_env: dict[str, str]  # pip's settings (PIP_ENV and this run's pip cache)
    installed: tuple[str, int, int] | None = None  # mha's install: installed_mha()


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
                    # (the runner adds --InteractiveShell.xmode=Minimal)
                ],
                "display_name": "Colab stand-in",
                "language": "python",
                "env": {**KERNEL_PIP_ENV, "PIP_CACHE_DIR": str(root / "pip-cache")},
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
    commit = run(["git", "rev-parse", "HEAD"], repository).strip()
    pip_env = {**PIP_ENV, "PIP_CACHE_DIR": str(root / "pip-cache")}
    return ColabStandIn(repository, commit, python, purelib, kernel_dirs, content, pip_env)


def installed_mha(purelib: Path) -> tuple[str, int, int]:
    """mha's install in the stand-in: its .dist-info folder and its RECORD's inode and mtime,
    which change whenever pip installs mha again."""
    found = sorted(purelib.glob("mha-*.dist-info"))
    assert len(found) == 1, f"expected one mha-*.dist-info in {purelib}, found {found}"
    record = (found[0] / "RECORD").stat()
    return found[0].name, record.st_ino, record.st_mtime_ns


def install_mha(colab: ColabStandIn) -> None:
    """Install mha in the stand-in once, as the first notebook's setup cell would: its `%pip
    install` line (URL pointed at the commit) run as IPython runs it, `python -m pip install ...`,
    in the kernel's working directory and environment."""
    setup = colab_setup_source(SETUP_CELL.read_text(encoding="utf-8"), colab)
    (line,) = PIP_LINE_RE.findall(setup)
    proc = subprocess.run(
        [str(colab.python), "-m", "pip", *shlex.split(line)],
        check=False,
        cwd=colab.content,
        env={**colab_environment(), **colab.pip_env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"pip could not install mha:\n{proc.stdout}\n{proc.stderr}"
    colab.installed = installed_mha(colab.purelib)


@pytest.fixture(scope="module")
def colab(tmp_path_factory) -> ColabStandIn:
    root = tmp_path_factory.mktemp("colab")
    standin = make_standin(root, snapshot_working_tree(root / "repository"))
    install_mha(standin)
    return standin


# What every kernel imports as it boots, while the notebook before it runs: the packages Colab
# has preinstalled that every setup cell imports (importing them took about 2.5 s of each setup
# cell here). Never mha, which the setup cell's %pip must find and the notebook import itself. The
# kernel's inline backend is chosen before these lines run, so pyplot gets the same backend.
PRELOAD = ("import torch, numpy, matplotlib.pyplot",)


@pytest.fixture(scope="module")
def kernels(colab):
    """The stand-in's kernels, each started while the notebook before it runs."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    def new_manager() -> KernelManager:  # over Unix sockets, as every kernel the runner starts
        specs = KernelSpecManager(kernel_dirs=[str(colab.kernel_dirs)])
        return execute_notebook.new_kernel_manager(
            kernel_name="colab-standin", kernel_spec_manager=specs
        )

    with execute_notebook.WarmKernels(
        new_manager, cwd=colab.content, env=colab_environment(), startup=PRELOAD
    ) as warm:
        yield warm


def colab_setup_source(source: str, colab: ColabStandIn) -> str:
    """The setup cell installing from the stand-in's repository instead of GitHub."""
    urls = GIT_URL_RE.findall(source)
    assert len(urls) == 1 and "google.colab" in source, (
        "the second cell is not the setup cell with one `%pip install ... git+https://...`"
    )
    # "localhost" keeps pip's URL check happy; git reads it as a local path. Naming the commit
    # lets pip cache the wheel it builds (it caches wheels of pinned git URLs only).
    return source.replace(urls[0], f"git+file://localhost{colab.repository}@{colab.commit}")


def colab_notebook(stored: nbformat.NotebookNode, colab: ColabStandIn) -> nbformat.NotebookNode:
    """The chapter as Colab runs it: no tags, setup cell installing from the local repository."""
    nb = nbformat.from_dict(json.loads(json.dumps(stored)))  # a deep copy
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
    setup = nb.cells[1]  # the chapter opens with its title, then the setup cell
    setup.source = colab_setup_source(setup.source, colab)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    return nb


def colab_environment() -> dict[str, str]:
    """This process's environment without the course's variables and pytest's, which no Colab
    runtime has (tests/conftest.py sets TRITON_INTERPRET for the tests; a chapter must set it
    itself). The same for every notebook: a kernel is started while the test before runs."""
    course = ("TRITON_INTERPRET", "PYTEST_CURRENT_TEST")
    return {k: v for k, v in os.environ.items() if k not in course and not k.startswith("MHA_")}


def run_as_in_colab(
    stored: nbformat.NotebookNode, colab: ColabStandIn, kernels: execute_notebook.WarmKernels
) -> execute_notebook.Run:
    """Run all, as in a fresh Colab runtime, on a fresh kernel started ahead."""
    return execute_notebook.run(
        colab_notebook(stored, colab),
        cwd=colab.content,
        honour_tags=False,  # the tags are gone anyway
        timeout=CELL_TIMEOUT,
        km=kernels.take(),
        env=colab_environment(),
        startup=PRELOAD,
    )


def probe_problems(printed: str, purelib: Path, commit: str) -> list[str]:
    """What is wrong with the probe cell's report (empty: the kernel was "Colab", the setup
    cell's %pip exited with 0, and mha came from the copy installed from the commit's URL)."""
    if "COLAB-PROBE " not in printed:
        return [f"the probe cell printed no report: {printed[-300:]!r}"]
    facts = json.loads(printed.split("COLAB-PROBE ", 1)[1])
    problems = []
    if not facts["colab"]:
        problems.append("the kernel had no google.colab: the setup cell took its local branch")
    if facts["pip_exit_code"] != 0:  # the last shell command: in a chapter, the setup cell's
        problems.append(f"%pip exited with {facts['pip_exit_code']}")
    if not Path(facts["mha"]).is_relative_to(purelib):
        problems.append(f"mha was imported from {facts['mha']}, not from the copy %pip installed")
    source = json.loads(facts["installed_from"] or "{}")
    if source.get("vcs_info", {}).get("commit_id") != commit:
        problems.append(f"the installed mha was not installed from commit {commit}: {source}")
    return problems


def setup_problems(result: execute_notebook.Run, colab: ColabStandIn) -> list[str]:
    """The setup cell ran its %pip line (IPython's note after it), which left mha as installed."""
    problems = []
    if 1 in result.sent and PIP_NOTE not in execute_notebook.stdout_of(result.notebook.cells[1]):
        shown = execute_notebook.stdout_of(result.notebook.cells[1])[-500:]
        problems.append(f"the setup cell did not run %pip (no note from IPython): {shown!r}")
    if installed_mha(colab.purelib) != colab.installed:
        problems.append("the setup cell's %pip installed mha again: it was already installed")
    return problems


def stub_problems(stored: nbformat.NotebookNode, result: execute_notebook.Run) -> list[str]:
    """Every exercise stub the run reached printed "not attempted yet", once per checker call."""
    problems = []
    for i, cell in enumerate(stored.cells):
        if cell.cell_type != "code" or "skip-execution" not in cell.metadata.get("tags", []):
            continue
        if i not in result.sent:
            continue  # not reached: the run stopped before
        calls = len(CHECKER_CALL_RE.findall(cell.source))
        printed = execute_notebook.stdout_of(result.notebook.cells[i])
        lines = [ln for ln in printed.splitlines() if NOT_ATTEMPTED in ln or NOT_ATTEMPTED_ZH in ln]
        if len(lines) != calls:
            problems.append(
                f"cell {i}: the unattempted stub made {calls} checker call(s) but printed "
                f"{len(lines)} '{NOT_ATTEMPTED}' line(s); output: {printed[-500:]!r}"
            )
    return problems


def problems_of(
    stored: nbformat.NotebookNode,
    result: execute_notebook.Run,
    colab: ColabStandIn,
    *,
    compare: bool = COMPARE,
) -> list[str]:
    """Everything wrong with one run of a chapter, each check's findings in turn."""
    problems = []
    if result.error:
        problems.append(f"Colab's Run all stops: {result.error}")
    if compare:
        rules = execute_notebook.sanitize_rules(SANITIZE)
        differs = execute_notebook.compare_outputs(stored, result, rules)
        problems += [f"outputs differ from the stored ones (nbval): {d}" for d in differs.values()]
    problems += setup_problems(result, colab)
    if not result.error:
        probe = result.notebook.cells[-1]
        problems += probe_problems(execute_notebook.stdout_of(probe), colab.purelib, colab.commit)
    problems += stub_problems(stored, result)
    return problems


def setup_cell_only(path: Path) -> bool:
    """Whether the notebook's only code cell is the setup cell (most opening pages)."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    setup = SETUP_CELL.read_text(encoding="utf-8").rstrip("\n")
    return len(code) == 1 and code[0].source.rstrip("\n") == setup


# Checked statically (test_opening_page_holds_only_the_setup_cell), not executed.
SETUP_ONLY = [p for p in CHAPTERS if setup_cell_only(p)]
EXECUTED = [p for p in CHAPTERS if p not in SETUP_ONLY] + ZH_CHAPTERS


def timings(result: execute_notebook.Run) -> str:
    """Where a run's time went: its cells (the setup cell's share), and the rest: waiting for
    the kernel to answer, shutting it down."""
    cells = sum(result.cell_seconds.values())
    return (
        f"{result.seconds:.1f} s: cells {cells:.1f} s (setup cell "
        f"{result.cell_seconds.get(1, 0.0):.1f} s), kernel {result.seconds - cells:.1f} s"
    )


@pytest.mark.parametrize(
    "path", EXECUTED, ids=lambda p: ("zh-" if p.parents[1] == REPO / "zh" else "") + p.stem
)
def test_chapter_runs_as_in_colab_and_shows_its_stored_outputs(path, colab, kernels):
    stored = nbformat.read(path, as_version=4)
    result = run_as_in_colab(stored, colab, kernels)
    if path.parents[1] == REPO / "zh":  # what the code printed, through the printed tables
        tables = translation_printed.tables(path.stem)
        for outputs in result.sent.values():
            for output in outputs:
                translation_printed.translate_output(output, tables)
    problems = problems_of(stored, result, colab)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)
    compared = "outputs as stored" if COMPARE else "outputs not compared (MHA_COMPARE_OUTPUTS=0)"
    print(f"{path.name}: ran to the end as in Colab in {timings(result)}, {compared}")


@pytest.mark.parametrize("path", SETUP_ONLY, ids=lambda p: p.stem)
def test_opening_page_holds_only_the_setup_cell(path):
    """Not executed: its one code cell is the setup cell, which every executed notebook runs
    (the same text, checked by tests/test_notebooks.py), and whose output nbval never compares.
    What is left to check: no other code cell, and the stored setup output every executed chapter
    stores (make execute ran it in the same fresh kernel)."""
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    setup = SETUP_CELL.read_text(encoding="utf-8").rstrip("\n")
    assert code == [1] and nb.cells[1].source.rstrip("\n") == setup, (
        f"{path.name}: code cells at {code}; a page with code besides the setup cell is executed"
    )
    cell = nb.cells[1]
    assert cell.execution_count == 1, f"{path.name}: the setup cell is stored unexecuted"
    printed = execute_notebook.stdout_of(cell)
    assert (
        re.fullmatch(r"mha \S+ \| torch \S+ \| device: cpu\n", printed) and len(cell.outputs) == 1
    ), f"{path.name}: the setup cell's stored output is not its usual line: {cell.outputs}"
    usual = json.dumps(cell.outputs)
    differ = [
        p.name
        for p in CHAPTERS
        if p not in SETUP_ONLY
        and json.dumps(nbformat.read(p, as_version=4).cells[1].outputs) != usual
    ]
    assert not differ, (
        f"{path.name}: setup output {printed!r}, which these chapters do not store: {differ}"
    )


def test_setup_cell_has_a_colab_branch():
    """The test above relies on it; a plain message here beats a puzzling failure there."""
    text = SETUP_CELL.read_text(encoding="utf-8")
    assert '"google.colab" in sys.modules' in text and len(GIT_URL_RE.findall(text)) == 1, text


# --- the same path, fed a deliberately broken notebook: each failure must be caught ---------


def code(
    source: str, outputs: list[dict] | None = None, count: int | None = 1, tags=()
) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, execution_count=count)
    cell.outputs = [nbformat.v4.new_output(**o) for o in outputs or []]
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def stdout(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


STUB = ("skip-execution", "nbval-skip")


def broken_chapter() -> nbformat.NotebookNode:
    """A chapter as a careless edit could leave it, with one cell per failure the test catches.
    Stored outputs are what `make execute` would have stored before the edit."""
    setup = SETUP_CELL.read_text(encoding="utf-8").rstrip("\n")
    return nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("(ch99)=\n# A broken chapter"),
            # 1: the setup cell: its output is ignored (nbval-ignore-output)
            code(
                setup, [stdout("mha 0.0 | torch 0.0 | device: cpu\n")], 1, ["nbval-ignore-output"]
            ),
            # 2: fine: measured numbers and addresses are masked by tests/sanitize.cfg
            code(
                'print("naive ~1.25 ms, ratio ~3.1x, <object at 0x7f3a>")',
                [stdout("naive ~7.5 ms, ratio ~12x, <object at 0xdeadbeef>\n")],
                2,
            ),
            # 3: FAILS: the printed text changed, the stored output was not refreshed
            code('print("softmax sums to 1")', [stdout("softmax sums to one\n")], 3),
            # 4: FAILS: a warning on stderr
            code('import sys\nprint("deprecated", file=sys.stderr)', [], 4),
            # 5: fine: tagged nbval-ignore-output
            code('print("anything")', [stdout("something else\n")], 5, ["nbval-ignore-output"]),
            # 6: fine: an unattempted stub (run, as Colab ignores tags), prints "not attempted yet"
            code(
                "def attention_weights(query, key):\n    ...  # your code here\n\n\n"
                "mha.exercises.check_lookup_weights(attention_weights)",
                [],
                None,
                STUB,
            ),
            # 7: FAILS: a stub whose checker call does not say "not attempted yet"
            code(
                'print("mha.exercises.check_lookup_weights(attention_weights) skipped")',
                [],
                None,
                STUB,
            ),
            # 8: FAILS: a stub that raises (the book skips it; Colab's Run all stops there)
            code('raise NotImplementedError("write your answer here")', [], None, STUB),
            # 9: never reached
            code('print("the end")', [stdout("the end\n")], 6),
        ]
    )


def test_a_broken_notebook_fails_on_each_broken_cell(colab, kernels):
    stored = broken_chapter()
    result = run_as_in_colab(stored, colab, kernels)
    problems = problems_of(stored, result, colab, compare=True)
    report = "\n".join(problems)

    def about(cell: int) -> list[str]:
        return [p for p in problems if f"cell {cell} " in p or f"cell {cell}:" in p]

    assert len(problems) == 4, report
    assert "'stdout' differs" in "".join(about(3)) and "softmax sums to one" in report, report
    assert "unexpected output fields from running code: ['stderr']" in "".join(about(4)), report
    assert "made 1 checker call(s) but printed 0" in "".join(about(7)), report
    assert problems[0].startswith("Colab's Run all stops: code cell 8 of 10"), report
    assert "NotImplementedError: write your answer here" in problems[0], report
    # Reached and fine: the setup cell's Colab branch, masked numbers, an ignored output, a stub.
    assert not about(1) + about(2) + about(5) + about(6), report
    assert NOT_ATTEMPTED in execute_notebook.stdout_of(result.notebook.cells[6])


def test_probe_problems_catch_the_local_branch_and_a_foreign_mha(tmp_path):
    installed = tmp_path / "site-packages"
    source = {"url": "file://localhost/repository", "vcs_info": {"vcs": "git", "commit_id": "c0"}}
    good = {
        "mha": str(installed / "mha" / "__init__.py"),
        "installed_from": json.dumps(source),
        "colab": True,
        "pip_exit_code": 0,
    }
    assert probe_problems("COLAB-PROBE " + json.dumps(good), installed, "c0") == []
    local = {
        "mha": str(REPO / "mha" / "__init__.py"),
        "installed_from": None,
        "colab": False,
        "pip_exit_code": 1,
    }
    found = probe_problems("COLAB-PROBE " + json.dumps(local), installed, "c0")
    assert len(found) == 4, found
    assert "local branch" in found[0] and "%pip exited with 1" in found[1]
    assert "not from the copy" in found[2] and "not installed from commit c0" in found[3]
    other = probe_problems("COLAB-PROBE " + json.dumps(good), installed, "c1")
    assert len(other) == 1 and "not installed from commit c1" in other[0]
    assert "no report" in probe_problems("", installed, "c0")[0]


def test_a_notebook_that_installs_mha_again_or_whose_pip_fails_is_caught(colab, kernels):
    """The checks that stand in for installing mha before every notebook: a %pip that installs
    mha again (here a later cell forcing it, from the same URL and commit) and a %pip that
    fails (the last one, which the probe reports) are both caught."""
    again = (
        "import importlib.metadata, json\n"
        'source = json.loads(importlib.metadata.distribution("mha").read_text("direct_url.json"))\n'
        "url = f\"git+{source['url']}@{source['vcs_info']['commit_id']}\"\n"
        '%pip install -q --force-reinstall --no-deps "mha @ {url}"'
    )
    missing = '%pip install -q "mha @ git+file://localhost/no/such/repository"'
    stored = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("(ch99)=\n# Installs mha again"),
            code(
                SETUP_CELL.read_text(encoding="utf-8").rstrip("\n"), [], 1, ["nbval-ignore-output"]
            ),
            code(again, [], 2, ["nbval-ignore-output"]),
            code(missing, [], 3, ["nbval-ignore-output"]),
        ]
    )
    try:
        result = run_as_in_colab(stored, colab, kernels)
        problems = problems_of(stored, result, colab, compare=True)
    finally:
        colab.installed = installed_mha(colab.purelib)  # the same wheel, installed anew
    assert result.passed, result.error
    assert len(problems) == 2, problems
    assert "installed mha again" in problems[0] and "%pip exited with 1" in problems[1], problems
