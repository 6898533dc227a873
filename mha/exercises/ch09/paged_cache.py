"""Section 9.1, a paged cache that is a pool of blocks: the exercises as data for :mod:`.._harness`.

References: the slots a block table reserves and leaves empty, counted by definition; attention
of one decode step by torch's SDPA over each sequence's keys, gathered through the table; the
blocks a shared prompt occupies, counted by definition. Mistakes: a full block of waste for a
length that fills its blocks, the used part counted instead of the empty one, the worst case; the
whole last block read, the key/value heads repeated in the wrong order, the table skipped, no
scale; no sharing, sharing without copy-on-write, the copied block kept, copies before any write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from .._harness import Case, Exercise, as_int, publish, randn64

# --- the memory a block table wastes ------------------------------------------------------------


def _waste_reference(lengths: Sequence[int], block_size: int) -> int:
    reserved = sum(math.ceil(n / block_size) * block_size for n in lengths)  # whole blocks
    return reserved - sum(lengths)


def _waste_cases() -> list[Case]:
    return [
        Case("waste([37, 5, 1200, 64, 300], 16)", ([37, 5, 1200, 64, 300], 16)),
        Case("waste([16, 32, 48], 16) (every block full)", ([16, 32, 48], 16)),
        Case("waste([0, 1, 7, 8, 9], 8) (an empty sequence too)", ([0, 1, 7, 8, 9], 8)),
        Case("waste([3, 10], 1)", ([3, 10], 1)),
    ]


_HINT_WASTE = (
    "A sequence of n tokens holds ceil(n / block_size) blocks; only the last one can be partly "
    "empty, by ceil(n / block_size) * block_size - n slots (0 when n is a multiple of block_size)."
)

BLOCK_WASTE = Exercise(
    "check_block_waste",
    "the empty slots of every last block, none for full blocks",
    _waste_reference,
    _waste_cases,
    variants=(
        lambda lengths, bs: sum(-n % bs for n in lengths),
        lambda lengths, bs: sum((n + bs - 1) // bs * bs - n for n in lengths),
    ),
    mistakes=(
        (
            lambda lengths, bs: sum(bs - n % bs for n in lengths),
            "A sequence whose length is a multiple of block_size fills its blocks: it wastes 0 "
            "slots, not a whole block (and an empty sequence holds no block). " + _HINT_WASTE,
        ),
        (
            lambda lengths, bs: sum(n % bs for n in lengths),
            "n % block_size counts the tokens in the last block, the slots in use; the waste is "
            "the rest of that block. " + _HINT_WASTE,
        ),
        (
            lambda lengths, bs: len(lengths) * (bs - 1),
            "block_size - 1 per sequence is the worst case, not what these lengths waste. "
            + _HINT_WASTE,
        ),
    ),
    hint=_HINT_WASTE,
    crash_hint=_HINT_WASTE,
    call=lambda answer, case: as_int(answer(*case.args), "waste(lengths, block_size)"),
    params=("waste",),
    doc="Check ``waste(lengths, block_size) -> int``: the slots that a paged cache reserves for "
    "sequences of these lengths and leaves empty.",
)


# --- one decode step through the block table -----------------------------------------------------


def _gather(pool: Tensor, row: Tensor, n: int) -> Tensor:
    """One sequence's first ``n`` positions from the pool: ``(1, Hkv, n, D)``."""
    blocks = pool[row[: math.ceil(n / pool.shape[2])].long()]  # (blocks, Hkv, bs, D)
    return blocks.transpose(0, 1).flatten(1, 2)[None, :, :n]  # (1, Hkv, n, D)


def _decode_reference(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """torch's SDPA over each sequence's own keys, gathered through the table."""
    outs = [
        F.scaled_dot_product_attention(
            query[b : b + 1],
            _gather(key_pool, block_table[b], n),
            _gather(value_pool, block_table[b], n),
            enable_gqa=True,
        )
        for b, n in enumerate(seq_lens.tolist())
    ]
    return torch.cat(outs)  # (B, H, 1, D)


def _decode_cases() -> list[Case]:
    """Shuffled pools whose unused slots hold random numbers (not zeros), lengths that end inside
    a block, on its last slot, and after one token."""
    g = torch.Generator().manual_seed(91)
    cases = []
    for what, H, Hkv, lengths in (
        ("H = 4 query heads, Hkv = 2 (GQA)", 4, 2, [5, 16, 1]),
        ("H = Hkv = 3", 3, 3, [9, 2]),
        ("H = 4, Hkv = 1 (MQA)", 4, 1, [13, 7, 4]),
    ):
        bs, D = 4, 8
        need = [math.ceil(n / bs) for n in lengths]
        N = sum(need) + 2
        order = torch.randperm(N, generator=g)
        table = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
        used = 0
        for b, k in enumerate(need):
            table[b, :k] = order[used : used + k].int()
            used += k
        args = (
            randn64(g, len(lengths), H, 1, D),  # query (B, H, 1, D)
            randn64(g, N, Hkv, bs, D),  # key_pool (N, Hkv, block_size, D)
            randn64(g, N, Hkv, bs, D),  # value_pool
            table,  # (B, M)
            torch.tensor(lengths),  # seq_lens (B,)
        )
        cases.append(Case(f"paged_decode(...) with {what}, lengths {lengths}", args))
    return cases


def _decode_by_hand(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """Each sequence gathered block by block, softmax written out, heads grouped by a view."""
    B, H, _, D = query.shape
    Hkv, bs = key_pool.shape[1], key_pool.shape[2]
    out = []
    for b in range(B):
        n = int(seq_lens[b])
        k = torch.cat([key_pool[int(block_table[b, j])] for j in range(-(-n // bs))], 1)[:, :n]
        v = torch.cat([value_pool[int(block_table[b, j])] for j in range(-(-n // bs))], 1)[:, :n]
        q = query[b, :, 0].view(Hkv, H // Hkv, D)  # (Hkv, G, D)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)  # (Hkv, G, n)
        out.append((w @ v).reshape(H, 1, D))  # (H, 1, D)
    return torch.stack(out)  # (B, H, 1, D)


def _decode_whole_blocks(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    rounded = (seq_lens + key_pool.shape[2] - 1) // key_pool.shape[2] * key_pool.shape[2]
    return _decode_reference(query, key_pool, value_pool, block_table, rounded)


def _decode_heads_repeated(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    groups = query.shape[1] // key_pool.shape[1]
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        k = _gather(key_pool, block_table[b], n).repeat(1, groups, 1, 1)  # head i -> i % Hkv
        v = _gather(value_pool, block_table[b], n).repeat(1, groups, 1, 1)
        outs.append(F.scaled_dot_product_attention(query[b : b + 1], k, v))
    return torch.cat(outs)


def _decode_no_table(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    in_order = torch.arange(block_table.numel()).view(block_table.shape)  # blocks 0, 1, 2, ...
    return _decode_reference(query, key_pool, value_pool, in_order, seq_lens)


def _decode_no_scale(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    D = query.shape[-1]
    return _decode_reference(query * math.sqrt(D), key_pool, value_pool, block_table, seq_lens)


_HINT_DECODE = (
    "Sequence b's position t is in block block_table[b, t // block_size] at offset "
    "t % block_size; read its first seq_lens[b] positions, and let query head h use key/value "
    "head h // (H // Hkv); then softmax(q·k / sqrt(D)) · v."
)

PAGED_DECODE = Exercise(
    "check_paged_decode",
    "equals torch's SDPA over each sequence's own keys (float64)",
    _decode_reference,
    _decode_cases,
    variants=(_decode_by_hand, mha.paged_attention),
    mistakes=(
        (
            _decode_whole_blocks,
            "The last block of a sequence is only partly written: its slots past seq_lens[b] "
            "hold whatever was there before. Read the first seq_lens[b] positions only. "
            + _HINT_DECODE,
        ),
        (
            _decode_heads_repeated,
            "repeat puts the key/value heads in the order 0, 1, 0, 1, ...: query head h then "
            "reads head h % Hkv. Grouped-query attention gives consecutive query heads one "
            "key/value head: repeat_interleave (or a view of the query as (Hkv, G, D)). "
            + _HINT_DECODE,
        ),
        (
            _decode_no_table,
            "A sequence's blocks are wherever the pool had room, not blocks 0, 1, 2, ...: look "
            "each one up in block_table. " + _HINT_DECODE,
        ),
        (_decode_no_scale, "Scale the scores by 1/sqrt(D). " + _HINT_DECODE),
    ),
    hint=_HINT_DECODE,
    crash_hint=_HINT_DECODE,
    atol=1e-10,
    rtol=1e-8,
    params=("paged_decode",),
    doc="Check ``paged_decode(query, key_pool, value_pool, block_table, seq_lens) -> "
    "(B, H, 1, D)``: one decode step per sequence, its keys and values read through the block "
    "table.",
)


# --- blocks shared by a prompt --------------------------------------------------------------------


def _shared_reference(prompt_len: int, new_tokens: int, num_sequences: int, block_size: int) -> int:
    full = prompt_len // block_size  # the prompt's full blocks: shared, never written again
    if new_tokens == 0:  # nobody has written: the partly filled block is shared too
        return math.ceil(prompt_len / block_size)
    own = math.ceil((prompt_len + new_tokens) / block_size) - full  # each one's own blocks
    return full + num_sequences * own


def _shared_by_cache(prompt_len: int, new_tokens: int, num_sequences: int, block_size: int) -> int:
    """Count the blocks of a real PagedKVCache that decodes the sequences one token at a time."""
    cache = mha.PagedKVCache(block_size=block_size)
    cache.update(torch.zeros(1, 1, prompt_len, 1), torch.zeros(1, 1, prompt_len, 1))
    for _ in range(num_sequences - 1):
        cache.fork(0)
    token = torch.zeros(num_sequences, 1, 1, 1)
    for _ in range(new_tokens):
        cache.update(token, token)
    return cache.blocks_in_use


_SHARED_CASES = (
    (37, 20, 2, 16),
    (37, 2, 3, 16),
    (37, 0, 3, 16),
    (32, 5, 4, 16),
    (5, 100, 3, 4),
    (0, 9, 2, 4),
    (100, 1, 1, 16),
)

_HINT_SHARED = (
    "The prompt's full blocks stay shared (nobody writes them again). The partly filled last "
    "block is shared until a sequence writes into it: then it is copied for each writer but the "
    "last, so every sequence ends up with its own copy. Each sequence owns "
    "ceil((prompt_len + new_tokens) / block_size) - prompt_len // block_size blocks."
)

SHARED_PREFIX_BLOCKS = Exercise(
    "check_shared_prefix_blocks",
    "full prompt blocks shared, the partly filled one copied on write",
    _shared_reference,
    lambda: [Case(f"blocks_in_use{args}", args) for args in _SHARED_CASES],
    variants=(
        _shared_by_cache,
        lambda p, t, n, bs: -(-p // bs) if t == 0 else p // bs + n * (-(-(p + t) // bs) - p // bs),
    ),
    mistakes=(
        (
            lambda p, t, n, bs: n * math.ceil((p + t) / bs),
            "The sequences share the prompt's blocks: its full blocks are stored once. "
            + _HINT_SHARED,
        ),
        (
            lambda p, t, n, bs: (
                math.ceil(p / bs) + n * (math.ceil((p + t) / bs) - math.ceil(p / bs))
            ),
            "The prompt's last block is only partly filled: the sequences' next tokens go into "
            "it, different for each one, so each writer needs its own copy (copy-on-write). "
            + _HINT_SHARED,
        ),
        (
            lambda p, t, n, bs: _shared_reference(p, t, n, bs) + (p % bs > 0 and t > 0 and n > 1),
            "The original partly filled block is not kept besides the copies: the last sequence "
            "still using it writes into it in place. " + _HINT_SHARED,
        ),
        (
            lambda p, t, n, bs: p // bs + n * (math.ceil((p + t) / bs) - p // bs),
            "Copies are made when a sequence writes, not before: with no new token the partly "
            "filled block is still shared. " + _HINT_SHARED,
        ),
    ),
    hint=_HINT_SHARED,
    crash_hint=_HINT_SHARED,
    call=lambda answer, case: as_int(answer(*case.args), f"blocks_in_use{case.args}"),
    params=("blocks_in_use",),
    doc="Check ``blocks_in_use(prompt_len, new_tokens, num_sequences, block_size) -> int``: the "
    "blocks of a paged cache in use after ``num_sequences`` sequences that share a prompt each "
    "decode ``new_tokens`` tokens.",
)


EXERCISES = publish(globals())
