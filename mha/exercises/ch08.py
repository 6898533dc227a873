"""Chapter 8, attention in today's models: the exercises as data for :mod:`._harness`.

References: RoPE as complex multiplication (``torch.polar``), the merge of split-KV partials by
the full softmax over the concatenated scores, a block table read by its definition; mistakes:
neighbour (interleaved) pairs, the frequency exponent without its 2, the rotation backwards, the
positions ignored; partials averaged, ``exp(lse)`` without the shift (overflow), no
renormalisation, the shift by the first split's lse (NaN for an empty split), the weights
broadcast along the rows; the table skipped, block and offset swapped, sequence and block swapped;
and the library's own functions, which the exercises ban.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

import mha

from ._harness import Case, Exercise, as_int, publish


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


def _rope_case(label: str, x: Tensor, positions: Tensor) -> Case:
    """A RoPE written in float32 (as models do) turns by angles p·θ rounded to float32: an error
    of about p · 1e-7 radians, which the tolerance allows (a wrong rotation is off by O(1))."""
    tol = 1e-6 * max(1, int(positions.abs().max()))
    return Case(label, (x, positions), atol=tol, rtol=tol)


def _rope_cases() -> list[Case]:
    g = torch.Generator().manual_seed(80)
    return [
        _rope_case(
            "rope(x, positions) with x (2, 3, 6, 8), positions 0…5",
            _randn(g, 2, 3, 6, 8),
            torch.arange(6),
        ),
        _rope_case(
            "rope(x, positions) with x (4, 16), positions [5, 900, 17, 3]",
            _randn(g, 4, 16),
            torch.tensor([5, 900, 17, 3]),
        ),
    ]


def _rope_hugging_face(x: Tensor, positions: Tensor) -> Tensor:
    """Hugging Face's way, in float32: cos and sin of shape (L, D), and rotate_half."""
    D = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # (D/2,)
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # (L, D)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def _rope_by_rotation_matrices(x: Tensor, positions: Tensor) -> Tensor:
    """Each pair times its 2×2 rotation matrix [[cos, -sin], [sin, cos]]."""
    D = x.shape[-1]
    theta = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    a = positions.double()[:, None] * theta  # (L, D/2)
    rot = torch.stack(
        [torch.stack([a.cos(), -a.sin()], -1), torch.stack([a.sin(), a.cos()], -1)], -2
    )  # (L, D/2, 2, 2)
    pairs = torch.stack([x[..., : D // 2], x[..., D // 2 :]], -1)  # (..., L, D/2, 2)
    turned = (rot @ pairs.unsqueeze(-1)).squeeze(-1)  # (..., L, D/2, 2)
    return torch.cat([turned[..., 0], turned[..., 1]], -1)


_HINT_ROPE = (
    "Pair coordinate i with i + D/2 (x1, x2 = the two halves) and turn each pair by "
    "p·θ_i with θ_i = 10000 ** (-2i / D), i = 0 … D/2-1: "
    "(x1·cos - x2·sin, x2·cos + x1·sin)."
)


def _rope_mistake(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, positions: _rope_slip(x, positions, **{name: True})


_NO_APPLY_ROPE = "write the rotation yourself, without mha.apply_rope."
ROPE = Exercise(
    "check_rope",
    "equals RoPE as complex multiplication (rotate-half pairs, base 10000, float64)",
    _rope_reference,
    _rope_cases,
    variants=(partial(_rope_slip), _rope_hugging_face, _rope_by_rotation_matrices),
    mistakes=(
        (
            _rope_mistake("interleaved"),
            "These are neighbour pairs (2i, 2i + 1), RoFormer's layout (and Meta's Llama code); "
            "Hugging Face transformers' Llama (and this course) pairs coordinate i with i + D/2. "
            + _HINT_ROPE,
        ),
        (
            _rope_mistake("no_two"),
            "The exponent is -2i/D (i counts pairs, 2i the coordinates): with -i/D the slowest "
            "pair turns at 10000 ** -0.5 instead of about 1/10000. " + _HINT_ROPE,
        ),
        (
            _rope_mistake("backwards"),
            "The pairs turn the wrong way: the sine's sign is flipped. " + _HINT_ROPE,
        ),
        (
            _rope_mistake("ignore_positions"),
            "Use the positions you are given (they need not be 0 … L-1, e.g. while decoding). "
            + _HINT_ROPE,
        ),
        (mha.apply_rope, _NO_APPLY_ROPE),
        (lambda x, positions: mha.apply_rope(x, positions), _NO_APPLY_ROPE),
    ),
    hint=_HINT_ROPE,
    crash_hint="x is (..., L, D) and positions (L,): the angles positions[:, None] * theta are "
    "(L, D/2) and broadcast over the leading dims.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=(mha.apply_rope,),
    forbidden_hint=_NO_APPLY_ROPE,
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
        q, k, v = _randn(g, 2, 3, L, 16), _randn(g, 2, 3, 40, 16), _randn(g, 2, 3, 40, Dv)
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
    cache.block_table, cache.length = block_table, len(block_table[0]) * block_size
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
