"""Section 8.4, caches that serve: the exercises as data for :mod:`.._harness`.

References: the merge of split-KV partials by the full softmax over the concatenated scores, a
block table read by its definition; mistakes: partials averaged, ``exp(lse)`` without the shift
(overflow), no renormalisation, the shift by the first split's lse (NaN for an empty split), the
weights broadcast along the rows; the table skipped, block and offset swapped, sequence and block
swapped; and the library's own functions, which the exercises ban.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import mha

from .._harness import Case, Exercise, as_int, publish, randn64

# --- merging split-KV partials ------------------------------------------------------------------


def _merge_reference(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    """The merged output, written as a softmax over the two partials' logsumexps."""
    w = torch.softmax(torch.stack([lse1, lse2]), dim=0).unsqueeze(-1)  # (2, ..., L, 1)
    return w[0] * out1 + w[1] * out2  # (..., L, Dv)


def _merge_cases() -> list[Case]:
    """Two splits of real attention: with several query rows (L = Dv, so that weights broadcast
    along the wrong axis still run), with scores near 1000 (exp(lse) overflows), and with an empty
    first split (its output 0, its lse -inf, as a split-KV program that saw no key leaves them)."""
    g = torch.Generator().manual_seed(81)
    cases = []
    for what, size, L, Dv, first in (
        ("moderate scores, L = 4 queries", 1.0, 4, 4, slice(0, 15)),
        ("scores near 1000", 1000.0, 1, 8, slice(0, 15)),
        ("an empty first split (out1 = 0, lse1 = -inf)", 1.0, 3, 5, slice(0, 0)),
    ):
        q, k, v = randn64(g, 2, 3, L, 16), randn64(g, 2, 3, 40, 16), randn64(g, 2, 3, 40, Dv)
        scores = q @ k.transpose(-2, -1) + size  # (B, H, L, S): a shift leaves softmax alone
        parts = []
        for keys in (first, slice(first.stop, 40)):
            s = scores[..., keys]  # (B, H, L, S_i); no key: out_i = 0, lse_i = -inf
            parts += [torch.softmax(s, -1) @ v[..., keys, :], torch.logsumexp(s, -1)]
        expected = torch.softmax(scores, -1) @ v  # (B, H, L, Dv): attention over all 40 keys
        cases.append(
            Case(f"merge(out1, lse1, out2, lse2) with {what}", tuple(parts), expected=expected)
        )
    return cases


def _merge_no_shift(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    e1, e2 = lse1.exp().unsqueeze(-1), lse2.exp().unsqueeze(-1)  # overflow to inf near 1000
    return (e1 * out1 + e2 * out2) / (e1 + e2)


def _merge_no_renormalise(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    m = torch.maximum(lse1, lse2)
    return (lse1 - m).exp().unsqueeze(-1) * out1 + (lse2 - m).exp().unsqueeze(-1) * out2


def _merge_by_max_shift(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    m = torch.maximum(lse1, lse2)[..., None]
    w1, w2 = (lse1[..., None] - m).exp(), (lse2[..., None] - m).exp()
    return (w1 * out1 + w2 * out2) / (w1 + w2)


def _merge_shift_by_first(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    w2 = (lse2 - lse1).exp().unsqueeze(-1)  # exp(lse2 - lse1) / exp(0): inf if lse1 = -inf
    return (out1 + w2 * out2) / (1 + w2)


def _merge_along_rows(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    w = torch.softmax(torch.stack([lse1, lse2]), dim=0).unsqueeze(-2)  # (2, ..., 1, L)
    return w[0] * out1 + w[1] * out2  # weight of row l multiplies column l


_HINT_MERGE = (
    "Each partial was divided by its own sum exp(lse_i); the whole row's sum is exp(lse) with "
    "lse = logsumexp(lse1, lse2), so out = exp(lse1 - lse)·out1 + exp(lse2 - lse)·out2 "
    "(lse_i broadcast over Dv with [..., None])."
)
_NO_MERGE_PARTIALS = "merge the partials yourself, without mha.merge_partials."

MERGE_PARTIALS = Exercise(
    "check_merge_partials",
    "equals attention over all 40 keys, also where exp(lse) overflows (float64)",
    _merge_reference,
    _merge_cases,
    variants=(
        _merge_by_max_shift,
        lambda out1, lse1, out2, lse2: (
            torch.exp(lse1 - torch.logaddexp(lse1, lse2))[..., None] * out1
            + torch.exp(lse2 - torch.logaddexp(lse1, lse2))[..., None] * out2
        ),
        lambda out1, lse1, out2, lse2: torch.lerp(
            out2, out1, torch.sigmoid(lse1 - lse2).unsqueeze(-1)
        ),
    ),
    mistakes=(
        (
            lambda out1, lse1, out2, lse2: (out1 + out2) / 2,
            "An average weighs both splits alike; a split whose keys score higher must count "
            "more, by its softmax mass exp(lse_i). " + _HINT_MERGE,
        ),
        (
            _merge_no_shift,
            "exp(lse) overflows for large scores (inf / inf = NaN): subtract the largest lse "
            "(or the total logsumexp) before exp, as softmax does. " + _HINT_MERGE,
        ),
        (
            _merge_no_renormalise,
            "After shifting by the maximum the weights exp(lse_i - m) no longer sum to 1: "
            "divide by their sum (or shift by the total lse instead). " + _HINT_MERGE,
        ),
        (
            _merge_shift_by_first,
            "Shift by the largest lse (or the total), not by lse1: a split that saw no key has "
            "lse1 = -inf, and exp(lse2 - lse1) = inf gives inf / inf = NaN. " + _HINT_MERGE,
        ),
        (
            _merge_along_rows,
            "lse_i holds one number per query row: give it a last dim of 1, lse_i[..., None], "
            "so that it broadcasts over Dv; unsqueezed elsewhere it weighs the wrong entries. "
            + _HINT_MERGE,
        ),
        (
            lambda out1, lse1, out2, lse2: mha.merge_partials(
                torch.stack([out1, out2]), torch.stack([lse1, lse2])
            )[0],
            _NO_MERGE_PARTIALS,
        ),
    ),
    hint=_HINT_MERGE,
    crash_hint="out_i is (..., L, Dv) and lse_i (..., L): give the weights a last dim of 1 "
    "(lse[..., None]) to broadcast over Dv.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=(mha.merge_partials, mha.flash_decoding),
    forbidden_hint=_NO_MERGE_PARTIALS,
    params=("merge",),
    doc="Check ``merge(out1, lse1, out2, lse2) -> out``: combine the attention outputs "
    "``(..., L, Dv)`` of two disjoint sets of keys and their row logsumexps ``(..., L)`` into "
    "attention over all the keys.",
)


# --- reading a block table ----------------------------------------------------------------------


def _slot_reference(block_table: Sequence[Sequence[int]], block_size: int, seq: int, t: int) -> int:
    block, offset = divmod(t, block_size)  # logical block, position inside it
    return block_table[seq][block] * block_size + offset


def _lookup_cases() -> list[Case]:
    table4 = [[7, 2, 9, 4], [0, 11, 5, 14], [3, 8, 13, 1], [10, 6, 15, 12]]
    table2 = [[5, 0, 3], [2, 4, 1]]
    cases = [
        Case("slot(block_table, 4, seq, t) for 4 sequences, t = 0…15", (table4, 4)),
        Case("slot(block_table, 16, seq, t) for 2 sequences, t = 0…47", (table2, 16)),
    ]
    return [Case(c.label, c.args, expected=_every_slot(_slot_reference, c)) for c in cases]


def _every_slot(answer: Callable[..., object], case: Case) -> Tensor:
    """The answer for every (sequence, position) the table covers: ``(sequences, positions)``."""
    table, block_size = case.args
    positions = len(table[0]) * block_size
    slots = [
        [
            as_int(answer([list(r) for r in table], block_size, b, t), f"slot(…, {b}, {t})")
            for t in range(positions)
        ]
        for b in range(len(table))
    ]
    return torch.tensor(slots)


_HINT_LOOKUP = (
    "Position t is in logical block t // block_size at offset t % block_size; the table maps "
    "the logical block to a physical one: block_table[seq][t // block_size] * block_size "
    "+ t % block_size."
)


def _slot_by_paged_cache(block_table: list[list[int]], block_size: int, seq: int, t: int) -> int:
    """Read the slot from a PagedKVCache whose table is replaced by the given one."""
    cache = mha.PagedKVCache(block_size=block_size)
    cache._tables = [list(row) for row in block_table]
    cache._lens = [len(row) * block_size for row in block_table]
    return cache.slot(seq, t)


PAGE_LOOKUP = Exercise(
    "check_page_lookup",
    "every (sequence, position) lands in its pool slot",
    _slot_reference,
    _lookup_cases,
    variants=(
        _slot_by_paged_cache,
        lambda table, bs, seq, t: table[seq][t // bs] * bs + (t - t // bs * bs),
    ),
    mistakes=(
        (
            lambda table, bs, seq, t: t,
            "The slot of position t is not t: the sequence's blocks are scattered over the "
            "pool; look the logical block up in the block table. " + _HINT_LOOKUP,
        ),
        (
            lambda table, bs, seq, t: table[seq][t % bs] * bs + t // bs,
            "Block and offset are swapped: the block index is t // block_size, the offset "
            "t % block_size. " + _HINT_LOOKUP,
        ),
        (
            lambda table, bs, seq, t: table[t // bs][seq] * bs + t % bs,
            "The table has one row per sequence: block_table[seq][block], not "
            "block_table[block][seq]. " + _HINT_LOOKUP,
        ),
        (
            lambda table, bs, seq, t: table[seq][t // bs] * len(table[seq]) + t % bs,
            "A physical block holds block_size slots: multiply the block by block_size, not by "
            "the number of blocks. " + _HINT_LOOKUP,
        ),
    ),
    hint=_HINT_LOOKUP,
    crash_hint=_HINT_LOOKUP,
    call=lambda answer, case: _every_slot(answer, case),
    params=("slot",),
    doc="Check ``slot(block_table, block_size, seq, t) -> int``: the pool slot that holds "
    "position ``t`` of sequence ``seq`` in a paged KV cache, ``block_table`` one list of "
    "physical blocks per sequence.",
)


EXERCISES = publish(globals())
