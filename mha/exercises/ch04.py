"""Chapter 4, masking: the exercises as data for :mod:`._harness`, with NaN on rows that see no
key (forward and backward) and fills that overflow float16 among the mistakes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import bias as torch_bias

import mha

from .. import flex, masks
from .. import multihead as _multihead_module
from ..masks import padding_mask
from . import _writer
from ._harness import Case, Exercise, ExerciseError, as_shape, defined_in, publish, tr
from .ch01 import READY_MADE_ATTENTION

_INVERTED = "Inverted: here (and in SDPA) True = may attend; flip it with ~."
_NOT_BOOL = "Return a bool tensor: a 1/0 float mask is *added* to the scores and masks nothing."
_READ_AS_LS = "Against (B, H, L, S) scores a (B, S) mask is read as (L, S): return (B, 1, 1, S)."


def _padding(lengths: Tensor, S: int) -> Tensor:
    return (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


_ROWS_NOT_KEYS = "That shape masks queries (rows); padding hides *keys*: (B, 1, 1, S)."
_OFF_BY_ONE = "One too {} token kept: a sequence of length n keeps positions j < n."
_NO_PADDING_MASK = "build the mask yourself, without mha.padding_mask or any other of mha's masks."

#: Every function of mha/masks.py (public and private) and of mha/flex.py (the same masks as
#: FlexAttention mask_mods, and ALiBi's slopes), and torch's bottom-right causal bias.
_MASK_LIBRARY: tuple[Callable[..., Any], ...] = (
    *defined_in(masks),
    *defined_in(flex),
    torch_bias.causal_lower_right,
    torch_bias.CausalBias._materialize,
)


def _padding_by_private_helper(lengths: Tensor, S: int) -> Tensor:
    """Row n of the causal mask's private helper, one diagonal down, keeps exactly j < n."""
    return masks._causal_mask(S + 1, S, diagonal=-1)[lengths][:, None, None, :]


PADDING_MASK = Exercise(
    "check_padding_mask",
    "(B, 1, 1, S) bool, True for real tokens",
    _padding,
    lambda: [
        Case(f"padding_mask(lengths={n}, S={S})", (torch.tensor(n), S))
        for n, S in (([3, 5, 0, 1], 5), ([2, 7], 7), ([4], 6))
    ],
    variants=(
        lambda lengths, S: (torch.arange(S) < lengths.unsqueeze(-1)).view(-1, 1, 1, S),
        lambda lengths, S: torch.stack([torch.arange(S) < n for n in lengths])[:, None, None],
    ),
    mistakes=(
        (lambda lengths, S: ~_padding(lengths, S), _INVERTED),
        (lambda lengths, S: _padding(lengths + 1, S), _OFF_BY_ONE.format("many")),
        (lambda lengths, S: _padding(lengths - 1, S), _OFF_BY_ONE.format("few")),
        (lambda lengths, S: _padding(lengths, S)[:, 0, 0], _READ_AS_LS),
        (lambda lengths, S: _padding(lengths, S).transpose(-2, -1), _ROWS_NOT_KEYS),
        (lambda lengths, S: _padding(lengths, S).float(), _NOT_BOOL),
        (padding_mask, _NO_PADDING_MASK),
        (_padding_by_private_helper, _NO_PADDING_MASK),
    ),
    hint="Keep position j of sequence b when j < lengths[b], shaped (B, 1, 1, S).",
    exact_dtype=True,
    forbidden=_MASK_LIBRARY,
    forbidden_hint=_NO_PADDING_MASK,
    rewrites=(padding_mask,),
    doc="Check ``fn(lengths, S)``: the ``(B, 1, 1, S)`` keep-mask of right-padded sequences.",
)


def _ones(L: int, S: int | None = None) -> Tensor:
    return torch.ones(L, L if S is None else S, dtype=torch.bool)  # (L, S)


def _cache_mask(L: int, S: int, window: int | None = None) -> Tensor:
    """mha's semantics: the bottom-right causal mask, or the last L rows of the (S, S) causal
    sliding window (the reference, run outside the ban)."""
    if window is None:
        return masks.causal_mask_bottom_right(L, S)  # (L, S)
    return masks.sliding_window_mask(S, window=window)[S - L :]  # (L, S)


def _cache_slip(
    L: int, S: int, window: int | None = None, *, shift: int = 0, extra: int = 0, ahead=False
) -> Tensor:
    """The mask by positions, with one usual slip: ``shift`` moves each query (``-(S - L)``: the
    top-left alignment), ``extra`` widens the window, ``ahead`` lets it look forward too."""
    p = torch.arange(L)[:, None] + S - L + shift  # (L, 1): query i's position in the sequence
    j = torch.arange(S)[None, :]  # (1, S)
    keep = (j <= p) if not ahead else (j < p + (window or S + 1))  # (L, S)
    return keep & (j > p - window - extra) if window is not None else keep


def _cache_by_slicing(L: int, S: int, window: int | None = None) -> Tensor:
    ones = torch.ones(S, S, dtype=torch.bool)
    full = ones.tril() if window is None else ones.tril() & ones.triu(1 - window)  # (S, S)
    return full[S - L :]  # the last L queries


def _cache_by_diagonals(L: int, S: int, window: int | None = None) -> Tensor:
    ones = torch.ones(L, S, dtype=torch.bool)
    return ones.tril(S - L) & (ones.triu(S - L - window + 1) if window else ones)


def _cache_by_library(L: int, S: int, window: int | None = None) -> Tensor:
    if window is None:
        return mha.causal_mask_bottom_right(L, S)
    return mha.sliding_window_mask(S, window=window)[S - L :]


def _cache_by_private_helper(L: int, S: int, window: int | None = None) -> Tensor:
    """mha.masks' private helper, reached around the public names."""
    keep = masks._causal_mask(L, S, diagonal=S - L)
    return keep & ~masks._causal_mask(L, S, diagonal=S - L - window) if window else keep


_CACHE_CASES = (
    (4, 4, None),
    (1, 6, None),
    (3, 7, None),
    (1, 1, None),
    (5, 5, 2),
    (1, 8, 3),
    (3, 9, 4),
    (2, 5, 1),
    (2, 7, 2),
    (4, 6, 10),
    (6, 6, 6),
)
_TOP_LEFT = (
    "The L new queries are the last L of the S positions: query i stands at i + S - L "
    "(bottom-right), not at i (top-left, torch's is_causal)."
)
_NO_MASK_FUNCTIONS = (
    "build the mask yourself (comparisons of positions, or tril/triu), without mha's masks or "
    "torch's causal_lower_right."
)
CAUSAL_MASK = Exercise(
    "check_causal_mask",
    f"equal to mha's bottom-right causal mask and causal sliding window on {len(_CACHE_CASES)} "
    "shapes (L = 1, L = S, L < S, a window longer than S)",
    _cache_mask,
    lambda: [
        Case(f"my_causal_mask(L={L}, S={S}, window={w})", (L, S, w)) for L, S, w in _CACHE_CASES
    ],
    variants=(_cache_by_slicing, _cache_by_diagonals, _cache_slip),
    mistakes=(
        (lambda L, S, window=None: ~_cache_slip(L, S, window), _INVERTED),
        (lambda L, S, window=None: _cache_slip(L, S, window).int(), _NOT_BOOL),
        (
            lambda L, S, window=None: _cache_slip(L, S, window, shift=L - S),
            _TOP_LEFT,
        ),
        (
            lambda L, S, window=None: _cache_slip(L, S, window, shift=-1),
            "A query may attend to itself: keep the key at its own position i + S - L.",
        ),
        (
            lambda L, S, window=None: _cache_slip(L, S, window, shift=1),
            "Shifted by one: each query sees a future key.",
        ),
        (
            lambda L, S, window=None: _cache_slip(S, S, window),
            "Return the rows of the L new queries only: (L, S), the last L rows of the (S, S) "
            "mask.",
        ),
        (
            lambda L, S, window=None: _cache_slip(L, S),
            "With a window, hide the keys window or more positions behind the query as well.",
        ),
        (
            lambda L, S, window=None: _cache_slip(L, S, window, extra=1),
            "A window of w keeps w keys, the query's own included: positions p - w + 1 .. p.",
        ),
        (
            lambda L, S, window=None: _cache_slip(L, S, window, ahead=True),
            "The causal window looks back only: keys after the query stay hidden.",
        ),
        (_cache_by_library, _NO_MASK_FUNCTIONS),
        (_cache_by_private_helper, _NO_MASK_FUNCTIONS),
    ),
    hint="Query i stands at p = i + S - L; keep key j when j <= p (and, with a window w, "
    "j > p - w).",
    exact_dtype=True,
    forbidden=_MASK_LIBRARY,
    forbidden_hint=_NO_MASK_FUNCTIONS,
    rewrites=(masks.causal_mask_bottom_right, masks.sliding_window_mask),
    params=("my_causal_mask",),
    doc="Check ``my_causal_mask(L, S, window=None)``: the ``(L, S)`` causal keep-mask of L new "
    "queries that are the last L of S positions (aligned bottom-right, as decoding with a cache "
    "needs), with ``window``, a causal sliding window of that many keys; equal to "
    "``mha.causal_mask_bottom_right`` and to the last L rows of ``mha.sliding_window_mask(S, "
    "window=window)``, which it may not call.",
)


def _left_padded_keep() -> Tensor:
    """The chapter's prediction exercise: a left-padded batch under a causal mask."""
    real = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)  # (B, S), 1 = real token
    return real[:, None, None, :] & _ones(4).tril()  # (B, 1, L, S)


def _mask_truth() -> tuple[tuple[int, ...], Tensor, list[int]]:
    keep = _left_padded_keep()  # (B, 1, L, S)
    return tuple(keep.shape), keep[1, 0], [i for i in range(4) if not keep[1, 0, i].any()]


def _as_mask_prediction(answer: tuple[Any, Iterable[Iterable[object]], Any]) -> tuple[Any, ...]:
    shape, rows, empty_rows = answer
    try:
        mask = torch.tensor([[bool(x) for x in row] for row in rows])
    except (TypeError, ValueError) as err:
        message = "mask should be a list of 4 rows of 4 zeros/ones ({err})."
        raise ExerciseError(tr(message, err=err)) from None
    return as_shape(shape, "shape"), mask, sorted(as_shape(empty_rows, "empty_rows"))


_HINT_EMPTY = "A row is empty when every key it may see causally is padding (a naive NaN)."
_TRAILING = "Broadcasting aligns trailing dims: (B, 1, 1, S) & (L, S) -> (B, 1, L, S)."
_NOT_CAUSAL = "The mask is causal too: query i sees no key after i."
MASK_PREDICTION = Exercise(
    "check_mask_prediction",
    lambda want: tr("shape {0}, empty rows {1}", want[0], want[2]),
    _mask_truth,
    prediction=True,
    variants=(
        lambda t: ((2, 1, 4, 4), [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], [0, 1]),
        lambda t: ((2, 1, 4, 4), [[False] * 4, [False] * 4, [0, 0, 1, 0], [0, 0, 1, 1]], (1, 0)),
        lambda t: (torch.Size([2, 1, 4, 4]), t[1], t[2]),
    ),
    mistakes=(
        (lambda t: ((2, 4, 4), *t[1:]), _TRAILING),
        (lambda t: ((2, 8, 4, 4), *t[1:]), "The head dim stays 1 until the scores meet it."),
        (lambda t: (t[0], t[1], []), _HINT_EMPTY),
        (lambda t: (t[0], _ones(4).tril(), []), "Keys 0 and 1 of sequence 1 are padding."),
        (lambda t: (t[0], _left_padded_keep()[1, 0, -1].expand(4, 4), []), _NOT_CAUSAL),
    ),
    hint={
        "shape": _TRAILING,
        "mask": "Query i sees key j if j <= i AND key j is real (keys 0, 1 of sequence 1 are not).",
        "empty_rows": _HINT_EMPTY,
    },
    outputs=("shape", "mask", "empty_rows"),
    convert=_as_mask_prediction,
    doc="Check predictions of ``keep.shape``, ``keep[1, 0]`` (0/1 rows) and the empty query rows "
    "for ``keep = real[:, None, None, :] & causal_mask(4)``, real = [[1, 1, 1, 1], [0, 0, 1, 1]].",
)


_TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (5e-2, 5e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def _attention_cases() -> list[Case]:
    """float32, float16 and bfloat16 inputs, without and then with query rows that see no key
    (and another head dimension D)."""
    g = torch.Generator().manual_seed(4)
    keep = _padding(torch.tensor([6, 3]), 6) & _ones(5, 6).tril()  # (B, 1, L, S)
    keep_empty = keep.clone()
    keep_empty[1, :, 1] = False  # query 1 of sequence 1 sees no key
    keep_empty[0, :, 4] = False
    cases = []
    for mask, empty, D in ((keep, "", 8), (keep_empty, " with a fully masked query row", 16)):
        q, k, v = (torch.randn(2, 2, n, D, generator=g) for n in (5, 6, 6))  # (B, H, L or S, D)
        for dtype, (atol, rtol) in _TOLERANCES.items():
            label = f"masked_attention(q, k, v, keep) in {str(dtype)[6:]}{empty}"
            args = (*(t.to(dtype) for t in (q, k, v)), mask)
            cases.append(Case(label, args, atol=atol, rtol=rtol))
    return cases


def _with_gradients(fn: Callable[..., Tensor], case: Case) -> object:
    """``fn``'s output and its gradients with respect to q, k and v."""
    q, k, v = (t.detach().clone().requires_grad_() for t in case.args[:3])
    out = fn(q, k, v, case.args[3])
    if out is None:
        return None
    if not isinstance(out, Tensor) or out.grad_fn is None:
        return out, None, None, None  # compared part by part: "out" first, then the gradients
    grads = torch.autograd.grad(out.float().sum(), (q, k, v), allow_unused=True)
    filled = (torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads))
    return (out.detach(), *filled)


def _fill_safe(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, D: int | None = None) -> Tensor:
    """The chapter's answer: -inf fill, a softmax that never sees an all -inf row, zero rows
    (with ``D``, the scale of that head dimension, whatever q's)."""
    has_key = keep.any(-1, keepdim=True)  # (B, 1, L, 1)
    scale = math.sqrt(D or q.shape[-1])
    scores = (q.float() @ k.float().mT / scale).masked_fill(~keep, -math.inf)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key  # (B, H, L, S)
    return weights @ v.float()


def _reference_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """torch's SDPA in float32. A row with no key gets every key unmasked, then zeroed, so the
    reference never depends on how a given torch version treats empty rows."""
    has_key = keep.any(-1, keepdim=True)  # (B, 1, L, 1)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep | ~has_key)
    return out * has_key  # (B, H, L, D)


def _fill_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, fill: float, nan_to_num=False):
    """The seeds' masked attention: masked_fill with ``fill`` (-inf: as a float mask), softmax."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if nan_to_num:  # zeros in the forward pass, but NaN still flows back into the scores
        bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, fill)
        return torch.nan_to_num(torch.softmax(scores + bias, dim=-1)) @ v
    return torch.softmax(scores.masked_fill(~keep, fill), dim=-1) @ v  # (B, H, L, D)


_FINITE = "With a finite fill a query with no key averages the hidden keys: zero rows with no key."
_MINUS_1E9 = "-1e9 overflows float16 (max 65504): fill with float('-inf') or finfo(dtype).min."
_NAN_FLOWS_BACK = (
    "A forward NaN flows back even after nan_to_num or * 0: never softmax an all -inf row."
)
_ALL_INF = "An all -inf row gives 0/0 = NaN: give rows with no key (keep.any(-1)) zero weights."
_NOT_DIFFERENTIABLE = "The result is not differentiable: build it from torch operations."
_NO_READY_MADE = "write the masked softmax yourself, without a ready-made attention."
_HEAD_DIM = (
    "Take D from the inputs, q.shape[-1]: a fixed head dimension is right for one size only."
)


def _masked_where(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """The chapter's answer written with torch.where."""
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    has_key = keep.any(-1, keepdim=True)
    scores = torch.where(keep | ~has_key, scores, float("-inf"))
    return torch.where(has_key, torch.softmax(scores, -1), 0.0) @ v.float()


def _attention_by_private_helper(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """mha.attention's private helper, reached around the public function."""
    from mha.attention import _attention

    out: Any = _attention(q, k, v, keep, 0.0, False, q.shape[-1] ** -0.5)
    return out  # type: ignore[no-any-return]


MASKED_ATTENTION = Exercise(
    "check_masked_attention",
    "float32/float16/bfloat16, empty rows give zeros forward and backward",
    lambda *args: _with_gradients(_reference_attention, Case("", args)),
    _attention_cases,
    variants=(_fill_safe, _masked_where),
    mistakes=(
        (lambda q, k, v, keep: _fill_attention(q, k, v, keep, torch.finfo(q.dtype).min), _FINITE),
        (partial(_fill_attention, fill=-1e9), _MINUS_1E9),
        (partial(_fill_attention, fill=-math.inf, nan_to_num=True), _NAN_FLOWS_BACK),
        (partial(_fill_attention, fill=-math.inf), _ALL_INF),
        (lambda *args: _fill_safe(*args).detach(), _NOT_DIFFERENTIABLE),
        (partial(_fill_safe, D=8), _HEAD_DIM),
        (F.scaled_dot_product_attention, _NO_READY_MADE),
        (lambda q, k, v, keep: mha.scaled_dot_product_attention(q, k, v, keep), _NO_READY_MADE),
        (_attention_by_private_helper, _NO_READY_MADE),
    ),
    hint={
        "out": "Expected softmax(q @ kᵀ / sqrt(D), masked where keep is False) @ v.",
        **dict.fromkeys(
            ("grad_q", "grad_k", "grad_v"), "The gradient is wrong: mask with torch operations."
        ),
    },
    outputs=("out", "grad_q", "grad_k", "grad_v"),
    call=_with_gradients,
    # every attention of mha and torch, public and private, and the layers that contain one
    forbidden=(
        *READY_MADE_ATTENTION,
        *defined_in(_multihead_module),
        nn.MultiheadAttention.forward,
    ),
    forbidden_hint=_NO_READY_MADE,
    rewrites=(F.scaled_dot_product_attention, mha.scaled_dot_product_attention),
    doc="Check ``fn(q, k, v, keep)``, masked attention equal to SDPA forward and backward, in "
    "float32, float16 and bfloat16, with zeros (never NaN) for a query whose keys are all masked.",
)

_HF_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])  # (B, S), 1 = attend
_IGNORE = "key_padding_mask marks the keys to *ignore*: attention_mask == 0."
_OPPOSITE = (
    "SDPA's bool mask is True = attend (attention_mask == 1), the opposite of key_padding_mask."
)
MASK_CONVERSION = Exercise(
    "check_mask_conversion",
    "key_padding_mask True = ignore, sdpa_mask True = attend",
    lambda am: (am == 0, (am == 1)[:, None, None, :]),
    lambda: [Case("convert(attention_mask)", (_HF_MASK,))],
    variants=(
        lambda am: (~am.bool(), am.bool().view(am.shape[0], 1, 1, -1)),
        lambda am: (am.eq(0), am.ne(0).unsqueeze(1).unsqueeze(1)),
    ),
    mistakes=(
        (lambda am: (am == 1, (am == 1)[:, None, None, :]), _IGNORE),
        (lambda am: (am == 0, (am == 0)[:, None, None, :]), _OPPOSITE),
        (lambda am: (am == 0, am == 1), _READ_AS_LS),
        (lambda am: (1 - am, (am == 1)[:, None, None, :]), _NOT_BOOL),
        (lambda am: (am == 0, am[:, None, None, :].float()), _NOT_BOOL),
    ),
    hint={
        "key_padding_mask": "(B, S) bool, True exactly where attention_mask is 0.",
        "sdpa_mask": "(B, 1, 1, S) bool, True exactly where attention_mask is 1.",
    },
    exact_dtype=True,
    rewrites=(),  # neither mha nor torch has a function that converts the conventions
    outputs=("key_padding_mask", "sdpa_mask"),
    params=("convert",),
    doc="Check ``fn(attention_mask) -> (key_padding_mask, sdpa_mask)``: Hugging Face's (B, S) "
    "1 = attend, to nn.MultiheadAttention's (B, S) True = ignore and SDPA's (B, 1, 1, S) True = "
    "attend.",
)


def _power_of_two_slopes(n: int) -> Tensor:
    return 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float64) / n)  # (n,)


def _alibi(H: int, L: int, S: int, slopes: str = "paper", shift: int = 0, sign=-1, causal=True):
    """ALiBi's bias (H, L, S) for L queries that are the last L of S positions, with the slopes
    of the paper's code (``slopes="paper"``, as mha.flex.alibi_slopes) or a usual slip."""
    n = 1 << (H.bit_length() - 1)  # the largest power of two <= H
    extra = {
        "paper": _power_of_two_slopes(2 * n)[0::2],  # the odd terms 2^(-8k/2n), k = 1, 3, ...
        "first": _power_of_two_slopes(2 * n),  # its first terms, odd and even
    }
    if slopes in ("naive", "from_zero", "flip"):  # 2^(-8h/H) for every H
        first = 0 if slopes == "from_zero" else 1
        m = 2.0 ** (-8.0 * torch.arange(first, first + H, dtype=torch.float64) / H)
        m = m.flip(0) if slopes == "flip" else m
    else:
        m = torch.cat([_power_of_two_slopes(n), extra[slopes.removesuffix("_sorted")][: H - n]])
        m = m.sort(descending=True).values if slopes.endswith("_sorted") else m
    p = torch.arange(L)[:, None] + S - L + shift  # (L, 1): query i's position
    j = torch.arange(S)[None, :]  # (1, S)
    bias = sign * m[:, None, None] * (p - j)  # (H, L, S)
    return (bias.masked_fill(j > p, float("-inf")) if causal else bias).float()


def _alibi_reference(H: int, L: int, S: int) -> Tensor:
    """mha's semantics: the slopes of mha.flex.alibi_slopes, the bottom-right causal mask."""
    slopes = flex.alibi_slopes(H).double()  # (H,)
    p = torch.arange(L)[:, None] + S - L  # (L, 1)
    bias = -slopes[:, None, None] * (p - torch.arange(S))  # (H, L, S)
    return bias.masked_fill(~masks.causal_mask_bottom_right(L, S), float("-inf")).float()


def _alibi_loops(H: int, L: int, S: int) -> Tensor:
    n = 2 ** math.floor(math.log2(H))
    slopes = [2 ** (-8 * k / n) for k in range(1, n + 1)]
    slopes += [2 ** (-8 * k / (2 * n)) for k in range(1, 2 * (H - n), 2)]
    bias = torch.full((H, L, S), float("-inf"))
    for h in range(H):
        for i in range(L):
            for j in range(i + S - L + 1):
                bias[h, i, j] = -slopes[h] * (i + S - L - j)
    return bias


def _alibi_by_ratio(H: int, L: int, S: int) -> Tensor:
    """The slopes as geometric sequences: ratio 2^(-8/n), and 2^(-8/n) squared for the extra."""
    n = 1 << (H.bit_length() - 1)
    r = 2.0 ** (-8.0 / n)
    first = r ** torch.arange(1, n + 1, dtype=torch.float64)  # (n,)
    rest = math.sqrt(r) * r ** torch.arange(H - n, dtype=torch.float64)  # (H - n,)
    slopes = torch.cat([first, rest])
    keep = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    distance = (torch.arange(L)[:, None] + S - L - torch.arange(S)).double()  # (L, S)
    return torch.where(keep, -slopes[:, None, None] * distance, -math.inf).float()


def _alibi_by_library(H: int, L: int, S: int) -> Tensor:
    slopes = flex.alibi_slopes(H)
    distance = torch.arange(L)[:, None] + S - L - torch.arange(S)  # (L, S)
    return (-slopes[:, None, None] * distance).masked_fill(distance < 0, -math.inf)


def _alibi_by_private_helper(H: int, L: int, S: int) -> Tensor:
    """The slopes by hand, the causal part by mha.masks' private helper."""
    keep = masks._causal_mask(L, S, diagonal=S - L)
    return _alibi(H, L, S, causal=False).masked_fill(~keep, -math.inf)


_ALIBI_CASES = (
    (8, 5, 5),
    (6, 4, 4),
    (12, 1, 7),
    (5, 3, 8),
    (1, 2, 2),
    (3, 4, 6),
    (16, 2, 9),
    (112, 1, 3),
)
_NAIVE = (
    "2^(-8h/H) are ALiBi's slopes only when H is a power of two. For other H take the n slopes "
    "of n = 2^floor(log2 H) heads, then H - n from the sequence for 2n heads."
)
_ODD = (
    "The extra slopes come from the sequence for 2n heads, 2^(-8k/(2n)), at odd k = 1, 3, 5, "
    "...: at even k it repeats the first n slopes."
)
_NO_ALIBI_LIBRARY = (
    "derive the slopes and the alignment yourself, without mha.flex.alibi_slopes or mha's masks."
)
ALIBI_BIAS = Exercise(
    "check_alibi_bias",
    "the paper's slopes for H = 8, 6, 12, 5, 1, 3, 16, 112 (powers of two and not), the distance "
    "penalty aligned bottom-right, -inf on future keys",
    _alibi_reference,
    lambda: [Case(f"alibi_bias(H={H}, L={L}, S={S})", (H, L, S)) for H, L, S in _ALIBI_CASES],
    variants=(_alibi, _alibi_loops, _alibi_by_ratio),
    mistakes=(
        (partial(_alibi, slopes="naive"), _NAIVE),
        (partial(_alibi, slopes="first"), _ODD),
        (
            partial(_alibi, slopes="paper_sorted"),
            "Append the H - n extra slopes after the first n, in their order, as the paper's "
            "code and BLOOM do: do not sort them in.",
        ),
        (partial(_alibi, slopes="from_zero"), "h runs 1..H: the first slope is 2**(-8/H)."),
        (partial(_alibi, slopes="flip"), "Reversed: head 1 has the largest slope."),
        (partial(_alibi, shift=-1), "Shifted by one: a query's own key has distance 0."),
        (
            lambda H, L, S: _alibi(H, L, S, shift=L - S),
            "The L queries are the last L of S positions: query i stands at p = i + S - L, "
            "and the distance is p - j.",
        ),
        (partial(_alibi, causal=False), "Future keys need -inf (a causal mask)."),
        (partial(_alibi, sign=1.0), "Penalise distance: -m_h * (p - j) <= 0."),
        (lambda H, L, S: _alibi(H, L, S)[0], "One (L, S) bias per head: (H, L, S)."),
        (
            lambda H, L, S: torch.ones(L, S, dtype=torch.bool).tril(S - L).expand(H, L, S),
            "A bias is float: added, -inf where hidden.",
        ),
        (_alibi_by_library, _NO_ALIBI_LIBRARY),
        (_alibi_by_private_helper, _NO_ALIBI_LIBRARY),
    ),
    hint="bias[h, i, j] = -m_h * (p - j) for j <= p = i + S - L and -inf for j > p; m = the n "
    "slopes 2^(-8k/n), k = 1..n, of n = 2^floor(log2 H), then H - n slopes 2^(-8k/(2n)) at odd k.",
    crash_hint="With H a power of two there is no extra slope: torch.arange(1, 2 * (H - n), 2) "
    "then raises (its end lies before its start), while 2 * torch.arange(H - n) + 1 is empty.",
    forbidden=_MASK_LIBRARY,
    forbidden_hint=_NO_ALIBI_LIBRARY,
    rewrites=(flex.alibi_slopes, masks.causal_mask_bottom_right),
    params=("alibi_bias",),
    doc="Check ``alibi_bias(H, L, S)``: ALiBi's bias (H, L, S) for L queries that are the last L "
    "of S positions, -m_h * (i + S - L - j) on visible keys and -inf on future ones, with the "
    "slopes of the ALiBi paper's code for any H (as ``mha.flex.alibi_slopes``: powers of two "
    "2^(-8h/H); otherwise those of n = 2^floor(log2 H), then the odd terms of the sequence for 2n).",
)

# Section 4.4's capstone: the learner's own causal multi-head layer (its answers, the values'
# check and the training are in _writer.py).
MODEL_THAT_WRITES = Exercise(
    "check_model_that_writes",
    _writer.SUCCESS,
    None,
    variants=(_writer.PerHead, _writer.Einsum),
    mistakes=_writer.MISTAKES,
    hint=_writer.HINTS,
    crash_hint=_writer.CONTRACT,
    forbidden=_writer.BANNED,
    forbidden_hint=_writer.NO_READY_MADE,
    rewrites=_writer.REWRITES,
    custom=_writer.check,
    params=("Layer",),
    doc="Check ``Layer(E, H)``, causal multi-head self-attention with ``forward(x, real=None, "
    "cache=None)``: equal to nn.MultiheadAttention with the same weights under a causal mask and "
    "with right padding, its decode through its own cache equal to the full causal pass (the "
    "cache then holding every key and value, (B, H, S, D)), written "
    "without mha's or torch's attention; then a one-block character model built on it is trained "
    "200 steps and must reach a held-out loss below 2.8.",
)

EXERCISES = publish(globals())
