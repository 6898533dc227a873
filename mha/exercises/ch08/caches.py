"""Section 8.4, caches that serve: the exercises as data for :mod:`.._harness`.

References: the merge of split-KV partials by the full softmax over the concatenated scores; the
slot mapping of a step's new tokens, token by token, blocks taken from the free list when a
position opens one. Mistakes: partials averaged, ``exp(lse)`` without the shift (overflow), no
renormalisation, the shift by the first split's lse (NaN for an empty split), the weights
broadcast along the rows; positions counted from 0, the free list read from the front, one block
per sequence, none for an empty sequence, the table skipped; and the library's own
functions (every function of ``mha.decoding`` and ``mha.paged``), which the exercises ban.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor

import mha
from mha import decoding, paged

from .._harness import Case, Exercise, ExerciseError, as_int, defined_in, publish, randn64, tr

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
        (
            lambda out1, lse1, out2, lse2: decoding._merge_partials(
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
    forbidden=(*defined_in(decoding), mha.ring_attention, *defined_in(paged)),
    forbidden_hint=_NO_MERGE_PARTIALS,
    rewrites=(mha.merge_partials,),
    params=("merge",),
    doc="Check ``merge(out1, lse1, out2, lse2) -> out``: combine the attention outputs "
    "``(..., L, Dv)`` of two disjoint sets of keys and their row logsumexps ``(..., L)`` into "
    "attention over all the keys.",
)


# --- where a step's new tokens go: the slot mapping -------------------------------------------------


def _slot_mapping_reference(
    block_table: list[list[int]],
    seq_lens: list[int],
    new_tokens: list[int],
    free_blocks: list[int],
    block_size: int,
) -> list[int]:
    """Token by token: a position at the start of a block needs a block from the free list."""
    slots = []
    for b, (n, new) in enumerate(zip(seq_lens, new_tokens)):
        for t in range(n, n + new):  # the new tokens' positions in sequence b
            if t % block_size == 0:  # its blocks are full (or it has none): take a free one
                block_table[b].append(free_blocks.pop())
            slots.append(block_table[b][t // block_size] * block_size + t % block_size)
    return slots


def _mapping_case(label: str, lengths: list[int], new: list[int], bs: int, pool: int) -> Case:
    """Tables whose blocks are scattered over a pool of ``pool`` blocks; the rest is free, in a
    shuffled order."""
    g = torch.Generator().manual_seed(84 + bs + len(lengths))
    order = torch.randperm(pool, generator=g).tolist()
    table, used = [], 0
    for n in lengths:
        k = -(-n // bs)  # ceil(n / bs) blocks hold the n stored tokens
        table.append(order[used : used + k])
        used += k
    args = (table, list(lengths), list(new), order[used:], bs)
    return Case(label, args, expected=torch.tensor(_slot_mapping_reference(*copy.deepcopy(args))))


def _mapping_cases() -> list[Case]:
    return [
        _mapping_case(
            "slot_mapping(...) for a decode step, seq_lens [5, 8, 0, 3], block_size 4",
            [5, 8, 0, 3], [1, 1, 1, 1], 4, 12,
        ),
        _mapping_case(
            "slot_mapping(...) for prompt chunks and a decode, seq_lens [2, 0, 7], new_tokens "
            "[7, 5, 1], block_size 4",
            [2, 0, 7], [7, 5, 1], 4, 16,
        ),
        _mapping_case(
            "slot_mapping(...) with seq_lens [37, 16, 100, 9], new_tokens [20, 1, 28, 0], "
            "block_size 16",
            [37, 16, 100, 9], [20, 1, 28, 0], 16, 24,
        ),
    ]  # fmt: skip


def _mapping_run(answer: Callable[..., object], case: Case) -> object:
    """The answer's slots as an int64 tensor (the learner's lists are copies: it may append)."""
    out = answer(*copy.deepcopy(case.args))
    if out is None:
        return None
    if not isinstance(out, (list, tuple, Tensor)):
        kind = type(out).__name__
        raise ExerciseError(tr("slot_mapping should return a list of ints, got {kind}.", kind=kind))
    items = out.tolist() if isinstance(out, Tensor) else list(out)
    return torch.tensor([as_int(s, f"slot_mapping(...)[{i}]") for i, s in enumerate(items)])


def _mapping_by_blocks_first(table, seq_lens, new_tokens, free_blocks, bs):
    """Per sequence: take every block the new tokens need first, then compute their slots."""
    slots = []
    for row, n, new in zip(table, seq_lens, new_tokens):
        needed = -(-(n + new) // bs) - len(row)  # blocks to add for positions n … n+new-1
        row.extend(free_blocks.pop() for _ in range(needed))
        slots += [row[t // bs] * bs + t % bs for t in range(n, n + new)]
    return slots


def _mapping_by_capacity(table, seq_lens, new_tokens, free_blocks, bs):
    """Token by token, a block taken when the position is past what the row's blocks hold."""
    slots = []
    for b in range(len(table)):
        for i in range(new_tokens[b]):
            t = seq_lens[b] + i
            while t >= len(table[b]) * bs:
                table[b].append(free_blocks.pop())
            block, offset = divmod(t, bs)
            slots.append(table[b][block] * bs + offset)
    return slots


def _mapping_slip(**slip: bool) -> Callable[..., list[int]]:
    def answer(table, seq_lens, new_tokens, free_blocks, bs):
        slots = []
        for b, (n, new) in enumerate(zip(seq_lens, new_tokens)):
            taken = 0
            for i in range(new):
                t = i if slip.get("from_zero") else n + i
                full = t % bs == 0 and not (slip.get("skip_empty") and t == 0)
                if full and not (slip.get("one_block") and taken):
                    table[b].append(free_blocks.pop(0) if slip.get("front") else free_blocks.pop())
                    taken += 1
                if slip.get("no_table"):
                    slots.append(t)
                else:
                    slots.append(table[b][t // bs] * bs + t % bs)
        return slots

    return answer


def _mapping_by_library_slot(table, seq_lens, new_tokens, free_blocks, bs):
    """PagedKVCache.slot called on a table of one's own."""
    cache = SimpleNamespace(_tables=table, _lens=[], block_size=bs)
    slots = []
    for b, (n, new) in enumerate(zip(seq_lens, new_tokens)):
        table[b] += [free_blocks.pop() for _ in range(-(-(n + new) // bs) - len(table[b]))]
        cache._lens = [n + new for n, new in zip(seq_lens, new_tokens)]
        slots += [mha.PagedKVCache.slot(cache, b, t) for t in range(n, n + new)]  # type: ignore
    return slots


def _mapping_by_private_take(table, seq_lens, new_tokens, free_blocks, bs):
    """PagedKVCache's private _take for each new block, the slots by hand."""
    pool = SimpleNamespace(_free=free_blocks, _refs={})
    slots = []
    for b, (n, new) in enumerate(zip(seq_lens, new_tokens)):
        for t in range(n, n + new):
            if t % bs == 0:
                table[b].append(mha.PagedKVCache._take(pool))  # type: ignore[arg-type]
            slots.append(table[b][t // bs] * bs + t % bs)
    return slots


_HINT_MAPPING = (
    "Sequence b's new tokens are its positions seq_lens[b], seq_lens[b] + 1, …; position t is "
    "at offset t % block_size of the row's block t // block_size. A position with "
    "t % block_size == 0 opens a new block: append free_blocks.pop() to block_table[b] first. "
    "Slot = block_table[b][t // block_size] * block_size + t % block_size, sequence after "
    "sequence."
)
_NO_PAGED = "work it out yourself, without mha.PagedKVCache (its slot, update or private helpers)."

#: Every function of mha.paged: PagedKVCache's methods (public and private) and paged_attention.
PAGED_BANNED = tuple(defined_in(paged))

PAGE_LOOKUP = Exercise(
    "check_page_lookup",
    "every new token's slot, new blocks taken when a position opens one (decode steps, prompt "
    "chunks, an empty sequence)",
    lambda *args: torch.tensor(_slot_mapping_reference(*copy.deepcopy(args))),
    _mapping_cases,
    variants=(_mapping_by_blocks_first, _mapping_by_capacity),
    mistakes=(
        (
            _mapping_slip(from_zero=True),
            "The new tokens come after the seq_lens[b] tokens already stored: their positions "
            "are seq_lens[b] + i, not i. " + _HINT_MAPPING,
        ),
        (
            _mapping_slip(front=True),
            "The next free block is the last one of free_blocks (take it with pop(), as "
            "PagedKVCache does), not the first. " + _HINT_MAPPING,
        ),
        (
            _mapping_slip(one_block=True),
            "A prompt chunk can cross more than one block boundary: take a block at every "
            "position that opens one, not one per sequence. " + _HINT_MAPPING,
        ),
        (
            _mapping_slip(skip_empty=True),
            "An empty sequence has no block yet: its first token, position 0, needs one too. "
            + _HINT_MAPPING,
        ),
        (
            _mapping_slip(no_table=True),
            "The slot of position t is not t: a sequence's blocks are wherever the pool had room; "
            "look its logical block t // block_size up in block_table[b]. " + _HINT_MAPPING,
        ),
        (_mapping_by_library_slot, _NO_PAGED),
        (_mapping_by_private_take, _NO_PAGED),
    ),
    hint=_HINT_MAPPING,
    crash_hint=_HINT_MAPPING,
    call=_mapping_run,
    forbidden=PAGED_BANNED,
    forbidden_hint=_NO_PAGED,
    rewrites=(mha.PagedKVCache.slot,),
    params=("slot_mapping",),
    doc="Check ``slot_mapping(block_table, seq_lens, new_tokens, free_blocks, block_size) -> "
    "list[int]``: the pool slot of every token a step writes (``new_tokens[b]`` after the "
    "``seq_lens[b]`` stored ones, sequence after sequence), taking blocks from ``free_blocks`` "
    "(with ``pop()``) when a position opens one; ``block_table`` one list of physical blocks per "
    "sequence.",
)


EXERCISES = publish(globals())
