"""tools/execute_notebook.py, the one notebook runner, and its comparison with stored outputs.

The notebook test (tests/test_colab_run.py) no longer runs nbval: it executes each chapter once and
compares the outputs with execute_notebook.compare_outputs. Here a small notebook, one cell per
case (masked numbers, changed text, stderr, ignored outputs, clear_output, ...), is run by nbval
itself and by the runner: both must fail exactly the same cells, the ones listed as failing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import execute_notebook  # noqa: E402 (tools/ is not a package: it joins the path first)

SANITIZE = REPO / "tests" / "sanitize.cfg"
RULES = execute_notebook.sanitize_rules(SANITIZE)


def out(kind: str, **fields) -> nbformat.NotebookNode:
    if kind in ("stdout", "stderr"):
        return nbformat.v4.new_output("stream", name=kind, text=fields["text"])
    return nbformat.v4.new_output(kind, **fields)


def differs(stored: list, sent: list) -> str | None:
    return execute_notebook.compare_cell(stored, sent, RULES)


def test_sanitize_file_is_read_as_nbval_reads_it():
    nbval = pytest.importorskip("nbval.plugin")
    expected = list(nbval.get_sanitize_patterns(SANITIZE.read_text(encoding="utf-8")))
    assert RULES == expected and len(RULES) >= 2


def test_compare_cell_rules():
    same = [out("stdout", text="naive ~12.31 ms, ratio ~4.1x at 0x7f3a\n")]
    masked = [out("stdout", text="naive ~3.5 ms, ratio ~11x at 0xdeadbeef\n")]
    assert differs(same, masked) is None
    assert "differs" in differs(same, [out("stdout", text="naive 12.31 ms\n")])
    # stderr, or a stream that is not stored, is an unexpected field; a missing one is missing
    assert "unexpected" in differs(same, same + [out("stderr", text="warning\n")])
    assert "missing" in differs(same, [])
    # streams are merged by name wherever they come, and a line rewritten with \r keeps its end
    split = [out("stdout", text="a\n"), out("stderr", text=""), out("stdout", text="b\n")]
    assert "unexpected" in differs([out("stdout", text="a\nb\n")], split)
    assert differs([out("stdout", text="a\nb\n")], [split[0], split[2]]) is None
    assert differs([out("stdout", text="100%\n")], [out("stdout", text="10%\r100%\n")]) is None
    # images and metadata are not compared; text/plain of a figure is
    fig = {"image/png": "AAAA", "text/plain": "<Figure size 640x480 with 1 Axes>"}
    stored = [out("display_data", data=fig, metadata={"a": 1})]
    other = [out("display_data", data={**fig, "image/png": "BBBB"})]
    assert differs(stored, other) is None
    other = [out("display_data", data={**fig, "text/plain": "<Figure size 640x480 with 2 Axes>"})]
    assert "text/plain" in differs(stored, other)
    # one display more of the same type
    assert "2 outputs of 'text/plain'" in differs(stored, stored + stored)


def cell(source: str, stored: list, count: int | None = 1, tags=()) -> nbformat.NotebookNode:
    c = nbformat.v4.new_code_cell(source, execution_count=count)
    c.outputs = stored
    if tags:
        c.metadata["tags"] = list(tags)
    return c


# (cell, fails?) — each cell's source runs, its stored outputs are compared
CASES = [
    (cell('print("same")', [out("stdout", text="same\n")]), False),
    (cell('print("t ~1.25 ms")', [out("stdout", text="t ~7.5 ms\n")]), False),
    (cell('print("object at 0x1234")', [out("stdout", text="object at 0xabcdef\n")]), False),
    (cell('print("new text")', [out("stdout", text="old text\n")]), True),
    (cell('import sys\nprint("warn", file=sys.stderr)', []), True),
    (cell('print("x")', [out("stdout", text="y\n")], tags=["nbval-ignore-output"]), False),
    (cell('# NBVAL_IGNORE_OUTPUT\nprint("x")', [out("stdout", text="y\n")]), False),
    (
        cell(
            'print("x")\n# NBVAL_CHECK_OUTPUT',
            [out("stdout", text="y\n")],
            tags=["nbval-ignore-output"],
        ),
        True,
    ),
    (
        cell(
            'from IPython.display import Markdown, display\ndisplay(Markdown("**a**"))',
            [
                out(
                    "display_data",
                    data={
                        "text/markdown": "**b**",
                        "text/plain": "<IPython.core.display.Markdown object>",
                    },
                )
            ],
        ),
        True,
    ),
    (
        cell(
            'import sys\nprint("a")\nsys.stdout.flush()\nprint("b")', [out("stdout", text="a\nb\n")]
        ),
        False,
    ),
    (cell('print("10%\\r100%")', [out("stdout", text="100%\n")]), False),
    (cell("x = 1", [out("stdout", text="1\n")]), True),
    (
        cell(
            'display({"image/png": "iVBORw0KGgo=", "text/plain": "fig"}, raw=True)',
            [out("display_data", data={"image/png": "AAAA", "text/plain": "fig"})],
        ),
        False,
    ),
    (
        cell(
            'from IPython.display import clear_output\nprint("first")\nclear_output()\nprint("second")',
            [out("stdout", text="second\n")],
        ),
        True,
    ),
    (cell('print("z")', [out("stdout", text="z\n")], count=None), True),
    (cell('print("q")', [out("stdout", text="r\n")], count=5, tags=["nbval-skip"]), False),
    (cell("1 + 1", [out("execute_result", data={"text/plain": "2"}, execution_count=3)]), False),
    (cell("2 + 2", [out("execute_result", data={"text/plain": "5"}, execution_count=4)]), True),
]


def nbval_failures(path, tmp_path) -> set[int]:
    """The code cells (0-based, as nbval counts them) that `pytest --nbval` fails."""
    report = tmp_path / "nbval.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--nbval",
            "--nbval-current-env",
            "--nbval-sanitize-with",
            str(SANITIZE),
            f"--junitxml={report}",
            "-q",
            path.name,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    failed = set()
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(int(case.get("name").removeprefix("Cell ")))
    return failed


@pytest.mark.slow
def test_runner_fails_exactly_the_cells_nbval_fails(tmp_path):
    pytest.importorskip("nbval")
    nb = nbformat.v4.new_notebook(cells=[c for c, _ in CASES])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "cases.ipynb"
    nbformat.write(nb, path)

    expected = {i for i, (_, fails) in enumerate(CASES) if fails}
    assert nbval_failures(path, tmp_path) == expected

    result = execute_notebook.run(nbformat.read(path, as_version=4), cwd=tmp_path)
    assert result.passed, result.error
    stored = nbformat.read(path, as_version=4)
    problems = execute_notebook.compare_outputs(stored, result, RULES)
    assert set(problems) == expected, "\n".join(problems.values())


@pytest.mark.slow
def test_run_stops_at_the_first_error_whatever_the_tags(tmp_path):
    nb = nbformat.v4.new_notebook(
        cells=[
            cell('print("one")', []),
            cell('raise ValueError("on purpose")', [], tags=["raises-exception"]),
            cell('print("never")', []),
            cell('print("skipped")', [], tags=["skip-execution"]),
        ]
    )
    result = execute_notebook.run(nb, cwd=tmp_path)
    assert result.error.startswith("code cell 2 of 4 ('raise ValueError(\"on purpose\")') raised")
    assert "ValueError: on purpose" in result.error and "one" not in result.error
    assert set(result.sent) == {0, 1}
    assert nb.cells[2].execution_count is None and not nb.cells[2].outputs


@pytest.mark.slow
def test_tags_are_honoured_as_in_the_book_or_ignored_as_in_colab(tmp_path):
    def notebook() -> nbformat.NotebookNode:
        return nbformat.v4.new_notebook(
            cells=[cell('print("one")', []), cell('print("stub")', [], tags=["skip-execution"])]
        )

    book = execute_notebook.run(notebook(), cwd=tmp_path)
    assert book.passed and set(book.sent) == {0}
    assert book.notebook.cells[1].execution_count is None and not book.notebook.cells[1].outputs
    colab = execute_notebook.run(notebook(), cwd=tmp_path, honour_tags=False)
    assert colab.passed and set(colab.sent) == {0, 1}
    assert execute_notebook.stdout_of(colab.notebook.cells[1]) == "stub\n"


@pytest.mark.slow
def test_setup_cell_outside_colab_uses_the_checkout():
    """The notebook test takes the setup cell's Colab branch; this is its other branch, as in a
    local Jupyter (and make execute): from chapters/, mha comes from the checkout one level up."""
    setup = (REPO / "tools" / "setup_cell.txt").read_text(encoding="utf-8")
    probe = 'import json\nprint(json.dumps([mha.__file__, "google.colab" in sys.modules]))'
    nb = nbformat.v4.new_notebook(cells=[cell(setup, []), cell(probe, [])])
    result = execute_notebook.run(nb, cwd=REPO / "chapters")
    assert result.passed, result.error
    assert execute_notebook.stdout_of(nb.cells[0]).startswith("mha ")
    where, colab = json.loads(execute_notebook.stdout_of(nb.cells[1]))
    assert Path(where).is_relative_to(REPO / "mha") and not colab


@pytest.mark.slow
def test_make_execute_records_the_smallest_text_of_each_figure(tmp_path, monkeypatch):
    """What tests/test_browser.py reads to check figure labels on a phone: make execute's kernel
    (tools/figure_text.py) stores each figure's smallest text against the image's width, and a
    second drawing with the Chinese of the notebook's figure labels (i18n/zh/<stem>.yml)."""
    import base64
    from io import BytesIO

    import translation_files
    from PIL import Image

    i18n = tmp_path / "i18n"
    i18n.mkdir()
    (i18n / "figures.yml").write_text(
        'cells: {}\nfigures:\n  "a line": "一条线"\n  "big": "大"\n', encoding="utf-8"
    )
    monkeypatch.setattr(translation_files, "I18N", i18n)
    draw = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(4.0, 3.0), layout='constrained')\n"
        "ax.plot([0, 1], [0, 1], label='a line')\n"
        "ax.legend(fontsize=7)\n"
        "ax.set_title('big', fontsize=20)\n"
        "plt.show()\n"
        "fig, ax = plt.subplots(figsize=(2.0, 2.0))\n"
        "ax.axis('off')\n"
        "ax.imshow([[0, 1], [1, 0]])\n"
        "plt.show()"
    )
    path = tmp_path / "figures.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell(draw, [])]), path)
    execute_notebook.execute(path)
    outputs = [
        o for o in nbformat.read(path, as_version=4).cells[0].outputs if "image/png" in o.data
    ]
    assert len(outputs) == 2
    text, blank = (o.metadata["mha_text"] for o in outputs)
    assert text["min_pt"] == 7.0  # the legend, smaller than the title and the 10-pt ticks
    assert 3.9 < text["width_in"] < 4.6  # the tight bounding box, 0.1 in of padding each side
    assert text["fraction"] == pytest.approx(7.0 / 72 / text["width_in"], rel=1e-3)
    assert blank["min_pt"] is None and blank["fraction"] is None  # an image without words
    assert {"a line", "big"} <= set(text["strings"]) and blank["strings"] == []
    drawn = outputs[0].metadata["mha_zh"]  # none for the image without words
    assert "mha_zh" not in outputs[1].metadata
    assert {"一条线", "大"} <= set(drawn["strings"]) and not {"a line", "big"} & set(
        drawn["strings"]
    )
    png = Image.open(BytesIO(base64.b64decode(drawn["image/png"])))
    assert json.loads(png.text["Description"]) == drawn["strings"]
    assert png.width == drawn["size"]["width"]  # a plain PNG: no setup cell asked for retina


@pytest.mark.slow
def test_warm_kernels_give_each_run_a_fresh_kernel_started_ahead(tmp_path):
    """The notebook test's kernels: each run takes one that is already started and has run
    nothing, the next one starts at once, and no kernel serves two runs."""

    def notebook() -> nbformat.NotebookNode:
        return nbformat.v4.new_notebook(
            cells=[cell("import os\nx = globals().get('x', 0) + 1\nprint(os.getpid(), x)", [])]
        )

    with execute_notebook.WarmKernels(cwd=tmp_path) as warm:  # their own Unix sockets
        assert warm.new_manager is execute_notebook.new_kernel_manager
        taken = [warm.take() for _ in range(2)]  # the second is the one started ahead
        assert all(km.has_kernel for km in taken) and warm.next.has_kernel
        runs = [execute_notebook.run(notebook(), cwd=tmp_path, km=km) for km in taken]
        assert all(r.passed for r in runs), [r.error for r in runs]
        printed = [execute_notebook.stdout_of(r.notebook.cells[0]).split() for r in runs]
        assert printed[0][0] != printed[1][0] and printed[0][1] == printed[1][1] == "1", printed
        assert not any(km.has_kernel for km in taken)  # each shut down after its run
        assert set(runs[0].cell_seconds) == {0} and runs[0].cell_seconds[0] < runs[0].seconds
        # a kernel started for another working directory (or already used) is refused
        with pytest.raises(ValueError, match="not started ahead for this run"):
            execute_notebook.run(notebook(), cwd=REPO, km=warm.take())
        last = warm.next
    assert warm.started == 4 and not last.has_kernel  # closing shuts down the one left
    assert {km.transport for km in [*taken, last]} == {"ipc"}


@pytest.mark.slow
def test_a_run_leaves_no_client_connected_to_the_ports_of_its_kernel(tmp_path):
    """After a run on a kernel it was handed, nothing of the run's client stays connected: its
    heartbeat, left running, pinged the dead kernel's port every second, and a later kernel that
    bound that port for its shell logged "DELIM not in msg_list" as stderr into its cells."""
    import zmq
    from jupyter_client.manager import KernelManager

    km = KernelManager()
    nb = nbformat.v4.new_notebook(cells=[cell("print(1)", [])])
    assert execute_notebook.run(nb, cwd=tmp_path, km=km).passed and not km.has_kernel
    ctx = zmq.Context()
    listener = ctx.socket(zmq.ROUTER)  # a later kernel's shell socket on the freed port
    try:
        listener.bind(f"tcp://{km.ip}:{km.hb_port}")
        # the heartbeat pings once a second and reconnects within 0.1 s
        assert not listener.poll(3000), listener.recv_multipart()
    finally:
        listener.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_kernels_talk_over_unix_sockets_removed_after_the_run(tmp_path):
    """run()'s own kernel manager (execute_notebook.new_kernel_manager): no TCP port to race for,
    and no socket file left behind once the kernel is shut down."""
    source = "from ipykernel.kernelapp import IPKernelApp\nprint(IPKernelApp.instance().transport)"
    nb = nbformat.v4.new_notebook(cells=[cell(source, [])])
    assert execute_notebook.run(nb, cwd=tmp_path).passed
    assert execute_notebook.stdout_of(nb.cells[0]) == "ipc\n"
    folder = Path(execute_notebook._SOCKETS.name)
    assert folder.is_dir() and not list(folder.iterdir())
