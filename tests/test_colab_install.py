"""Install `mha` the way the chapters' setup cell does on Colab, and check nothing else moves.

Colab already has torch, numpy and matplotlib. The setup cell runs
`%pip install -q "mha @ git+<repository>"`; that must install mha and leave those packages alone
(pyproject.toml keeps mha's dependencies loose for exactly this reason).

The test reproduces it offline: a local `git clone` of this repository at HEAD stands in for GitHub
(so only committed files count, as on Colab), and a fresh virtual environment stands in for Colab's
Python. The course environment's packages are made visible to it, *preinstalled*, through a `.pth`
file pointing at a directory of links to them, leaving out mha itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, preinstalled_venv, run

SETUP_CELL = REPO / "tools" / "setup_cell.txt"
PREINSTALLED = ("torch", "numpy", "matplotlib")

pytestmark = pytest.mark.slow


def pip_command_of_setup_cell() -> tuple[list[str], str, str]:
    """(pip options, requirement name, git URL) from the setup cell's `%pip install` line."""
    line = next(
        ln for ln in SETUP_CELL.read_text(encoding="utf-8").splitlines() if "%pip install" in ln
    )
    match = re.search(r"%pip install\s+(.*?)[\"'](\w+)\s*@\s*git\+(\S+?)[\"']", line)
    assert match, f"cannot parse the setup cell's install line: {line!r}"
    options = match.group(1).split()
    return options, match.group(2), match.group(3)


def versions(python: Path, cwd: Path) -> dict[str, str]:
    code = (
        "import importlib, json; "
        f"print(json.dumps({{m: importlib.import_module(m).__version__ for m in {PREINSTALLED!r}}}))"
    )
    return json.loads(run([str(python), "-c", code], cwd).strip().splitlines()[-1])


def test_colab_style_install_keeps_torch_and_numpy(tmp_path, monkeypatch):
    # Colab's Python has no PYTHONPATH; one pointing at a checkout (to test it without
    # installing it) would make mha importable in the stand-in before the install.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    options, name, url = pip_command_of_setup_cell()
    assert name == "mha" and url.startswith("https://"), (name, url)

    # 1. GitHub stand-in: a clone of the committed state.
    clone = tmp_path / "clone"
    run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], tmp_path)
    assert (clone / "pyproject.toml").exists(), "the repository at HEAD has no pyproject.toml"

    # 2. Colab stand-in: a fresh venv that already "has" the course environment, minus mha.
    python, purelib, preinstalled = preinstalled_venv(tmp_path, with_pip=True)
    (purelib / "colab_preinstalled.pth").write_text(f"{preinstalled}\n")

    work = tmp_path / "content"  # like Colab's /content: nowhere near the checkout
    work.mkdir()
    before = versions(python, work)
    assert before == versions(Path(sys.executable), work), (
        "the stand-in does not see the course's packages"
    )
    probe = subprocess.run(
        [str(python), "-c", "import mha"], check=False, cwd=work, capture_output=True, text=True
    )
    assert probe.returncode != 0, (
        "mha is importable before installing it; the test would prove nothing"
    )

    # 3. The setup cell's command, with the local clone in place of GitHub. (The host part
    # "localhost" keeps older pip releases, whose URL check wants one, happy; git ignores it.)
    requirement = f"{name} @ git+file://localhost{clone}"
    out = run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", *options, requirement],
        work,
        timeout=600,
    )

    after = versions(python, work)
    assert after == before, (
        f"installing mha changed preinstalled packages: {before} -> {after}\n{out}"
    )
    installed = sorted(p.name.split("-")[0].lower() for p in purelib.glob("*.dist-info"))
    assert set(installed) <= {"mha", "pip", "setuptools"} and "mha" in installed, (
        f"pip installed more than mha into the Colab stand-in: {installed}"
    )

    # 4. The installed package (not the checkout) imports, with every subpackage of the clone.
    subpackages = sorted(
        ".".join(p.parent.relative_to(clone).parts) for p in (clone / "mha").rglob("__init__.py")
    )
    code = (
        "import importlib, json, mha; "
        f"mods = [importlib.import_module(m) for m in {subpackages!r}]; "
        "print(json.dumps([mha.__version__, mha.__file__]))"
    )
    version, location = json.loads(run([str(python), "-c", code], work).strip().splitlines()[-1])
    assert Path(location).is_relative_to(purelib), (
        f"imported mha from {location}, not from the installed copy"
    )
    assert version, "mha.__version__ is empty"
