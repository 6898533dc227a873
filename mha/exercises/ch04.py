"""Chapter 4, masking: the exercises as data for :mod:`._harness`, with NaN on rows that see no
key (forward and backward) and fills that overflow float16 among the mistakes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from ..masks import padding_mask
from . import _writer
from ._harness import NO_SDPA, Case, Exercise, ExerciseError, as_shape, publish, tr

_INVERTED = "Inverted: here (and in SDPA) True = may attend; flip it with ~."
_NOT_BOOL = "Return a bool tensor: a 1/0 float mask is *added* to the scores and masks nothing."
_READ_AS_LS = "Against (B, H, L, S) scores a (B, S) mask is read as (L, S): return (B, 1, 1, S)."


def _padding(lengths: Tensor, S: int) -> Tensor:
    return (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


_ROWS_NOT_KEYS = "That shape masks queries (rows); padding hides *keys*: (B, 1, 1, S)."
_OFF_BY_ONE = "One too {} token kept: a sequence of length n keeps positions j < n."
_NO_PADDING_MASK = "build the mask yourself, without mha.padding_mask."
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
    ),
    hint="Keep position j of sequence b when j < lengths[b], shaped (B, 1, 1, S).",
    exact_dtype=True,
    forbidden=(padding_mask,),
    forbidden_hint=_NO_PADDING_MASK,
    doc="Check ``fn(lengths, S)``: the ``(B, 1, 1, S)`` keep-mask of right-padded sequences.",
)


def _ones(L: int, S: int | None = None) -> Tensor:
    return torch.ones(L, L if S is None else S, dtype=torch.bool)  # (L, S)


_BOTTOM_RIGHT = "That is the bottom-right alignment (for a cache); torch's is_causal is top-left."
CAUSAL_MASK = Exercise(
    "check_causal_mask",
    "(L, S) bool, True on and below the diagonal",
    lambda L, S=None: _ones(L, S).tril(),
    lambda: [
        Case(f"causal_mask({', '.join(map(str, args))})", args)
        for args in ((4,), (1,), (3, 5), (5, 3))
    ],
    variants=(
        mha.causal_mask,
        lambda L, S=None: torch.arange(L)[:, None] >= torch.arange(S or L)[None, :],
    ),
    mistakes=(
        (lambda L, S=None: ~_ones(L, S).tril(), _INVERTED),
        (
            lambda L, S=None: _ones(L, S).tril(-1),
            "A token may attend to itself: keep the diagonal.",
        ),
        (lambda L, S=None: _ones(L, S).tril(1), "Shifted by one: each query sees a future key."),
        (lambda L, S=None: _ones(L, S).triu(), "The upper triangle sees the *future*."),
        (lambda L, S=None: _ones(L, S).tril((S or L) - L), _BOTTOM_RIGHT),
        (lambda L, S=None: _ones(L).tril(), "The columns are the S keys: (L, S)."),
        (lambda L, S=None: _ones(L, S).tril().int(), _NOT_BOOL),
    ),
    hint="Query i may attend to keys j <= i.",
    exact_dtype=True,
    doc="Check ``fn(L, S=None)``: the ``(L, S)`` causal keep-mask aligned top-left (torch's "
    "``is_causal``).",
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
    ),
    hint={
        "out": "Expected softmax(q @ kᵀ / sqrt(D), masked where keep is False) @ v.",
        **dict.fromkeys(
            ("grad_q", "grad_k", "grad_v"), "The gradient is wrong: mask with torch operations."
        ),
    },
    outputs=("out", "grad_q", "grad_k", "grad_v"),
    call=_with_gradients,
    forbidden=NO_SDPA,
    forbidden_hint=_NO_READY_MADE,
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
    outputs=("key_padding_mask", "sdpa_mask"),
    params=("convert",),
    doc="Check ``fn(attention_mask) -> (key_padding_mask, sdpa_mask)``: Hugging Face's (B, S) "
    "1 = attend, to nn.MultiheadAttention's (B, S) True = ignore and SDPA's (B, 1, 1, S) True = "
    "attend.",
)


def _alibi(H: int, L: int, first: int = 1, flip: bool = False, sign: float = -1, causal=True):
    """The causal ALiBi bias (H, L, L), or one of its usual mis-implementations."""
    slopes = 2.0 ** (-8.0 * torch.arange(first, first + H, dtype=torch.float64) / H)  # (H,)
    slopes = slopes.flip(0) if flip else slopes
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]  # (L, 1), (1, L)
    bias = sign * slopes[:, None, None] * (i - j)  # (H, L, L)
    return (bias.masked_fill(j > i, float("-inf")) if causal else bias).float()


def _alibi_loops(H: int, L: int) -> Tensor:
    bias = torch.full((H, L, L), float("-inf"))
    for h in range(H):
        for i in range(L):
            for j in range(i + 1):
                bias[h, i, j] = -(2 ** (-8 * (h + 1) / H)) * (i - j)
    return bias


ALIBI_BIAS = Exercise(
    "check_alibi_bias",
    "slopes 2^(-8h/H), linear distance penalty, causal",
    _alibi,
    lambda: [Case(f"alibi_bias(H={H}, L={L})", (H, L)) for H, L in ((8, 5), (4, 6), (2, 3))],
    variants=(
        _alibi_loops,
        lambda H, L: (
            -(2.0 ** (-8.0 * torch.arange(1, H + 1) / H))[:, None, None]
            * (torch.arange(L)[:, None] - torch.arange(L))
        ).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf")),
    ),
    mistakes=(
        (partial(_alibi, first=0), "h runs 1..H: the first slope is 2**(-8/H)."),
        (partial(_alibi, flip=True), "Reversed: head 1 has the largest slope."),
        (partial(_alibi, causal=False), "Future keys need -inf (a causal mask)."),
        (partial(_alibi, sign=1.0), "Penalise distance: -m_h * (i - j) <= 0."),
        (lambda H, L: _alibi(H, L)[0], "One (L, L) bias per head: (H, L, L)."),
        (lambda H, L: _ones(L).expand(H, L, L), "A bias is float: added, -inf where hidden."),
    ),
    hint="bias[h, i, j] = -m_h * (i - j) for j <= i and -inf for j > i, with m_h = "
    "2 ** (-8 * h / H), h = 1..H.",
    params=("alibi_bias",),
    doc="Check ``alibi_bias(H, L)``: the causal ALiBi bias (H, L, L), -m_h * (i - j) for j <= i, "
    "-inf above, with m_h = 2 ** (-8 * h / H), h = 1..H (Press et al., 2022).",
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
    custom=_writer.check,
    params=("Layer",),
    doc="Check ``Layer(E, H)``, causal multi-head self-attention with ``forward(x, real=None, "
    "cache=None)``: equal to nn.MultiheadAttention with the same weights under a causal mask and "
    "with right padding, its decode through its own cache equal to the full causal pass, written "
    "without mha's or torch's attention; then a one-block character model built on it is trained "
    "200 steps and must reach a held-out loss below 2.8.",
)

EXERCISES = publish(globals())
