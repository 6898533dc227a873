"""Print the versions that decide how the chapters behave: Python and the packages they import.

Usage: python tools/versions.py   (make test-newest prints them before running the chapters)
"""

from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = ("torch", "numpy", "matplotlib", "triton", "ipykernel", "nbclient", "pip", "setuptools")


def main() -> None:
    print(f"Python {platform.python_version()} ({platform.python_implementation()})")
    for name in PACKAGES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{name:12s} {version}")


if __name__ == "__main__":
    main()
