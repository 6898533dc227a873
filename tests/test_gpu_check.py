"""tools/gpu_check.py writes a results file with every field the appendix and the issue name."""

from __future__ import annotations

import json
import os
import sys

import nbformat
import pytest
import torch
from conftest import REPO

import mha

sys.path.insert(0, str(REPO / "tools"))

import bench_report  # noqa: E402 (tools/ is not a package: it joins the path first)
import gpu_check  # noqa: E402

# What a results file holds: what chapters/09 renders and the issue asks for.
FIELDS = {
    "device",
    "compute_capability",
    "date",
    "torch",
    "triton",
    "python",
    "capabilities",
    "chapters",
    "report",
    "triton_vs_sdpa_fp16",
}


@pytest.mark.slow
def test_run_chapter_records_pass_fail_time_and_claims(tmp_path):
    """run_chapter executes a notebook (tools/execute_notebook.py) with MHA_CLAIMS_FILE set, as
    mha.claims records a claim there. A small notebook stands in for a chapter: every chapter is
    executed by the notebook test (tests/test_colab_run.py), once."""
    claim = {"name": "a / b time", "value": 3.0, "above": 1.5, "below": None, "margin": 2.0}
    record = f"import json, os\nopen(os.environ['MHA_CLAIMS_FILE'], 'a').write(json.dumps({claim!r}) + '\\n')"
    cells = [nbformat.v4.new_code_cell(record), nbformat.v4.new_code_cell("print('done')")]
    good, bad = tmp_path / "01_good.ipynb", tmp_path / "02_bad.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), good)
    cells = [nbformat.v4.new_code_cell(record), nbformat.v4.new_code_cell("raise ValueError('no')")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), bad)

    outcome = gpu_check.run_chapter(good)
    assert outcome["passed"] is True and outcome["error"] is None
    assert outcome["seconds"] > 0 and outcome["claims"] == [claim]
    outcome = gpu_check.run_chapter(bad)
    assert outcome["passed"] is False and "ValueError: no" in outcome["error"]
    assert outcome["claims"] == [claim]  # what it measured before it failed
    assert "MHA_CLAIMS_FILE" not in os.environ


def test_main_writes_the_cpu_file(tmp_path, monkeypatch, capsys):
    """The results file, from a run whose chapter and report are stand-ins (the chapters run in
    the notebook test, the report in tests/test_bench_report.py: each once per make test)."""
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)  # the CPU file
    ran = {"passed": True, "seconds": 1.5, "error": None, "claims": []}
    monkeypatch.setattr(gpu_check, "run_chapter", lambda path: ran)
    checks = [
        bench_report.Check("causal tile-skipping speed-up", 1.8, 1.6, False, "x ~1 ms"),
        bench_report.Check("a / b time", 1.2, 1.0, True, "a ~1.2 ms, b ~1 ms"),
    ]
    asked = {}

    def report(**kwargs):
        asked.update(kwargs)
        return checks

    monkeypatch.setattr(gpu_check.bench_report, "run_report", report)
    chapter = REPO / "chapters" / "01_queries_keys_values.ipynb"
    assert gpu_check.main(["--quick", "--chapters", str(chapter)]) == 0
    assert asked["quick"] is True and asked["device"] == "cpu"
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert set(result) >= FIELDS
    assert result["chapters"] == {"01_queries_keys_values": ran}
    assert result["report"] == [
        {
            "name": c.name,
            "value": c.value,
            "target": c.target,
            "at_most": c.at_most,
            "passed": c.passed,
        }
        for c in checks
    ]
    assert [c["passed"] for c in result["report"]] == [True, False]
    assert result["triton_vs_sdpa_fp16"] is None  # no GPU here
    assert result["triton_targets"] == {"forward": 0.8, "backward": 0.5}
    assert result["triton_paged_varlen_fp16"] is None
    assert "wrote" in capsys.readouterr().out


@pytest.fixture
def fake_timer(monkeypatch):
    """For the GPU timings run at smoke-test sizes in Triton's interpreter (on a GPU they run
    compiled at full size): a time_fn that records the function it is given and says the n-th
    call took n ms. Returns the list of functions timed."""
    pytest.importorskip("triton")
    import mha.lab.timing

    if torch.cuda.is_available():
        pytest.skip("on a GPU tools/gpu_check.py runs it at full size")
    calls = []

    def recorded(fn, *args, **kwargs):
        calls.append(fn)
        t = 1e-3 * len(calls)
        return mha.lab.timing.Timing(median=t, iqr=0.0, runs=1, times=(t,))

    monkeypatch.setattr(mha.lab.timing, "time_fn", recorded)
    return calls


@pytest.mark.triton
def test_paged_varlen_timing_checks_and_times_the_three(fake_timer):
    """The serving-step timing at smoke-test sizes, its kernel in Triton's interpreter (on a GPU
    it runs compiled): the kernel, mha.paged_varlen_attention and SDPA per sequence agree, and
    each is timed (a timer that only records what it is given stands in: the interpreter is
    slow)."""
    calls = fake_timer
    rows = gpu_check.paged_varlen_timing(quick=True, device="cpu")
    assert [r["D"] for r in rows] == [64, 128]
    from mha.triton_paged import triton_paged_varlen_attention

    per_sequence = gpu_check.bench_report.MixedBatch.per_sequence
    timed = [triton_paged_varlen_attention, mha.paged_varlen_attention, per_sequence]
    assert [getattr(fn, "__func__", fn) for fn in calls] == timed * 2
    assert rows[0]["mha_over_triton"] == 2.0 and rows[0]["sdpa_over_triton"] == 3.0
    assert rows[1]["chunks"] == "4 x 32" and rows[1]["decodes"] == 6


def test_device_slug():
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_committed_results_hold_what_the_appendix_reads():
    """chapters/09 renders every results/*.json: each needs these fields, and a consistent verdict."""
    files = sorted((REPO / "results").glob("*.json"))
    assert any(p.name == "cpu.json" for p in files), "results/cpu.json is missing"
    for path in files:
        result = json.loads(path.read_text(encoding="utf-8"))
        assert set(result) >= FIELDS, path.name
        assert set(result["capabilities"]) >= {"bfloat16", "tf32", "sdpa_flash"}, path.name
        for check in result["report"]:
            meets = (
                check["value"] <= check["target"]
                if check["at_most"]
                else check["value"] >= check["target"]
            )
            assert check["passed"] == meets, (path.name, check["name"])


@pytest.mark.triton
def test_triton_throughput_times_forward_and_backward_against_sdpa(fake_timer):
    """The Triton sweep at a tiny size, its kernels in Triton's interpreter (on a GPU they run
    compiled at full size): the forward and the backward of the kernel and of SDPA are each timed,
    the throughputs follow from the FLOPs, and the error against SDPA is recorded (small here)."""
    calls = fake_timer
    rows = gpu_check.triton_throughput(quick=True, device="cpu", lengths=[32], tokens=64, heads=2)
    assert [(r["D"], r["L"], r["causal"]) for r in rows] == [
        (64, 32, False),
        (64, 32, True),
        (128, 32, False),
        (128, 32, True),
    ]
    assert len(calls) == 4 * len(rows)  # per row: forward and backward of each
    first = rows[0]  # timed 1, 2 (triton fwd, bwd) then 3, 4 (SDPA fwd, bwd) ms
    assert first["ratio"] == 3.0 and first["bwd_ratio"] == 2.0
    flops = 4 * 2 * 2 * 32 * 32 * 64  # B 2, H 2, L 32, D 64, full
    assert first["triton_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert first["triton_bwd_tflops"] == pytest.approx(2.5 * flops / 2e-3 / 1e12)
    assert rows[1]["sdpa_tflops"] == pytest.approx(flops / 2 / 7e-3 / 1e12)  # causal: half
    assert all(r["max_relative_error"] < 1e-2 for r in rows), rows
    assert set(gpu_check.TRITON_TARGETS) == {"forward", "backward"}
