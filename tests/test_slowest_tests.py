"""make test's list of the slowest tests: the durations each pytest stage records
(tests/conftest.py) and tools/slowest_tests.py, which reads them."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import conftest
import pytest
from conftest import REPO, add_durations

sys.path.insert(0, str(REPO / "tools"))
import slowest_tests  # noqa: E402 (tools/ is not a package: it joins the path first)


def test_a_stage_run_twice_adds_its_tests_to_one_file(tmp_path):
    path = tmp_path / "durations" / "unit.json"
    add_durations(path, {"a.py::parallel": {"setup": 0.5, "call": 2.0, "teardown": 0.1}})
    add_durations(path, {"b.py::serial": {"setup": 0.0, "call": 3.0, "teardown": 0.0}})
    timed = slowest_tests.read(path.parent)
    assert [(t.stage, t.test) for t in timed] == [
        ("unit", "b.py::serial"),
        ("unit", "a.py::parallel"),
    ]
    assert [t.seconds for t in timed] == pytest.approx([3.0, 2.6])  # the phases together


def test_only_the_controlling_process_writes(tmp_path, monkeypatch):
    path = tmp_path / "unit.json"
    monkeypatch.setenv(conftest.DURATIONS, str(path))
    monkeypatch.setattr(conftest, "_durations", {"t.py::x": {"call": 1.0}})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a pytest-xdist worker: its reports are
    conftest.pytest_sessionfinish(SimpleNamespace())  # sent to the controller, which writes
    assert not path.exists()
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    conftest.pytest_sessionfinish(SimpleNamespace())
    assert slowest_tests.read(tmp_path) == [slowest_tests.Timed(1.0, "unit", "t.py::x")]


def test_the_slowest_across_stages_with_their_stage(tmp_path):
    add_durations(tmp_path / "unit.json", {f"u::{i}": {"call": float(i)} for i in range(20)})
    add_durations(tmp_path / "notebooks.json", {"n::chapter": {"setup": 1.0, "call": 30.0}})
    add_durations(tmp_path / "browser.json", {"b::page": {"call": 18.5}})
    text = slowest_tests.table(slowest_tests.read(tmp_path), top=3)
    assert text.splitlines() == [
        "The 3 slowest of 22 tests (browser, notebooks, unit), setup + call + teardown:",
        " seconds  stage      test",
        "    31.0  notebooks  n::chapter",
        "    19.0  unit       u::19",
        "    18.5  browser    b::page",
    ]


def test_command_line_prints_15_by_default_and_fails_without_durations(tmp_path):
    add_durations(tmp_path / "unit.json", {f"u::{i}": {"call": float(i)} for i in range(20)})
    tool = [sys.executable, str(REPO / "tools" / "slowest_tests.py")]
    done = subprocess.run([*tool, str(tmp_path)], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("The 15 slowest of 20 tests (unit)") and len(lines) == 2 + 15
    assert lines[-1].split() == ["5.0", "unit", "u::5"]
    empty = tmp_path / "empty"
    done = subprocess.run([*tool, str(empty)], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "no test durations in" in done.stderr
