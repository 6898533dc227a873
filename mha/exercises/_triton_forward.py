"""Section 6.2's capstone, the Triton forward kernel's loop, as data for :mod:`._harness`;
published by :mod:`.ch06` with the chapter's other exercises.

The learner writes ``attention_loop``, a ``@triton.jit`` function: the running state, the causal
loop bound and the loop body (key and value tiles, scores, the causal mask, the online softmax).
The skeleton kernel below gives the rest (program ids, pointers, the query tile, the final
``acc / l`` and the store) and calls it; :func:`skeleton_attention` launches it.
"""

# No `from __future__ import annotations`: the skeleton's `tl.constexpr` annotations are read by
# Triton as objects (as in mha.triton_flash).
import types
from functools import cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import attention, flash, triton_flash
from ..triton_flash import tl
from ._harness import Exercise, ExerciseError, Lazy, defined_in, difference, tr

# --- the skeleton: everything but the loop ----------------------------------------------------


def attention_loop(*args: Any) -> Any:
    """Stands in for yours: :func:`skeleton_attention` builds the kernel around the one it gets."""
    raise NotImplementedError("pass your attention_loop to skeleton_attention")


# fmt: off
def flash_forward_skeleton(
    Q, K, V, Out,  # (B, H, L|S, D), contiguous
    L, S,  # query and key lengths
    sm_scale,  # the softmax scale, 1 / sqrt(D)
    HEAD_DIM: tl.constexpr,  # D, a power of two >= 16 (no padded lanes)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    IS_CAUSAL: tl.constexpr,  # query i sees keys 0..i (top-left, as PyTorch's is_causal)
):
    start_m = tl.program_id(0)  # which tile of BLOCK_M query rows
    off_bh = tl.program_id(1)  # which (batch, head) pair, b * H + h
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) this tile's query rows
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions inside one key tile
    offs_d = tl.arange(0, HEAD_DIM)  # (HEAD_DIM,)
    q_ptrs = Q + off_bh * L * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_m[:, None] < L, other=0.0)  # (BLOCK_M, HEAD_DIM)
    # The first key tile, read as K^T; key j + 1 lies HEAD_DIM elements after key j, so the
    # tile that starts at key start_n is at k_ptrs + start_n * HEAD_DIM (v_ptrs likewise).
    k_ptrs = K + off_bh * S * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None]  # (D, BLOCK_N)
    v_ptrs = V + off_bh * S * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # (BLOCK_N, D)

    acc, l = attention_loop(  # yours: (BLOCK_M, HEAD_DIM) and (BLOCK_M,), float32
        q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM, IS_CAUSAL
    )

    out = acc / l[:, None]  # (BLOCK_M, HEAD_DIM)
    o_ptrs = Out + off_bh * L * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < L)
# fmt: on


_KERNELS: dict[int, tuple[Any, Any]] = {}  # id(attention_loop) -> (attention_loop, its kernel)


def _triton_kind(attention_loop: object) -> type:
    """The class of a Triton function (compiled or interpreted), or an ExerciseError."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        raise ExerciseError(tr("this exercise needs Triton: pip install triton")) from None
    if isinstance(attention_loop, (InterpretedFunction, JITFunction)):
        return type(attention_loop)
    message = "attention_loop should be a Triton function (decorated with @triton.jit), got {kind}."
    raise ExerciseError(tr(message, kind=type(attention_loop).__name__))


def _kernel(attention_loop: Any) -> Any:
    """The skeleton kernel calling ``attention_loop``, compiled or interpreted as it is."""
    kind = _triton_kind(attention_loop)
    if id(attention_loop) not in _KERNELS:
        scope = {**flash_forward_skeleton.__globals__, "attention_loop": attention_loop}
        fn = types.FunctionType(flash_forward_skeleton.__code__, scope, "flash_forward_skeleton")
        # A new function object starts with no annotations: without `tl.constexpr` on BLOCK_M
        # and the others, the GPU compiler would take them as runtime integers (tl.arange fails).
        fn.__annotations__ = dict(flash_forward_skeleton.__annotations__)
        _KERNELS[id(attention_loop)] = (attention_loop, kind(fn))
    return _KERNELS[id(attention_loop)][1]


def skeleton_attention(
    attention_loop: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool = False,
    *,
    block_m: int = 16,
    block_n: int = 16,
) -> Tensor:
    """Attention by the skeleton kernel with your ``attention_loop`` (a ``@triton.jit`` function).

    Args:
        attention_loop: returns ``(acc, l)`` for one query tile (see the section's exercise).
        q, k, v: on the GPU, or on the CPU when Triton runs in its interpreter; one dtype.
        is_causal: query ``i`` sees keys ``0..i``.
        block_m, block_n: query rows per program, keys per loop step (powers of two >= 16).

    Shapes:
        q ``(B, H, L, D)``, k and v ``(B, H, S, D)``, D a power of two from 16 to 128; returns
        ``(B, H, L, D)`` in q's dtype.
    """
    B, H, L, D = q.shape
    S = k.shape[2]
    if D < 16 or D > 128 or D & (D - 1):
        raise ValueError(f"the skeleton needs D a power of two from 16 to 128, got D={D}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)  # (B, H, L, D)
    grid = (-(-L // block_m), B * H)
    _kernel(attention_loop)[grid](
        q, k, v, out, L, S, D**-0.5,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=bool(is_causal),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


# --- the answers the checker knows ----------------------------------------------------------
# Plain functions here, made Triton functions on first use by _loops() (Triton is optional, and
# TRITON_INTERPRET must be set before it is imported).


# fmt: off
def _by_exp2(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The course kernel's formulation: base-2 units, one loop bound for both cases."""
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
    hi = S
    if IS_CAUSAL:
        hi = tl.minimum(S, tl.minimum(L, (start_m + 1) * BLOCK_M))
    for start_n in range(0, hi, BLOCK_N):
        offs_s = start_n + offs_n
        k = tl.load(k_ptrs + start_n * HEAD_DIM, mask=offs_s[None, :] < S, other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * qk_scale
        keep = offs_s[None, :] < S
        if IS_CAUSAL:
            keep = keep & (offs_s[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = alpha * l + tl.sum(p, 1)
        v = tl.load(v_ptrs + start_n * HEAD_DIM, mask=offs_s[:, None] < S, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    return acc, l


def _two_loops(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Natural exp; the key tiles every row sees first, unmasked, then the rest with the mask."""
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = S
    full = 0  # below `full`, every key is real and seen by every row of the tile
    if IS_CAUSAL:
        last_row = tl.minimum(L, start_m * BLOCK_M + BLOCK_M) - 1
        end = tl.minimum(S, last_row + 1)
        full = tl.minimum(end, start_m * BLOCK_M) // BLOCK_N * BLOCK_N
    for start_n in range(0, full, BLOCK_N):
        k = tl.load(k_ptrs + start_n * HEAD_DIM)
        v = tl.load(v_ptrs + start_n * HEAD_DIM)
        s = tl.dot(q, k, input_precision="ieee") * sm_scale
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    for start_n in range(full, end, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_ptrs + start_n * HEAD_DIM, mask=cols[None, :] < S, other=0.0)
        v = tl.load(v_ptrs + start_n * HEAD_DIM, mask=cols[:, None] < S, other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * sm_scale
        hidden = cols[None, :] >= S
        if IS_CAUSAL:
            hidden = hidden | (cols[None, :] > offs_m[:, None])
        s = tl.where(hidden, float("-inf"), s)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    return acc, l


def _slipped(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
             SLIP: tl.constexpr):
    """The loop with one slip (see _SLIPS)."""
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float16 if SLIP == 8 else tl.float32)
    l = tl.zeros([BLOCK_M], dtype=m.dtype)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=m.dtype)
    hi = S
    if IS_CAUSAL:
        if SLIP == 3:
            hi = tl.minimum(S, start_m * BLOCK_M)
        elif SLIP == 4:
            hi = tl.minimum(S, tl.minimum(L, (start_m + 1) * BLOCK_N))
        elif SLIP == 6:
            hi = tl.minimum(S, (start_m + 1) * BLOCK_M)
        elif SLIP != 5:
            hi = tl.minimum(S, tl.minimum(L, (start_m + 1) * BLOCK_M))
    for start_n in range(0, hi, BLOCK_N):
        offs_s = start_n + offs_n
        k = tl.load(k_ptrs + start_n * HEAD_DIM, mask=offs_s[None, :] < S, other=0.0)
        s = tl.dot(q, k, input_precision="ieee")
        if SLIP != 2:
            s = s * sm_scale
        keep = offs_s[None, :] < S
        if IS_CAUSAL and SLIP != 7:
            keep = keep & (offs_s[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1).to(m.dtype))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp((m - m_new).to(tl.float32))
        l = (alpha * l + tl.sum(p, 1)).to(m.dtype)
        v = tl.load(v_ptrs + start_n * HEAD_DIM, mask=offs_s[:, None] < S, other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        if SLIP == 1:
            acc = (acc + pv).to(m.dtype)
        else:
            acc = (acc * alpha[:, None] + pv).to(m.dtype)
        m = m_new
    return acc.to(tl.float32), l.to(tl.float32)


def _slip_template(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr):
    # `slipped` and `SLIP` are the globals _loops() gives each copy of this function
    return slipped(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale,  # type: ignore[name-defined] # noqa: F821
                   BLOCK_M, BLOCK_N, HEAD_DIM, IS_CAUSAL, SLIP)  # type: ignore[name-defined] # noqa: F821
# fmt: on

#: The slips of _slipped, numbered from 1, as the mistakes name them.
_SLIPS = ("keep_acc", "no_scale", "no_diagonal", "block_n", "no_skip", "ragged", "no_mask", "half")


@cache
def _loops() -> dict[str, Any]:
    """The variants and mistakes as Triton functions (compiled or interpreted, as the
    environment says when they are first built)."""
    import triton

    loops = {"by_exp2": triton.jit(_by_exp2), "two_loops": triton.jit(_two_loops)}
    slipped = triton.jit(_slipped)
    for n, name in enumerate(_SLIPS, 1):
        scope = {**_slip_template.__globals__, "slipped": slipped, "SLIP": tl.constexpr(n)}
        fn = types.FunctionType(
            _slip_template.__code__, scope, "_slip_template"
        )  # as in its source
        fn.__annotations__ = dict(_slip_template.__annotations__)  # its tl.constexpr (see _kernel)
        loops[name] = triton.jit(fn)
    return loops


def _loop(name: str) -> Lazy:
    return Lazy(lambda: _loops()[name])


# --- the checker --------------------------------------------------------------------------------


class _Case(NamedTuple):
    """Sizes, and whether causal; a causal case has one head per query tile (see _inputs)."""

    B: int
    H: int
    L: int
    S: int
    D: int
    causal: bool
    block_m: int
    block_n: int


_CASES = (
    _Case(2, 2, 40, 72, 32, False, 16, 16),
    _Case(1, 2, 40, 80, 16, True, 32, 16),
    _Case(1, 3, 48, 48, 32, True, 16, 32),
    _Case(1, 3, 72, 40, 64, True, 32, 16),
)
#: float32 in the interpreter; float16 on a GPU (where float32 tiles would go through TF32).
_TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 4e-3)}


class _Inputs(NamedTuple):
    q: Tensor  # (B, H, L, D) on the device
    k: Tensor  # (B, H, S, D)
    v: Tensor
    k_nan: Tensor  # k and v with NaN in the key tiles some query tiles must skip
    v_nan: Tensor
    want: Tensor  # (B, H, L, D) float64, SDPA on the CPU
    compared: Tensor  # (B, H, L) bool: the rows compared when the NaN-filled tiles are used


def _label(c: _Case) -> str:
    message = (
        "attention_loop on L={L}, S={S}, D={D}, is_causal={causal}, BLOCK_M={bm}, BLOCK_N={bn}"
    )
    return tr(message, L=c.L, S=c.S, D=c.D, causal=c.causal, bm=c.block_m, bn=c.block_n)


def _hi(c: _Case, tile: int) -> int:
    """Where the keys that query tile ``tile`` needs end: the causal loop bound."""
    return min(c.S, c.L, (tile + 1) * c.block_m) if c.causal else c.S


@cache
def _inputs(index: int, device: str) -> _Inputs:
    """Case ``index`` on ``device``. Causal: head h holds NaN from the first key tile that query
    tile h skips on; query tiles 0..h skip it too, so their rows are compared, and a loop that
    reads a tile it should skip turns its rows into NaN."""
    c = _CASES[index]
    dtype = torch.float32 if device == "cpu" else torch.float16
    g = torch.Generator().manual_seed(62 + index)
    q, k, v = (torch.randn(c.B, c.H, n, c.D, generator=g).to(dtype) for n in (c.L, c.S, c.S))
    q64, k64, v64 = (t.double() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q64, k64, v64, is_causal=c.causal)
    compared = torch.ones(c.B, c.H, c.L, dtype=torch.bool)  # (B, H, L)
    k_nan, v_nan = k.clone(), v.clone()
    if c.causal:
        for h in range(c.H):
            first = -(-_hi(c, h) // c.block_n) * c.block_n  # the first key tile it skips
            k_nan[:, h, first:] = v_nan[:, h, first:] = float("nan")
            compared[:, h, (h + 1) * c.block_m :] = False
    q, k, v, k_nan, v_nan = (t.to(device) for t in (q, k, v, k_nan, v_nan))
    return _Inputs(q, k, v, k_nan, v_nan, want, compared)


_OUTPUTS: dict[tuple[int, int, str, bool], object] = {}  # the declared answers' outputs


def _run(loop: Any, index: int, device: str, clean: bool = False) -> object:
    """The skeleton's output with ``loop`` on case ``index``, on the CPU (the NaN-filled keys
    and values unless ``clean``); or the exception it raised."""
    declared = any(loop is known for known in _loops().values())
    key = (id(loop), index, device, clean)
    if declared and key in _OUTPUTS:
        return _OUTPUTS[key]
    c, x = _CASES[index], _inputs(index, device)
    keys = (x.k, x.v) if clean else (x.k_nan, x.v_nan)
    try:
        out: object = skeleton_attention(
            loop, x.q, *keys, c.causal, block_m=c.block_m, block_n=c.block_n
        ).cpu()
    except Exception as err:  # noqa: BLE001 - the learner's bug, quoted back
        out = err
    if declared:
        _OUTPUTS[key] = out
    return out


def _problem(got: object, index: int, device: str, clean: bool = False) -> str | None:
    """How ``got`` differs from SDPA on the compared rows (all rows if ``clean``), or None."""
    x = _inputs(index, device)
    if not isinstance(got, Tensor):
        return "raised"
    rows = torch.ones_like(x.compared) if clean else x.compared
    atol, rtol = _TOLERANCE[got.dtype]
    return difference(got[rows], x.want[rows].to(got.dtype), atol=atol, rtol=rtol)


def _alike(a: object, b: object, index: int, device: str) -> bool:
    """Do two outputs agree on the compared rows (NaN where the other has NaN)?"""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False
    rows = _inputs(index, device).compared
    atol, rtol = _TOLERANCE[a.dtype]
    return bool(torch.allclose(a[rows], b[rows].to(a.dtype), atol, rtol, equal_nan=True))


_RESCALE = (
    "When a tile raises a row's maximum, shrink what the row holds: alpha = exp(m - m_new), "
    "l = alpha * l + tl.sum(p, 1), acc = acc * alpha[:, None] + tl.dot(p, v)."
)
_SCALE = "Multiply the scores by sm_scale (1/√D) before the softmax."
_DIAGONAL = (
    "The causal loop stops one tile short: the last row of query tile start_m is "
    "(start_m + 1) * BLOCK_M - 1, and it sees keys up to itself, so the diagonal tile is needed."
)
_BLOCK_M = (
    "The bound comes from the query tile: its rows end at (start_m + 1) * BLOCK_M, whatever "
    "BLOCK_N is."
)
_SKIP = (
    "Right values, but the skip is the point: with IS_CAUSAL the loop ends at the query tile's "
    "last row, hi = min(S, L, (start_m + 1) * BLOCK_M), so no key tile past it is ever loaded "
    "(the checker filled them with NaN)."
)
_RAGGED = (
    "Right values, but the last query tile is ragged: its rows stop at L - 1, so bound the loop "
    "with min(L, ...) as well, or it loads a key tile none of its real rows sees."
)
_MASK = (
    "The diagonal tile needs the causal mask: keep score (i, j) only where j <= i "
    "(offs_s[None, :] <= offs_m[:, None]), and -inf elsewhere."
)
_FLOAT32 = (
    "Keep m, l and acc in float32 (tl.float32), whatever the inputs' dtype: float16 statistics "
    "lose the digits the softmax needs."
)
_NO_LIBRARY = (
    "write the loop yourself: not the course's kernel (mha.triton_flash's triton_attention, "
    "_attn_fwd_kernel and their helpers), nor mha.flash_attention or any ready-made attention."
)
_CRASH = (
    "Keep the signature attention_loop(q, k_ptrs, v_ptrs, start_m, L, S, sm_scale, BLOCK_M, "
    "BLOCK_N, HEAD_DIM, IS_CAUSAL) and return (acc, l), float32, shaped (BLOCK_M, HEAD_DIM) and "
    "(BLOCK_M,); cast p to v.dtype before tl.dot(p, v)."
)
_HINT = (
    "Per key tile: scores = tl.dot(q, k) * sm_scale, -inf where hidden (keys past S; with "
    "IS_CAUSAL, keys past the row); m_new = max(m, row max); p = exp(scores - m_new); "
    "alpha = exp(m - m_new); l and acc rescaled by alpha, plus the tile's share."
)
_SUCCESS = (
    f"equal to SDPA in {len(_CASES)} cases (causal and not; L < S, L = S and L > S; D from 16 to "
    "64; tiles 16×16, 32×16 and 16×32); with is_causal it loaded no key or value tile past a "
    "query tile's last row (those tiles held NaN)"
)


def _diagnose(answer: Any, got: object, index: int, device: str) -> str:
    """The hint of the first declared mistake that gives the learner's output, or the generic
    one (the skip's, if the same loop gives the right values on the keys without NaN)."""
    for mistake, hint in ATTENTION_LOOP.mistakes:
        if hint == _NO_LIBRARY:
            continue
        out = _run(ATTENTION_LOOP.as_answer(mistake), index, device)
        if _problem(out, index, device) and _alike(got, out, index, device):
            return tr(hint)
    clean = _run(answer, index, device, clean=True)
    if _CASES[index].causal and not _problem(clean, index, device, clean=True):
        return tr(_SKIP)
    return tr(_HINT)


#: Everything the learner's loop must not be, nor call.
_BANNED: tuple[Any, ...] = (
    *defined_in(triton_flash),
    *(
        getattr(triton_flash, name)
        for name in vars(triton_flash)
        if name.startswith("_attn_") and name.endswith("_kernel")
    ),
    *defined_in(flash),
    *defined_in(attention),
    F.scaled_dot_product_attention,
    F.multi_head_attention_forward,
)
_BANNED_MODULES = (triton_flash, flash, attention, F)


def _banned_reference(answer: Any) -> Any:
    """The banned function ``answer`` is, or names in its code (following the Triton functions it
    calls), or None."""
    seen: set[int] = set()

    def banned(obj: Any) -> Any:
        for candidate in (obj, getattr(obj, "fn", None)):
            if candidate is not None and any(candidate is b for b in _BANNED):
                return candidate
        return None

    def walk(obj: Any) -> Any:
        found = banned(obj)
        fn = getattr(obj, "fn", None)
        if found is not None or not isinstance(fn, types.FunctionType) or id(fn) in seen:
            return found
        seen.add(id(fn))
        names = fn.__code__.co_names
        cells = [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not None]
        for value in [fn.__globals__.get(n) for n in names] + cells:
            if any(value is module for module in _BANNED_MODULES):
                for name in names:
                    found = banned(getattr(value, name, None))
                    if found is not None:
                        return found
            elif hasattr(value, "fn"):
                found = walk(value)
                if found is not None:
                    return found
        return None

    return walk(answer)


def _check(answer: Any) -> str:
    found = _banned_reference(answer)
    if found is not None:
        err = ExerciseError(f"{ATTENTION_LOOP.name}: {tr(_NO_LIBRARY)}")
        err.banned = found
        raise err
    kind = _triton_kind(answer)
    device = "cpu" if kind.__name__ == "InterpretedFunction" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ExerciseError(
            tr(
                "your kernel was compiled for a GPU, but there is none. Set "
                "os.environ['TRITON_INTERPRET'] = '1' before the first `import triton`, then "
                "restart the kernel and run the chapter again."
            )
        )
    for index, case in enumerate(_CASES):
        got = _run(answer, index, device)
        label = _label(case)
        if isinstance(got, Exception):
            error = f"{type(got).__name__}: {(str(got).splitlines() or [''])[0]}"
            message = "{label} raised {error}. {hint}"
            raise ExerciseError(tr(message, label=label, error=error, hint=tr(_CRASH)))
        problem = _problem(got, index, device)
        if problem:
            hint = _diagnose(answer, got, index, device)
            message = "{label}: out {problem}. {hint}"
            raise ExerciseError(tr(message, label=label, problem=problem, hint=hint))
    return tr(_SUCCESS)


ATTENTION_LOOP = Exercise(
    "check_attention_loop",
    _SUCCESS,
    None,
    variants=(_loop("by_exp2"), _loop("two_loops")),
    mistakes=(
        (_loop("keep_acc"), _RESCALE),
        (_loop("no_scale"), _SCALE),
        (_loop("half"), _FLOAT32),
        (_loop("no_diagonal"), _DIAGONAL),
        (_loop("no_mask"), _MASK),
        (_loop("block_n"), _BLOCK_M),
        (_loop("no_skip"), _SKIP),
        (_loop("ragged"), _RAGGED),
        (triton_flash.triton_attention, _NO_LIBRARY),
        (triton_flash._triton_attention, _NO_LIBRARY),
        (Lazy(lambda: triton_flash._attn_fwd_kernel), _NO_LIBRARY),
    ),
    hint=_HINT,
    crash_hint=_CRASH,
    custom=_check,
    forbidden=_BANNED,
    rewrites=(triton_flash.triton_attention,),
    forbidden_hint=_NO_LIBRARY,
    params=("attention_loop",),
    doc="Check ``attention_loop``, the ``@triton.jit`` loop of a FlashAttention forward kernel "
    "(the running state, the causal bound, the online softmax over key tiles), run by the "
    "skeleton kernel on the GPU or in Triton's interpreter: against SDPA, causal and not, and "
    "with is_causal for the key tiles it must skip (filled with NaN).",
)


# --- on a GPU: a line to compare ------------------------------------------------------------


__all__ = ["ATTENTION_LOOP", "flash_forward_skeleton", "skeleton_attention"]
