"""Shared fixtures: the repository layout, the book's configuration, and the CI switch; the
``serial`` marker; each test's duration recorded for ``make test``.

Run the tests through the Makefile (`make test`), or directly:
    .venv/bin/pytest -n auto -m "not browser and not serial" tests   # unit tests, notebook guards
    .venv/bin/pytest -m "serial and not browser" tests               # ... that measure: one process
    .venv/bin/pytest -m browser tests                                 # the built book in Chromium
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

# Without a GPU, Triton kernels can only run in its interpreter, and Triton reads this variable
# when it is first imported: set it before any test module can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --- serial tests ------------------------------------------------------------------------------

SERIAL = (
    "serial: measures time or memory (or bounds how long processes take): make test-unit runs it "
    "in a pytest of its own, without pytest-xdist, so that no other test runs beside it"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SERIAL)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:  # the workers share the cores: each takes its part of them, not all of them
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker another test runs beside each one: a serial test is skipped."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        skip = pytest.mark.skip(reason="serial: run it without -n (make test-unit does)")
        for item in items:
            if item.get_closest_marker("serial"):
                item.add_marker(skip)


# --- every test's duration, for make test ----------------------------------------------------------
# With MHA_TEST_DURATIONS naming a JSON file (make test names _build/durations/<stage>.json for
# each of its pytest stages), the session adds to that file how long each test took, phase by
# phase (setup, call, teardown); tools/slowest_tests.py lists the slowest. Under pytest-xdist the
# workers' reports reach the controlling process, which alone writes the file.

DURATIONS = "MHA_TEST_DURATIONS"
_durations: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations.setdefault(report.nodeid, {})[report.when] = round(report.duration, 4)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(DURATIONS)
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        add_durations(Path(path), _durations)


def add_durations(path: Path, durations: dict[str, dict[str, float]]) -> None:
    """Merge ``durations`` (test id -> phase -> seconds) into the JSON file ``path``."""
    recorded = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    recorded.update(durations)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normal numbers from a seeded generator on the CPU: the same tensor on every run."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    """Run a command; fail with its output unless it exits 0. Returns its stdout."""
    proc = subprocess.run(
        cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def preinstalled_venv(root: Path, *, with_pip: bool) -> tuple[Path, Path, Path]:
    """A fresh virtual environment in ``root / "colab"`` standing in for Colab: it "already has"
    every package of the environment running the tests, except mha (links in
    ``root / "preinstalled"``; the caller puts that folder on its path with a .pth file).
    Returns ``(python, purelib, preinstalled)``."""
    env_dir = root / "colab"
    venv.EnvBuilder(with_pip=with_pip, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(run([str(python), "-c", query], root).strip())
    # Links to every package here except mha (installed from the checkout) and the .pth files
    # (an editable mha, setuptools' hooks).
    preinstalled = root / "preinstalled"
    preinstalled.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.suffix == ".pth" or re.match(r"(__editable__.*|mha)([-_.].*)?$", entry.name):
            continue
        (preinstalled / entry.name).symlink_to(entry)
    return python, purelib, preinstalled


def in_ci() -> bool:
    """True when the environment variable CI is set (GitHub Actions and .ci/run set it)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> None:
    """Skip locally when a prerequisite is missing, but fail in CI, where it must be there."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)")
    pytest.skip(reason)


def read_yaml(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def toc_chapter_files(toc: dict) -> list[str]:
    """Every file listed under the parts/chapters of a jb-book _toc.yml, in reading order, the
    `sections:` of a chapter right after it."""
    files: list[str] = []

    def walk(entries: list[dict]) -> None:
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections", []))

    for part in toc.get("parts", []):
        walk(part.get("chapters", []))
    walk(toc.get("chapters", []))
    return files


def toc_chapters(toc: dict) -> dict[str, list[str]]:
    """Each chapter file of a jb-book _toc.yml -> the files of its `sections:` (in order)."""
    chapters: dict[str, list[str]] = {}
    entries = [e for part in toc.get("parts", []) for e in part.get("chapters", [])]
    for entry in entries + list(toc.get("chapters", [])):
        if "file" in entry:
            chapters[entry["file"]] = [s["file"] for s in entry.get("sections", []) if "file" in s]
    return chapters


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def book_config() -> dict:
    return read_yaml(REPO / "_config.yml")


@pytest.fixture(scope="session")
def toc() -> dict:
    return read_yaml(REPO / "_toc.yml")


@pytest.fixture(scope="module")
def tf():
    """``mha.triton_flash``, built for the GPU if there is one, else for Triton's interpreter."""
    pytest.importorskip("triton")
    import mha.triton_flash as module

    on_cpu = not torch.cuda.is_available()
    if module.is_interpreted() != on_cpu:
        module = importlib.reload(module)  # imported earlier under another setting
    assert module.is_interpreted() == on_cpu
    module._check_mode(module.is_interpreted())  # Triton itself was imported after the setting
    return module
