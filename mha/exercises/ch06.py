"""Checkers for chapter 6, a FlashAttention kernel in Triton.

The tile-counting and loop-bound checkers compare the learner's arithmetic with a brute force over
real keep-masks (``torch.tril``, :func:`mha.sliding_window_mask`); the softmax-kernel checker
launches the learner's Triton kernel (in the interpreter when there is no GPU) and compares it with
``torch.softmax``; the backward checker compares with the gradient autograd computes. Triton is
imported only inside the kernel checker, so ``mha.exercises`` imports without it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from ._check import ExerciseError, check_close, passed

__all__ = [
    "check_backward_delta",
    "check_kv_tile_range",
    "check_softmax_kernel",
    "check_tile_counts",
]


def _call(fn: Callable[..., object], what: str, *args: object) -> object:
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - any error of the learner's code is quoted back
        raise ExerciseError(f"{what} raised {type(err).__name__}: {err}") from None


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ExerciseError(f"{what} should be an int, got {value!r}.")
    return int(value)


# ----------------------------------------------------------------------------------------------
# Exercise: predict the launch grid and the work
# ----------------------------------------------------------------------------------------------


def _needed_tiles(keep: Tensor, r0: int, r1: int, block_n: int) -> list[int]:
    """Starts of the key tiles holding at least one key visible to a row in ``[r0, r1)``."""
    visible = keep[r0:r1].any(0)  # (S,) may some row of the tile see key j?
    S = visible.shape[0]
    padded = torch.nn.functional.pad(visible, (0, -S % block_n))  # (cdiv(S, block_n) * block_n,)
    return [int(t) * block_n for t in padded.view(-1, block_n).any(1).nonzero().flatten()]


def _reference_work(
    B: int, H: int, L: int, S: int, bm: int, bn: int, causal: bool
) -> tuple[int, int]:
    keep = torch.ones(L, S, dtype=torch.bool)  # (L, S)
    if causal:
        keep = keep.tril()
    n_m = -(-L // bm)
    tiles = sum(len(_needed_tiles(keep, i * bm, min(L, (i + 1) * bm), bn)) for i in range(n_m))
    return n_m * B * H, tiles * B * H


_WORK_CASES = [
    # B, H, L, S, block_m, block_n, is_causal
    (2, 4, 1000, 1000, 64, 64, False),
    (2, 4, 1000, 1000, 64, 64, True),
    (2, 4, 1000, 1000, 128, 32, True),
    (1, 8, 100, 300, 32, 64, True),
    (1, 2, 40, 100, 32, 16, True),
    (3, 2, 77, 50, 16, 32, True),
    (1, 1, 64, 64, 64, 64, True),
    (1, 12, 200, 200, 16, 16, False),
]


def check_tile_counts(count_work: Callable[..., tuple[int, int]]) -> None:
    """Check ``count_work(B, H, L, S, block_m, block_n, is_causal) -> (programs, kv_tiles)``.

    ``programs`` is the number of programs the kernel is launched with, ``kv_tiles`` the number of
    key/value tiles all of them load in total (steps of their loops). The reference counts, from a
    real causal keep-mask, the key tiles that hold at least one key a row of the query tile sees:
    exactly the tiles the kernel must visit.
    """
    name = "check_tile_counts"
    for B, H, L, S, bm, bn, causal in _WORK_CASES:
        what = f"count_work({B}, {H}, {L}, {S}, block_m={bm}, block_n={bn}, is_causal={causal})"
        result = _call(count_work, what, B, H, L, S, bm, bn, causal)
        if not isinstance(result, tuple) or len(result) != 2:
            raise ExerciseError(
                f"{what} should return a tuple (programs, kv_tiles), got {result!r}."
            )
        programs, tiles = (_as_int(x, f"{what}[{i}]") for i, x in enumerate(result))
        want_programs, want_tiles = _reference_work(B, H, L, S, bm, bn, causal)
        if programs != want_programs:
            n_m = -(-L // bm)
            if programs == n_m:
                hint = "the grid has a second axis: one program per (query tile, batch·head) pair."
            elif programs == (L // bm) * B * H:
                hint = (
                    "the last query tile is ragged but still needs a program: round up, "
                    "cdiv(L, block_m) = -(-L // block_m)."
                )
            elif programs == n_m * (-(-S // bn)) * B * H:
                hint = (
                    "key tiles are not programs: each program loops over them. The grid is "
                    "(cdiv(L, block_m), B * H)."
                )
            else:
                hint = "the grid is (cdiv(L, block_m), B * H); count its programs."
            raise ExerciseError(
                f"{what} says {programs} programs, expected {want_programs}: {hint}"
            )
        if tiles != want_tiles:
            full = _reference_work(B, H, L, S, bm, bn, False)[1]
            if causal and tiles == full:
                hint = (
                    "with is_causal the loop stops at the diagonal: a query tile ending at row r "
                    "visits only the key tiles starting below min(S, L, r + 1)."
                )
            elif causal and tiles > want_tiles:
                hint = (
                    "too many: the last query tile is ragged (its rows stop at L - 1), and a key "
                    "tile is visited only if it starts below min(S, L, (start_m + 1) * block_m)."
                )
            else:
                hint = (
                    "each program takes cdiv(hi, block_n) loop steps, hi = S without a mask and "
                    "min(S, L, (start_m + 1) * block_m) with is_causal; sum them over all programs."
                )
            raise ExerciseError(
                f"{what} says {tiles} key/value tiles, expected {want_tiles}: {hint}"
            )
    passed(name, f"grid and tile counts right in all {len(_WORK_CASES)} configurations")


# ----------------------------------------------------------------------------------------------
# Exercise: the loop bounds of sliding-window attention
# ----------------------------------------------------------------------------------------------


def _window_cases() -> list[tuple[int, int, int, int, int]]:
    """(L, S, window, block_m, block_n) with L <= S, so that every query sees at least itself."""
    cases = []
    for L, S in [(100, 100), (40, 100), (64, 64), (130, 130), (17, 23)]:
        for window in (1, 5, 16, 40, 1000):
            for bm, bn in [(32, 16), (16, 32), (64, 64), (32, 32)]:
                cases.append((L, S, window, bm, bn))
    return cases


def check_kv_tile_range(kv_tile_range: Callable[..., tuple[int, int]]) -> None:
    """Check ``kv_tile_range(start_m, BLOCK_M, BLOCK_N, L, S, window) -> (lo, hi)``.

    The kernel would loop ``for start_n in range(lo, hi, BLOCK_N)``. With causal sliding-window
    attention, query ``i`` sees keys ``i - window + 1 .. i`` (:func:`mha.sliding_window_mask`). The
    visited tiles must be exactly those holding a key that some row of the query tile sees: none
    missing (the result would be wrong) and none too many (the skip is the point).
    """
    from ..masks import sliding_window_mask

    name = "check_kv_tile_range"
    cases = _window_cases()
    for L, S, window, bm, bn in cases:
        keep = sliding_window_mask(L, S, window=window, causal=True)  # (L, S)
        for start_m in range(-(-L // bm)):
            what = f"kv_tile_range({start_m}, {bm}, {bn}, L={L}, S={S}, window={window})"
            result = _call(kv_tile_range, what, start_m, bm, bn, L, S, window)
            if not isinstance(result, tuple) or len(result) != 2:
                raise ExerciseError(f"{what} should return a tuple (lo, hi), got {result!r}.")
            lo, hi = (_as_int(x, f"{what}[{i}]") for i, x in enumerate(result))
            r0, r1 = start_m * bm, min(L, (start_m + 1) * bm)
            if lo < 0:
                raise ExerciseError(
                    f"{what} returned lo={lo}: negative key positions would be read out of bounds "
                    "(the kernel's load mask only checks < S). Clamp with max(0, ...)."
                )
            if lo % bn:
                raise ExerciseError(
                    f"{what} returned lo={lo}, not a multiple of BLOCK_N={bn}: key tiles start at "
                    "multiples of BLOCK_N. Round down: lo // BLOCK_N * BLOCK_N."
                )
            visited = list(range(lo, hi, bn))
            needed = _needed_tiles(keep, r0, r1, bn)
            missing = [s for s in needed if s not in visited]
            extra = [s for s in range(lo, hi, bn) if s not in needed]
            rows = f"rows {r0}..{r1 - 1}"
            if missing:
                s = missing[0]
                where = (
                    f"lo is too large: row {r0} sees keys from {max(0, r0 - window + 1)} on"
                    if s < lo
                    else f"hi is too small: row {r1 - 1} sees keys up to {min(S, r1) - 1}"
                )
                raise ExerciseError(
                    f"{what} skips the key tile starting at {s}, which {rows} need, so the kernel "
                    f"would compute a wrong result: {where}."
                )
            if extra:
                s = extra[0]
                where = (
                    f"lo can start higher: no row of {rows} sees a key below {max(0, r0 - window + 1)}"
                    if s < needed[0]
                    else f"hi can stop lower: no row of {rows} sees a key at or past {min(S, r1)} "
                    "(the last query tile is ragged: its rows stop at L - 1)"
                )
                raise ExerciseError(
                    f"{what} visits the key tile starting at {s}, which no row of {rows} sees. "
                    f"The result stays right, but the skip is the point: {where}."
                )
    passed(
        name, f"exactly the needed key tiles in all {len(cases)} configurations, every query tile"
    )


# ----------------------------------------------------------------------------------------------
# Exercise: a row-softmax kernel in Triton
# ----------------------------------------------------------------------------------------------


_UNWRITTEN = -7.0  # what the output holds before the kernel runs: no softmax value is negative


def _softmax_cases() -> list[tuple[str, Tensor]]:
    g = torch.Generator().manual_seed(6)
    ragged = torch.randn(6, 13, generator=g) * 3  # 13 columns in a 16-lane block
    large = 1000.0 + torch.randn(3, 16, generator=g)  # exp(1000) overflows float32
    wide = torch.randn(4, 32, generator=g) * 2
    strided = wide[:, :20]  # rows 32 elements apart, 20 columns each
    return [
        ("13 columns per row (BLOCK=16)", ragged),
        ("logits near 1000", large),
        ("rows 32 elements apart, 20 columns each", strided),
        ("a single column", torch.randn(5, 1, generator=g)),
    ]


def check_softmax_kernel(kernel: object) -> None:
    """Check a Triton kernel ``softmax_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr)``.

    It is launched with one program per row, ``kernel[(n_rows,)](x, y, x.stride(0), y.stride(0),
    n_cols, BLOCK=triton.next_power_of_2(n_cols))``, and must write ``softmax(x, dim=-1)`` into
    ``y``. It runs on the GPU when the kernel was compiled for one, else in Triton's interpreter on
    the CPU (``TRITON_INTERPRET=1`` set before ``import triton``).
    """
    name = "check_softmax_kernel"
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        raise ExerciseError("this exercise needs Triton: pip install triton") from None
    if isinstance(kernel, InterpretedFunction):
        device = "cpu"
    elif isinstance(kernel, JITFunction):
        if not torch.cuda.is_available():
            raise ExerciseError(
                "your kernel was compiled for a GPU, but there is none. Set "
                "os.environ['TRITON_INTERPRET'] = '1' before the first `import triton`, then "
                "restart the kernel and run the chapter again."
            )
        device = "cuda"
    else:
        raise ExerciseError(
            f"softmax_kernel should be a Triton kernel (a function decorated with @triton.jit), "
            f"got {type(kernel).__name__}."
        )

    for what, x in _softmax_cases():
        n_rows, n_cols = x.shape
        x_dev = x.to(device)
        y = torch.full((n_rows, n_cols), _UNWRITTEN, device=device)  # (n_rows, n_cols)
        block = triton.next_power_of_2(n_cols)
        call = f"softmax_kernel on {what}"
        try:
            kernel[(n_rows,)](x_dev, y, x_dev.stride(0), y.stride(0), n_cols, BLOCK=block)
        except Exception as err:  # noqa: BLE001 - any error of the learner's kernel is quoted back
            raise ExerciseError(
                f"{call} raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                "Keep the signature (X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr)."
            ) from None
        y = y.cpu()
        check_close(
            y,
            torch.softmax(x, dim=-1),
            what=call,
            hint=_softmax_kernel_hint(x, y),
            atol=1e-6,
            rtol=1e-5,
        )
    passed(name, "ragged rows, large logits and strided rows all right")


def _softmax_kernel_hint(x: Tensor, y: Tensor) -> str:
    n_rows, n_cols = x.shape
    if (y == _UNWRITTEN).all(1).any():
        return (
            "some rows were never written: each program handles the row tl.program_id(0) and "
            "stores all its n_cols values."
        )
    if not torch.isfinite(y).all():
        return (
            "exp overflowed (exp(89) is already inf in float32): subtract the row maximum, "
            "tl.max(x, axis=0), before tl.exp."
        )
    block = 1 << (n_cols - 1).bit_length()
    padded = torch.cat([x, torch.zeros(n_rows, block - n_cols)], 1)  # lanes past n_cols loaded as 0
    if block > n_cols and torch.allclose(y, torch.softmax(padded, -1)[:, :n_cols], atol=1e-6):
        return (
            "the lanes past n_cols count in your sum: load them with other=-float('inf') so "
            "that exp gives 0 there."
        )
    # What a kernel reads that steps n_cols (not stride_x) elements from one row to the next:
    packed = x.as_strided((n_rows, n_cols), (n_cols, 1))  # (n_rows, n_cols)
    if x.stride(0) != n_cols and torch.allclose(y, torch.softmax(packed, -1), atol=1e-6):
        return "row r starts at X + r * stride_x, not X + r * n_cols."
    return "each row must be exp(x - max) / sum(exp(x - max)) over its own n_cols values."


# ----------------------------------------------------------------------------------------------
# Exercise: the first step of the backward pass
# ----------------------------------------------------------------------------------------------


def check_backward_delta(backward_delta: Callable[[Tensor, Tensor], Tensor]) -> None:
    """Check ``backward_delta(out, grad_out) -> delta``, the first step of FlashAttention's backward.

    The gradient of the scores is ``dS = P * (dP - delta)`` with ``dP = dO @ V^T`` and
    ``delta_i = sum_j P_ij dP_ij``, which needs no ``P`` at all because it equals a row-wise dot
    product of ``dO`` and ``O``. The checker puts the learner's ``delta`` into that formula and
    compares ``dS`` with the gradient autograd computes through ``torch.softmax``.

    Shapes:
        out and grad_out ``(B, H, L, D)``; delta ``(B, H, L)``.
    """
    name = "check_backward_delta"
    g = torch.Generator().manual_seed(60)
    B, H, L, S, D = 2, 3, 10, 12, 16
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    grad_out = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)  # dO
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).requires_grad_()  # (B, H, L, S)
    weights = torch.softmax(scores, dim=-1)  # (B, H, L, S) = P
    out = weights @ v  # (B, H, L, D) = O
    out.backward(grad_out)

    what = "backward_delta(out, grad_out)"
    delta = _call(backward_delta, what, out.detach().clone(), grad_out.clone())
    if isinstance(delta, Tensor) and delta.shape == (B, H, L, 1):
        delta = delta.squeeze(-1)
    hint = "delta is the row-wise dot product of grad_out and out: (grad_out * out).sum(-1)."
    if isinstance(delta, Tensor) and delta.shape == (B, H, D):
        raise ExerciseError(
            f"{what} has shape {tuple(delta.shape)}, expected (B, H, L) = {(B, H, L)}: you summed "
            f"over the rows (dim -2); sum over the head dim (dim -1). {hint}"
        )
    if (
        isinstance(delta, Tensor)
        and delta.shape == (B, H, L)
        and torch.allclose(delta.double(), grad_out.sum(-1))
    ):
        hint = "multiply grad_out by out elementwise before summing. " + hint
    check_close(
        delta, (grad_out * out.detach()).sum(-1), what=what, hint=hint, atol=1e-9, rtol=1e-9
    )
    d_scores = weights.detach() * (grad_out @ v.transpose(-2, -1) - delta.double()[..., None])  # dS
    check_close(d_scores, scores.grad, what="P * (dP - delta)", hint=hint, atol=1e-9, rtol=1e-9)
    passed(name, "with your delta, P * (dP - delta) equals autograd's gradient of the scores")
