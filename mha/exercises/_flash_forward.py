"""Section 5.3's capstone, the whole tiled forward, as data for :mod:`._harness`; published by
:mod:`.ch05` with the chapter's other exercises."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import cache, partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention
from torch.overrides import TorchFunctionMode

import mha

from .. import attention, flash
from ._harness import Case, Exercise, ExerciseError, defined_in, never_larger, tr

# --- 5.3: the whole tiled forward, the capstone ----------------------------------------------


def _causal_offset(causal: str | None, L: int, S: int) -> int | None:
    """Query ``i`` sees key ``j`` when ``j <= i + offset``; None without a causal mask."""
    if causal not in (None, "bottom-right", "top-left"):
        raise ValueError(f"causal must be None, 'bottom-right' or 'top-left', got {causal!r}")
    return None if causal is None else (S - L if causal == "bottom-right" else 0)


def _flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: str | None = None,
    block_q: int = 16,
    block_k: int = 16,
    **slip: bool,
) -> tuple[Tensor, Tensor]:
    """The tiled forward with an online softmax: right without ``slip``, or with one slip."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    offset = _causal_offset("top-left" if causal and slip.get("top_left") else causal, L, S)
    stats = q.dtype if slip.get("half") else torch.float32  # m, l, acc and the scores
    # (B, Hkv, G, L, D): the G query heads that share a key/value head, side by side
    qg = (q.to(stats) * D**-0.5).unflatten(1, (Hkv, H // Hkv))
    kf, vf = k.to(stats).unsqueeze(2), v.to(stats).unsqueeze(2)  # (B, Hkv, 1, S, D)
    out = torch.zeros(B, Hkv, H // Hkv, L, D, dtype=stats)
    lse = torch.zeros(B, Hkv, H // Hkv, L, dtype=stats)
    for q0 in range(0, L, block_q):
        q1 = min(q0 + block_q, L)
        m = torch.full((*qg.shape[:3], q1 - q0, 1), float("-inf"), dtype=stats)
        l = torch.zeros_like(m)  # (B, Hkv, G, R, 1)
        acc = torch.zeros(*qg.shape[:3], q1 - q0, D, dtype=stats)  # (B, Hkv, G, R, D)
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if offset is not None and k0 > q1 - 1 + offset and not slip.get("all_tiles"):
                break  # no row of this block sees this tile, nor any later one
            scores = qg[..., q0:q1, :] @ kf[..., k0:k1, :].transpose(-2, -1)  # (.., R, C)
            if offset is not None and k1 - 1 > q0 + offset:  # some key of the tile is hidden
                rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)
                scores = scores.masked_fill(cols > rows + offset, float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            shift = m_new if slip.get("no_guard") else m_new.nan_to_num(neginf=0.0)
            p = torch.exp(scores - shift)  # (B, Hkv, G, R, C)
            alpha = torch.exp(m - shift)  # (B, Hkv, G, R, 1)
            l = alpha * l + p.sum(-1, keepdim=True)
            acc = (1.0 if slip.get("keep_acc") else alpha) * acc + p @ vf[..., k0:k1, :]
            m = m_new
        out[..., q0:q1, :] = acc / torch.where(l == 0, 1.0, l)  # a row that saw no key: 0
        lse[..., q0:q1] = (l.log() if slip.get("no_max") else m + l.log()).squeeze(-1)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).float()


def _flash_whole_scores(
    q: Tensor, k: Tensor, v: Tensor, causal: str | None = None, block_q=16, block_k=16
) -> tuple[Tensor, Tensor]:
    """Tiles of scores computed as asked, then written into one (L, S) matrix per head."""
    B, H, L, D = q.shape
    S, G = k.shape[2], H // k.shape[1]
    offset = _causal_offset(causal, L, S)
    kf, vf = (t.float().repeat_interleave(G, 1) for t in (k, v))  # (B, H, S, D)
    scores = torch.full((B, H, L, S), float("-inf"))  # the whole matrix
    for q0 in range(0, L, block_q):
        for k0 in range(0, S, block_k):
            if offset is None or k0 <= min(q0 + block_q, L) - 1 + offset:
                rows, cols = slice(q0, q0 + block_q), slice(k0, k0 + block_k)
                scores[..., rows, cols] = q[..., rows, :].float() @ kf[..., cols, :].mT / D**0.5
    if offset is not None:
        hidden = torch.arange(S) > torch.arange(L)[:, None] + offset
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # (B, H, L)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return (p @ vf).to(q.dtype), lse


def _flash_by_key_tiles(q, k, v, causal=None, block_q=16, block_k=16):
    """Key tiles outside, query blocks inside (FlashAttention-1's order); heads repeated for
    GQA, einsum and a mask made with torch.where."""
    B, H, L, D = q.shape
    S = k.shape[2]
    shift = {None: None, "bottom-right": S - L, "top-left": 0}[causal]
    q32 = q.float() / math.sqrt(D)
    k32, v32 = (t.float().repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
    m = torch.full((B, H, L, 1), -math.inf)
    l = torch.zeros(B, H, L, 1)
    acc = torch.zeros(B, H, L, D)
    for k0 in range(0, S, block_k):
        kt, vt = k32[:, :, k0 : k0 + block_k], v32[:, :, k0 : k0 + block_k]
        for q0 in range(0, L, block_q):
            q1 = min(q0 + block_q, L)
            if shift is not None and q1 - 1 + shift < k0:
                continue  # every key of this tile is in the future of every row
            s = torch.einsum("bhrd,bhcd->bhrc", q32[:, :, q0:q1], kt)
            if shift is not None:
                see = torch.arange(k0, k0 + kt.shape[2]) <= torch.arange(q0, q1)[:, None] + shift
                s = torch.where(see, s, -math.inf)
            rows = slice(q0, q1)
            new_m = torch.max(m[:, :, rows], s.max(-1, keepdim=True).values)
            safe = torch.where(new_m == -math.inf, 0.0, new_m)
            p = (s - safe).exp()
            scale = (m[:, :, rows] - safe).exp()
            l[:, :, rows] = scale * l[:, :, rows] + p.sum(-1, keepdim=True)
            acc[:, :, rows] = scale * acc[:, :, rows] + torch.einsum("bhrc,bhcd->bhrd", p, vt)
            m[:, :, rows] = new_m
    out = torch.where(l > 0, acc / l, 0.0)
    return out.to(q.dtype), (m + l.log()).squeeze(-1)


def _flash_per_head(q, k, v, causal=None, block_q=16, block_k=16):
    """One head at a time (key head h // G), torch.matmul, a tril mask per diagonal tile."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out, lse = torch.empty(B, H, L, D, dtype=q.dtype), torch.empty(B, H, L)
    for h in range(H):
        qh = q[:, h].float() * D**-0.5  # (B, L, D)
        kh, vh = k[:, h // (H // Hkv)].float(), v[:, h // (H // Hkv)].float()  # (B, S, D)
        for q0 in range(0, L, block_q):
            q1 = min(q0 + block_q, L)
            m = torch.full((B, q1 - q0, 1), -torch.inf)
            l, acc = torch.zeros(B, q1 - q0, 1), torch.zeros(B, q1 - q0, D)
            last = S if causal is None else q1 + (S - L if causal == "bottom-right" else 0)
            for k0 in range(0, min(S, last), block_k):  # the tiles some row sees
                k1 = min(k0 + block_k, S)
                s = torch.matmul(qh[:, q0:q1], kh[:, k0:k1].transpose(1, 2))  # (B, R, C)
                if causal is not None:
                    diagonal = q0 + (S - L if causal == "bottom-right" else 0) - k0
                    keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(diagonal)
                    s = s.masked_fill(~keep, -torch.inf)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p, fade = torch.exp(s - base), torch.exp(m - base)
                m, l, acc = m_new, l * fade + p.sum(-1, keepdim=True), acc * fade + p @ vh[:, k0:k1]
            out[:, h, q0:q1] = (acc / l.clamp_min(1e-30)).to(q.dtype)
            lse[:, h, q0:q1] = (m + torch.log(l)).squeeze(-1)
    return out, lse


#: The matrix products an answer may compute scores with, as a TorchFunctionMode sees them
#: (``a @ b`` arrives as ``Tensor.matmul``).
_PRODUCTS = {
    *(getattr(m, n) for m in (torch, Tensor) for n in ("matmul", "bmm", "mm", "baddbmm", "addmm")),
    *(torch.einsum, torch.tensordot, torch.inner, Tensor.inner, torch.linalg.matmul, F.linear),
}


class _ScoreProducts(TorchFunctionMode):
    """Sees every matrix product of ``_PRODUCTS`` the answer makes and keeps the score products:
    those whose result does not end in the head dim ``D`` (in the checker's cases no tile has
    ``D`` rows or keys, so a product of weights and values always ends in ``D``)."""

    def __init__(self, D: int) -> None:
        super().__init__()
        self.D, self.total, self.largest = D, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in _PRODUCTS and isinstance(out, Tensor) and out.dim() and out.shape[-1] != self.D:
            self.total += out.numel()
            self.largest = max(self.largest, out.numel())
        return out


class WholeScoreMatrix(Exception):
    """The answer made a tensor as large as a head's whole (L, S) score matrix."""


class TileTooLarge(Exception):
    """One score product of the answer covered more than one tile."""


class _Flash(NamedTuple):
    """A case's sizes: batch, query heads, key/value heads, L, S, head dim, causal, blocks."""

    B: int
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    causal: str | None
    block_q: int
    block_k: int
    dtype: torch.dtype = torch.float32
    big: float = 1.0  # scales q and k: larger scores
    guard: bool = False  # run under never_larger(L * S)


_FLASH = (
    _Flash(2, 4, 2, 40, 72, 24, None, 16, 16),
    _Flash(2, 4, 2, 40, 72, 24, "bottom-right", 16, 16),
    _Flash(1, 4, 2, 70, 40, 24, "bottom-right", 16, 8),
    _Flash(2, 2, 2, 40, 72, 24, "top-left", 8, 16),
    _Flash(1, 4, 1, 72, 40, 24, "top-left", 16, 16),
    _Flash(2, 4, 2, 64, 100, 24, "bottom-right", 16, 16, torch.float16, big=3.0),
    _Flash(1, 4, 2, 64, 48, 24, None, 32, 16, torch.bfloat16),
    _Flash(1, 2, 1, 96, 80, 8, "bottom-right", 16, 16, guard=True),
)


#: out is rounded to the input dtype: float16 keeps 11 significant bits, bfloat16 8.
_FLASH_TOLERANCE = {
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def _visible_area(c: _Flash) -> int:
    """The scores per head of the tiles some query sees: what the tiled loop computes."""
    offset = _causal_offset(c.causal, c.L, c.S)
    return sum(
        (min(q0 + c.block_q, c.L) - q0) * (min(k0 + c.block_k, c.S) - k0)
        for q0 in range(0, c.L, c.block_q)
        for k0 in range(0, c.S, c.block_k)
        if offset is None or k0 <= min(q0 + c.block_q, c.L) - 1 + offset
    )


def _flash_label(c: _Flash) -> str:
    """How a case is named in the messages: its sizes and the call's keywords."""
    heads = f"H={c.H}, Hkv={c.Hkv}" if c.H != c.Hkv else f"H={c.H}"
    call = f"causal={c.causal!r}, block_q={c.block_q}, block_k={c.block_k}"
    return f"my_flash_forward(L={c.L}, S={c.S}, {heads}, {str(c.dtype)[6:]}, {call})"


def _flash_cases() -> list[Case]:
    """Every configuration of ``_FLASH``, with SDPA's output and torch.logsumexp's lse (both
    in float64) and the scores per head of the visible tiles."""
    g = torch.Generator().manual_seed(53)
    cases = []
    for c in _FLASH:
        q = (torch.randn(c.B, c.H, c.L, c.D, generator=g) * c.big).to(c.dtype)
        k = (torch.randn(c.B, c.Hkv, c.S, c.D, generator=g) * c.big).to(c.dtype)
        v = torch.randn(c.B, c.Hkv, c.S, c.D, generator=g).to(c.dtype)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        keep = torch.ones(c.L, c.S, dtype=torch.bool)
        offset = _causal_offset(c.causal, c.L, c.S)
        if offset is not None:
            keep = keep.tril(offset)
        out = F.scaled_dot_product_attention(q64, k64, v64, keep, enable_gqa=True)
        out = torch.where(keep.any(-1)[:, None], out, 0.0)  # a row that sees no key: 0
        k_all = k64.repeat_interleave(c.H // c.Hkv, 1)  # (B, H, S, D)
        scores = (q64 @ k_all.mT / math.sqrt(c.D)).masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # (B, H, L)
        kwargs = {"causal": c.causal, "block_q": c.block_q, "block_k": c.block_k}
        tol = _FLASH_TOLERANCE.get(c.dtype, {})  # the output is rounded to 16 bits
        expected = (out.to(c.dtype), lse.float(), _visible_area(c))
        cases.append(Case(_flash_label(c), (q, k, v), kwargs, expected, **tol))
    return cases


_GUARDED = {_flash_label(c) for c in _FLASH if c.guard}  # whose inputs, output, tiles < L·S


def _flash_run(answer: Callable[..., Any], case: Case) -> object:
    """``(out, lse, scores per head)``: the answer's output and the scores its matrix products
    computed, divided by B·H. Raises WholeScoreMatrix (a guarded case) or TileTooLarge."""
    q, k, v = (t.clone() for t in case.args)
    B, H, L, D = q.shape
    S = k.shape[-2]
    products = _ScoreProducts(D)
    guard: contextlib.AbstractContextManager[list[tuple[int, ...]]] = (
        never_larger(L * S, "") if case.label in _GUARDED else contextlib.nullcontext([])
    )
    try:
        with guard as seen, products:
            got = answer(q, k, v, **case.kwargs)
    except ExerciseError:
        if not seen:  # a banned call: the harness says so
            raise
        message = "made a tensor of {n} elements or more, as many as a whole (L, S) score matrix"
        raise WholeScoreMatrix(tr(message, n=L * S)) from None
    if got is None:
        return None
    if not (isinstance(got, tuple) and len(got) == 2):
        kind = type(got).__name__
        raise ExerciseError(tr("my_flash_forward should return (out, lse), got {kind}.", kind=kind))
    tile = B * H * case.kwargs["block_q"] * case.kwargs["block_k"]
    if products.largest > tile:
        message = "a matrix product computed more scores than one tile, B·H·block_q·block_k = {n}"
        raise TileTooLarge(tr(message, n=tile))
    per_head, rest = divmod(products.total, B * H)
    return (*got, per_head if not rest else products.total / (B * H))


def _flash_all_at_once(q, k, v, causal=None, block_q=16, block_k=16):
    """Every score in one product, then a softmax written out: no tiles at all."""
    L, S, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(G, 1) for t in (k, v))  # (B, H, S, D)
    scores = q.float() @ kf.mT / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if causal is not None:
        hidden = torch.arange(S) > torch.arange(L)[:, None] + _causal_offset(causal, L, S)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # (B, H, L)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return (p @ vf).to(q.dtype), lse


def _flash_by_library(q, k, v, causal=None, block_q=16, block_k=16):
    """mha.flash_attention, with a bottom-right mask made for it."""
    L, S = q.shape[2], k.shape[2]
    mask = mha.causal_mask_bottom_right(L, S) if causal == "bottom-right" else None
    return mha.flash_attention(
        q, k, v, mask, causal == "top-left", block_size=block_k, enable_gqa=True, return_lse=True
    )


def _flash_by_helper(q, k, v, causal=None, block_q=16, block_k=16):
    """The library's loop without its checks: mha.flash.flash_attention_forward."""
    L, S, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    mask = mha.causal_mask_bottom_right(L, S) if causal == "bottom-right" else None
    k, v = (t.repeat_interleave(G, 1) for t in (k, v))
    options = {"scale": q.shape[-1] ** -0.5, "block_size": block_k}
    out, lse = flash.flash_attention_forward(q, k, v, mask, causal == "top-left", **options)
    return out, lse.float()


def _flash_by_private_helper(q, k, v, causal=None, block_q=16, block_k=16):
    """mha.flash's private _flash_attention, the loop behind flash_attention without its checks."""
    L, S, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    mask = mha.causal_mask_bottom_right(L, S) if causal == "bottom-right" else None
    scale = q.shape[-1] ** -0.5
    out, lse = flash._flash_attention(q, k, v, mask, causal == "top-left", scale, block_k, G)
    return out, lse.float()


def _flash_by_sdpa(q, k, v, causal=None, block_q=16, block_k=16):
    """F.scaled_dot_product_attention for out, torch.logsumexp of every score for lse."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True), torch.zeros(q.shape[:-1])


class _NoReadyMade(Sequence):
    """The functions the tiled forward must not call; the Triton forward's once it is loaded
    (importing it here would import Triton before a notebook can choose its interpreter)."""

    def __init__(self, fixed: Sequence[Callable[..., Any]]) -> None:
        self.fixed = tuple(fixed)

    @cache  # noqa: B019 - two states at most: with and without the Triton module
    def _with(self, triton_flash: Any) -> tuple[Callable[..., Any], ...]:
        return self.fixed + (tuple(defined_in(triton_flash)) if triton_flash else ())

    def _all(self) -> tuple[Callable[..., Any], ...]:
        return self._with(sys.modules.get("mha.triton_flash"))

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._all()[index]

    def __iter__(self) -> Iterator[Callable[..., Any]]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


_SOFTMAX_NAMES = ("softmax", "log_softmax")
_FLASH_BANNED = _NoReadyMade(
    (
        *defined_in(flash),
        *defined_in(attention),
        F.scaled_dot_product_attention,
        F.multi_head_attention_forward,
        flex_attention,
        mha.varlen_attention,
        mha.paged_attention,
        mha.flash_decoding,
        mha.topk_sparse_attention,
        *(getattr(m, n) for m in (torch, torch.special, F, Tensor) for n in _SOFTMAX_NAMES),
        torch._softmax,
    )
)

_FLASH_NO_LIBRARY = (
    "write the tile loop yourself: nothing from mha.flash (flash_attention, tile_schedule, "
    "online_softmax_update ...), no ready-made attention (mha.scaled_dot_product_attention, "
    "F.scaled_dot_product_attention ...) and no softmax function: the online softmax is the point."
)
_FLASH_RESCALE = (
    "When a tile raises a row's maximum, shrink what it holds: alpha = exp(m - m_new), "
    "l = alpha * l + p.sum(-1), acc = alpha * acc + p @ v_tile."
)
_FLASH_LSE = "lse is m + log(l): l counts exp(score - m), relative to the running maximum m."
_FLASH_ALIGN = (
    "causal='bottom-right' puts the L queries at the end of the S keys: query i sees key j "
    "when j <= i + S - L ('top-left': j <= i)."
)
_FLASH_SKIP = (
    "Right values, but the skip is the point: a query block never computes a key tile whose first "
    "key k0 is past what its last row sees (k0 > q1 - 1 + offset); only the tiles on the "
    "diagonal need a mask."
)
_FLASH_ONE_TILE = (
    "Compute the scores one tile at a time: q[..., q0:q1, :] @ k[..., k0:k1, :].mT, at most "
    "(block_q, block_k) per head, folded into m, l and acc before the next one."
)
_FLASH_NO_MATRIX = (
    "Never keep the whole (L, S) matrix, of scores or of a mask: fold each tile into m, l and "
    "acc and let it go; build a diagonal tile's mask from torch.arange of its rows and keys."
)
_FLASH_FLOAT32 = (
    "Keep the scores, m, l and acc in float32 (q.float() ...) and round only out to the input's "
    "dtype at the end; lse stays float32."
)
_FLASH_EMPTY = (
    "A row that has seen no visible key keeps m = -inf: subtract 0 there, not m (exp(-inf + inf) "
    "is NaN), and give it out = 0 (l is 0) and lse = -inf."
)
_FLASH_SUCCESS = (
    f"out and lse match SDPA and torch.logsumexp in {len(_FLASH)} cases (GQA, L ≠ S both ways, "
    "causal bottom-right and top-left, float16, bfloat16); scores computed only for the visible "
    "tiles, one tile per product; never held an (L, S) tensor at L=96, S=80"
)

FLASH_FORWARD = Exercise(
    "check_flash_forward",
    _FLASH_SUCCESS,
    _flash_forward,
    _flash_cases,
    variants=(_flash_by_key_tiles, _flash_per_head),
    mistakes=(
        (partial(_flash_forward, keep_acc=True), _FLASH_RESCALE),
        (partial(_flash_forward, no_max=True), _FLASH_LSE),
        (partial(_flash_forward, top_left=True), _FLASH_ALIGN),
        (partial(_flash_forward, no_guard=True), _FLASH_EMPTY),
        (partial(_flash_forward, half=True), _FLASH_FLOAT32),
        (partial(_flash_forward, all_tiles=True), _FLASH_SKIP),
        (_flash_whole_scores, _FLASH_NO_MATRIX),
        (_flash_all_at_once, _FLASH_ONE_TILE),
        (_flash_by_library, _FLASH_NO_LIBRARY),
        (_flash_by_helper, _FLASH_NO_LIBRARY),
        (_flash_by_private_helper, _FLASH_NO_LIBRARY),
        (_flash_by_sdpa, _FLASH_NO_LIBRARY),
    ),
    hint={
        "out": "Per query block: m = -inf, l = 0, acc = 0; for each visible key tile update them "
        "(alpha = exp(m - m_new) rescales l and acc); then out = acc / l.",
        "lse": _FLASH_LSE,
        "scores_computed": "Compute each visible tile's scores with one matrix product (@, "
        "torch.matmul or torch.einsum), and no tile that no row of the query block sees.",
    },
    crash_hint="q is (B, H, L, D), k and v are (B, Hkv, S, D) with H a multiple of Hkv: query "
    "head h reads key/value head h // (H // Hkv).",
    exact_dtype=True,
    outputs=("out", "lse", "scores_computed"),
    call=_flash_run,
    forbidden=_FLASH_BANNED,
    rewrites=(flash.flash_attention,),
    forbidden_hint=_FLASH_NO_LIBRARY,
    params=("my_flash_forward",),
    doc="Check ``my_flash_forward(q, k, v, causal=None, block_q=16, block_k=16) -> (out, lse)``, "
    "the whole tiled forward with an online softmax, against SDPA and torch.logsumexp; with the "
    "scores its matrix products computed (only the visible tiles, one tile per product) and, "
    "in one case, no tensor as large as an (L, S) score matrix.",
)
