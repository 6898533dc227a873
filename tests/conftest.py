"""Shared fixtures: the repository layout, the book's configuration, and the CI switch.

Run the tests through the Makefile (`make test`), or directly:
    .venv/bin/pytest -m "not browser" tests        # unit tests and notebook guards
    .venv/bin/pytest -m browser tests               # the built book in headless Chromium
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

# Without a GPU, Triton kernels can only run in its interpreter, and Triton reads this variable
# when it is first imported: set it before any test module can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    """Every file listed under the parts/chapters of a jb-book _toc.yml, in reading order."""
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


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def book_config() -> dict:
    return read_yaml(REPO / "_config.yml")


@pytest.fixture(scope="session")
def toc() -> dict:
    return read_yaml(REPO / "_toc.yml")
