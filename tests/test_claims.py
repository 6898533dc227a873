"""mha.lab.claims: one way to print, assert and record a measured claim; tools/robustness.py's table."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from mha.lab import claims
from mha.lab.claims import claim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import robustness  # noqa: E402 (tools/ is not a package)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(claims, "_MADE", {})
    monkeypatch.delenv("MHA_CLAIMS_FILE", raising=False)
    monkeypatch.delenv("MHA_CLAIMS_CONTINUE", raising=False)


@pytest.mark.parametrize(
    ("value", "kwargs", "margin"),
    [
        (3.0, {"above": 2.0}, 1.5),
        (0.1, {"below": 0.25}, 2.5),
        (1.0, {"above": 0.5, "below": 4.0}, 2.0),  # value / above = 2, below / value = 4
        (3.0, {"above": 0.5, "below": 4.0}, 4 / 3),
    ],
)
def test_margin_is_value_over_bound_or_its_inverse(value, kwargs, margin, capsys):
    assert claim("ratio", value, **kwargs) is None  # a cell ending with it shows no value
    (made,) = claims.claims_made()
    assert made.margin == pytest.approx(margin)
    printed = capsys.readouterr().out
    assert printed.startswith("ratio: ~") and f"margin ~{margin:.2f}" in printed


def test_a_failed_claim_raises_and_names_value_and_bound(capsys):
    with pytest.raises(
        AssertionError, match=r"claim failed: t = 1\.2, expected > 1\.5 \(margin 0\.80\)"
    ):
        claim("t", 1.2, above=1.5)
    with pytest.raises(AssertionError, match=r"expected in \(1, 2\)"):
        claim("u", 2.5, above=1, below=2)
    assert "FAILED" in capsys.readouterr().out


def test_printed_value_and_margin_are_sanitised_and_the_bound_is_not(capsys):
    claim("growth, L = 512 -> 2048", 14.73, above=8, below=32)
    line = capsys.readouterr().out.strip()
    assert line == "growth, L = 512 -> 2048: ~14.7  (claim in (8, 32), margin ~1.84)"


def test_record_file_and_continue_mode(tmp_path, monkeypatch, capsys):
    record = tmp_path / "claims.jsonl"
    monkeypatch.setenv("MHA_CLAIMS_FILE", str(record))
    monkeypatch.setenv("MHA_CLAIMS_CONTINUE", "1")
    claim("holds", 4.0, above=2)
    claim("fails", 1.0, above=2)  # recorded, printed as FAILED, not raised
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["name"], r["margin"]) for r in rows] == [("holds", 2.0), ("fails", 0.5)]
    assert rows[0]["above"] == 2 and rows[0]["below"] is None
    assert capsys.readouterr().out.splitlines()[1].endswith("FAILED")


def test_running_a_cell_again_replaces_its_claim_and_summary_keeps_the_order():
    claim("b", 3.0, above=1)
    claim("a", 0.1, below=1)
    claim("b", 2.0, above=1)
    assert [(c.name, c.value) for c in claims.claims_made()] == [("b", 2.0), ("a", 0.1)]
    lines = claims.summary().splitlines()
    assert lines[0].startswith("b  > 1") and "~2  (margin ~2.00)" in lines[0]
    assert lines[1].startswith("a  < 1") and "(margin ~10.00)" in lines[1]


def test_numbers_of_any_kind_are_accepted():
    claim("tensor", torch.tensor(2.0), above=1)
    claim("int", 3, below=4)
    assert [c.value for c in claims.claims_made()] == [2.0, 3.0]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("x", 1.0), {}, ValueError, "claim 'x' needs a bound"),
        (("x", 1.0), {"above": 0}, ValueError, r"above must be a finite number > 0, got 0\.0"),
        (("x", -1.0), {"above": 1}, ValueError, r"value must be a finite number > 0, got -1\.0"),
        (("x", math.nan), {"above": 1}, ValueError, "value must be a finite number > 0, got nan"),
        (
            ("x", 1.0),
            {"above": 2, "below": 1},
            ValueError,
            r"above \(2\) must be smaller than below \(1\)",
        ),
        (("x", "2"), {"above": 1}, TypeError, "value must be a real number, got str"),
        (("x", True), {"above": 0.5}, TypeError, "value must be a real number, got bool"),
        (
            ("x", torch.ones(2)),
            {"above": 0.5},
            TypeError,
            r"value must be a single number, got shape \(2,\)",
        ),
        (("", 1.0), {"above": 0.5}, TypeError, "name must be a non-empty string"),
    ],
)
def test_bad_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        claim(*args, **kwargs)


def test_robustness_table_takes_each_claims_worst_margin_worst_first():
    def run(condition, claims_):
        return {"chapter": "05_gpu", "condition": condition, "claims": claims_}

    def rec(name, value, above=None, below=None):
        made = claims.Claim(name, value, above, below)
        return {"name": name, "value": value, "above": above, "below": below, "margin": made.margin}

    runs = [
        run("one-thread", [rec("speed-up", 3.0, above=1.5), rec("memory", 0.1, below=0.25)]),
        run("busy-core", [rec("speed-up", 1.8, above=1.5), rec("memory", 0.05, below=0.25)]),
    ]
    rows = robustness.worst_margins(runs)
    assert [(r["claim"], r["worst_margin"], r["worst_condition"]) for r in rows] == [
        ("speed-up", pytest.approx(1.2), "busy-core"),
        ("memory", pytest.approx(2.5), "one-thread"),
    ]
    text = robustness.table(rows, min_margin=1.3)
    assert "| 05 | speed-up | > 1.5 | 1.8–3 | 2 | 1.20 ✗ | busy-core |" in text
    assert "| 05 | memory | < 0.25 | 0.05–0.1 | 2 | 2.50 | one-thread |" in text
    # a section of a chapter (chapters/NN_K_name.ipynb) keeps its number
    assert [robustness.chapter_number(s) for s in ("05_gpu", "08_1_rope")] == ["05", "08.1"]


def test_robustness_conditions_set_threads_and_start_a_neighbour(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with robustness.condition("one-thread"):
        assert robustness.os.environ["OMP_NUM_THREADS"] == "1"
    with robustness.condition("all-threads"):
        assert "OMP_NUM_THREADS" not in robustness.os.environ
    assert robustness.os.environ["OMP_NUM_THREADS"] == "7"
    started = []
    real_popen = robustness.subprocess.Popen

    def popen(cmd, *a, **k):
        started.append(cmd)
        return real_popen([sys.executable, "-c", "import time; time.sleep(30)"])

    monkeypatch.setattr(robustness.subprocess, "Popen", popen)
    with robustness.condition("memory-stream"):
        pass
    assert "np.copyto" in started[0][-1]


def test_robustness_merge_rebuilds_one_table_from_split_runs(tmp_path, capsys):
    def run_file(name, chapter, margin_value, passed=True):
        record = {"name": "ratio", "value": margin_value, "above": 1.0, "below": None}
        runs = [
            {
                "chapter": chapter,
                "condition": "busy-core",
                "run": 1,
                "passed": passed,
                "seconds": 1.0,
                "error": None if passed else "AssertionError: x",
                "claims": [{**record, "margin": margin_value}],
            }
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"chapter_runs": runs}))
        return path

    a, b = run_file("a.json", "02_x", 2.0), run_file("b.json", "05_y", 1.1)
    out = tmp_path / "all.json"
    assert robustness.main(["--merge", str(a), str(b), "--output", str(out)]) == 1  # 1.1 < 1.3
    merged = json.loads(out.read_text())
    assert [(r["chapter"], r["worst_margin"]) for r in merged["claims"]] == [
        ("05_y", 1.1),
        ("02_x", 2.0),
    ]
    assert "1 below margin 1.3, 0 failed runs of 2" in capsys.readouterr().out
    c = run_file("c.json", "02_x", 3.0, passed=False)
    assert robustness.main(["--merge", str(a), str(c), "--output", str(out)]) == 1
    assert json.loads(out.read_text())["failures"] == ["02_x (busy-core, run 1): AssertionError: x"]
