"""Exercises of chapter 4, masking, as data for :mod:`._harness`.

References: PyTorch's own operators (``torch.tril``, ``torch.arange``,
``F.scaled_dot_product_attention``). Known mistakes: an inverted mask, an off-by-one diagonal, a
shape that broadcasts the wrong way, a fill that overflows float16, NaN on rows with no key
(forward and backward), ALiBi slopes counted from the wrong end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._harness import Case, Exercise, ExerciseError, Mistake, as_shape

_INVERTED = (
    "The mask is inverted. In this course (and in F.scaled_dot_product_attention) True means "
    "'may attend'; True = 'masked out' is nn.MultiheadAttention's convention. Flip it with ~."
)
_NOT_BOOL = (
    "Return a bool tensor. A float mask is *added* to the scores, so a 1/0 float mask masks "
    "nothing (real keys get +1, padding +0), and an integer mask is rejected by SDPA."
)
_READ_AS_LS = (
    "Against scores of shape (B, H, L, S), broadcasting aligns the *last* dims, so a (B, S) mask "
    "is read as (L, S): with B == L it runs without an error, and batch element b masks query "
    "row b. Add the head and query dims: (B, 1, 1, S)."
)


def _padding(lengths: Tensor, S: int) -> Tensor:
    return (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


PADDING_MASK = Exercise(
    "check_padding_mask",
    "(B, 1, 1, S) bool, True for real tokens",
    _padding,
    lambda: [
        Case(f"padding_mask(lengths={n}, S={S})", (torch.tensor(n), S))
        for n, S in (([3, 5, 0, 1], 5), ([2, 7], 7), ([4], 6))
    ],
    (
        Mistake(lambda lengths, S: ~_padding(lengths, S), _INVERTED),
        *(
            Mistake(
                lambda lengths, S, d=d: _padding(lengths + d, S),
                f"It keeps one too {how} token per sequence. A sequence of length n has its "
                "real tokens at positions 0..n-1: keep position j when j < n.",
            )
            for d, how in ((1, "many"), (-1, "few"))
        ),
        Mistake(lambda lengths, S: _padding(lengths, S)[:, 0, 0], _READ_AS_LS),
        Mistake(
            lambda lengths, S: _padding(lengths, S).transpose(-2, -1),
            "This shape masks queries (rows of the scores), not keys (columns). Padding hides "
            "*keys*: (B, 1, 1, S).",
        ),
        Mistake(lambda lengths, S: _padding(lengths, S).float(), _NOT_BOOL),
    ),
    hint="Position j of sequence b is real when j < lengths[b], and the mask broadcasts over "
    "heads and queries: (B, 1, 1, S).",
    exact_dtype=True,
    doc="Check ``fn(lengths, S)``: the ``(B, 1, 1, S)`` keep-mask of right-padded sequences.",
)


def _ones(L: int, S: int | None = None) -> Tensor:
    return torch.ones(L, L if S is None else S, dtype=torch.bool)  # (L, S)


CAUSAL_MASK = Exercise(
    "check_causal_mask",
    "(L, S) bool, True on and below the diagonal",
    lambda L, S=None: _ones(L, S).tril(),
    lambda: [
        Case(f"causal_mask({', '.join(map(str, args))})", args)
        for args in ((4,), (1,), (3, 5), (5, 3))
    ],
    (
        Mistake(
            lambda L, S=None: ~_ones(L, S).tril(),
            _INVERTED + " (torch.triu(..., diagonal=1) is the 'masked out' version.)",
        ),
        Mistake(
            lambda L, S=None: _ones(L, S).tril(-1),
            "The diagonal must be True: a token may attend to itself. Without it the first "
            "query sees no key at all.",
        ),
        Mistake(
            lambda L, S=None: _ones(L, S).tril(1),
            "Each query sees one future token: the diagonal is shifted by one.",
        ),
        Mistake(
            lambda L, S=None: _ones(L, S).triu(),
            "That is the upper triangle: each query sees itself and the *future*.",
        ),
        Mistake(
            lambda L, S=None: _ones(L, S).tril((S or L) - L),
            "That is the bottom-right alignment (the last query sees every key), which "
            "decoding with a cache needs. Here we want torch's is_causal alignment, top-left: "
            "query i sees keys 0..i.",
        ),
        Mistake(
            lambda L, S=None: _ones(L).tril(),
            "Use S (the number of keys) for the columns: scores are (L, S).",
        ),
        Mistake(lambda L, S=None: _ones(L, S).tril().int(), _NOT_BOOL),
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


def _as_mask_prediction(
    answer: tuple[object, Iterable[Iterable[object]], object],
) -> tuple[object, ...]:
    shape, rows, empty_rows = answer
    try:
        mask = torch.tensor([[bool(x) for x in row] for row in rows])
    except (TypeError, ValueError) as err:
        raise ExerciseError(f"mask should be a list of 4 rows of 4 zeros/ones ({err}).") from None
    return as_shape(shape, "shape"), mask, sorted(as_shape(empty_rows, "empty_rows"))


_HINT_EMPTY = (
    "A row is empty when every key it could see causally is padding. Those rows are the ones a "
    "naive softmax turns into NaN."
)

MASK_PREDICTION = Exercise(
    "check_mask_prediction",
    lambda want: f"shape {want[0]}, empty rows {want[2]}",
    _mask_truth,
    mistakes=(
        Mistake(
            lambda t: ((2, 4, 4), *t[1:]),
            "Broadcasting aligns trailing dims: (B, 1, 1, S) & (L, S) -> (B, 1, L, S).",
        ),
        Mistake(
            lambda t: ((2, 8, 4, 4), *t[1:]),
            "The head dim stays 1 until the scores (B, H, L, S) meet the mask.",
        ),
        Mistake(lambda t: (t[0], t[1], []), _HINT_EMPTY),
        Mistake(
            lambda t: (t[0], _ones(4).tril(), []),
            "The causal part is right, but keys 0 and 1 of sequence 1 are padding: no query "
            "may see them.",
        ),
        Mistake(
            lambda t: (t[0], _left_padded_keep()[1, 0, -1].expand(4, 4), []),
            "The padding part is right, but the mask is causal too: query i sees no key after i.",
        ),
    ),
    hint={
        "shape": "Broadcasting aligns trailing dims: (B, 1, 1, S) & (L, S) -> (B, 1, L, S); the "
        "head dim stays 1 until the scores (B, H, L, S) meet the mask.",
        "mask": "keep[1, 0] has one row per query (4) and one entry per key (4). Query i may see "
        "key j only if j <= i (causal) AND key j is a real token (keys 0 and 1 of sequence 1 are "
        "padding).",
        "empty_rows": _HINT_EMPTY,
    },
    outputs=("shape", "mask", "empty_rows"),
    prediction=True,
    convert=_as_mask_prediction,
    params=("shape", "mask", "empty_rows"),
    doc="Check predictions of ``keep.shape``, ``keep[1, 0]`` (0/1 rows) and the empty query rows "
    "for ``keep = real[:, None, None, :] & causal_mask(4)``, real = [[1, 1, 1, 1], [0, 0, 1, 1]].",
)


def _attention_cases() -> list[Case]:
    """float32, float16 and bfloat16 inputs, without and then with query rows that see no key."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (5, 6, 6))  # (B, H, L or S, D)
    keep = _padding(torch.tensor([6, 3]), 6) & _ones(5, 6).tril()  # (B, 1, L, S)
    keep_empty = keep.clone()
    keep_empty[1, :, 1] = False  # query 1 of sequence 1 sees no key
    keep_empty[0, :, 4] = False
    cases = []
    for mask, empty in ((keep, ""), (keep_empty, " with a fully masked query row")):
        for dtype, atol, rtol in (
            (torch.float32, 1e-4, 1e-3),
            (torch.float16, 5e-2, 5e-2),
            (torch.bfloat16, 5e-2, 5e-2),
        ):
            label = f"masked_attention(q, k, v, keep) in {str(dtype)[6:]}{empty}"
            cases.append(
                Case(label, (q.to(dtype), k.to(dtype), v.to(dtype), mask), atol=atol, rtol=rtol)
            )
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


def _reference_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """torch's SDPA in float32. A row with no key gets every key unmasked, then zeroed, so the
    reference never depends on how a given torch version treats empty rows."""
    has_key = keep.any(-1, keepdim=True)  # (B, 1, L, 1)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep | ~has_key)
    return out * has_key  # (B, H, L, D)


def _fill_attention(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor, fill: float, nan_to_num: bool = False
) -> Tensor:
    """The seeds' masked attention: masked_fill with ``fill`` (-inf: as a float mask), softmax."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if nan_to_num:  # zeros in the forward pass, but NaN still flows back into the scores
        bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, fill)
        return torch.nan_to_num(torch.softmax(scores + bias, dim=-1)) @ v
    return torch.softmax(scores.masked_fill(~keep, fill), dim=-1) @ v  # (B, H, L, D)


MASKED_ATTENTION = Exercise(
    "check_masked_attention",
    "float32/float16/bfloat16, empty rows give zeros forward and backward",
    lambda *args: _with_gradients(_reference_attention, Case("", args)),
    _attention_cases,
    (
        Mistake(
            lambda q, k, v, keep: _fill_attention(q, k, v, keep, torch.finfo(q.dtype).min),
            "A finite fill such as -1e9 or finfo.min makes all the scores of a query that may "
            "attend to no key equal, so softmax spreads the weight uniformly over keys that "
            "should be hidden (silently averaging padding). Zero the weights of rows with no "
            "key.",
        ),
        Mistake(
            lambda q, k, v, keep: _fill_attention(q, k, v, keep, -1e9),
            "-1e9 does not fit in float16 (its largest magnitude is 65504): fill with "
            "float('-inf') or torch.finfo(scores.dtype).min instead.",
        ),
        Mistake(
            lambda q, k, v, keep: _fill_attention(q, k, v, keep, -math.inf, nan_to_num=True),
            "The output looks right, but a NaN in the forward pass (e.g. softmax of an all "
            "-inf row), even one you replaced afterwards with nan_to_num or multiplied by 0, "
            "still flows back as NaN. Keep the softmax from ever seeing an all -inf row.",
        ),
        Mistake(
            lambda q, k, v, keep: _fill_attention(q, k, v, keep, -math.inf),
            "With a -inf fill, the softmax of a query that may attend to no key is 0/0 = NaN. "
            "Give such rows zero weights (e.g. find them with keep.any(-1) and torch.where), "
            "as torch's SDPA does.",
        ),
        Mistake(
            lambda q, k, v, keep: _reference_attention(q, k, v, keep).detach(),
            "The result is not differentiable: build it from torch operations.",
        ),
    ),
    hint={
        "out": "Compare your scores, mask and softmax with F.scaled_dot_product_attention; keep "
        "means True = may attend, and the scale is 1/sqrt(D).",
        **dict.fromkeys(
            ("grad_q", "grad_k", "grad_v"),
            "The forward pass is right but the "
            "gradient is not: is the mask applied with torch operations autograd can "
            "follow?",
        ),
    },
    outputs=("out", "grad_q", "grad_k", "grad_v"),
    call=_with_gradients,
    solution=_reference_attention,
    doc="Check ``fn(q, k, v, keep)``, masked attention equal to SDPA forward and backward, in "
    "float32, float16 and bfloat16, with zeros (never NaN) for a query whose keys are all masked.",
)

MASK_CONVERSION = Exercise(
    "check_mask_conversion",
    "key_padding_mask True = ignore, sdpa_mask True = attend",
    lambda am: (am == 0, (am == 1)[:, None, None, :]),
    lambda: [
        Case(
            "convert(attention_mask)",
            (torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]),),
        )
    ],
    (
        Mistake(
            lambda am: (am == 1, (am == 1)[:, None, None, :]),
            "nn.MultiheadAttention's key_padding_mask marks the keys to *ignore* (True = "
            "padding), the opposite of attention_mask (1 = attend). Use attention_mask == 0.",
        ),
        Mistake(
            lambda am: (am == 0, (am == 0)[:, None, None, :]),
            "SDPA's bool mask means True = attend, like attention_mask's 1. Did you reuse "
            "key_padding_mask? Flip it with ~.",
        ),
        Mistake(lambda am: (am == 0, am == 1), _READ_AS_LS),
        Mistake(lambda am: (1 - am, (am == 1)[:, None, None, :]), _NOT_BOOL),
        Mistake(lambda am: (am == 0, am[:, None, None, :].float()), _NOT_BOOL),
    ),
    hint={
        "key_padding_mask": "nn.MultiheadAttention wants (B, S) bool, True exactly where "
        "attention_mask is 0.",
        "sdpa_mask": "SDPA wants (B, 1, 1, S) bool, True exactly where attention_mask is 1.",
    },
    exact_dtype=True,
    outputs=("key_padding_mask", "sdpa_mask"),
    params=("convert",),
    doc="Check ``fn(attention_mask) -> (key_padding_mask, sdpa_mask)``: Hugging Face's (B, S) "
    "1 = attend, to nn.MultiheadAttention's (B, S) True = ignore and SDPA's (B, 1, 1, S) True = "
    "attend.",
)


def _alibi(
    H: int, L: int, first: int = 1, flip: bool = False, sign: float = -1.0, causal: bool = True
) -> Tensor:
    """The causal ALiBi bias (H, L, L), or one of its usual mis-implementations."""
    slopes = 2.0 ** (-8.0 * torch.arange(first, first + H, dtype=torch.float64) / H)  # (H,)
    slopes = slopes.flip(0) if flip else slopes
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]  # (L, 1), (1, L)
    bias = sign * slopes[:, None, None] * (i - j)  # (H, L, L)
    return (bias.masked_fill(j > i, float("-inf")) if causal else bias).float()


ALIBI_BIAS = Exercise(
    "check_alibi_bias",
    "slopes 2^(-8h/H), linear distance penalty, causal",
    _alibi,
    lambda: [Case(f"alibi_bias(H={H}, L={L})", (H, L)) for H, L in ((8, 5), (4, 6), (2, 3))],
    (
        Mistake(
            lambda H, L: _alibi(H, L, first=0),
            "h runs from 1 to H: the first head's slope must be 2**(-8/H), not 1.",
        ),
        Mistake(
            lambda H, L: _alibi(H, L, flip=True),
            "The slopes are in reverse order: head 1 has the largest slope, 2**(-8/H).",
        ),
        Mistake(
            lambda H, L: _alibi(H, L, causal=False),
            "The bias must be -inf above the diagonal: ALiBi in a decoder is added to a "
            "causal mask, so future keys stay hidden.",
        ),
        Mistake(
            lambda H, L: _alibi(H, L, sign=1.0),
            "The bias must *penalise* distance: -m_h * (i - j) <= 0.",
        ),
        Mistake(
            lambda H, L: _alibi(H, L)[0],
            "One (L, L) bias per head, (H, L, L), so that it broadcasts against (B, H, L, L).",
        ),
        Mistake(
            lambda H, L: _ones(L).expand(H, L, L),
            "A bias is a float mask, added to the scores: return floats, -inf where hidden.",
        ),
    ),
    hint="bias[h, i, j] = -m_h * (i - j) for j <= i and -inf for j > i, with m_h = "
    "2 ** (-8 * h / H), h = 1..H.",
    params=("alibi_bias",),
    doc="Check ``alibi_bias(H, L)``: the causal ALiBi bias (H, L, L), -m_h * (i - j) for j <= i, "
    "-inf above, with m_h = 2 ** (-8 * h / H), h = 1..H (Press et al., 2022).",
)

EXERCISES = (
    PADDING_MASK,
    CAUSAL_MASK,
    MASK_PREDICTION,
    MASKED_ATTENTION,
    MASK_CONVERSION,
    ALIBI_BIAS,
)
check_padding_mask = PADDING_MASK.checker()
check_causal_mask = CAUSAL_MASK.checker()
check_mask_prediction = MASK_PREDICTION.checker()
check_masked_attention = MASKED_ATTENTION.checker()
check_mask_conversion = MASK_CONVERSION.checker()
check_alibi_bias = ALIBI_BIAS.checker()
