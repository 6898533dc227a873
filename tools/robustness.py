"""How close does each measured claim of the book come to failing? Run every chapter under load.

    python tools/robustness.py                       # or: make test-robust
    python tools/robustness.py --chapters 05 08 --runs 1 --conditions busy-core

Every chapter asserts its measured claims through ``mha.claims.claim``, which records each claim's
margin (value / bound, or bound / value; >= 1 when it holds). A claim sized on one quiet machine can
fail on the next reader's laptop, so this tool executes every chapter, top to bottom, under each
of these conditions, ``--runs`` times (three by default), the conditions taking turns:

* ``one-thread``: torch on one thread (``OMP_NUM_THREADS=1``), as on a 1-core runtime;
* ``all-threads``: torch on every core;
* ``busy-core``: a second process keeps one core busy (a neighbour on a shared machine);
* ``memory-stream``: a second process streams a 512 MiB array through memory (bandwidth contention).

Then it prints every claim's worst margin across all runs, worst first, with the condition that
gave it, writes everything to ``results/robustness/<device>.json``, and fails (exit 1) if a chapter
failed or any claim's worst margin is below ``--min-margin`` (1.3).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from gpu_check import (  # noqa: E402 (tools/ is not a package)
    ChapterRun,
    device_name,
    run_chapter,
    slug,
)

CONDITIONS = ("one-thread", "all-threads", "busy-core", "memory-stream")

# The neighbours, each a Python process that runs until it is killed.
NEIGHBOURS = {
    "busy-core": "while True:\n    pass\n",
    "memory-stream": (
        "import numpy as np\n"
        "a = np.ones(2**26)  # 512 MiB of float64, far beyond any cache\n"
        "b = np.empty_like(a)\n"
        "while True:\n"
        "    np.copyto(b, a)\n"
    ),
}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class Run(ChapterRun):
    """One chapter executed under one condition (the JSON file's ``chapter_runs``)."""

    chapter: str
    condition: str
    run: int


class Row(TypedDict):
    """One claim of one chapter across all runs (the JSON file's ``claims``)."""

    chapter: str
    claim: str
    bound: str
    worst_margin: float
    worst_condition: str | None
    values: list[float]
    runs: int


@contextlib.contextmanager
def condition(name: str) -> Iterator[None]:
    """Set up one load condition for the chapters run inside the block."""
    saved = {v: os.environ.get(v) for v in THREAD_VARIABLES}
    neighbour = None
    for variable in THREAD_VARIABLES:
        os.environ.pop(variable, None)
        if name == "one-thread":
            os.environ[variable] = "1"
    if name in NEIGHBOURS:
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[name]])
    try:
        yield
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        for variable, value in saved.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def run_once(chapter: Path, name: str) -> ChapterRun:
    """Execute one chapter under one condition; its result holds the claims it recorded."""
    os.environ["MHA_CLAIMS_CONTINUE"] = "1"  # measure every claim, even after one fails
    try:
        with condition(name):
            return run_chapter(chapter)
    finally:
        del os.environ["MHA_CLAIMS_CONTINUE"]


def worst_margins(runs: Sequence[Run]) -> list[Row]:
    """One row per (chapter, claim): its worst margin, the condition that gave it, value range.

    ``runs`` holds dicts with ``chapter``, ``condition`` and ``claims`` (as recorded by
    ``mha.claims``: ``name``, ``value``, ``above``, ``below``, ``margin``). Rows come worst first.
    """
    rows: dict[tuple[str, str], Row] = {}
    for run in runs:
        for c in run["claims"]:
            key = (run["chapter"], c["name"])
            row = rows.setdefault(
                key,
                {
                    "chapter": key[0],
                    "claim": c["name"],
                    "bound": _bound(c),
                    "worst_margin": float("inf"),
                    "worst_condition": None,
                    "values": [],
                    "runs": 0,
                },
            )
            row["values"].append(c["value"])
            row["runs"] += 1
            if c["margin"] < row["worst_margin"]:
                row["worst_margin"], row["worst_condition"] = c["margin"], run["condition"]
    return sorted(rows.values(), key=lambda r: r["worst_margin"])


def _bound(c: dict[str, Any]) -> str:
    above, below = c.get("above"), c.get("below")
    if above is not None and below is not None:
        return f"in ({above:g}, {below:g})"
    return f"> {above:g}" if above is not None else f"< {below:g}"


def chapter_number(stem: str) -> str:
    """The number of a chapter ("08": 08_modern_attention) or section ("08.1": 08_1_rope)."""
    match = re.match(r"\d+(?:_\d+(?=_))?", stem)
    return match.group().replace("_", ".") if match else stem


def table(rows: Sequence[Row], min_margin: float) -> str:
    """The rows as a Markdown table, worst margin first."""
    lines = [
        "| chapter | claim | bound | values (min–max) | runs | worst margin | under |",
        "|---|---|---|---|--:|--:|---|",
    ]
    for r in rows:
        values = r["values"]
        flag = "" if r["worst_margin"] >= min_margin else " ✗"
        lines.append(
            f"| {chapter_number(r['chapter'])} | {r['claim']} | {r['bound']}"
            f" | {min(values):.3g}–{max(values):.3g} | {r['runs']}"
            f" | {r['worst_margin']:.2f}{flag} | {r['worst_condition']} |"
        )
    return "\n".join(lines)


def save(runs: Sequence[Run], args: argparse.Namespace) -> Path:
    """Write the runs so far and their worst margins to the JSON file (after every run, so that
    an interrupted run keeps what it measured)."""
    output = args.output or REPO / "results" / "robustness" / f"{slug(device_name())}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    rows, failures = worst_margins(runs), failures_of(runs)
    summary = {
        "device": device_name(),
        "date": dt.date.today().isoformat(),
        "conditions": sorted({r["condition"] for r in runs}),
        "runs": len(runs),
        "min_margin": args.min_margin,
        "claims": rows,
        "failures": failures,
        "chapter_runs": list(runs),  # each with its claims: --merge rebuilds the table from them
    }
    output.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return output


def failures_of(runs: Sequence[Run]) -> list[str]:
    return [
        f"{r['chapter']} ({r['condition']}, run {r['run']}): {r['error']}"
        for r in runs
        if not r["passed"]
    ]


def report(runs: Sequence[Run], args: argparse.Namespace) -> int:
    """Print the table of worst margins, write the JSON file, return the exit status."""
    rows = worst_margins(runs)
    failures = failures_of(runs)
    print()
    print(table(rows, args.min_margin))
    weak = [r for r in rows if r["worst_margin"] < args.min_margin]
    output = save(runs, args)
    print(
        f"\n{len(rows)} claims, {len(weak)} below margin {args.min_margin},"
        f" {len(failures)} failed runs of {len(runs)} -> {output}"
    )
    for failure in failures:
        print(f"failed: {failure}")
    return 1 if weak or failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--chapters", nargs="*", default=None, help="chapter number prefixes (default: all)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per condition (default 3)")
    parser.add_argument("--conditions", nargs="*", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--min-margin", type=float, default=1.3)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON file (default results/robustness/<device>.json)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="run nothing: one table from the runs recorded in these JSON files",
    )
    args = parser.parse_args(argv)
    if args.merge:
        merged = [r for f in args.merge for r in json.loads(f.read_text())["chapter_runs"]]
        return report(merged, args)

    chapters = sorted((REPO / "chapters").glob("[0-9]*.ipynb"))
    if args.chapters:
        chapters = [p for p in chapters if any(p.name.startswith(c) for c in args.chapters)]
    if not chapters:
        parser.error(f"no chapter matches {args.chapters}")

    runs: list[Run] = []
    total = args.runs * len(args.conditions) * len(chapters)
    for i in range(args.runs):
        for name in args.conditions:
            for chapter in chapters:
                result = run_once(chapter, name)
                runs.append({"chapter": chapter.stem, "condition": name, "run": i + 1, **result})
                status = "ok" if result["passed"] else f"FAILED: {result['error']}"
                print(
                    f"[{len(runs)}/{total}] {chapter.stem:<32} {name:<13} run {i + 1}:"
                    f" {result['seconds']:6.1f} s, {len(result['claims'])} claims, {status}",
                    flush=True,
                )
                save(runs, args)
    return report(runs, args)


if __name__ == "__main__":
    sys.exit(main())
