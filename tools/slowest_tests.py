"""The slowest tests of a make test run, across its pytest stages.

Usage: python tools/slowest_tests.py [FOLDER] [--top N]   (make test runs it at the end)

Each pytest stage of make test records in FOLDER (default _build/durations) a file
<stage>.json: test id -> {"setup": s, "call": s, "teardown": s} (tests/conftest.py writes it when
MHA_TEST_DURATIONS names it, as make test does). This prints the N slowest tests (default 15), a
test's time being its three phases together (a module fixture's setup counts for the first test
that uses it), with their stage. Exit status 1 when the folder holds no durations at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

FOLDER = Path("_build/durations")


class Timed(NamedTuple):
    seconds: float
    stage: str
    test: str


def read(folder: Path) -> list[Timed]:
    """Every recorded test of every stage in ``folder``, slowest first."""
    timed = []
    for path in sorted(folder.glob("*.json")):
        for test, phases in json.loads(path.read_text(encoding="utf-8")).items():
            timed.append(Timed(sum(phases.values()), path.stem, test))
    return sorted(timed, key=lambda t: (-t.seconds, t.stage, t.test))


def table(timed: list[Timed], top: int) -> str:
    """The ``top`` slowest of ``timed`` (slowest first), one line each: seconds, stage, test."""
    stages = sorted({t.stage for t in timed})
    width = max(len("stage"), *map(len, stages))
    lines = [
        f"The {min(top, len(timed))} slowest of {len(timed)} tests "
        f"({', '.join(stages)}), setup + call + teardown:",
        f"{'seconds':>8}  {'stage':<{width}}  test",
    ]
    lines += [f"{t.seconds:8.1f}  {t.stage:<{width}}  {t.test}" for t in timed[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=FOLDER)
    parser.add_argument("--top", type=int, default=15, help="how many tests (default 15)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be at least 1, got {args.top}")
    timed = read(args.folder)
    if not timed:
        print(f"slowest_tests: no test durations in {args.folder}", file=sys.stderr)
        return 1
    print(table(timed, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
