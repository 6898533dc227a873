"""tools/bench_report.py: the report's structure and exit code (no test asserts a speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_report  # noqa: E402 (tools/ is not a package: it joins the path first)

NEEDLES = (
    "MultiHeadAttention(backend='sdpa') / nn.MultiheadAttention time, B=2 L=32",
    "MultiHeadAttention(backend='sdpa') / nn.MultiheadAttention time, B=2 L=64",
    "flash_attention / math attention peak memory",
    "flash_attention / math attention time",
    "flash_attention / torch SDPA time",
    "causal tile-skipping speed-up",
    "mha.scaled_dot_product_attention / inline",
    "scaled_dot_product_attention float16 error",
    "flash_attention bfloat16 error",
    "MultiHeadAttention(backend='flash') float16 error",
    "decode step q/k/v projection and head split / three nn.Linear time, B=1 L=1 E=1024",
    "decode step with GQA (H=8, Hkv=2) / without GQA time, cache 64, E=512",
    "decode attention, grouped / repeated key-value heads time, Hkv=2 cache 64 E=1024",
    "PagedKVCache update (and truncate) at 256 / at 16 cached tokens",
    "paged_varlen_attention (4 chunks of 32 + 6 decodes over 128 cached)",
    "paged_attention / SDPA over a contiguous cache time, B=2 H=8 Hkv=2 D=64 S=256",
    "prefill with / without prefix caching time, 9 requests on 3 system prompts (3 each)",
    "padded / packed (varlen) causal attention time, lengths 8..64 (8x spread)",
)
N_CHECKS = 25


def test_check_pass_fail_and_text():
    ok = bench_report.Check("a / b time", 0.9, 1.0, True, "a ~1 ms, b ~1.1 ms")
    bad = bench_report.Check("speed-up", 1.2, 1.6, False, "")
    assert ok.passed and not bad.passed
    assert str(ok) == "[PASS] a / b time: ~0.900 (target <= 1); a ~1 ms, b ~1.1 ms"
    assert str(bad).startswith("[FAIL] speed-up: ~1.200 (target >= 1.6)")


@pytest.mark.slow
@pytest.mark.serial  # it times every target (and asserts none of the times)
def test_command_line_quick_report():
    proc = subprocess.run(
        [sys.executable, "tools/bench_report.py", "--quick", "--strict"],
        capture_output=True,
        check=False,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("bench_report: torch ") and "quick sizes" in lines[0]
    checks = [line for line in lines if line.startswith(("[PASS]", "[FAIL]"))]
    assert len(checks) == N_CHECKS
    for needle in NEEDLES:
        assert sum(needle in line for line in checks) == 1, needle
    skipped = [line for line in lines if line.startswith("[SKIP]")]  # no Check: not counted
    assert len(skipped) == 1 and skipped[0].startswith("[SKIP] FlexAttention paged (compiled)")
    failed = sum(line.startswith("[FAIL]") for line in checks)
    assert lines[-1] == f"{N_CHECKS - failed}/{N_CHECKS} targets met"
    assert proc.returncode == (1 if failed else 0)  # --strict: 1 exactly when a target is missed


def test_command_line_rejects_unknown_device(capsys):
    with pytest.raises(SystemExit) as info:
        bench_report.main(["--device", "meta"])
    assert info.value.code == 2
    assert "--device must be cpu or cuda" in capsys.readouterr().err


def test_exit_code_is_0_on_a_miss_unless_strict(monkeypatch, capsys):
    missed = [bench_report.Check("x / y time", 2.0, 1.0, True, "x ~2 ms, y ~1 ms")]
    monkeypatch.setattr(bench_report, "run_report", lambda **kwargs: missed)
    assert bench_report.main([]) == 0
    assert bench_report.main(["--strict"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "0/1 targets met"


def test_command_line_rejects_bad_thread_count(capsys):
    with pytest.raises(SystemExit) as info:
        bench_report.main(["--threads", "0"])
    assert info.value.code == 2
    assert "--threads must be a positive int, got 0" in capsys.readouterr().err
