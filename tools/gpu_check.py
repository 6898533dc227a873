"""Run the whole course on this machine and record what it measured: results/<device>.json.

    python tools/gpu_check.py            # or: make gpu-check
    python tools/gpu_check.py --quick    # the performance report at smoke-test sizes

On a CUDA machine it runs on the GPU; elsewhere it produces the CPU file. It executes every chapter
strictly (every cell, every assert, nothing written back), runs the performance report
(tools/bench_report.py) on the device, and, on a GPU, times the chapter-6 Triton kernel (forward)
and the chapter-7 kernels (backward) against torch's SDPA in float16 for L from 1k to 16k, with
the course's targets (TRITON_TARGETS: at least 0.8 of SDPA's throughput forward, 0.5 backward),
and the chapter-9 Triton kernel for a serving step (prompt chunks and decode steps over the paged
pool) against mha.paged_varlen_attention and one SDPA call per sequence. The JSON holds the
device, its compute capability, the versions of torch and triton, each chapter's pass/fail, wall
time and measured claims (value, bound and margin, from ``mha.claims``), every measured ratio of
the report, the kernels' timings and the Triton targets.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import sys
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypedDict

import nbformat
import torch
from execute_notebook import run as run_notebook
from fold_solutions import fold

import mha
from mha.device import capabilities

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
sys.path.insert(0, str(REPO / "tools"))

import bench_report  # noqa: E402 (tools/ is not a package)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class ChapterRun(TypedDict):
    """One chapter executed: passed, wall time, the error, and the claims ``mha.claims`` recorded
    (each a JSON object: ``name``, ``value``, ``above``, ``below``, ``margin``)."""

    passed: bool
    seconds: float
    error: str | None
    claims: list[dict[str, Any]]


def run_chapter(path: Path) -> ChapterRun:
    """Execute one chapter in a fresh kernel (tools/execute_notebook.py), every cell, stopping at
    the first error.

    Returns its pass/fail, wall time, error and the measured claims it made (``mha.claims``
    records each one, with its margin, in the file named by ``MHA_CLAIMS_FILE``).
    """
    nb = nbformat.read(path, as_version=4)
    fold(nb)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "claims.jsonl"
        # The kernel gets this process's environment (robustness.py sets thread counts in it).
        env = {**os.environ, "MHA_CLAIMS_FILE": str(record)}
        result = run_notebook(nb, cwd=path.parent, timeout=1200, env=env)
        lines = record.read_text(encoding="utf-8").splitlines() if record.exists() else []
    return {
        "passed": result.passed,
        "seconds": round(result.seconds, 1),
        "error": result.error[-2000:] if result.error else None,
        "claims": [json.loads(line) for line in lines],
    }


# The course's targets for the chapter-6/7 Triton kernels on a GPU, as fractions of torch SDPA's
# throughput in float16 (head dims 64 and 128): the forward pass, and the backward pass.
TRITON_TARGETS = {"forward": 0.8, "backward": 0.5}


def triton_throughput(
    quick: bool,
    device: str = "cuda",
    lengths: Sequence[int] | None = None,
    tokens: int = 16384,
    heads: int = 16,
) -> list[dict[str, object]]:
    """TFLOP/s of the chapter-6 forward kernel and the chapter-7 backward kernels against torch
    SDPA's, float16, for head dims 64 and 128, causal and not, ``tokens`` = B x L fixed.

    Each row records how far the kernel's output and gradients are from SDPA's
    (``max_relative_error``, which chapter 11 checks), so that a wrong kernel's speed is not read
    as a result; a large error does not stop the run, which writes its file at the end. FLOPs:
    4 B H L^2 D for a full forward (two matrix products), 2.5 times that for the backward (five),
    half of each with the causal mask. The backward is timed alone: ``autograd.grad`` over a graph
    built once and kept. ``ratio`` and ``bwd_ratio`` are the kernel's throughput over SDPA's.
    """
    from mha import triton_flash
    from mha.lab.timing import time_fn

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if lengths is None:
        lengths = [1024, 2048] if quick else [1024, 2048, 4096, 8192, 16384]
    rows: list[dict[str, object]] = []
    g = torch.Generator().manual_seed(0)
    for D in (64, 128):
        for L in lengths:
            for causal in (False, True):
                B = max(1, tokens // L)
                q, k, v, grad = (
                    torch.randn(B, heads, L, D, generator=g).to(device, torch.float16)
                    for _ in range(4)
                )
                flops = 4 * B * heads * L * L * D / (2 if causal else 1)
                t_fwd, t_bwd = {}, {}
                outs: dict[str, tuple[torch.Tensor, ...]] = {}
                for name, fn in (("triton", triton_flash.triton_attention), ("sdpa", sdpa)):
                    with torch.no_grad():
                        t_fwd[name] = time_fn(fn, q, k, v, is_causal=causal).median
                    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
                    out = fn(inputs[0], inputs[1], inputs[2], is_causal=causal)  # graph kept
                    backward = partial(torch.autograd.grad, out, inputs, grad, retain_graph=True)
                    outs[name] = (out.detach(), *backward())
                    t_bwd[name] = time_fn(backward).median
                # the largest difference from SDPA, over SDPA's largest magnitude, of the
                # output and the three gradients (float16 rounding alone gives ~1e-3)
                error = max(
                    (
                        (ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()
                    ).item()
                    for ours, theirs in zip(outs["triton"], outs["sdpa"], strict=True)
                )
                rows.append(
                    {
                        "D": D,
                        "L": L,
                        "causal": causal,
                        "triton_tflops": flops / t_fwd["triton"] / 1e12,
                        "sdpa_tflops": flops / t_fwd["sdpa"] / 1e12,
                        "ratio": t_fwd["sdpa"] / t_fwd["triton"],
                        "triton_bwd_tflops": 2.5 * flops / t_bwd["triton"] / 1e12,
                        "sdpa_bwd_tflops": 2.5 * flops / t_bwd["sdpa"] / 1e12,
                        "bwd_ratio": t_bwd["sdpa"] / t_bwd["triton"],
                        "max_relative_error": error,
                    }
                )
    return rows


def paged_varlen_timing(quick: bool, device: str = "cuda") -> list[dict[str, object]]:
    """One serving step as the bench's chunked-prefill check builds it (4 prompt chunks of 256
    and 28 decode steps over 2,048 cached positions, H 8, Hkv 2, blocks of 16, float16), for D 64
    and 128: the chapter-9 Triton kernel against ``mha.paged_varlen_attention`` (the same pool,
    one call) and against one SDPA call per sequence over its contiguous cache. The ratios are
    the others' time over the kernel's (> 1: the kernel is faster). The three agree first."""
    from mha import triton_paged
    from mha.lab.timing import time_fn

    chunk, decodes, cached = (32, 6, 128) if quick else (256, 28, 2048)
    g = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    rows: list[dict[str, object]] = []
    for D in (64, 128):
        batch = bench_report.mixed_batch(
            [chunk] * 4 + [1] * decodes, cached, 8, 2, D, 16, dev, g, torch.float16
        )
        with torch.no_grad():
            ours = triton_paged.triton_paged_varlen_attention(*batch.args)
            want = batch.packed(batch.per_sequence())  # (total_q, H, D)
            torch.testing.assert_close(ours, want, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(
                ours, mha.paged_varlen_attention(*batch.args), atol=2e-3, rtol=2e-3
            )
            t_ours = time_fn(triton_paged.triton_paged_varlen_attention, *batch.args).median
            t_mha = time_fn(mha.paged_varlen_attention, *batch.args).median
            t_sdpa = time_fn(batch.per_sequence).median
        rows.append(
            {
                "D": D,
                "chunks": f"4 x {chunk}",
                "decodes": decodes,
                "cached": cached,
                "triton_ms": t_ours * 1e3,
                "mha_ms": t_mha * 1e3,
                "sdpa_per_sequence_ms": t_sdpa * 1e3,
                "mha_over_triton": t_mha / t_ours,
                "sdpa_over_triton": t_sdpa / t_ours,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/gpu_check.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="performance report at smoke-test sizes"
    )
    parser.add_argument("--chapters", nargs="*", help="only these chapter files")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    caps = capabilities(dev)
    name = device_name()
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    result: dict[str, object] = {
        "device": name,
        "compute_capability": caps.compute_capability,
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton_version,
        "mha": mha.__version__,
        "python": platform.python_version(),
        "capabilities": {
            "bfloat16": caps.bfloat16,
            "tf32": caps.tf32,
            "sdpa_flash": caps.sdpa_flash,
        },
    }
    chapters = (
        [Path(p) for p in args.chapters]
        if args.chapters
        else sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
    )
    outcomes: dict[str, ChapterRun] = {}
    result["chapters"] = outcomes
    for path in chapters:
        print(f"{path.name} ...", end=" ", flush=True)
        outcome = run_chapter(path)
        outcomes[path.stem] = outcome
        print(
            ("passed" if outcome["passed"] else "FAILED") + f" in {outcome['seconds']} s",
            flush=True,
        )
    checks = bench_report.run_report(
        quick=args.quick, device=dev, log=lambda line: print(line, flush=True)
    )
    result["report"] = [
        {
            "name": c.name,
            "value": c.value,
            "target": c.target,
            "at_most": c.at_most,
            "passed": c.passed,
        }
        for c in checks
    ]
    result["triton_targets"] = TRITON_TARGETS
    result["triton_vs_sdpa_fp16"] = (
        # a T4 with Triton >= 3.3 cannot compile the kernels (caps.triton_note says why)
        triton_throughput(args.quick) if cuda and caps.triton_native else None
    )
    # chapter 9's kernel for a serving step: None without a GPU Triton compiles for
    result["triton_paged_varlen_fp16"] = (
        paged_varlen_timing(args.quick) if cuda and caps.triton_native else None
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{slug(name if cuda else 'cpu')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    failed = [c for c, o in outcomes.items() if not o["passed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
