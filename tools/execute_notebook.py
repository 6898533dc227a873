"""The course's one notebook runner: execute a notebook in a fresh kernel, top to bottom.

Usage: python tools/execute_notebook.py chapters/01_queries_keys_values.ipynb [...]

On the command line (``make execute``) it re-executes chapters *in place*, the way they are
committed: each in a fresh kernel with its directory as the working directory, cells tagged
``skip-execution`` kept unexecuted, stopping at the first error (a deliberate error is shown with
``mha.expect_error``, never by a cell that raises: Colab's "Run all" honours no tags). It folds the
exercise solutions for Colab and JupyterLab (tools/fold_solutions.py) and strips the per-cell
metadata (timings, widgets state) that the tests do not need.

Everything else that executes a notebook uses :func:`run` too: the notebook test
(tests/test_colab_run.py: Colab's "Run all", no tags honoured, outputs compared with the stored
ones by :func:`compare_outputs`), ``make gpu-check`` (tools/gpu_check.py) and ``make test-robust``
(tools/robustness.py). A caller that runs notebooks one after another can start each kernel
ahead with :class:`WarmKernels`: the next one boots while the current notebook runs, and every
run still gets a fresh kernel of its own (the notebook test does this).

Tracebacks are stored in IPython's ``Minimal`` mode ("ValueError: message"), so that an error
never prints file paths of the machine that ran it.

:func:`compare_outputs` is nbval's comparison (``pytest --nbval``, nbval 0.11), reproduced: for
every code cell that the stored notebook shows executed, the outputs the kernel sent (every one,
before any ``clear_output``) must equal the stored outputs after the sanitize rules
(tests/sanitize.cfg), except in cells tagged ``nbval-ignore-output`` or ``nbval-skip`` (or marked
with nbval's ``# NBVAL_IGNORE_OUTPUT`` / ``# NBVAL_SKIP`` comments). Streams are merged by name, so
any text on stderr where the stored cell has none fails; images and output metadata are not
compared. tests/test_execute_notebook.py checks, cell by cell, that it fails exactly where nbval
itself fails.
"""

from __future__ import annotations

import atexit
import copy
import re
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from fold_solutions import fold
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import output_from_msg
from translation_files import load_figure_labels

# tags: myst-nb and nbclient read them, the notebook test too; cellView (Colab) and
# jupyter.source_hidden (JupyterLab) fold the solutions.
KEEP_CELL_METADATA = {"tags", "cellView", "jupyter", "mystnb"}
MINIMAL_TRACEBACKS = "--InteractiveShell.xmode=Minimal"
# make execute's kernels record each figure's smallest text and draw it once more in Chinese with
# the notebook's figure labels (read tools/figure_text.py); leaves no name in the namespace.
FIGURE_TEXT = Path(__file__).with_name("figure_text.py")


def record_figure_text(stem: str) -> str:
    """The kernel's first line for notebook ``stem``: tools/figure_text.py, given the Chinese
    figure labels of ``i18n/zh/<stem>.yml`` (None where the notebook has no translation file)."""
    labels = load_figure_labels(stem)
    return (
        f"__import__('runpy').run_path({str(FIGURE_TEXT)!r}, "
        f"init_globals={{'ZH_FIGURES': {labels!r}}}, run_name='__mha_figures__')"
    )


# --- running ---------------------------------------------------------------------------------

_SOCKETS: tempfile.TemporaryDirectory[str] | None = None  # the kernels' sockets, this process's


def new_kernel_manager(**kwargs: Any) -> KernelManager:
    """A kernel manager whose kernel talks over Unix sockets in a folder of this process's own
    (``kwargs``: ``kernel_name``, ``kernel_spec_manager`` ...), not over TCP ports on 127.0.0.1.

    With TCP, a kernel's five ports are picked free and bound a moment later by the kernel, and
    every connection to a kernel takes a port of the same range for its own end: a kernel then
    may find its port taken (seen: its heartbeat thread died with "Address already in use"), and
    a client left connected to a freed port reaches whichever later kernel binds it. A socket
    file has a name of its own: neither can happen. (On Windows, which has no ipc transport in
    ZeroMQ, the kernels keep TCP.)
    """
    if sys.platform == "win32":
        return KernelManager(**kwargs)
    global _SOCKETS
    if _SOCKETS is None:
        _SOCKETS = tempfile.TemporaryDirectory(prefix="mha-kernels-")
    name = f"kernel-{uuid.uuid4().hex[:12]}"  # its files: <name>-<port>
    return KernelManager(transport="ipc", ip=str(Path(_SOCKETS.name) / name), **kwargs)


@dataclass
class Run:
    """One execution of a notebook.

    Attributes:
        notebook: the notebook with this run's outputs (as a notebook frontend keeps them).
        seconds: wall time from kernel start (or, for a kernel started ahead, from the moment the
            run took it over) to the kernel's shutdown after the end (or the error).
        error: ``None`` if every cell ran; else where it stopped and why, in one paragraph.
        sent: for each code cell the run executed (by index in ``notebook.cells``), every output
            the kernel sent, in order, ``clear_output`` ignored: what nbval compares.
        cell_seconds: each executed code cell's wall time, by index in ``notebook.cells``.
    """

    notebook: nbformat.NotebookNode
    seconds: float
    error: str | None
    sent: dict[int, list[nbformat.NotebookNode]] = field(default_factory=dict)
    cell_seconds: dict[int, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None


class _Client(NotebookClient):
    """nbclient's client that also keeps every output message, as nbval collects them."""

    def __init__(self, nb: nbformat.NotebookNode, **kw: Any) -> None:
        super().__init__(nb, **kw)
        self.sent: dict[int, list[nbformat.NotebookNode]] = {}
        self.cell_seconds: dict[int, float] = {}

    async def async_execute_cell(
        self, cell: nbformat.NotebookNode, cell_index: int, *args: Any, **kw: Any
    ) -> nbformat.NotebookNode:
        start = time.perf_counter()
        try:
            return await super().async_execute_cell(cell, cell_index, *args, **kw)
        finally:
            if cell_index in self.sent:  # executed, not skipped for its tag
                self.cell_seconds[cell_index] = time.perf_counter() - start

    def process_message(
        self, msg: dict[str, Any], cell: nbformat.NotebookNode, cell_index: int
    ) -> nbformat.NotebookNode | None:
        sent = self.sent.setdefault(cell_index, [])  # every executed cell: "busy", "idle" ...
        if msg["msg_type"] in ("stream", "display_data", "execute_result", "error"):
            sent.append(output_from_msg(msg))
        return super().process_message(msg, cell, cell_index)


def where_it_stopped(nb: nbformat.NotebookNode) -> str:
    """The first code cell with an error output: its position, first line, error and stdout."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    for n, cell in enumerate(code, start=1):
        for out in cell.outputs:
            if out.output_type == "error":
                lines = cell.source.strip().splitlines()
                printed = stdout_of(cell)[-800:]
                return (
                    f"code cell {n} of {len(code)} ({lines[0] if lines else ''!r}) raised "
                    f"{out.ename}: {out.evalue}"
                    + (f"\nafter printing:\n{printed}" if printed else "")
                )
    return "no cell shows an error"


def stdout_of(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


def _client(
    nb: nbformat.NotebookNode,
    *,
    cwd: Path,
    honour_tags: bool = True,
    timeout: int = 600,
    kernel_name: str = "python3",
    km: Any = None,
    startup: Sequence[str] = (),
) -> _Client:
    """The client that runs ``nb``; the kernel it starts gets the arguments that :func:`run`
    documents (:class:`WarmKernels` starts its kernels through it too, so they match)."""
    return _Client(
        nb,
        km=km,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(cwd)}},
        record_timing=False,
        # nbclient skips the cells carrying this tag; no cell carries an empty one.
        skip_cells_with_tag="skip-execution" if honour_tags else "",
        force_raise_errors=True,  # not even a cell tagged raises-exception may raise
        extra_arguments=[MINIMAL_TRACEBACKS, *(f"--IPKernelApp.exec_lines={x}" for x in startup)],
    )


def _kernel_start(
    cwd: Path, env: Mapping[str, str] | None, startup: Sequence[str]
) -> tuple[str, tuple[tuple[str, str], ...] | None, tuple[str, ...]]:
    """What a kernel was started with, to check that a kernel started ahead suits a run."""
    return str(cwd), None if env is None else tuple(sorted(env.items())), tuple(startup)


def run(
    nb: nbformat.NotebookNode,
    *,
    cwd: Path,
    honour_tags: bool = True,
    timeout: int = 600,
    kernel_name: str = "python3",
    km: Any = None,
    env: Mapping[str, str] | None = None,
    startup: Sequence[str] = (),
) -> Run:
    """Execute ``nb`` (in place: its outputs are replaced) in a fresh kernel started in ``cwd``.

    Every code cell runs in order and the run stops at the first error; no cell may raise, whatever
    its tags. With ``honour_tags`` cells tagged ``skip-execution`` are left unexecuted (as in the
    book); without it every cell runs, as in Colab's "Run all". ``km`` is a kernel manager to use
    (a Colab stand-in's kernelspec), or one whose kernel :class:`WarmKernels` started ahead with
    the same ``cwd``, ``env`` and ``startup`` (and never used); without it, a new one from
    :func:`new_kernel_manager` for ``kernel_name``; ``env``, the kernel's environment
    (default: this process's); ``startup``, Python lines the kernel runs before the first cell.
    The kernel is shut down at the end.
    """
    if km is None:
        km = new_kernel_manager(kernel_name=kernel_name)
    elif km.has_kernel:
        started = getattr(km, "mha_started_with", None)
        if started != _kernel_start(cwd, env, startup):
            km.shutdown_kernel(now=True)
            raise ValueError(
                "the kernel manager's kernel is already running, but was not started ahead for "
                f"this run (WarmKernels with cwd={cwd}, the same env and startup): {started}"
            )
        km.mha_started_with = "taken"  # a kernel runs one notebook only
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = _client(
        nb,
        cwd=cwd,
        honour_tags=honour_tags,
        timeout=timeout,
        kernel_name=kernel_name,
        km=km,
        startup=startup,
    )
    start = time.perf_counter()
    error = None
    try:
        client.execute(**({"env": dict(env)} if env is not None else {}))
    except CellExecutionError:
        error = where_it_stopped(nb)
    except Exception as err:  # a timeout, a dead kernel: no cell output says it
        error = f"{type(err).__name__}: {err}".strip()[-2000:]
    finally:
        if km.has_kernel:  # nbclient leaves a kernel it was handed running
            km.shutdown_kernel(now=True)
        # ... and that kernel's client connected. Its heartbeat would go on pinging the freed
        # ports (over TCP, a later kernel that bound one as its shell port logged "DELIM not in
        # msg_list" into the cell running then, as stderr).
        if client.kc is not None:
            client.kc.stop_channels()
            client.kc = None
        atexit.unregister(client._cleanup_kernel)  # left registered when a kernel fails to start
    return Run(nb, time.perf_counter() - start, error, dict(client.sent), client.cell_seconds)


class WarmKernels:
    """Kernels started one ahead, for notebooks run one after another: :meth:`take` hands over a
    kernel that is already started (and has run nothing) and at once starts the next one, which
    boots while the caller runs a notebook on the one it took. Each kernel serves one run:
    :func:`run` shuts it down at the end. Use it as a context manager (or call :meth:`close`) so
    that the kernel started last is shut down too.

    ``new_manager`` makes a kernel manager (one per kernel; default :func:`new_kernel_manager`);
    ``cwd``, ``env`` and ``startup`` are those of :func:`run`, which must be given the same.
    """

    def __init__(
        self,
        new_manager: Callable[[], Any] = new_kernel_manager,
        *,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        startup: Sequence[str] = (),
    ) -> None:
        self.new_manager = new_manager
        self.cwd, self.env, self.startup = cwd, None if env is None else dict(env), list(startup)
        self.next: Any = None
        self.started = 0  # kernels started so far
        atexit.register(self.close)

    def start(self) -> Any:
        km = self.new_manager()
        client = _client(nbformat.v4.new_notebook(), cwd=self.cwd, km=km, startup=self.startup)
        # nbclient's own start (cwd, extra arguments), as run() would start it; this returns once
        # the kernel's process is launched, and run() waits for it to answer.
        client.start_new_kernel(**({"env": self.env} if self.env is not None else {}))
        km.mha_started_with = _kernel_start(self.cwd, self.env, self.startup)
        self.started += 1
        return km

    def take(self) -> Any:
        """A fresh, started kernel's manager for one :func:`run`; the next kernel starts now."""
        km = self.next if self.next is not None else self.start()
        self.next = None
        self.next = self.start()
        return km

    def close(self) -> None:
        """Shut down the kernel started ahead (none is left running)."""
        if self.next is not None and self.next.has_kernel:
            self.next.shutdown_kernel(now=True)
        self.next = None
        atexit.unregister(self.close)

    def __enter__(self) -> WarmKernels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- comparing with the stored outputs (nbval's rules) ---------------------------------------

# nbval 0.11's output fields and MIME types that are never compared (without --nbdime).
SKIP_COMPARE = frozenset(
    {
        "metadata",
        "traceback",
        "prompt_number",
        "output_type",
        "name",
        "execution_count",
        "application/vnd.jupyter.widget-view+json",
        "image/png",
        "image/jpeg",
    }
)
# nbval's markers: cell tags, and comment lines (``# NBVAL_IGNORE_OUTPUT``), which win.
_TAG_OPTIONS = {
    "nbval-ignore-output": ("check", False),
    "pytest-validate-ignore-output": ("check", False),
    "nbval-check-output": ("check", True),
    "nbval-skip": ("skip", True),
}
_COMMENT_OPTIONS = {
    "NBVAL_IGNORE_OUTPUT": ("check", False),
    "PYTEST_VALIDATE_IGNORE_OUTPUT": ("check", False),
    "NBVAL_CHECK_OUTPUT": ("check", True),
    "NBVAL_SKIP": ("skip", True),
}
_CARRIAGE_RETURN = re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)


def sanitize_rules(path: Path) -> list[tuple[str, str]]:
    """The (regex, replacement) pairs of an nbval sanitize file, read as nbval reads it (a regex
    given twice keeps its first place and its last replacement)."""
    text = path.read_text(encoding="utf-8")
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", text, flags=re.MULTILINE)
    return list(dict(pairs).items())


def nbval_options(cell: nbformat.NotebookNode) -> dict[str, bool]:
    """nbval's options for a code cell: ``check`` (compare its outputs) and ``skip`` (run it not)."""
    options = {"check": True, "skip": False}
    for tag in cell.metadata.get("tags", []):
        if tag in _TAG_OPTIONS:
            key, value = _TAG_OPTIONS[tag]
            options[key] = value
    for line in cell.source.splitlines():
        line = line.strip()
        if line.startswith("#") and line.lstrip("#").strip() in _COMMENT_OPTIONS:
            key, value = _COMMENT_OPTIONS[line.lstrip("#").strip()]
            options[key] = value
    return options


def _coalesced(outputs: Sequence[nbformat.NotebookNode]) -> list[dict[str, Any]]:
    """Streams merged by name (at the first one's place), a line's text before a \\r dropped:
    nbval's form."""
    merged: list[dict[str, Any]] = []
    streams: dict[str, dict[str, Any]] = {}
    for out in copy.deepcopy(list(outputs)):
        if out.get("output_type") == "stream":
            if out["name"] in streams:
                streams[out["name"]]["text"] += out["text"]
                continue
            streams[out["name"]] = out
        merged.append(out)
    for stream in streams.values():
        # nbval 0.11 also means to apply backspaces, but its loop never runs: \b stays as is.
        stream["text"] = _CARRIAGE_RETURN.sub("", stream["text"])
    return merged


def _fields(outputs: Sequence[nbformat.NotebookNode], rules: Sequence[tuple[str, str]]) -> dict:
    """Field (a MIME type, a stream's name, ename ...) -> its sanitized values, in order."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            for regex, replace in rules:
                value = re.sub(regex, replace, value)
        return value

    fields: dict[str, list[Any]] = defaultdict(list)
    for out in _coalesced(outputs):
        if out.get("output_type") == "stream":
            out = {"output_type": "stream", out["name"]: out["text"]}
        for key, value in out.items():
            if key in SKIP_COMPARE:
                continue
            if key == "data":
                for mime, data in value.items():
                    if mime not in SKIP_COMPARE:
                        fields[mime].append(clean(data))
            else:
                fields[key].append(clean(value))
    return fields


def compare_cell(
    stored: Sequence[nbformat.NotebookNode],
    sent: Sequence[nbformat.NotebookNode],
    rules: Sequence[tuple[str, str]],
) -> str | None:
    """``None`` if the outputs a run sent match the stored ones under nbval's rules, else why not."""
    want, got = _fields(stored, rules), _fields(sent, rules)
    if set(want) - set(got):
        return f"missing output fields from running code: {sorted(set(want) - set(got))}"
    if set(got) - set(want):
        extra = sorted(set(got) - set(want))
        shown = "; ".join(f"{k}: {str(got[k][0])[:300]!r}" for k in extra)
        return f"unexpected output fields from running code: {extra} ({shown})"
    for key, values in want.items():
        if len(values) != len(got[key]):
            return f"{len(got[key])} outputs of {key!r}, the stored cell has {len(values)}"
        for stored_value, new_value in zip(values, got[key], strict=True):
            if stored_value != new_value:
                return (
                    f"{key!r} differs (after tests/sanitize.cfg):\n  stored: {stored_value!r}"
                    f"\n  now:    {new_value!r}"
                )
    return None


def compare_outputs(
    stored: nbformat.NotebookNode, result: Run, rules: Sequence[tuple[str, str]]
) -> dict[int, str]:
    """The cells whose outputs in ``result`` differ from those stored in ``stored`` under nbval's
    rules: cell index -> what differs. The run's notebook has the stored notebook's cells in the
    same places (it may append cells after them). Cells the run did not reach are not compared."""
    problems = {}
    number = 0
    for i, cell in enumerate(stored.cells):
        if cell.cell_type != "code":
            continue
        number += 1
        options = nbval_options(cell)
        if options["skip"]:
            continue
        first = (cell.source.strip().splitlines() or [""])[0]
        where = f"cell {i} (code cell {number}, {first[:60]!r})"
        if cell.execution_count is None and cell.outputs:
            problems[i] = f"{where}: stored unexecuted, but with outputs"
        elif options["check"] and cell.execution_count is not None and i in result.sent:
            why = compare_cell(cell.outputs, result.sent[i], rules)
            if why:
                problems[i] = f"{where}: {why}"
    return problems


# --- make execute: chapters executed in place -------------------------------------------------


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
    result = run(nb, cwd=path.parent, timeout=timeout, startup=[record_figure_text(path.stem)])
    if result.error:
        raise RuntimeError(f"{path}: {result.error}")
    # A fresh kernel numbers the executed cells 1..N; tests/test_notebooks.py relies on it.
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code" and c.execution_count]
    if counts != list(range(1, len(counts) + 1)):
        raise RuntimeError(f"{path}: unexpected execution counts {counts}")
    clean(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return result.seconds


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
