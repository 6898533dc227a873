"""Chapter 8, attention in today's models: the exercises as data for :mod:`._harness`.

References: RoPE as complex multiplication (``torch.polar``), the merge of split-KV partials by
the full softmax over the concatenated scores, a block table read by its definition; mistakes:
neighbour (interleaved) pairs, the frequency exponent without its 2, the rotation backwards, the
positions ignored; partials averaged, ``exp(lse)`` without the shift (overflow), no
renormalisation; the table skipped, block and offset swapped, sequence and block swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import mha

from .. import decoding, rope
from ._harness import Case, Exercise, Mistake, as_int, publish


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# --- RoPE -----------------------------------------------------------------------------------------


def _rope_reference(x: Tensor, positions: Tensor) -> Tensor:
    """Pair (x_i, x_{i+D/2}) as the complex number x_i + j·x_{i+D/2}, times e^{j·p·θ_i}."""
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)  # (D/2,)
    turn = torch.polar(
        torch.ones(()).double(), positions.double()[:, None] * theta
    )  # (L, D/2) complex
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * turn  # (..., L, D/2)
    return torch.cat([z.real, z.imag], dim=-1)  # (..., L, D)


def _rope_slip(x: Tensor, positions: Tensor, **slip: bool) -> Tensor:
    """RoPE with one of the usual slips."""
    D = x.shape[-1]
    i = torch.arange(D // 2, dtype=torch.float64)  # pair index
    theta = 10000.0 ** (-i / D if slip.get("no_two") else -2 * i / D)  # (D/2,)
    pos = torch.arange(x.shape[-2]) if slip.get("ignore_positions") else positions
    angles = pos.double()[:, None] * theta  # (L, D/2)
    cos, sin = angles.cos(), angles.sin()
    if slip.get("backwards"):
        sin = -sin
    if slip.get("interleaved"):  # pairs (2i, 2i + 1), RoFormer's layout
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)  # (..., L, D)


def _rope_cases() -> list[Case]:
    g = torch.Generator().manual_seed(80)
    return [
        Case(
            "rope(x, positions) with x (2, 3, 6, 8), positions 0…5",
            (_randn(g, 2, 3, 6, 8), torch.arange(6)),
        ),
        Case(
            "rope(x, positions) with x (4, 16), positions [5, 900, 17, 3]",
            (_randn(g, 4, 16), torch.tensor([5, 900, 17, 3])),
        ),
    ]


_HINT_ROPE = (
    "Pair coordinate i with i + D/2 (x1, x2 = the two halves) and turn each pair by "
    "p·θ_i with θ_i = 10000 ** (-2i / D), i = 0 … D/2-1: "
    "(x1·cos - x2·sin, x2·cos + x1·sin)."
)


def _rope_mistake(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, positions: _rope_slip(x, positions, **{name: True})


ROPE = Exercise(
    "check_rope",
    "equals RoPE as complex multiplication (rotate-half pairs, base 10000, float64)",
    _rope_reference,
    _rope_cases,
    (
        Mistake(
            _rope_mistake("interleaved"),
            "These are neighbour pairs (2i, 2i + 1), RoFormer's layout; Llama (and this course) "
            "pairs coordinate i with i + D/2. " + _HINT_ROPE,
        ),
        Mistake(
            _rope_mistake("no_two"),
            "The exponent is -2i/D (i counts pairs, 2i the coordinates): with -i/D the slowest "
            "pair turns at 10000 ** -0.5 instead of about 1/10000. " + _HINT_ROPE,
        ),
        Mistake(
            _rope_mistake("backwards"),
            "The pairs turn the wrong way: the sine's sign is flipped. " + _HINT_ROPE,
        ),
        Mistake(
            _rope_mistake("ignore_positions"),
            "Use the positions you are given (they need not be 0 … L-1, e.g. while decoding). "
            + _HINT_ROPE,
        ),
    ),
    hint=_HINT_ROPE,
    crash_hint="x is (..., L, D) and positions (L,): the angles positions[:, None] * theta are "
    "(L, D/2) and broadcast over the leading dims.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=[(mha, "apply_rope"), (rope, "apply_rope")],
    forbidden_hint="write the rotation yourself, without mha.apply_rope.",
    params=("rope",),
    doc="Check ``rope(x, positions) -> (..., L, D)``: x ``(..., L, D)`` rotated by RoPE with "
    "base 10000 and rotate-half pairs, ``positions`` an integer tensor ``(L,)``.",
)


# --- merging split-KV partials ------------------------------------------------------------------


def _merge_reference(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    """The merged output, written as a softmax over the two partials' logsumexps."""
    w = torch.softmax(torch.stack([lse1, lse2]), dim=0).unsqueeze(-1)  # (2, ..., L, 1)
    return w[0] * out1 + w[1] * out2  # (..., L, Dv)


def _merge_cases() -> list[Case]:
    """Two splits of real attention; in the second the scores are large (exp(lse) overflows)."""
    g = torch.Generator().manual_seed(81)
    cases = []
    for label, size in (("moderate scores", 1.0), ("scores near 1000", 1000.0)):
        q, k, v = _randn(g, 2, 3, 1, 16), _randn(g, 2, 3, 40, 16), _randn(g, 2, 3, 40, 8)
        scores = q @ k.transpose(-2, -1) + size  # (B, H, 1, S): a shift leaves softmax alone
        parts = []
        for keys in (slice(0, 15), slice(15, 40)):
            s = scores[..., keys]  # (B, H, 1, S_i)
            parts += [torch.softmax(s, -1) @ v[..., keys, :], torch.logsumexp(s, -1)]
        expected = torch.softmax(scores, -1) @ v  # (B, H, 1, Dv): attention over all 40 keys
        cases.append(
            Case(f"merge(out1, lse1, out2, lse2) with {label}", tuple(parts), expected=expected)
        )
    return cases


def _merge_no_shift(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    e1, e2 = lse1.exp().unsqueeze(-1), lse2.exp().unsqueeze(-1)  # overflow to inf near 1000
    return (e1 * out1 + e2 * out2) / (e1 + e2)


def _merge_no_renormalise(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    m = torch.maximum(lse1, lse2)
    return (lse1 - m).exp().unsqueeze(-1) * out1 + (lse2 - m).exp().unsqueeze(-1) * out2


_HINT_MERGE = (
    "Each partial was divided by its own sum exp(lse_i); the whole row's sum is exp(lse) with "
    "lse = logsumexp(lse1, lse2), so out = exp(lse1 - lse)·out1 + exp(lse2 - lse)·out2 "
    "(lse_i broadcast over Dv with [..., None])."
)

MERGE_PARTIALS = Exercise(
    "check_merge_partials",
    "equals attention over all 40 keys, also where exp(lse) overflows (float64)",
    _merge_reference,
    _merge_cases,
    (
        Mistake(
            lambda out1, lse1, out2, lse2: (out1 + out2) / 2,
            "An average weighs both splits alike; a split whose keys score higher must count "
            "more, by its softmax mass exp(lse_i). " + _HINT_MERGE,
        ),
        Mistake(
            _merge_no_shift,
            "exp(lse) overflows for large scores (inf / inf = NaN): subtract the largest lse "
            "(or the total logsumexp) before exp, as softmax does. " + _HINT_MERGE,
        ),
        Mistake(
            _merge_no_renormalise,
            "After shifting by the maximum the weights exp(lse_i - m) no longer sum to 1: "
            "divide by their sum (or shift by the total lse instead). " + _HINT_MERGE,
        ),
    ),
    hint=_HINT_MERGE,
    crash_hint="out_i is (..., L, Dv) and lse_i (..., L): give the weights a last dim of 1 "
    "(lse[..., None]) to broadcast over Dv.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=[(m, n) for m in (mha, decoding) for n in ("merge_partials", "flash_decoding")],
    forbidden_hint="merge the partials yourself, without mha.merge_partials.",
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

PAGE_LOOKUP = Exercise(
    "check_page_lookup",
    "every (sequence, position) lands in its pool slot",
    _slot_reference,
    _lookup_cases,
    (
        Mistake(
            lambda table, bs, seq, t: t,
            "The slot of position t is not t: the sequence's blocks are scattered over the "
            "pool; look the logical block up in the block table. " + _HINT_LOOKUP,
        ),
        Mistake(
            lambda table, bs, seq, t: table[seq][t % bs] * bs + t // bs,
            "Block and offset are swapped: the block index is t // block_size, the offset "
            "t % block_size. " + _HINT_LOOKUP,
        ),
        Mistake(
            lambda table, bs, seq, t: table[t // bs][seq] * bs + t % bs,
            "The table has one row per sequence: block_table[seq][block], not "
            "block_table[block][seq]. " + _HINT_LOOKUP,
        ),
        Mistake(
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

EXERCISES = (ROPE, MERGE_PARTIALS, PAGE_LOOKUP)
publish(globals(), EXERCISES)
