"""Tests for the lab's measuring instruments: memory (measured on known allocations), timing
(structure), bench (table and sweep) and fit.

No test asserts how fast anything is (the machine is shared and noisy); the report is run at its
smoke-test sizes and checked for structure and for consistency between its lines and exit code.
"""

from __future__ import annotations

import configparser
import itertools
import os
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

from mha.lab import bench, fit, memory, timing

# Every test here measures time or memory, or belongs with those that do: none runs beside
# another test (make test-unit runs them in a pytest without -n).
pytestmark = pytest.mark.serial

MiB = memory.MiB
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ peak_memory (CPU)


def test_single_allocation_is_its_size():
    n = MiB  # float32 elements: 4 MiB
    peak = memory.peak_memory(torch.empty, n)
    assert peak == torch.empty(n).nbytes == 4 * MiB


def test_chain_that_frees_intermediates_reports_less_than_their_sum():
    def chain():
        x = torch.ones(MiB)  # 4 MiB
        y = x * 2  # 8 MiB live
        del x
        z = y + 1  # 8 MiB live
        del y
        return z.exp()  # 8 MiB live at the peak, 4 MiB returned

    peak = memory.peak_memory(chain)
    # Four 4 MiB tensors were made, but never more than two at once (plus a few scalar bytes).
    assert 8 * MiB <= peak < 8 * MiB + 4096
    assert peak < 16 * MiB


def test_temporary_freed_inside_the_call_still_counts():
    def temporary():
        t = torch.ones(2 * MiB)  # 8 MiB, dropped before returning
        return float(t[0])

    assert 8 * MiB <= memory.peak_memory(temporary) < 8 * MiB + 4096


def test_memory_that_existed_before_is_not_counted():
    x = torch.randn(512, 512)
    assert memory.peak_memory(lambda: x.t()) == 0  # a view allocates nothing


def test_freeing_older_tensors_does_not_make_room():
    for _ in range(3):  # the profiler knows the sizes of some older blocks and not of others
        old = [torch.ones(MiB)]

        def drop_and_allocate(old=old):
            old.clear()  # frees 4 MiB that existed before the call
            return torch.ones(MiB // 4)  # 1 MiB

        assert memory.peak_memory(drop_and_allocate, warmup=False) == MiB


def test_matches_torch_for_an_attention_score_matrix():
    q, k = torch.randn(2, 4, 128, 32), torch.randn(2, 4, 256, 32)
    scores = q @ k.transpose(-2, -1)  # (2, 4, 128, 256)
    peak = memory.peak_memory(lambda: q @ k.transpose(-2, -1))
    assert peak >= scores.nbytes
    assert peak < 2 * scores.nbytes  # the result dominates; no second copy of it


def test_profiler_lines_do_not_reach_stderr_but_the_calls_own_output_does(capfd):
    old = [torch.ones(1000)]

    def noisy():
        old.clear()  # makes the CPU allocator write its "allocated before profiling" notice
        os.write(2, b"written by the measured call\n")
        return torch.ones(10)

    memory.peak_memory(noisy, warmup=False)
    err = capfd.readouterr().err
    assert err == "written by the measured call\n"


def test_kineto_gpu_count_failure_on_a_machine_without_a_gpu_is_dropped(capfd):
    """A CUDA build of torch without a GPU (Colab's CPU runtime): Kineto writes that it could not
    count the GPUs when the profiler starts; that line is dropped, the call's own lines are not."""

    def reports():
        os.write(2, b"ERROR:2026-11-28 10:26:52 25102:25102 DeviceProperties.cpp:56] ")
        os.write(2, b"gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"gpuGetDeviceCount failed, said the measured call\n")
        return torch.ones(10)

    memory.peak_memory(reports, warmup=False)
    assert capfd.readouterr().err == "gpuGetDeviceCount failed, said the measured call\n"


def test_python_warnings_of_the_call_are_not_swallowed():
    def warns():
        warnings.warn("from the measured call", UserWarning, stacklevel=1)
        return torch.ones(1)

    with pytest.warns(UserWarning, match="from the measured call"):
        memory.peak_memory(warns, warmup=False)


def test_peak_memory_bad_input():
    with pytest.raises(TypeError, match="fn must be callable"):
        memory.peak_memory(42)
    with pytest.raises(ValueError, match="device must be a cpu or cuda device, got 'meta'"):
        memory.peak_memory(torch.ones, 3, device="meta")
    with pytest.raises(TypeError, match=r"warmup must be a bool, got int \(0\)"):
        memory.peak_memory(torch.ones, 3, warmup=0)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_peak_memory_cuda_unavailable():
    with pytest.raises(ValueError, match="CUDA is not available"):
        memory.peak_memory(torch.ones, 3, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_cuda_single_allocation():
    peak = memory.peak_memory(torch.empty, MiB, device="cuda")
    assert 4 * MiB <= peak < 5 * MiB


# ---------------------------------------------------------------------------------------- timing


def test_time_fn_structure_and_arguments():
    calls = []

    def fn(a, b, *, c):
        calls.append((a, b, c))

    t = timing.time_fn(fn, 1, 2, c=3, min_run_time=0.01, min_blocks=4)
    assert isinstance(t, timing.Timing)
    assert set(calls) == {(1, 2, 3)}
    assert len(t.times) >= 4
    assert t.runs % len(t.times) == 0 and t.runs >= len(t.times)
    assert len(calls) > t.runs  # warm-up calls come on top of the measured ones
    assert min(t.times) <= t.median <= max(t.times)
    assert t.iqr >= 0
    assert t.ms == pytest.approx(t.median * 1e3)


def test_time_fn_measures_at_least_the_sleep():
    t = timing.time_fn(time.sleep, 0.002, min_run_time=0.02)
    assert t.median >= 0.002  # sleep never returns early; no upper bound on a shared machine


def test_time_fn_uses_torchs_thread_count():
    seen = []
    timing.time_fn(lambda: seen.append(torch.get_num_threads()), min_run_time=0.01)
    assert set(seen) == {torch.get_num_threads()}  # Timer alone would switch to one thread


def test_timing_str_is_stable_after_sanitising():
    a = timing.Timing(0.001234, 0.0001, 40, (0.001, 0.0012))
    b = timing.Timing(0.2, 0.01, 3, (0.2,))
    assert _sanitise(str(a)) == _sanitise(str(b)) == "~N ms (IQR ~N ms, ~N runs)"


def test_time_fn_bad_input():
    with pytest.raises(ValueError, match="min_run_time must be a positive finite number, got 0"):
        timing.time_fn(print, min_run_time=0)
    with pytest.raises(ValueError, match="min_blocks must be positive, got 0"):
        timing.time_fn(print, min_blocks=0)
    with pytest.raises(TypeError, match="fn must be callable"):
        timing.time_fn("not a function")


def test_compare_times_interleaves_rounds():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    t = timing.compare_times(fns, rounds=3, min_run_time=0.005)
    assert list(t) == ["a", "b"]
    assert all(len(t[name].times) >= 3 for name in fns)  # at least one block per round
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert switches >= 5  # a, b, a, b, a, b: measured in turns, not one after the other
    with pytest.raises(ValueError, match="fns must be a non-empty mapping"):
        timing.compare_times({})
    with pytest.raises(TypeError, match=r"fns\['a'\] must be callable, got int"):
        timing.compare_times({"a": 1})


# ----------------------------------------------------------------------------------------- table


def _sanitise(text: str) -> str:
    """Apply the notebooks' nbval sanitize rules (tests/sanitize.cfg)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "tests" / "sanitize.cfg")
    for section in cfg.sections():
        text = re.sub(cfg[section]["regex"], cfg[section]["replace"], text)
    return text


def _rows(time_s, peak):
    return [
        {
            "impl": "naive",
            "L": 256,
            "time_s": time_s,
            "iqr_s": time_s / 10,
            "runs": 7,
            "peak_bytes": peak,
        },
        {
            "impl": "flash",
            "L": 256,
            "time_s": time_s * 3,
            "iqr_s": 0.0,
            "runs": 123,
            "peak_bytes": peak // 8,
        },
        {
            "impl": "naive",
            "L": 1024,
            "time_s": time_s * 16,
            "iqr_s": 0.0,
            "runs": 1,
            "peak_bytes": peak * 16,
        },
    ]


def test_table_text_is_stable_after_sanitising_and_readable():
    t1, t2 = bench.Table(_rows(0.00123, 4 * MiB)), bench.Table(_rows(1.5, 123456789))
    assert str(t1) != str(t2)
    assert _sanitise(str(t1)) == _sanitise(str(t2))
    first = str(t1).splitlines()[0]
    assert first == "impl=naive  L=256   time ~1.230 ms  iqr ~0.123 ms  runs ~7  peak ~4.00 MiB"
    assert len(str(t1).splitlines()) == 3


def test_table_markdown_and_selection():
    t = bench.Table(_rows(0.002, 2 * MiB))
    md = t.to_markdown().splitlines()
    assert md[0] == "| impl | L | time | iqr | runs | peak |"
    assert md[1] == "|---|---|---|---|---|---|"
    assert md[2] == "| naive | 256 | ~2.000 ms | ~0.200 ms | ~7 | ~2.00 MiB |"
    assert len(md) == 2 + len(t)
    assert t.column("L", impl="naive") == [256, 1024]
    assert len(t.where(impl="flash")) == 1
    assert len(t.where(impl="nothing")) == 0 and t.where(impl="nothing").columns == t.columns
    assert [r["impl"] for r in t] == ["naive", "flash", "naive"]


def test_table_custom_measured_columns():
    t = bench.Table([{"case": "a", "ratio": 1.23456}], measured=["ratio"])
    assert str(t) == "case=a  ratio ~1.235"


def test_table_bad_input():
    with pytest.raises(ValueError, match="rows must all have the columns"):
        bench.Table([{"a": 1}, {"b": 2}])
    with pytest.raises(ValueError, match="unknown column 'x'"):
        bench.Table(_rows(1.0, 1)).column("x")


# ----------------------------------------------------------------------------------------- sweep


def test_sweep_memory_slopes_quadratic_and_linear():
    sizes = [128, 256, 512, 1024]
    table = bench.sweep(
        {"square": lambda n: torch.ones(n, n), "line": lambda n: torch.ones(n, 64)},
        sizes,
        lambda n: (n,),
        size_name="n",
        time=False,
    )
    assert table.columns == ["impl", "n", "peak_bytes"]
    assert table.column("peak_bytes", impl="square") == [n * n * 4 for n in sizes]
    assert table.column("peak_bytes", impl="line") == [n * 64 * 4 for n in sizes]
    assert fit.loglog_fit(sizes, table.column("peak_bytes", impl="square")).slope == pytest.approx(
        2.0
    )
    assert fit.loglog_fit(sizes, table.column("peak_bytes", impl="line")).slope == pytest.approx(
        1.0
    )


def test_sweep_structure_order_limits_and_progress(capsys):
    made = []

    def make_inputs(n):
        made.append(n)
        return {"n": n}

    table = bench.sweep(
        {"a": lambda n: torch.ones(n), "b": lambda n: torch.ones(2 * n)},
        [8, 16, 32],
        make_inputs,
        min_run_time=0.005,
        max_size={"b": 16},
        progress=True,
    )
    assert made == [8, 16, 32]  # inputs built once per size, shared by the implementations
    assert [(r["impl"], r["L"]) for r in table] == [
        ("a", 8),
        ("b", 8),
        ("a", 16),
        ("b", 16),
        ("a", 32),
    ]
    assert table.columns == ["impl", "L", "time_s", "iqr_s", "runs", "peak_bytes"]
    assert all(r["time_s"] > 0 and r["runs"] >= 1 for r in table)
    out = capsys.readouterr().out
    assert "sweep 5/5: a L=32" in out and "sweep done: 5 measurements" in out


def test_sweep_bad_input():
    fns = {"a": lambda n: n}
    with pytest.raises(ValueError, match="fns must be a non-empty mapping"):
        bench.sweep({}, [1], lambda n: (n,))
    with pytest.raises(TypeError, match=r"fns\['b'\] must be callable"):
        bench.sweep({"b": 3}, [1], lambda n: (n,))
    with pytest.raises(ValueError, match="sizes must not be empty"):
        bench.sweep(fns, [], lambda n: (n,))
    with pytest.raises(ValueError, match="each of sizes must be positive, got 0"):
        bench.sweep(fns, [0], lambda n: (n,))
    with pytest.raises(ValueError, match="max_size names 'c'"):
        bench.sweep(fns, [1], lambda n: (n,), max_size={"c": 1})
    with pytest.raises(TypeError, match="make_inputs must return a tuple"):
        bench.sweep(fns, [1], lambda n: [n], time=False)
    with pytest.raises(ValueError, match="at least one of time and memory"):
        bench.sweep(fns, [1], lambda n: (n,), time=False, memory=False)
    with pytest.raises(TypeError, match=r"memory must be a bool, got str \('no'\)"):
        bench.sweep(fns, [1], lambda n: (n,), memory="no")
    with pytest.raises(TypeError, match="make_inputs must be callable, got tuple"):
        bench.sweep(fns, [1], (1,))
    with pytest.raises(TypeError, match="each of sizes must be an int, got float"):
        bench.sweep(fns, [1.5], lambda n: (n,))
    with pytest.raises(TypeError, match=r"size_name must be a str, got int \(3\)"):
        bench.sweep(fns, [1], lambda n: (n,), size_name=3)
    with pytest.raises(ValueError, match="size_name must be a str other than the table's own"):
        bench.sweep(fns, [1], lambda n: (n,), size_name="impl")
    with pytest.raises(ValueError, match="min_run_time must be a positive finite number, got 0"):
        bench.sweep(fns, [1], lambda n: (n,), min_run_time=0)
    with pytest.raises(ValueError, match=r"max_size\['a'\] must be positive, got 0"):
        bench.sweep(fns, [1], lambda n: (n,), max_size={"a": 0})


# ------------------------------------------------------------------------------------------- fit


def test_loglog_fit_recovers_a_power_law():
    x = [64, 128, 256, 512]
    f = fit.loglog_fit(x, [3.0 * v**2 for v in x])
    assert f.slope == pytest.approx(2.0)
    assert f.coefficient == pytest.approx(3.0)
    assert f(1000) == pytest.approx(3e6)
    assert f([1, 2]) == pytest.approx([3.0, 12.0])


def test_loglog_fit_is_least_squares():
    x, y = [1.0, 2.0, 4.0], [1.0, 2.5, 3.9]
    import numpy as np

    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    f = fit.loglog_fit(torch.tensor(x), torch.tensor(y))
    assert f.slope == pytest.approx(slope)
    assert f.coefficient == pytest.approx(np.exp(intercept))


def test_loglog_fit_has_one_home():
    # Chapters and mha.lab.charts both import it from mha.lab.fit; bench does not re-export it.
    assert not hasattr(bench, "loglog_fit") and not hasattr(bench, "LogLogFit")


def test_loglog_fit_bad_input():
    with pytest.raises(ValueError, match="y must hold positive finite numbers"):
        fit.loglog_fit([1, 2], [1, 0])
    with pytest.raises(ValueError, match="x and y must have the same length, got 3 and 2"):
        fit.loglog_fit([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least two distinct values"):
        fit.loglog_fit([2, 2], [1, 3])
    with pytest.raises(TypeError, match="x must be a sequence of numbers"):
        fit.loglog_fit(5, [1])


def test_paired_ratio_is_the_median_of_pairs_and_sees_a_real_difference():
    ratio, slow, fast = timing.paired_ratio(
        lambda: time.sleep(0.004), lambda: time.sleep(0.001), pairs=3, min_run_time=0.01
    )
    assert ratio > 1.5  # 4 ms against 1 ms, whatever else the machine does
    assert slow.median > fast.median
    with pytest.raises(ValueError, match="pairs must be positive, got 0"):
        timing.paired_ratio(time.time, time.time, pairs=0)
