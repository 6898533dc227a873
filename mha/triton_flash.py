"""FlashAttention as Triton kernels: the forward pass (chapter 6) and the backward (chapter 7).

:func:`triton_attention` computes the same thing as :func:`mha.flash_attention` (chapter 5), but as
one GPU kernel written in Triton: each *program* (a thread block) owns one tile of ``BLOCK_M``
query rows of one (batch, head) pair, keeps its running softmax state ``m, l, acc`` in registers,
and streams the keys and values past it ``BLOCK_N`` columns at a time. The ``(L, S)`` score
matrix never exists in memory, and with ``is_causal`` the loop stops at the diagonal, so the
tiles above it are never even loaded.

:func:`triton_attention` is differentiable. The forward kernel also saves each row's logsumexp
(natural-log units, float32, as :func:`mha.flash_attention` with ``return_lse=True``), and the
backward pass runs three kernels that rebuild the weights tile by tile, ``P = exp(S - lse)``:
``δ = rowsum(dO ∘ O)`` per row; dK and dV with one program per key tile looping over the query
tiles; dQ with one program per query tile looping over the key tiles ("two passes": every
accumulator has one owner, so no atomic adds and the same result on every run). With
``is_causal`` both loops skip the tiles that lie wholly above the diagonal.

Triton is optional (``pip install "mha[triton]"``): ``import mha`` works without it, and
:func:`triton_attention` then raises an ``ImportError`` that says what to install.

Where the kernel runs is decided when this module is imported, because ``@triton.jit`` reads
the environment variable ``TRITON_INTERPRET`` at the moment it decorates a function (and Triton
decorates its own ``triton.language`` helpers when ``triton`` is first imported, so the variable
must be set before the first ``import triton`` of the process):

* unset: the kernel is compiled for the GPU (CUDA or ROCm) and needs GPU tensors. The GPU must
  be one the installed Triton compiles ``tl.dot`` for (``capabilities(device).triton_native``):
  compute capability 8.0 or newer, or a T4 (7.5) with Triton 3.2 or older, since Triton 3.3
  dropped Turing's tensor-core ``tl.dot``; on any other GPU :func:`triton_attention` says so;
* ``TRITON_INTERPRET=1``: the kernel runs in Triton's interpreter, which executes it program by
  program with NumPy on the CPU. It is slow, but it runs the very same kernel source, which is how
  the course tests it on machines without a GPU.

The interpreter stores bfloat16 as raw 16-bit patterns and does not compute with them (Triton's
debugging guide says to cast bfloat16 to float32 first). Under the interpreter the kernel therefore
up-casts bfloat16 tiles to float32 right after loading them; compiled for a GPU it multiplies them
in bfloat16 on the tensor cores. The backward kernels do the same.
"""

# No `from __future__ import annotations` here: the kernel's `tl.constexpr` annotations are read
# by Triton as objects, the way its documentation writes them.
import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import validation as validate
from .device import capabilities

try:
    import triton
    import triton.language as tl
except ImportError:  # mha works without Triton; triton_attention() says what to install

    class _NoTriton:
        """Stands in for ``triton`` and ``triton.language`` so this module imports without them.

        ``jit`` leaves the kernels as plain Python functions; they are never launched, because
        :func:`triton_attention` raises first.
        """

        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()
    HAS_TRITON = False
else:
    HAS_TRITON = True

LOG2E = math.log2(math.e)  # exp(x) == exp2(x * LOG2E); exp2 is the cheaper instruction
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


# The kernel's layout groups related arguments and terms; the formatter leaves it alone.
# fmt: off
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out,  # pointers to the first element of each (B, H, L|S, D) tensor
    Lse,  # (B, H, L) float32, contiguous: each row's logsumexp, for the backward pass
    stride_qb, stride_qh, stride_ql, stride_qd,  # strides in elements, any layout
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_ol, stride_od,
    H, L, S,  # heads, query length, key length
    qk_scale,  # scale * log2(e): scores come out in base-2 units, ready for exp2
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two >= 16, as tl.arange and tl.dot need
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key/value rows per loop step
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,  # compute on float32 copies of the tiles (bfloat16, interpreter)
):
    # step 1 - program ids
    start_m = tl.program_id(0)  # which tile of BLOCK_M query rows
    off_bh = tl.program_id(1)  # which (batch, head) pair, flattened to b * H + h
    off_b = off_bh // H
    off_h = off_bh % H
    # end of step 1

    # step 2 - load the query tile
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) the query rows of this tile
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions inside one key tile
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,) head-dim lanes; those past D are padding
    q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
              + offs_m[:, None] * stride_ql + offs_d[None, :] * stride_qd)  # (BLOCK_M, BLOCK_D)
    q_mask = (offs_m[:, None] < L) & (offs_d[None, :] < HEAD_DIM)  # rows past L, lanes past D
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D), zeros where masked
    if UPCAST:
        q = q.to(tl.float32)
    # K is read as K^T, (BLOCK_D, BLOCK_N), so that q @ k^T is a plain tl.dot.
    k_ptrs = (K + off_b * stride_kb + off_h * stride_kh
              + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd)  # (BLOCK_D, BLOCK_N)
    v_ptrs = (V + off_b * stride_vb + off_h * stride_vh
              + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd)  # (BLOCK_N, BLOCK_D)
    # end of step 2

    # step 3 - the running state
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (base-2 units)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running denominator, relative to m
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running numerator, relative to m
    # end of step 3

    # step 4 - the causal loop bound
    if IS_CAUSAL:
        # Row i sees keys 0..i, so no row of this tile sees a key past its last real row: the
        # key tiles from there on are skipped, not loaded and masked.
        hi = tl.minimum(S, tl.minimum(L, (start_m + 1) * BLOCK_M))
    else:
        hi = S
    # end of step 4

    for start_n in range(0, hi, BLOCK_N):
        # step 5 - one tile of scores
        offs_s = start_n + offs_n  # (BLOCK_N,) the key positions of this tile
        k_mask = (offs_s[None, :] < S) & (offs_d[:, None] < HEAD_DIM)  # (BLOCK_D, BLOCK_N)
        k = tl.load(k_ptrs + start_n * stride_ks, mask=k_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
        if UPCAST:
            k = k.to(tl.float32)
        # Padded head-dim lanes are 0 in q and k, so they add nothing to the dot product.
        # "ieee" keeps float32 inputs in full float32 (the default would be TF32 on tensor cores).
        scores = tl.dot(q, k, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N) float32
        keep = offs_s[None, :] < S  # (1, BLOCK_N) keys past S are padding of the last tile
        if IS_CAUSAL:
            keep = keep & (offs_s[None, :] <= offs_m[:, None])  # (BLOCK_M, BLOCK_N)
        scores = tl.where(keep, scores, float("-inf"))
        # end of step 5

        # step 6 - the online-softmax update
        m_new = tl.maximum(m, tl.max(scores, 1))  # (BLOCK_M,)
        # A row that has seen only hidden keys keeps m = -inf; shifting by 0 instead of -inf makes
        # its exponentials exactly 0 rather than exp2(-inf - (-inf)) = NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # (BLOCK_M,)
        p = tl.exp2(scores - shift[:, None])  # (BLOCK_M, BLOCK_N) unnormalised weights
        alpha = tl.exp2(m - shift)  # (BLOCK_M,) how much the old state shrinks
        l = alpha * l + tl.sum(p, 1)  # (BLOCK_M,)
        v_mask = (offs_s[:, None] < S) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs + start_n * stride_vs, mask=v_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        if UPCAST:
            v = v.to(tl.float32)
        # p is cast to the value dtype so that the second matmul runs on the tensor cores too.
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")  # (BLOCK_M, BLOCK_D) float32
        acc = acc * alpha[:, None] + pv
        m = m_new
        # end of step 6

    # step 7 - normalise and store
    l = tl.where(l == 0.0, 1.0, l)  # a row that saw no key at all (S == 0) returns zeros
    out = acc / l[:, None]  # (BLOCK_M, BLOCK_D)
    o_ptrs = (Out + off_b * stride_ob + off_h * stride_oh
              + offs_m[:, None] * stride_ol + offs_d[None, :] * stride_od)  # (BLOCK_M, BLOCK_D)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    # end of step 7

    # step 8 - save the row logsumexp for the backward pass (chapter 7), in natural-log units
    # as mha.flash_attention's: lse = (m + log2(l)) * ln(2). A row that saw no key: -inf.
    lse = (m + tl.log2(l)) * 0.6931471805599453  # (BLOCK_M,)
    tl.store(Lse + off_bh * L + offs_m, lse, mask=offs_m < L)
    # end of step 8


# The backward pass: three kernels (chapter 7). All rebuild the weights from the saved
# logsumexp, P = exp(S - lse), in base-2 units as the forward kernel computes them.
@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, dOut, Delta,  # (B, H, L, D) output and its gradient; (B, H, L) float32, contiguous
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_gb, stride_gh, stride_gl, stride_gd,  # strides of dOut
    H, L,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # delta = rowsum(dO * O): one number per query row, in float32
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask = (offs_m[:, None] < L) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_M, BLOCK_D)
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh
                + offs_m[:, None] * stride_ol + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(dOut + off_b * stride_gb + off_h * stride_gh
                 + offs_m[:, None] * stride_gl + offs_d[None, :] * stride_gd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(Delta + off_bh * L + offs_m, delta, mask=offs_m < L)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV,  # dK, dV: (B, H, S, D), contiguous
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gl, stride_gd,  # strides of dOut
    H, L, S,
    qk_scale,  # scale * log2(e), as in the forward kernel
    scale,  # the scale itself, for dK = dS^T Q * scale
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per loop step
    BLOCK_N: tl.constexpr,  # keys owned by this program
    IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per key tile of one (batch, head): it alone writes dK and dV of its keys, so
    # it can keep them in registers while every query tile streams past.
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) this program's keys
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows inside one query tile
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    kv_mask = (offs_n[:, None] < S) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_N, BLOCK_D)
    k_ptrs = (K + off_b * stride_kb + off_h * stride_kh
              + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd)  # (BLOCK_N, BLOCK_D)
    v_ptrs = (V + off_b * stride_vb + off_h * stride_vh
              + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd)  # (BLOCK_N, BLOCK_D)
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # loaded once, kept for the whole loop
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # Q is read as Q^T, (BLOCK_D, BLOCK_M): the scores come out transposed, one row per key.
    qT_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
               + offs_m[None, :] * stride_ql + offs_d[:, None] * stride_qd)  # (BLOCK_D, BLOCK_M)
    do_ptrs = (dOut + off_b * stride_gb + off_h * stride_gh
               + offs_m[:, None] * stride_gl + offs_d[None, :] * stride_gd)  # (BLOCK_M, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    if IS_CAUSAL:
        # Query i sees key j only if i >= j: rows before this tile's first key see none of it,
        # so the loop starts at the query tile that holds that row (the diagonal's tile).
        lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    for start_m in range(lo, L, BLOCK_M):
        rows = start_m + offs_m  # (BLOCK_M,) the query rows of this step
        q_mask = (rows[None, :] < L) & (offs_d[:, None] < HEAD_DIM)  # (BLOCK_D, BLOCK_M)
        qT = tl.load(qT_ptrs + start_m * stride_ql, mask=q_mask, other=0.0)  # (BLOCK_D, BLOCK_M)
        do_mask = (rows[:, None] < L) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_M, BLOCK_D)
        do = tl.load(do_ptrs + start_m * stride_gl, mask=do_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
        if UPCAST:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
        # Rebuild P^T from the logsumexp: exp(s - lse) = exp2(s * log2(e) - lse * log2(e)).
        lse = tl.load(Lse + off_bh * L + rows, mask=rows < L, other=0.0) * 1.4426950408889634
        delta = tl.load(Delta + off_bh * L + rows, mask=rows < L, other=0.0)  # (BLOCK_M,)
        sT = tl.dot(k, qT, input_precision="ieee") * qk_scale  # (BLOCK_N, BLOCK_M) base 2
        keep = (rows[None, :] < L) & (offs_n[:, None] < S)  # (BLOCK_N, BLOCK_M)
        if IS_CAUSAL:
            keep = keep & (rows[None, :] >= offs_n[:, None])
        pT = tl.exp2(tl.where(keep, sT, float("-inf")) - lse[None, :])  # (BLOCK_N, BLOCK_M)
        dv += tl.dot(pT.to(do.dtype), do, input_precision="ieee")  # P^T dO, (BLOCK_N, BLOCK_D)
        dpT = tl.dot(v, tl.trans(do), input_precision="ieee")  # (dO V^T)^T, (BLOCK_N, BLOCK_M)
        dsT = pT * (dpT - delta[None, :])  # (BLOCK_N, BLOCK_M) dS^T = P^T * (dP^T - delta)
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision="ieee")  # dS^T Q

    offs = off_bh * S * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # contiguous
    tl.store(dK + offs, (dk * scale).to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dV + offs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, dOut, Lse, Delta, dQ,  # dQ: (B, H, L, D), contiguous
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_gb, stride_gh, stride_gl, stride_gd,  # strides of dOut
    H, L, S,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    # The second pass: one program per query tile owns dQ of its rows and loops over the key
    # tiles, as the forward kernel does (and stops at the diagonal as it does).
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    q_mask = (offs_m[:, None] < L) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_M, BLOCK_D)
    q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
              + offs_m[:, None] * stride_ql + offs_d[None, :] * stride_qd)  # (BLOCK_M, BLOCK_D)
    do_ptrs = (dOut + off_b * stride_gb + off_h * stride_gh
               + offs_m[:, None] * stride_gl + offs_d[None, :] * stride_gd)  # (BLOCK_M, BLOCK_D)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    do = tl.load(do_ptrs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + off_bh * L + offs_m, mask=offs_m < L, other=0.0) * 1.4426950408889634
    delta = tl.load(Delta + off_bh * L + offs_m, mask=offs_m < L, other=0.0)  # (BLOCK_M,)
    kT_ptrs = (K + off_b * stride_kb + off_h * stride_kh
               + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd)  # (BLOCK_D, BLOCK_N)
    vT_ptrs = (V + off_b * stride_vb + off_h * stride_vh
               + offs_n[None, :] * stride_vs + offs_d[:, None] * stride_vd)  # (BLOCK_D, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if IS_CAUSAL:
        hi = tl.minimum(S, tl.minimum(L, (start_m + 1) * BLOCK_M))  # the forward kernel's bound
    else:
        hi = S
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) the keys of this step
        kv_mask = (cols[None, :] < S) & (offs_d[:, None] < HEAD_DIM)  # (BLOCK_D, BLOCK_N)
        kT = tl.load(kT_ptrs + start_n * stride_ks, mask=kv_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
        vT = tl.load(vT_ptrs + start_n * stride_vs, mask=kv_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
        if UPCAST:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        s = tl.dot(q, kT, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N) base 2
        keep = cols[None, :] < S  # (1, BLOCK_N)
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(tl.where(keep, s, float("-inf")) - lse[:, None])  # (BLOCK_M, BLOCK_N)
        dp = tl.dot(do, vT, input_precision="ieee")  # (BLOCK_M, BLOCK_N) dO V^T
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision="ieee")  # dS K

    offs = off_bh * L * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]  # contiguous
    tl.store(dQ + offs, (dq * scale).to(dQ.dtype.element_ty), mask=q_mask)
# fmt: on


def is_interpreted() -> bool:
    """Whether this module's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

    Decided when the module was imported; ``False`` if Triton is not installed.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_attn_fwd_kernel, InterpretedFunction)


def _check_mode(interpreted: bool) -> None:
    """Fail clearly if Triton itself and this module were imported under different settings.

    ``triton.language`` decorates its own helpers (``tl.zeros``, ...) with ``@triton.jit`` when
    ``triton`` is first imported. If ``TRITON_INTERPRET`` changed between that import and this
    module's, the kernel would call helpers built for the other mode and fail with an obscure error.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    helper = getattr(tl, "zeros", None)
    if not isinstance(helper, (InterpretedFunction, JITFunction)):
        return  # a Triton whose helpers are built differently: nothing to compare
    if isinstance(helper, InterpretedFunction) != interpreted:
        raise RuntimeError(
            "Triton was imported with a different TRITON_INTERPRET setting than mha.triton_flash. "
            "Set os.environ['TRITON_INTERPRET'] = '1' (CPU) or leave it unset (GPU) before the "
            "first `import triton` of the process, then restart Python."
        )


def _require_triton() -> None:
    if not HAS_TRITON:
        raise ImportError(
            "triton_attention needs Triton, which is not installed. Install it with "
            '`pip install triton` (or `pip install "mha[triton]"`); on Colab it comes with torch.'
        )


def default_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """The ``(BLOCK_M, BLOCK_N)`` tile sizes :func:`triton_attention` uses unless told otherwise.

    Two key/value tiles of ``BLOCK_N x D`` elements live in shared memory per pipeline stage, so
    wide heads and 4-byte float32 get narrower key tiles. They do not always fit: float32 with
    ``D = 128`` asks about 72 KiB forward and 105 KiB backward (compiled for sm80/sm90), more
    than a T4's 64 KiB or an L4's 99 KiB; there the launch fails for lack of shared memory and
    :func:`triton_attention` retries with halved tiles.
    """
    if dtype == torch.float32 or head_dim > 64:
        return 64, 32
    return 64, 64


def launch_grid(B: int, H: int, L: int, block_m: int) -> tuple[int, int]:
    """The launch grid of the kernel: one program per (query tile, batch·head) pair.

    Returns ``(cdiv(L, block_m), B * H)``: axis 0 is read by ``tl.program_id(0)`` (which query
    tile), axis 1 by ``tl.program_id(1)`` (which batch and head).
    """
    return (-(-L // block_m), B * H)


def causal_kv_end(start_m: int, block_m: int, L: int, S: int) -> int:
    """Python mirror of the kernel's causal loop bound: keys ``[0, end)`` are visited.

    The kernel visits the key tiles starting at ``0, BLOCK_N, 2·BLOCK_N, ...`` below this bound.
    """
    return min(S, L, (start_m + 1) * block_m)


def causal_q_start(start_n: int, block_n: int, block_m: int) -> int:
    """Python mirror of the dK/dV kernel's causal loop start: query rows ``[start, L)`` are visited.

    Key tile ``start_n`` holds keys ``start_n·BLOCK_N ...``; query ``i`` sees key ``j`` only if
    ``i >= j``, so the loop starts at the query tile that holds row ``start_n·BLOCK_N`` and visits
    the query tiles starting at ``start, start + BLOCK_M, ...`` below ``L``.
    """
    return start_n * block_n // block_m * block_m


def _check_block(name: str, value: int) -> int:
    validate.positive_int(name, value)
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs it), got {value}")
    return value


def _check_inputs(query: Tensor, key: Tensor, value: Tensor) -> None:
    """What the kernel needs beyond :func:`mha.validation.qkv`: 4-D, its dtypes, D = Dv <= 128."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        validate.tensor(name, t, ndim=4, layout="(B, H, L|S, D)")
        _check_dtype(name, t)
    # one dtype and device, equal head dims of query and key, equal (B, H) everywhere
    validate.qkv(query, key, value)
    if key.shape != value.shape:  # the kernel has one head dim for keys and values (Dv = D)
        raise ValueError(
            f"key and value must have the same shape (B, H, S, D), got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    _check_head_dim(query.shape[-1], f"query {tuple(query.shape)}")


def _check_dtype(name: str, t: Tensor) -> None:
    """One of the dtypes the kernel computes with (also what ``backend="triton"`` checks)."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16 or float32, got {t.dtype} (shape {tuple(t.shape)})"
        )


def _check_head_dim(D: int, where: str) -> None:
    """A head dim the kernel's tiles hold; ``where`` says where ``D`` comes from."""
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in [1, {MAX_HEAD_DIM}], got D={D} ({where})")


def _check_device(query: Tensor, interpreted: bool) -> None:
    """Fail with what to do when the tensors are where the compiled kernel cannot run."""
    if query.device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "query is on the CPU, but the Triton kernel was compiled for a GPU. Move the "
            "tensors to the GPU, or run the kernel in Triton's interpreter: set "
            "os.environ['TRITON_INTERPRET'] = '1' before the first `import triton` (importing "
            "mha.triton_flash imports triton), then restart Python."
        )
    if query.device.type != "cuda" or interpreted:
        return
    caps = capabilities(query.device)
    if not caps.triton_native:
        # A T4 with Triton >= 3.3 (no tensor-core tl.dot for Turing any more): say so, with
        # the ways out, rather than compile a kernel that Triton no longer supports there.
        raise RuntimeError(
            f"the Triton kernels cannot run natively on this GPU: {caps.triton_note} "
            f"(query {tuple(query.shape)}, {query.dtype})"
        )
    if query.dtype == torch.bfloat16 and not caps.triton_bfloat16:
        # Pre-Ampere NVIDIA GPUs have no bfloat16 tensor cores: say so here, with the fix,
        # rather than fail deep inside Triton's compiler.
        major, minor = torch.cuda.get_device_capability(query.device)
        raise TypeError(
            "bfloat16 needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere), this "
            f"one is {major}.{minor}; use float16 (query {tuple(query.shape)}, {query.dtype})"
        )


def triton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> Tensor:
    """Attention with the Triton FlashAttention kernels of this module, forward and backward.

    Same result as ``F.scaled_dot_product_attention(query, key, value, is_causal=is_causal,
    scale=scale)``, and differentiable: when an input requires grad, the forward kernel also saves
    the row logsumexp and the backward pass runs the three backward kernels (the same tiles).
    Masks other than the causal one are not supported; the softmax statistics, the output and the
    gradients accumulate in float32 for every input dtype.

    Args:
        query, key, value: float16, bfloat16 or float32 tensors on one device: a GPU, or the CPU
            when the kernel runs in Triton's interpreter (see :func:`is_interpreted`). Any strides.
        is_causal: query ``i`` sees keys ``0..i`` (top-left alignment, as in PyTorch); key tiles
            that lie wholly above the diagonal are skipped, forward and backward.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        block_m: query rows per program; ``block_n``: keys per loop step. Powers of two >= 16;
            the defaults come from :func:`default_blocks`.

    Shapes:
        query ``(B, H, L, D)``, key and value ``(B, H, S, D)`` with ``1 <= D <= 128``;
        returns ``(B, H, L, D)`` in the input dtype; the gradients have the inputs' shapes and
        dtype.

    Raises:
        ImportError: Triton is not installed.
        RuntimeError: CPU tensors while the kernel is compiled for a GPU (set
            ``TRITON_INTERPRET=1`` before importing this module to use the interpreter); or
            a GPU the installed Triton cannot compile the kernels for, such as a T4 with
            Triton 3.3 or newer (see :attr:`mha.device.Capabilities.triton_native`).
        TypeError: bfloat16 on a GPU without bfloat16 tensor cores (compute capability < 8.0).
    """
    _check_inputs(query, key, value)
    is_causal = validate.flag("is_causal", is_causal)
    scale = validate.scale(scale)
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block is not None:
            _check_block(name, block)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _triton_attention(query, key, value, is_causal, scale, block_m, block_n)


def _triton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> Tensor:
    """:func:`triton_attention` on checked arguments (``None`` tiles: :func:`default_blocks`).

    What remains to check is the machine: Triton installed, imported in the interpreter mode of
    this module, and a device the kernels run on (see :func:`triton_attention`'s Raises).
    """
    _require_triton()
    interpreted = is_interpreted()
    _check_mode(interpreted)
    _check_device(query, interpreted)
    tuned = block_m is None and block_n is None  # we chose the tiles, so we may shrink them
    default_m, default_n = default_blocks(query.shape[-1], query.dtype)
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n

    options = (is_causal, scale, block_m, block_n, tuned)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _TritonAttention.apply(query, key, value, *options)
    return _forward(query, key, value, *options)[0]


class _TritonAttention(torch.autograd.Function):
    """Saves query, key, value, out and the row logsumexp; the backward launches three kernels."""

    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, block_m, block_n, tuned):  # type: ignore[override]
        out, lse, tiles = _forward(query, key, value, is_causal, scale, block_m, block_n, tuned)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.options = (is_causal, scale, *tiles, tuned)  # the tiles the forward pass ran with
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        dq, dk, dv = _backward(grad_out, *ctx.saved_tensors, *ctx.options)
        return dq, dk, dv, None, None, None, None, None


def _shrinking(
    launch: Callable[[int, int], None], block_m: int, block_n: int, tuned: bool
) -> tuple[int, int]:
    """Run ``launch(block_m, block_n)``, with smaller tiles while the GPU runs out of resources.

    Returns the ``(block_m, block_n)`` that ran. Only tiles that we chose (``tuned``) shrink: a
    GPU with less shared memory than the default tiles need gets smaller ones.
    """
    while True:
        try:
            launch(block_m, block_n)
            return block_m, block_n
        except triton.runtime.errors.OutOfResources:
            if not tuned or block_m == block_n == 16:
                raise
            block_m, block_n = _halve_tiles(block_m, block_n)


def _forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    tuned: bool,
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """The forward kernel on checked arguments: ``(out, lse, (block_m, block_n))``.

    Shapes:
        out ``(B, H, L, D)`` in the input dtype; lse ``(B, H, L)`` float32, the natural-log
        logsumexp of each row's scaled (and causally masked) scores, ``-inf`` if it sees no key.
    """
    B, H, L, _ = query.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # (B, H, L, D)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=query.device)  # (B, H, L)
    if out.numel() == 0:
        return out, lse, (block_m, block_n)
    interpreted = is_interpreted()

    def launch(bm: int, bn: int) -> None:
        _launch(query, key, value, out, lse, is_causal, scale, bm, bn, interpreted)

    return out, lse, _shrinking(launch, block_m, block_n, tuned)


def _halve_tiles(block_m: int, block_n: int) -> tuple[int, int]:
    """The next smaller tiles to try: narrower key tiles first, down to 16, then fewer rows.

    The key/value tiles are what the pipeline keeps several copies of in shared memory.
    """
    if block_n > 16:
        return block_m, block_n // 2
    return block_m // 2, block_n


def _launch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    interpreted: bool,
) -> None:
    B, H, L, D = query.shape
    S = key.shape[2]
    grid = launch_grid(B, H, L, block_m)  # (cdiv(L, BLOCK_M), B * H)
    _attn_fwd_kernel[grid](
        query,
        key,
        value,
        out,
        lse,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *out.stride(),
        H,
        L,
        S,
        scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IS_CAUSAL=is_causal,
        UPCAST=interpreted and query.dtype == torch.bfloat16,
        num_warps=4,
        num_stages=2,
    )


def _backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    tuned: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` from the three backward kernels, in the inputs' dtypes.

    First ``δ = rowsum(dO ∘ O)`` per row, then the dK/dV pass (one program per key tile, looping
    over query tiles), then the dQ pass (one program per query tile, looping over key tiles).

    Shapes:
        grad_out and out ``(B, H, L, D)``, lse ``(B, H, L)``; returns tensors shaped like query,
        key and value (contiguous).
    """
    B, H, L, D = query.shape
    S = key.shape[2]
    # The kernels write every element, so the gradients start uninitialised; but with no query
    # or no key nothing flows back and no kernel runs: then they are zeros.
    new = torch.zeros_like if L == 0 or S == 0 else torch.empty_like
    dq = new(query, memory_format=torch.contiguous_format)  # (B, H, L, D)
    dk = new(key, memory_format=torch.contiguous_format)  # (B, H, S, D)
    dv = new(value, memory_format=torch.contiguous_format)  # (B, H, S, D)
    if L == 0 or S == 0:
        return dq, dk, dv
    delta = torch.empty(B, H, L, dtype=torch.float32, device=query.device)  # (B, H, L)
    interpreted = is_interpreted()

    def launch(bm: int, bn: int) -> None:
        tensors = (query, key, value, grad_out, out, lse, delta, dq, dk, dv)
        _launch_backward(*tensors, is_causal, scale, bm, bn, interpreted)

    _shrinking(launch, block_m, block_n, tuned)
    return dq, dk, dv


def _launch_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    interpreted: bool,
) -> None:
    """Launch the three backward kernels: ``delta``, then ``dk`` and ``dv``, then ``dq``."""
    B, H, L, D = query.shape
    S = key.shape[2]
    tiles = {"HEAD_DIM": D, "BLOCK_D": max(16, triton.next_power_of_2(D)), "BLOCK_M": block_m}
    launch = {"num_warps": 4, "num_stages": 2}
    _attn_bwd_preprocess_kernel[launch_grid(B, H, L, block_m)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), H, L, **tiles, **launch
    )  # delta: (B, H, L) = rowsum(dO ∘ O)
    tiles |= {"BLOCK_N": block_n, "IS_CAUSAL": is_causal}
    tiles["UPCAST"] = interpreted and query.dtype == torch.bfloat16
    strides = (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride())
    args = (H, L, S, scale * LOG2E, scale)
    _attn_bwd_dkdv_kernel[launch_grid(B, H, S, block_n)](  # one program per key tile
        query, key, value, grad_out, lse, delta, dk, dv, *strides, *args, **tiles, **launch
    )
    _attn_bwd_dq_kernel[launch_grid(B, H, L, block_m)](  # one program per query tile
        query, key, value, grad_out, lse, delta, dq, *strides, *args, **tiles, **launch
    )
