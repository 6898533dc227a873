"""Section 9.2, packed sequences: the exercises as data for :mod:`.._harness`.

References: ``cu_seqlens`` as prefix sums with a leading 0 (int32), the bottom-right causal mask
by ``tril`` with its diagonal moved by ``S - L``, and packed causal attention as torch's SDPA over
each sequence alone; mistakes: the lengths themselves, inclusive sums without the 0, int64, the
top-left mask, the diagonal moved the wrong way, causal attention across the packed boundaries,
boundaries without the causal mask, the packed layout read as ``(B, L, D)``, and the library's
own functions, which the exercises ban.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

import mha
from mha import chunked_prefill, masks, varlen

from .._harness import Case, Exercise, defined_in, publish, randn64

# --- cu_seqlens from the lengths ----------------------------------------------------------------


def _cu_reference(lengths: list[int]) -> Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)  # (B + 1,)


def _cu_cases() -> list[Case]:
    return [
        Case("cu_seqlens([3, 5, 2])", ([3, 5, 2],)),
        Case("cu_seqlens([7])", ([7],)),
        Case("cu_seqlens([4, 0, 6, 1]) (an empty sequence)", ([4, 0, 6, 1],)),
        Case("cu_seqlens([1, 1, 1, 1, 1])", ([1, 1, 1, 1, 1],)),
    ]


_HINT_CU = (
    "cu_seqlens holds B + 1 int32 offsets: 0, then the running total of the lengths, ending at "
    "the packed length; sequence b is packed[cu_seqlens[b]:cu_seqlens[b + 1]]."
)

_NO_VARLEN_MODULE = "write it yourself, without mha.varlen (pack, unpack, varlen_attention ...)."
#: Every function of mha.varlen and of chunked prefill, which packs sequences too.
VARLEN_BANNED = (*defined_in(varlen), *defined_in(chunked_prefill))


def _cu_by_private_helper(lengths: list[int]) -> Tensor:
    """The offsets read off mha.varlen's private per-sequence helper, called on each sequence."""
    empty = torch.zeros(0, 1, 1)
    sizes = [varlen._attend_one(empty, empty, empty, 1, False, 1.0).shape[0] + n for n in lengths]
    return F.pad(torch.tensor(sizes).cumsum(0), (1, 0)).to(torch.int32)


CU_SEQLENS = Exercise(
    "check_cu_seqlens",
    "B + 1 int32 offsets, from 0 to the packed length",
    _cu_reference,
    _cu_cases,
    variants=(
        lambda lengths: torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        lambda lengths: torch.cat(
            [torch.zeros(1, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32).cumsum(0)]
        ).to(torch.int32),
    ),
    mistakes=(
        (
            lambda lengths: torch.tensor(lengths, dtype=torch.int32),
            "These are the lengths; FlashAttention wants their prefix sums, where each sequence "
            "starts (FlashAttention issue #654). " + _HINT_CU,
        ),
        (
            lambda lengths: torch.tensor(lengths).cumsum(0).to(torch.int32),
            "An inclusive cumsum has B entries and no leading 0: sequence 0 starts at offset 0, "
            "so cu_seqlens starts with it. " + _HINT_CU,
        ),
        (
            lambda lengths: _cu_reference(lengths)[:-1],
            "The last offset, the packed length, belongs in cu_seqlens too: B + 1 entries, so "
            "that sequence B - 1 has an end. " + _HINT_CU,
        ),
        (
            lambda lengths: _cu_reference(lengths).long(),
            "The values are right, the dtype is not: FlashAttention's kernels read cu_seqlens as "
            "int32 (.to(torch.int32)).",
        ),
        (lambda lengths: varlen.pack([torch.zeros(n, 1) for n in lengths])[1], _NO_VARLEN_MODULE),
        (_cu_by_private_helper, _NO_VARLEN_MODULE),
    ),
    hint=_HINT_CU,
    crash_hint=_HINT_CU,
    exact_dtype=True,
    forbidden=VARLEN_BANNED,
    forbidden_hint=_NO_VARLEN_MODULE,
    rewrites=(varlen.pack,),  # pack returns the packed tensor and its cu_seqlens
    params=("cu_seqlens",),
    doc="Check ``cu_seqlens(lengths) -> (B + 1,) int32``: the offsets of packed sequences of "
    "the given lengths (a list of ints).",
)


# --- causal attention aligned bottom-right ------------------------------------------------------


def _bottom_right_reference(L: int, S: int) -> Tensor:
    return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)  # (L, S)


def _bottom_right_cases() -> list[Case]:
    return [
        Case(f"bottom_right_causal({L}, {S}){what}", (L, S))
        for L, S, what in (
            (4, 4, ""),
            (2, 6, " (L < S: new queries after cached keys)"),
            (5, 3, " (L > S: the first 2 queries see no key)"),
            (1, 7, " (one decoding step)"),
        )
    ]


def _bottom_right_by_positions(L: int, S: int) -> Tensor:
    i = torch.arange(L)[:, None]  # (L, 1)
    j = torch.arange(S)[None, :]  # (1, S)
    return (S - j) >= (L - i)  # distances to the end: the key no closer than the query


_HINT_BR = (
    "Align the ends: query i (of L) may see key j (of S) when j <= i + (S - L), i.e. "
    "torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)."
)

BOTTOM_RIGHT = Exercise(
    "check_bottom_right_causal",
    "the last query sees every key, for L < S, L = S and L > S",
    _bottom_right_reference,
    _bottom_right_cases,
    variants=(
        _bottom_right_by_positions,
        lambda L, S: torch.ones(L, S).tril(S - L).bool(),
    ),
    mistakes=(
        (
            lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(),
            "This is top-left alignment (torch's is_causal, FlashAttention before 2.1): with "
            "L < S the last query misses the newest keys (FlashAttention issues #517, #1778). "
            + _HINT_BR,
        ),
        (
            lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(diagonal=L - S),
            "The diagonal moves the other way: by S - L, to the right when there are more keys "
            "than queries. " + _HINT_BR,
        ),
        (
            lambda L, S: ~torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L),
            "The mask is inverted: a keep-mask is True where the query may attend. " + _HINT_BR,
        ),
        (
            lambda L, S: torch.ones(L, S).tril(S - L),
            "The pattern is right; return a bool keep-mask (dtype=torch.bool): a float mask "
            "would be added to the scores.",
        ),
        (
            lambda L, S: mha.causal_mask_bottom_right(L, S),
            "write it yourself, without mha.causal_mask_bottom_right.",
        ),
        (
            lambda L, S: masks._causal_mask(L, S, diagonal=S - L),
            "write it yourself, without mha.causal_mask_bottom_right.",
        ),
    ),
    hint=_HINT_BR,
    crash_hint=_HINT_BR,
    exact_dtype=True,
    forbidden=(*defined_in(masks), causal_lower_right),
    forbidden_hint="write it yourself, without mha.causal_mask_bottom_right.",
    rewrites=(mha.causal_mask_bottom_right, causal_lower_right),
    params=("bottom_right_causal",),
    doc="Check ``bottom_right_causal(L, S) -> (L, S) bool``: the causal keep-mask aligned "
    "bottom-right, as FlashAttention >= 2.1 and ``mha.varlen_attention`` use it.",
)


# --- packed causal attention --------------------------------------------------------------------


def _packed_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    """torch's SDPA over each sequence alone, causal."""
    starts = cu_seqlens.tolist()
    out = torch.zeros_like(q)  # (total, H, D)
    for a, b in zip(starts[:-1], starts[1:]):
        if b > a:
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, L, D) each
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def _packed_cases() -> list[Case]:
    g = torch.Generator().manual_seed(92)
    cases = []
    for lengths in ([3, 5, 2], [1, 6], [4, 0, 3, 1]):
        total = sum(lengths)
        q, k, v = (randn64(g, total, 2, 4) for _ in range(3))
        cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        cases.append(
            Case(f"packed_causal(q, k, v, cu_seqlens) for lengths {lengths}", (q, k, v, cu))
        )
    return cases


def _packed_by_document_mask(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    """One attention over the whole packed sequence, with a block-diagonal causal mask."""
    total = q.shape[0]
    doc = torch.arange(len(cu_seqlens) - 1).repeat_interleave(cu_seqlens.diff())  # (total,)
    keep = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # (H, total, D)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep)
    return out.transpose(0, 1)  # (total, H, D)


def _packed_by_softmax(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    outs = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
        scores = qs @ ks.transpose(-2, -1) / qs.shape[-1] ** 0.5  # (H, L, L)
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((weights @ vs).transpose(0, 1))  # (L, H, D)
    return torch.cat(outs)


def _packed_across_boundaries(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # (H, total, D)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)


def _packed_not_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    out = torch.zeros_like(q)
    starts = cu_seqlens.tolist()
    for a, b in zip(starts[:-1], starts[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, L, D) each
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
    return out


def _packed_no_transpose(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    out = torch.zeros_like(q)
    starts = cu_seqlens.tolist()
    for a, b in zip(starts[:-1], starts[1:]):
        out[a:b] = F.scaled_dot_product_attention(q[a:b], k[a:b], v[a:b], is_causal=True)
    return out


def _packed_by_private_helper(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    """mha.varlen's private per-sequence helper, reached around varlen_attention."""
    starts = cu_seqlens.tolist()
    scale = q.shape[-1] ** -0.5
    parts = [
        varlen._attend_one(q[a:b], k[a:b], v[a:b], 1, True, scale)
        for a, b in zip(starts, starts[1:])
    ]
    return torch.cat(parts)


_HINT_PACKED = (
    "Sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1] of q, k and v; attend causally within "
    "those rows only, with the heads in front: (L, H, D).transpose(0, 1) -> (H, L, D)."
)
_NO_VARLEN = "write it yourself, without mha.varlen_attention (or any function of mha.varlen)."

PACKED_CAUSAL = Exercise(
    "check_packed_causal",
    "equals torch's causal SDPA over each sequence alone (float64)",
    _packed_reference,
    _packed_cases,
    variants=(_packed_by_document_mask, _packed_by_softmax),
    mistakes=(
        (
            _packed_across_boundaries,
            "Causal over the whole packed tensor lets each sequence see the end of the one "
            "before it: no token may attend across a boundary. " + _HINT_PACKED,
        ),
        (
            _packed_not_causal,
            "The boundaries are right, but each query also sees the keys after it: make the "
            "attention inside a sequence causal. " + _HINT_PACKED,
        ),
        (
            _packed_no_transpose,
            "The packed layout is (L, H, D): SDPA reads the last two dims as (length, dim), so "
            "without a transpose it attends across the heads of one token. " + _HINT_PACKED,
        ),
        (
            lambda q, k, v, cu: mha.varlen_attention(q, k, v, cu, cu, is_causal=True),
            _NO_VARLEN,
        ),
        (_packed_by_private_helper, _NO_VARLEN),
    ),
    hint=_HINT_PACKED,
    crash_hint=_HINT_PACKED,
    atol=1e-10,
    rtol=1e-8,
    forbidden=VARLEN_BANNED,
    forbidden_hint=_NO_VARLEN,
    rewrites=(mha.varlen_attention,),
    params=("packed_causal",),
    doc="Check ``packed_causal(q, k, v, cu_seqlens) -> (total, H, D)``: causal self-attention "
    "over packed sequences ``(total, H, D)``, each attending only within itself.",
)


EXERCISES = publish(globals())
