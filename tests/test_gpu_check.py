"""tools/gpu_check.py writes a results file with every field the appendix and the issue name."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import gpu_check  # noqa: E402 (tools/ is not a package: it joins the path first)

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
def test_quick_run_on_one_chapter_writes_the_cpu_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    chapter = REPO / "chapters" / "01_queries_keys_values.ipynb"
    assert gpu_check.main(["--quick", "--chapters", str(chapter)]) == 0
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert set(result) >= FIELDS
    assert result["chapters"]["01_queries_keys_values"]["passed"] is True
    assert result["chapters"]["01_queries_keys_values"]["seconds"] > 0
    assert result["chapters"]["01_queries_keys_values"]["claims"] == []  # it measures nothing
    names = [c["name"] for c in result["report"]]
    assert len(names) == 20 and any("causal tile-skipping" in n for n in names)
    assert result["triton_vs_sdpa_fp16"] is None  # no GPU here
    assert "wrote" in capsys.readouterr().out


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
