"""Every Triton kernel the course ships or teaches compiles for NVIDIA GPUs (issue 37).

Without a GPU the tests run the kernels in Triton's interpreter, which never meets the GPU
compiler; here each kernel is compiled by it, for compute capabilities 8.0 and 9.0, as the course
launches it (see tests/triton_aot.py). The launch functions below call the course's launchers
(or, for the kernels a chapter defines in a cell, the chapter's own source and launch) on CPU
tensors of the dtypes, head dims and sizes the course uses:

* mha.triton_flash: the forward kernel and the three backward kernels, through
  ``triton_attention`` and its backward: float16 and bfloat16, D = 64 and 128, causal and not,
  with the tiles ``default_blocks`` chooses; float32 with the tiles chapters 6.2 and 7.3 pass
  (float32 with the default tiles takes the compiler over a minute, and is left out);
* mha.triton_paged: the decode kernel (float16, float32) and the mixed-batch kernel (bfloat16
  decode steps with a window, a float16 prompt chunk with sinks);
* chapter 6.1's ``copy_tiles`` and the softmax kernel (the chapter's solution and the
  checker's declared correct variants), launched as the chapter and the checker launch them;
* chapter 6.2's capstone: the skeleton kernel with the chapter's ``attention_loop`` solution
  and the checker's declared correct variants, at the checker's cases and at the timing's size.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from triton_aot import (
    REPO,
    TARGETS,
    allow_cpu_tensors,
    assert_compiled,
    compile_launches,
    label,
)

# --- the kernels a chapter defines in a cell: its own source, as a module ---------------------


def notebook_kernels(stem: str, cell_id: str) -> ModuleType:
    """The ``@triton.jit`` functions of one code cell of chapters/<stem>.ipynb, as a module (Triton
    reads a kernel's source from its file)."""
    cells = json.loads((REPO / "chapters" / f"{stem}.ipynb").read_text(encoding="utf-8"))["cells"]
    source = "".join(next(c for c in cells if c["id"] == cell_id)["source"])
    tree = ast.parse(source)
    defs = [
        ast.get_source_segment(source, node, padded=False)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and [ast.unparse(d) for d in node.decorator_list] == ["triton.jit"]
    ]
    assert defs, f"{stem} cell {cell_id} defines no @triton.jit function"
    # get_source_segment leaves the decorator out: put it back
    return source_module(f"nb_{stem}_{cell_id}", "\n\n\n".join(f"@triton.jit\n{d}" for d in defs))


def source_module(name: str, source: str) -> ModuleType:
    """``source`` (after ``import triton`` and ``triton.language as tl``) as module ``name``,
    written next to the compile's Triton cache."""
    folder = Path(os.environ["TRITON_CACHE_DIR"]).parent / "kernel_sources"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the launch functions (run in the compiling process, see triton_aot.compile_launches) -------


# A kernel the interpreter runs (BLOCK is a Python int there) but the GPU compiler refuses:
# without tl.constexpr, BLOCK is a runtime integer, and tl.arange needs a constant.
NOT_CONSTEXPR = """@triton.jit
def copy_block(X, BLOCK):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs) + 1.0)
"""


def launch_not_constexpr() -> None:
    """The kernel above, which must fail: the check sees what the interpreter does not."""
    with label("a BLOCK without tl.constexpr"):
        source_module("not_constexpr", NOT_CONSTEXPR).copy_block[(1,)](torch.empty(16), BLOCK=16)


def launch_flash() -> None:
    """triton_attention forward and backward with its default tiles; the tiles and sizes chapters
    6.2 and 7.3 pass."""
    from mha import triton_flash as tf

    allow_cpu_tensors(tf)
    # float16 and bfloat16, D = 64 and 128, causal and not: default tiles 64 x 64 and 64 x 32
    for dtype, D, causal in [(torch.float16, 64, True), (torch.bfloat16, 128, False)]:
        with label(f"triton_attention and its backward, {dtype}, D={D}, is_causal={causal}"):
            # chapter 6.2's benchmark size: the integers specialise as they do there
            q, k, v = (torch.empty(2, 16, 4096, D, dtype=dtype, requires_grad=True) for _ in "qkv")
            out = tf.triton_attention(q, k, v, is_causal=causal)
            out.backward(torch.empty_like(out))  # a contiguous gradient, as training gives
    # two of chapter 6.2's comparisons with SDPA, 32 x 16 tiles (float32 D=128: the most shared
    # memory of them)
    for dtype, L, S, D, causal in [(torch.float32, 29, 41, 128, True),
                                   (torch.float16, 37, 45, 32, True)]:  # fmt: skip
        with label(f"chapter 6.2's comparison, {dtype}, D={D}, is_causal={causal}"):
            q, k, v = (torch.empty(1, 2, n, D, dtype=dtype) for n in (L, S, S))
            tf.triton_attention(q, k, v, is_causal=causal, block_m=32, block_n=16)
    with label("chapter 7.3's backward, float32, D=24, causal, 16 x 16 tiles"):
        q, k, v = (torch.empty(1, 2, n, 24, requires_grad=True) for n in (37, 53, 53))
        out = tf.triton_attention(q, k, v, is_causal=True, block_m=16, block_n=16)
        out.backward(torch.empty_like(out))


def launch_paged() -> None:
    """The decode kernel; the mixed-batch kernel on decode steps and on a long prompt chunk."""
    from test_triton_paged import on_device, paged_case, varlen_case

    from mha import triton_paged as tp

    allow_cpu_tensors(tp)
    # the decode kernel (no tl.dot, float32 arithmetic for every dtype): D = 128 and 64, G = 4, 8
    for dtype, H, Hkv, D in [(torch.float16, 32, 8, 128), (torch.float32, 8, 1, 64)]:
        with label(f"triton_paged_attention, {dtype}, D={D}, H={H}, Hkv={Hkv}, blocks of 16"):
            args, _, _ = paged_case([40, 17, 1], H, Hkv, D, D, 16, dtype=dtype)
            tp.triton_paged_attention(*args)
    # decode steps only, with a window (16-row tiles); a 256-query prompt chunk and a decode step
    # with sinks (64-row tiles, 32-key tiles for D = 128)
    for dtype, D, seqs, window, sinks in [
        (torch.bfloat16, 64, [(40, 1), (7, 1), (0, 1)], 16, False),
        (torch.float16, 128, [(30, 256), (50, 1)], None, True),
    ]:
        with label(f"triton_paged_varlen_attention, {dtype}, D={D}, (cached, new) {seqs}"):
            args, _ = varlen_case(seqs, 8, 2, D, D, 16)
            s = torch.zeros(8) if sinks else None
            tp.triton_paged_varlen_attention(*on_device(args, dtype), sinks=s, window=window)


def launch_chapter_6_1() -> None:
    """copy_tiles as the chapter launches it; softmax kernels as check_softmax_kernel does."""
    import triton

    from mha.exercises import ch06

    with label("chapter 6.1's copy_tiles"):
        copy_tiles = notebook_kernels("06_1_triton_model", "f0e0c59c").copy_tiles
        x = torch.arange(200.0).view(20, 10).T  # (10, 20), transposed
        y, owner = torch.empty(10, 20), torch.full((10, 20), -1, dtype=torch.int32)
        copy_tiles[(3, 3)](x, y, owner, 10, 20, x.stride(0), x.stride(1), BLOCK_L=4, BLOCK_D=8)
    kernels = {
        "chapter 6.1's solution": notebook_kernels("06_1_triton_model", "c7a8ff64").softmax_kernel,
        **{f"declared variant {k}": ch06._kernels()[k] for k in ("stable", "by_where")},
    }
    for name, kernel in kernels.items():
        with label(f"softmax_kernel: {name}"):
            for _, rows, n_cols, stride_y in ch06._softmax_inputs():  # as the checker launches
                x = rows[:, :n_cols]
                y = torch.empty(x.shape[0] * stride_y).as_strided(x.shape, (stride_y, 1))
                block = triton.next_power_of_2(n_cols)
                kernel[(x.shape[0],)](x, y, x.stride(0), stride_y, n_cols, BLOCK=block)


def launch_capstone() -> None:
    """The skeleton kernel with each known-correct attention_loop at time_attention_loop's size and
    tiles, and the chapter's solution at the checker's cases too (float16, as on a GPU)."""
    from mha import triton_flash as tf
    from mha.exercises import _triton_forward as fwd

    loops = {
        "chapter 6.2's solution": notebook_kernels("06_2_flash_kernel", "e53e2f28").attention_loop,
        **{f"declared variant {k}": fwd._loops()[k] for k in ("by_exp2", "two_loops")},
    }
    block_m, block_n = tf.default_blocks(64, torch.float16)
    for name, loop in loops.items():
        # the chapter's solution at two of the checker's cases: not causal, and causal, D = 64
        cases = [fwd._CASES[0], fwd._CASES[3]] if name.startswith("chapter") else []
        for c in cases:
            with label(f"skeleton + {name}, checker case {tuple(c)}"):
                q, k, v = (torch.empty(c.B, c.H, n, c.D, dtype=torch.float16)
                           for n in (c.L, c.S, c.S))  # fmt: skip
                fwd.skeleton_attention(loop, q, k, v, c.causal, block_m=c.block_m,
                                       block_n=c.block_n)  # fmt: skip
        with label(f"skeleton + {name}, time_attention_loop's launch"):
            q, k, v = (torch.empty(4, 16, 4096, 64, dtype=torch.float16) for _ in "qkv")
            fwd.skeleton_attention(loop, q, k, v, True, block_m=block_m, block_n=block_n)


# --- the tests -----------------------------------------------------------------------------

#: How many of the launch functions' labels (distinct launches) compile each kernel, per target.
EXPECTED = {
    "_attn_fwd_kernel": 5,
    "_attn_bwd_preprocess_kernel": 3,
    "_attn_bwd_dkdv_kernel": 3,
    "_attn_bwd_dq_kernel": 3,
    "_paged_decode_kernel": 2,
    "_paged_varlen_kernel": 2,
    "copy_tiles": 1,
    "softmax_kernel": 1,  # chapter 6.1's solution
    "stable": 1,  # check_softmax_kernel's declared variants
    "by_where": 1,
    "flash_forward_skeleton": 5,  # the solution at 3 launches, each variant at 1
}


@pytest.mark.triton
@pytest.mark.slow
def test_triton_kernels_compile_for_nvidia_gpus(tmp_path):
    """The interpreter runs a kernel's source, not the GPU's compiler: compile every kernel of the
    course, as the course launches it, for compute capabilities 8.0 and 9.0."""
    results = compile_launches(
        tmp_path,
        "test_triton_compile:launch_flash",
        "test_triton_compile:launch_paged",
        "test_triton_compile:launch_chapter_6_1",
        "test_triton_compile:launch_capstone",
        "test_triton_compile:launch_not_constexpr",
    )
    refused = [r for r in results if r["kernel"] == "copy_block"]
    assert len(refused) == len(TARGETS), refused
    assert all("must be of type tl.constexpr" in r.get("error", "") for r in refused), refused
    assert_compiled([r for r in results if r["kernel"] != "copy_block"], EXPECTED)
