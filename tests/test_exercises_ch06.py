"""The chapter 6 checkers accept correct answers and reject the typical wrong ones with the right hint.

The softmax-kernel checker launches Triton kernels; without a GPU they run in Triton's interpreter,
which must be switched on before the first ``import triton`` of the process (hence the
environment variable set at the top of this module, before anything imports Triton).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import mha.exercises
from mha.exercises import ExerciseError
from mha.exercises.ch06 import (
    check_backward_delta,
    check_kv_tile_range,
    check_softmax_kernel,
    check_tile_counts,
)


def cdiv(a, b):
    return -(-a // b)


def test_checkers_are_reexported():
    for name in (
        "check_tile_counts",
        "check_kv_tile_range",
        "check_softmax_kernel",
        "check_backward_delta",
    ):
        assert getattr(mha.exercises, name) is globals()[name]


# ---------------------------------------------------------------------------------------------
# check_tile_counts
# ---------------------------------------------------------------------------------------------


def count_work(B, H, L, S, block_m, block_n, is_causal):
    n_m = cdiv(L, block_m)
    steps = sum(cdiv(min(S, L, (i + 1) * block_m) if is_causal else S, block_n) for i in range(n_m))
    return n_m * B * H, steps * B * H


def test_tile_counts_accepts_the_kernel_arithmetic(capsys):
    check_tile_counts(count_work)
    assert "✅ check_tile_counts" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (
            lambda B, H, L, S, bm, bn, c: (cdiv(L, bm), count_work(B, H, L, S, bm, bn, c)[1]),
            "second axis",
        ),
        (
            lambda B, H, L, S, bm, bn, c: ((L // bm) * B * H, count_work(B, H, L, S, bm, bn, c)[1]),
            "round up",
        ),
        (
            lambda B, H, L, S, bm, bn, c: (cdiv(L, bm) * cdiv(S, bn) * B * H, 0),
            "key tiles are not programs",
        ),
        (
            lambda B, H, L, S, bm, bn, c: count_work(B, H, L, S, bm, bn, False),
            "stops at the diagonal",
        ),
        (
            # the causal bound without min(L, ...): the ragged last query tile loads too much
            lambda B, H, L, S, bm, bn, c: (
                cdiv(L, bm) * B * H,
                sum(cdiv(min(S, (i + 1) * bm) if c else S, bn) for i in range(cdiv(L, bm))) * B * H,
            ),
            "ragged",
        ),
        (lambda B, H, L, S, bm, bn, c: [1, 2], "should return a tuple"),
    ],
)
def test_tile_counts_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_tile_counts(wrong)


# ---------------------------------------------------------------------------------------------
# check_kv_tile_range
# ---------------------------------------------------------------------------------------------


def kv_tile_range(start_m, BLOCK_M, BLOCK_N, L, S, window):
    first_row = start_m * BLOCK_M
    last_row = min(L, (start_m + 1) * BLOCK_M) - 1
    lo = max(0, first_row - window + 1) // BLOCK_N * BLOCK_N
    return lo, min(S, last_row + 1)


def test_kv_tile_range_accepts_the_tight_range(capsys):
    check_kv_tile_range(kv_tile_range)
    assert "✅ check_kv_tile_range" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        # forgot to round lo down to a tile start
        (
            lambda sm, bm, bn, L, S, w: (
                max(0, sm * bm - w + 1),
                kv_tile_range(sm, bm, bn, L, S, w)[1],
            ),
            "Round down",
        ),
        # no clamp at 0
        (
            lambda sm, bm, bn, L, S, w: (
                (sm * bm - w + 1) // bn * bn,
                kv_tile_range(sm, bm, bn, L, S, w)[1],
            ),
            "Clamp",
        ),
        # only the causal skip: starts at 0
        (
            lambda sm, bm, bn, L, S, w: (0, kv_tile_range(sm, bm, bn, L, S, w)[1]),
            "lo can start higher",
        ),
        # no causal bound: runs to S
        (
            lambda sm, bm, bn, L, S, w: (kv_tile_range(sm, bm, bn, L, S, w)[0], S),
            "hi can stop lower",
        ),
        # causal bound without min(L, ...)
        (
            lambda sm, bm, bn, L, S, w: (
                kv_tile_range(sm, bm, bn, L, S, w)[0],
                min(S, (sm + 1) * bm),
            ),
            "ragged",
        ),
        # rounding lo up misses the first needed tile
        (
            lambda sm, bm, bn, L, S, w: (
                min(S, cdiv(max(0, sm * bm - w + 1), bn) * bn),
                kv_tile_range(sm, bm, bn, L, S, w)[1],
            ),
            "lo is too large",
        ),
        # stops before the diagonal tile
        (
            lambda sm, bm, bn, L, S, w: (kv_tile_range(sm, bm, bn, L, S, w)[0], sm * bm),
            "hi is too small",
        ),
    ],
)
def test_kv_tile_range_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_kv_tile_range(wrong)


# ---------------------------------------------------------------------------------------------
# check_softmax_kernel (runs Triton kernels: on the GPU, or in the interpreter)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    """Correct and wrong softmax kernels, decorated after TRITON_INTERPRET is settled."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def good(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def zero_padding(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=0.0)
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def no_max(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x)
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def ignores_stride(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * n_cols + cols, mask=cols < n_cols, other=float("-inf"))
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def first_row_only(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n_cols, other=float("-inf"))
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        tl.store(Y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def wrong_signature(X, Y, n_cols, BLOCK: tl.constexpr):
        pass

    return {
        "good": good,
        "zero_padding": zero_padding,
        "no_max": no_max,
        "ignores_stride": ignores_stride,
        "first_row_only": first_row_only,
        "wrong_signature": wrong_signature,
    }


@pytest.mark.triton
def test_softmax_kernel_accepts_a_stable_masked_kernel(kernels, capsys):
    check_softmax_kernel(kernels["good"])
    assert "✅ check_softmax_kernel" in capsys.readouterr().out


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy overflows in exp
@pytest.mark.parametrize(
    "name, hint",
    [
        ("zero_padding", r"other=-float\('inf'\)"),
        ("no_max", "subtract the row maximum"),
        ("ignores_stride", r"X \+ r \* stride_x"),
        ("first_row_only", "never written"),
        ("wrong_signature", "Keep the signature"),
    ],
)
def test_softmax_kernel_rejects_typical_mistakes(kernels, name, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_softmax_kernel(kernels[name])


@pytest.mark.triton
def test_softmax_kernel_rejects_a_plain_function():
    pytest.importorskip("triton")

    def softmax_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK):
        pass

    with pytest.raises(ExerciseError, match="decorated with @triton.jit"):
        check_softmax_kernel(softmax_kernel)


# ---------------------------------------------------------------------------------------------
# check_backward_delta
# ---------------------------------------------------------------------------------------------


def test_backward_delta_accepts_the_row_dot_product(capsys):
    check_backward_delta(lambda out, grad_out: (grad_out * out).sum(-1))
    check_backward_delta(
        lambda out, grad_out: (grad_out * out).sum(-1, keepdim=True)
    )  # (B, H, L, 1)
    assert capsys.readouterr().out.count("✅ check_backward_delta") == 2


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda out, grad_out: (grad_out * out).sum(-2), "summed over the rows"),
        (lambda out, grad_out: grad_out.sum(-1), "multiply grad_out by out"),
        (lambda out, grad_out: (grad_out * out).mean(-1), r"\(grad_out \* out\).sum\(-1\)"),
        (lambda out, grad_out: None, "should return a torch.Tensor"),
    ],
)
def test_backward_delta_rejects_typical_mistakes(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        check_backward_delta(wrong)
