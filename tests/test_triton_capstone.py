"""Section 6.2's capstone: the Triton loop a learner writes, run by the skeleton kernel.

Its variants and mistakes are tried by the generated tests (test_exercises*.py, ``-k
check_attention_loop``); here what a declaration cannot say: the skeleton itself, answers of the
wrong kind, a loop that reaches the course's kernel from inside, and the GPU line on a CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mha.exercises
from mha.exercises import ExerciseError

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def capstone():
    pytest.importorskip("triton")
    from mha import triton_flash

    if not triton_flash.is_interpreted() and not torch.cuda.is_available():
        pytest.skip("Triton compiles for a GPU, and there is none")
    from mha.exercises import _triton_forward

    return _triton_forward


def test_the_skeleton_with_a_right_loop_is_attention(capstone):
    device = "cpu" if capstone.triton_flash.is_interpreted() else "cuda"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g).to(device) for n in (33, 50, 50))
    loop = capstone._loops()["by_exp2"]
    for causal in (False, True):
        out = capstone.skeleton_attention(loop, q, k, v, causal, block_m=16, block_n=32)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="power of two"):
        capstone.skeleton_attention(loop, q[..., :12], k[..., :12], v[..., :12])


def test_a_plain_python_function_is_not_a_triton_loop(capstone):
    def attention_loop(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BM, BN, D, IS_CAUSAL):
        return q, q

    with pytest.raises(ExerciseError, match=r"decorated with @triton.jit"):
        mha.exercises.check_attention_loop(attention_loop)


def test_a_loop_that_names_the_course_kernel_is_rejected(capstone):
    import triton
    import triton.language as tl

    from mha import triton_flash

    @triton.jit
    def attention_loop(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr):  # fmt: skip
        triton_flash._attn_fwd_kernel(q, k_ptrs, v_ptrs)
        return q, q

    with pytest.raises(ExerciseError, match="write the loop yourself") as err:
        mha.exercises.check_attention_loop(attention_loop)
    assert err.value.banned is triton_flash._attn_fwd_kernel


def test_a_triton_stub_is_not_attempted(capstone, capsys):
    import triton
    import triton.language as tl

    @triton.jit
    def attention_loop(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr): ...  # fmt: skip

    mha.exercises.check_attention_loop(attention_loop)
    assert "not attempted yet" in capsys.readouterr().out


def test_the_speed_line_says_it_needs_a_gpu_on_a_cpu(capstone, capsys):
    if torch.cuda.is_available() and not capstone.triton_flash.is_interpreted():
        pytest.skip("a GPU: the line is measured (make gpu-check)")
    mha.exercises.ch06.time_attention_loop(capstone._loops()["by_exp2"])
    assert "needs a GPU that Triton compiles for" in capsys.readouterr().out
