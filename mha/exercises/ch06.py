"""Chapter 6, a FlashAttention kernel in Triton: the exercises as data for :mod:`._harness`. The
softmax kernel's custom check imports Triton itself, so ``mha.exercises`` imports without it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import triton_flash
from ..lab import timing
from ..masks import sliding_window_mask
from ._harness import (
    Case,
    Exercise,
    ExerciseError,
    Lazy,
    as_int,
    defined_in,
    difference,
    never_larger,
    publish,
    tr,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _needed_tiles(keep: Tensor, r0: int, r1: int, block_n: int) -> tuple[int, ...]:
    """Starts of the key tiles holding at least one key visible to a row in ``[r0, r1)``."""
    visible = keep[r0:r1].any(0)  # (S,) may some row of the query tile see key j?
    padded = torch.nn.functional.pad(visible, (0, -visible.shape[0] % block_n))  # whole tiles
    return tuple(int(t) * block_n for t in padded.view(-1, block_n).any(1).nonzero().flatten())


def _work(B: int, H: int, L: int, S: int, bm: int, bn: int, causal: bool) -> tuple[int, int]:
    """(programs, key/value tiles loaded), counted from a real keep-mask."""
    keep = torch.ones(L, S, dtype=torch.bool)  # (L, S)
    keep = keep.tril() if causal else keep
    n_m = _cdiv(L, bm)
    tiles = sum(len(_needed_tiles(keep, i * bm, min(L, (i + 1) * bm), bn)) for i in range(n_m))
    return n_m * B * H, tiles * B * H


def _count_work(B: int, H: int, L: int, S: int, bm: int, bn: int, causal: bool, **slip: str):
    """The kernel's arithmetic (the chapter's solution), or one of its usual ``slip``s."""
    n_m = _cdiv(L, bm)
    grid = {"ok": n_m * B * H, "one axis": n_m, "floor": L // bm * B * H}
    programs = {**grid, "tiles": n_m * _cdiv(S, bn) * B * H}[slip.get("grid", "ok")]
    last = S if slip.get("stop") == "square" else L  # query tile i's causal loop stops below
    steps = sum(_cdiv(min(S, last, (i + 1) * bm) if causal else S, bn) for i in range(n_m))
    return programs, steps * B * H


_WORK_CASES = [  # B, H, L, S, block_m, block_n, is_causal
    (2, 4, 1000, 1000, 64, 64, False),
    (2, 4, 1000, 1000, 64, 64, True),
    (2, 4, 1000, 1000, 128, 32, True),
    (1, 8, 100, 300, 32, 64, True),
    (1, 2, 40, 100, 32, 16, True),
    (3, 2, 77, 50, 16, 32, True),
    (1, 1, 64, 64, 64, 64, True),
    (1, 12, 200, 200, 16, 16, False),
]

_LOOP = "Programs loop over key tiles: grid (cdiv(L, block_m), B * H)."
_STOPS = "With is_causal the loop stops at the diagonal, below min(S, L, (start_m + 1) * block_m)."


def _tile_counts_ceil(B: int, H: int, L: int, S: int, block_m: int, block_n: int, is_causal: bool):
    n_m = math.ceil(L / block_m)
    hi = [min(S, L, (i + 1) * block_m) if is_causal else S for i in range(n_m)]
    return n_m * B * H, sum(math.ceil(h / block_n) for h in hi) * B * H


def _count_by_library(B: int, H: int, L: int, S: int, bm: int, bn: int, causal: bool):
    """The kernel's own launch_grid and causal_kv_end from mha.triton_flash."""
    rows, heads = triton_flash.launch_grid(B, H, L, bm)
    ends = [triton_flash.causal_kv_end(i, bm, L, S) if causal else S for i in range(rows)]
    return rows * heads, sum(_cdiv(end, bn) for end in ends) * heads


def _count_by_private_helper(B: int, H: int, L: int, S: int, bm: int, bn: int, causal: bool):
    """The block sizes checked by mha.triton_flash's private _check_block, then counted right."""
    triton_flash._check_block("block_m", bm)
    return _count_work(B, H, L, S, bm, bn, causal)


#: The kernel's launch arithmetic is mha.triton_flash's (launch_grid, causal_kv_end): the
#: exercises that count it ban the whole module.
_KERNEL_BANNED = tuple(defined_in(triton_flash))
_NO_TRITON_FLASH = (
    "count it yourself, with no function of mha.triton_flash (launch_grid, causal_kv_end ...)."
)

TILE_COUNTS = Exercise(
    "check_tile_counts",
    f"grid and tile counts right in all {len(_WORK_CASES)} configurations",
    _work,
    lambda: [
        Case("count_work({}, {}, {}, {}, block_m={}, block_n={}, is_causal={})".format(*c), c)
        for c in _WORK_CASES
    ],
    variants=(_count_work, _tile_counts_ceil),
    mistakes=(
        (partial(_count_work, grid="one axis"), "One program per (query tile, B·H) pair."),
        (partial(_count_work, grid="floor"), "Round up: the ragged last tile needs a program."),
        (partial(_count_work, grid="tiles"), _LOOP),
        (lambda B, H, L, S, bm, bn, causal: _count_work(B, H, L, S, bm, bn, False), _STOPS),
        (partial(_count_work, stop="square"), "The ragged last query tile stops at row L - 1."),
        (_count_by_library, _NO_TRITON_FLASH),
        (_count_by_private_helper, _NO_TRITON_FLASH),
    ),
    hint={
        "programs": "The grid is (cdiv(L, block_m), B * H); count its programs.",
        "kv_tiles": "Each program takes cdiv(hi, block_n) steps, hi = S, or with is_causal "
        "min(S, L, (start_m + 1) * block_m).",
    },
    outputs=("programs", "kv_tiles"),
    convert=lambda out: (
        tuple(map(as_int, out, ("programs", "kv_tiles")))
        if (isinstance(out, tuple) and len(out) == 2)
        else out
    ),
    forbidden=_KERNEL_BANNED,
    rewrites=(triton_flash.launch_grid, triton_flash.causal_kv_end),
    forbidden_hint=_NO_TRITON_FLASH,
    params=("count_work",),
    doc="Check ``count_work(B, H, L, S, block_m, block_n, is_causal) -> (programs, kv_tiles)`` "
    "against a count of the key tiles a real keep-mask needs.",
)


def _kv_range(m: int, bm: int, bn: int, L: int, S: int, window: int, **slip: str):
    """The loop bounds of query tile ``m`` (the chapter's solution), or one of the usual slips."""
    first = max(0, m * bm - window + 1)  # the first key the tile's first row sees
    lo = {"down": first // bn * bn, "exact": first, "zero": 0, "up": _cdiv(first, bn) * bn}
    lo["unclamped"] = (m * bm - window + 1) // bn * bn
    hi = {"tight": min(S, L, (m + 1) * bm), "ragged": min(S, (m + 1) * bm), "S": S}
    return min(S, lo[slip.get("lo", "down")]), {**hi, "diagonal": m * bm}[slip.get("hi", "tight")]


_LENGTHS = [(100, 100), (40, 100), (64, 64), (130, 130), (17, 23)]  # L <= S: each query sees itself
_WINDOWS = (1, 5, 16, 40, 1000)
_BLOCKS = [(32, 16), (16, 32), (64, 64), (32, 32)]


def _window_cases() -> list[Case]:
    """Every query tile of every configuration; the expected tiles from a real keep-mask."""
    cases = []
    for (L, S), window, (bm, bn) in itertools.product(_LENGTHS, _WINDOWS, _BLOCKS):
        keep = sliding_window_mask(L, S, window=window, causal=True)  # (L, S)
        for m in range(_cdiv(L, bm)):
            call = f"kv_tile_range({m}, {bm}, {bn}, L={L}, S={S}, window={window})"
            needed = _needed_tiles(keep, m * bm, min(L, (m + 1) * bm), bn)
            cases.append(Case(f"range(*{call}, {bn})", (m, bm, bn, L, S, window), expected=needed))
    return cases


def _visited_tiles(kv_tile_range: Callable[..., object], case: Case) -> object:
    """The starts of the key tiles the kernel's loop ``range(lo, hi, BLOCK_N)`` visits."""
    with never_larger(_MASK_LIMIT, tr(_NO_MASK) + " {shape}"):  # indices, not a built mask
        out = kv_tile_range(*case.args)
    if out is not None and not (isinstance(out, tuple) and len(out) == 2):
        message = "kv_tile_range{args} should return a tuple (lo, hi), got {out!r}."
        raise ExerciseError(tr(message, args=case.args, out=out))
    return out and tuple(range(as_int(out[0], "lo"), as_int(out[1], "hi"), case.args[2]))


#: A tensor this large is a mask of a tile or more (the smallest tile is 16 x 16): the bounds are
#: arithmetic on the tile's first and last rows, no mask is needed to find them.
_MASK_LIMIT = 64
_NO_MASK = (
    "Right tiles, but found from a mask: the kernel cannot build one; work lo and hi out from "
    "the tile's first and last rows and the window, with integers. The mask:"
)
_SKIP = "Right result, but the skip is the point: "
_WRONG = "This skips a key tile some row needs: "


def _kv_range_floor(start_m: int, BLOCK_M: int, BLOCK_N: int, L: int, S: int, window: int):
    lo = max(0, start_m * BLOCK_M - window + 1)
    return math.floor(lo / BLOCK_N) * BLOCK_N, min(S, L, (start_m + 1) * BLOCK_M)


def _kv_range_from_mask(m: int, bm: int, bn: int, L: int, S: int, window: int):
    """The right bounds, read off a whole (L, S) sliding-window mask."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    keep = (j <= i) & (j > i - window)  # (L, S)
    cols = keep[m * bm : (m + 1) * bm].any(0).nonzero()  # the keys some row of the tile sees
    return int(cols.min()) // bn * bn, int(cols.max()) + 1


def _kv_range_by_library(m: int, bm: int, bn: int, L: int, S: int, window: int):
    """The causal bound from mha.triton_flash.causal_kv_end, the window's start by hand."""
    hi = triton_flash.causal_kv_end(m, bm, L, S)
    return max(0, m * bm - window + 1) // bn * bn, hi


def _kv_range_by_private_helper(m: int, bm: int, bn: int, L: int, S: int, window: int):
    """BLOCK_N checked by mha.triton_flash's private _check_block, then the right bounds."""
    triton_flash._check_block("BLOCK_N", bn)
    return _kv_range(m, bm, bn, L, S, window)


_NO_KERNEL_BOUND = (
    "work the bounds out yourself, with no function of mha.triton_flash (causal_kv_end ...)."
)

KV_TILE_RANGE = Exercise(
    "check_kv_tile_range",
    f"exactly the needed key tiles in all {len(_LENGTHS) * len(_WINDOWS) * len(_BLOCKS)} "
    "configurations, every query tile",
    _kv_range,
    _window_cases,
    variants=(partial(_kv_range, lo="down"), _kv_range_floor),
    mistakes=(
        (partial(_kv_range, lo="exact"), "Tiles start at multiples of BLOCK_N: round down."),
        (partial(_kv_range, lo="unclamped"), "Clamp lo with max(0, ...): no negative keys."),
        (partial(_kv_range, lo="zero"), _SKIP + "no row sees a key below first_row - window + 1."),
        (partial(_kv_range, hi="ragged"), _SKIP + "the ragged last tile's rows stop at L - 1."),
        (partial(_kv_range, hi="S"), _SKIP + "no row sees a key past the tile's last row."),
        (partial(_kv_range, lo="up"), _WRONG + "round the first visible key *down*."),
        (partial(_kv_range, hi="diagonal"), _WRONG + "the last row sees keys up to itself."),
        (_kv_range_from_mask, _NO_MASK),
        (_kv_range_by_library, _NO_KERNEL_BOUND),
        (_kv_range_by_private_helper, _NO_KERNEL_BOUND),
    ),
    hint="Visit exactly the key tiles holding a key that some row of the query tile sees: row i "
    "sees keys i - window + 1 .. i.",
    call=_visited_tiles,
    forbidden=_KERNEL_BANNED,
    rewrites=(triton_flash.causal_kv_end,),
    forbidden_hint=_NO_KERNEL_BOUND,
    params=("kv_tile_range",),
    doc="Check ``kv_tile_range(start_m, BLOCK_M, BLOCK_N, L, S, window) -> (lo, hi)``: "
    "``range(lo, hi, BLOCK_N)`` must visit exactly the key tiles causal sliding-window attention "
    "needs.",
)


_UNWRITTEN = -7.0  # what the output holds before the kernel runs: no softmax value is negative


def _softmax_inputs() -> list[tuple[str, Tensor, int, int]]:
    """``(what, rows, n_cols, stride_y)``: x is ``rows[:, :n_cols]``, and y's rows are
    ``stride_y`` elements apart."""
    g = torch.Generator().manual_seed(6)
    ragged = torch.randn(6, 13, generator=g) * 3  # 13 columns in a 16-lane block
    large = 1000.0 + torch.randn(3, 16, generator=g)  # exp(1000) overflows float32
    wide = torch.randn(4, 32, generator=g) * 2
    return [
        ("13 columns per row (BLOCK=16)", ragged, 13, 13),
        ("logits near 1000", large, 16, 16),
        ("rows of x 32 and rows of y 24 elements apart, 20 columns each", wide, 20, 24),
        ("a single column", torch.randn(5, 1, generator=g), 1, 1),
    ]


def _kernel_device(kernel: object) -> str:
    """Where the learner's kernel runs: "cpu" in Triton's interpreter, else "cuda"."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        raise ExerciseError(tr("this exercise needs Triton: pip install triton")) from None
    if isinstance(kernel, InterpretedFunction):
        return "cpu"
    if not isinstance(kernel, JITFunction):
        message = (
            "softmax_kernel should be a Triton kernel (a function decorated with @triton.jit), "
            "got {kind}."
        )
        raise ExerciseError(tr(message, kind=type(kernel).__name__))
    if not torch.cuda.is_available():
        raise ExerciseError(
            tr(
                "your kernel was compiled for a GPU, but there is none. Set "
                "os.environ['TRITON_INTERPRET'] = '1' before the first `import triton`, then "
                "restart the kernel and run the chapter again."
            )
        )
    return "cuda"


_UNWRITTEN_ROWS = "some rows were never written: program tl.program_id(0) stores its whole row."
_NO_MAX = "exp overflowed: subtract the row maximum, tl.max(x, axis=0), before tl.exp."
_LANES = "lanes past n_cols count in your sum: load them with other=-float('inf')."
_STRIDE_X = "row r starts at X + r * stride_x, not X + r * n_cols."
_STRIDE_Y = "row r of Y starts at Y + r * stride_y, not Y + r * n_cols."
_SIGNATURE = "Keep the signature (X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr)."


def _softmax_kernel_hint(x: Tensor, y: Tensor, stride_y: int) -> str:
    """Name the slip that explains a wrong output ``y`` of the kernel on ``x``."""
    n_rows, n_cols = x.shape
    if (y == _UNWRITTEN).all(1).any():
        return tr(_UNWRITTEN_ROWS)
    if not torch.isfinite(y).all():
        return tr(_NO_MAX)
    block = 1 << (n_cols - 1).bit_length()
    padded = torch.cat([x, torch.zeros(n_rows, block - n_cols)], 1)  # lanes past n_cols read as 0
    if block > n_cols and torch.allclose(y, torch.softmax(padded, -1)[:, :n_cols], atol=1e-6):
        return tr(_LANES)
    # What a kernel reads that steps n_cols (not stride_x) elements from one row to the next:
    packed = x.as_strided((n_rows, n_cols), (n_cols, 1))  # (n_rows, n_cols)
    if x.stride(0) != n_cols and torch.allclose(y, torch.softmax(packed, -1), atol=1e-6):
        return tr(_STRIDE_X)
    # What y holds when row r is stored at Y + r * n_cols instead of Y + r * stride_y:
    stored = torch.full((n_rows * stride_y,), _UNWRITTEN)
    stored[: n_rows * n_cols] = torch.softmax(x, -1).flatten()
    stored = stored.as_strided((n_rows, n_cols), (stride_y, 1))
    if stride_y != n_cols and torch.allclose(y, stored, atol=1e-6):
        return tr(_STRIDE_Y)
    return tr("each row must be exp(x - max) / sum(exp(x - max)) over its own n_cols values.")


def _check_softmax_kernel(kernel: Any) -> str:  # a Triton kernel, checked by _kernel_device
    device = _kernel_device(kernel)
    import triton  # after _kernel_device: Triton is installed

    for what, rows, n_cols, stride_y in _softmax_inputs():
        x, x_dev = rows[:, :n_cols], rows.to(device)[:, :n_cols]  # rows rows.shape[1] apart
        n_rows = x.shape[0]
        y = torch.full((n_rows * stride_y,), _UNWRITTEN, device=device)  # rows stride_y apart:
        y = y.as_strided((n_rows, n_cols), (stride_y, 1))  # (n_rows, n_cols)
        label = f"softmax_kernel on {what}"
        try:
            block = triton.next_power_of_2(n_cols)
            kernel[(n_rows,)](x_dev, y, x_dev.stride(0), stride_y, n_cols, BLOCK=block)
        except Exception as err:  # noqa: BLE001 - any error of the learner's kernel is quoted back
            error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            message = tr(
                "{label} raised {error}. {hint}", label=label, error=error, hint=tr(_SIGNATURE)
            )
            raise ExerciseError(message) from None
        y = y.cpu()
        problem = difference(y, torch.softmax(x, dim=-1), atol=1e-6, rtol=1e-5)
        if problem:
            hint = _softmax_kernel_hint(x, y, stride_y)
            message = tr("{label} {problem}. {hint}", label=label, problem=problem, hint=hint)
            raise ExerciseError(message)
    return tr("ragged rows, large logits and strided rows all right")


@cache
def _kernels() -> dict[str, Any]:
    """Right and wrong softmax kernels: the variants and mistakes of the exercise, built on first
    use (Triton is optional, and TRITON_INTERPRET must be set before it is imported)."""
    import triton
    import triton.language as tl

    @triton.jit
    def stable(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):  # the chapter's
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def by_where(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.where(inside, tl.load(X + row * stride_x + cols, mask=inside, other=0.0), -1e30)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e * (1.0 / tl.sum(e, axis=0)), mask=inside)

    @triton.jit
    def zero_padding(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=0.0)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def no_max(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        e = tl.exp(tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def ignores_stride_x(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * n_cols + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def ignores_stride_y(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * n_cols + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def first_row_only(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n_cols, other=float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    @triton.jit
    def wrong_signature(X, Y, n_cols, BLOCK: tl.constexpr):
        tl.store(Y, 0.0)

    return {k: v for k, v in locals().items() if k not in ("triton", "tl")}


def _kernel(name: str) -> Lazy:
    return Lazy(lambda: _kernels()[name])


SOFTMAX_KERNEL = Exercise(
    "check_softmax_kernel",
    "",
    None,
    variants=(_kernel("stable"), _kernel("by_where")),
    mistakes=(
        (_kernel("zero_padding"), _LANES),
        (_kernel("no_max"), _NO_MAX),
        (_kernel("ignores_stride_x"), _STRIDE_X),
        (_kernel("ignores_stride_y"), _STRIDE_Y),
        (_kernel("first_row_only"), _UNWRITTEN_ROWS),
        (_kernel("wrong_signature"), _SIGNATURE),
    ),
    custom=_check_softmax_kernel,
    # None: mha has no Triton softmax kernel, and a Triton kernel cannot call torch's softmax (the
    # check turns away anything that is not a @triton.jit kernel, torch.softmax included).
    rewrites=(),
    params=("kernel",),
    doc="Check a Triton ``softmax_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr)`` "
    "launched with one program per row (on the GPU, or in Triton's interpreter on the CPU).",
)


from ._triton_forward import ATTENTION_LOOP, skeleton_attention  # noqa: E402, F401


def time_attention_loop(attention_loop: Any) -> None:
    """Print your kernel's TFLOP/s and its ratio to SDPA and to the course's kernel, measured on
    this machine (causal, float16, B=4, H=16, L=S=4096, D=64); on a CPU, say that it needs a
    GPU."""
    if not torch.cuda.is_available() or triton_flash.is_interpreted():
        # printed as it is in both editions, like the chapter's other measured lines
        line = (
            "Your kernel's speed needs a GPU that Triton compiles for: in the interpreter it runs "
            "as NumPy, and its time says nothing. On a GPU this line prints your TFLOP/s next to "
            "SDPA's and the course kernel's."
        )
        print(line)
        return
    B, H, L, D = 4, 16, 4096, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to("cuda", torch.float16) for _ in range(3))
    block_m, block_n = triton_flash.default_blocks(D, torch.float16)  # the course kernel's tiles
    fns = {
        "yours": lambda: skeleton_attention(
            attention_loop, q, k, v, True, block_m=block_m, block_n=block_n
        ),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "course": lambda: triton_flash.triton_attention(q, k, v, is_causal=True),
    }
    with torch.no_grad():
        times = timing.compare_times(fns, rounds=3, min_run_time=0.2)
    flops = 4 * B * H * L * L * D / 2  # causal: half of Q K^T and of P V
    rate = {name: flops / t.median / 1e12 for name, t in times.items()}
    line = (
        "causal, float16, B={B}, H={H}, L=S={L}, D={D}, on this machine: yours ~{yours:.0f} "
        "TFLOP/s, SDPA ~{sdpa:.0f}, the course's kernel ~{course:.0f} (yours / SDPA "
        "{to_sdpa:.2f}, yours / course {to_course:.2f})"
    )
    ratios = {"to_sdpa": rate["yours"] / rate["sdpa"], "to_course": rate["yours"] / rate["course"]}
    print(line.format(B=B, H=H, L=L, D=D, **rate, **ratios))


EXERCISES = publish(globals())
