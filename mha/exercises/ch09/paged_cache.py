"""Section 9.1, a paged cache that is a pool of blocks: the exercises as data for :mod:`.._harness`.

References: the slots a block table reserves and leaves empty, counted by definition; attention
of one decode step by torch's SDPA over each sequence's keys, gathered through the table (the
learner's answer must instead read block by block: in one case no tensor it makes may hold as
many numbers as a whole sequence's keys); the blocks a shared prompt occupies, counted by
definition. Mistakes: a full block of waste for a length that fills its blocks, the used part
counted instead of the empty one, the worst case; the whole last block read, the key/value heads
repeated in the wrong order, the table skipped, no scale, a whole sequence gathered; no sharing,
sharing without copy-on-write, the copied block kept, copies before any write; and the library's
own functions (every function of ``mha.paged``, ready-made attention), which the exercises ban."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

import mha
from mha import chunked_prefill, paged

from .._harness import NO_SDPA, Case, Exercise, as_int, defined_in, publish, randn64, tr
from ._guard import no_tensor_as_large

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
    rewrites=(),  # arithmetic: mha has no function for the slots a table leaves empty
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


def _decode_case(g: torch.Generator, what: str, H: int, Hkv: int, lengths: list[int]) -> Case:
    """A shuffled pool whose unused slots hold random numbers (not zeros), blocks of 4 slots."""
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
    return Case(f"paged_decode(...) with {what}, lengths {lengths}", args)


#: The case in which the answer may not hold a whole sequence's keys: every sequence spans 5 or
#: more blocks, so one gathered sequence is larger than any block read (even one per sequence).
_LONG = "H = 4, Hkv = 2, every sequence 5 blocks or more"


def _decode_cases() -> list[Case]:
    """Lengths that end inside a block, on its last slot, and after one token; then long ones."""
    g = torch.Generator().manual_seed(91)
    return [
        _decode_case(g, "H = 4 query heads, Hkv = 2 (GQA)", 4, 2, [5, 16, 1]),
        _decode_case(g, "H = Hkv = 3", 3, 3, [9, 2]),
        _decode_case(g, "H = 4, Hkv = 1 (MQA)", 4, 1, [13, 7, 4]),
        _decode_case(g, _LONG, 4, 2, [21, 18, 24]),
    ]


def _decode_run(answer: Callable[..., object], case: Case) -> object:
    """The answer's output; in the long case, no tensor as large as one sequence's keys may be
    made (views of the pools, such as ``key_pool[block]``, cost nothing and are allowed)."""
    args = tuple(t.clone() for t in case.args)
    if _LONG not in case.label:
        return answer(*args)
    query, key_pool, _, _, seq_lens = args
    limit = key_pool.shape[1] * int(seq_lens.min()) * key_pool.shape[-1]  # Hkv·n·D
    message = tr(
        "made a tensor of {n} numbers or more, as many as a whole sequence's keys: read the "
        "pool one block at a time",
        n=limit,
    )
    with no_tensor_as_large(limit, args[1:3], message):
        return answer(*args)


def _decode_online(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """Block by block with a running max, sum and weighted sum (FlashAttention's online softmax),
    the query heads of a group as rows."""
    B, H, _, D = query.shape
    Hkv, bs = key_pool.shape[1], key_pool.shape[2]
    out = torch.empty_like(query)  # (B, H, 1, D)
    for b in range(B):
        n = int(seq_lens[b])
        q = query[b, :, 0].view(Hkv, H // Hkv, D) / math.sqrt(D)  # (Hkv, G, D)
        m = q.new_full((Hkv, H // Hkv, 1), -math.inf)
        l, acc = q.new_zeros(Hkv, H // Hkv, 1), torch.zeros_like(q)  # noqa: E741
        for j in range(-(-n // bs)):
            block, used = int(block_table[b, j]), min(bs, n - j * bs)
            s = q @ key_pool[block, :, :used].transpose(-1, -2)  # (Hkv, G, used)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, alpha = (s - m_new).exp(), (m - m_new).exp()
            l = alpha * l + p.sum(-1, keepdim=True)  # noqa: E741
            acc = alpha * acc + p @ value_pool[block, :, :used]  # (Hkv, G, D)
            m = m_new
        out[b, :, 0] = (acc / l).reshape(H, D)
    return out


def _decode_scores_first(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """vLLM's first paged kernel: every block's scores (one number per key), one softmax over
    them, then the values block by block; key/value heads repeated for the query heads."""
    B, H, _, D = query.shape
    Hkv, bs = key_pool.shape[1], key_pool.shape[2]
    outs = []
    for b in range(B):
        n = int(seq_lens[b])
        blocks = [int(x) for x in block_table[b, : -(-n // bs)]]
        k_of = lambda blk: key_pool[blk].repeat_interleave(H // Hkv, 0)  # noqa: E731
        scores = torch.cat([query[b] @ k_of(blk).mT for blk in blocks], -1)[..., :n]  # (H, 1, n)
        w = torch.softmax(scores / math.sqrt(D), -1)  # (H, 1, n)
        out = torch.zeros(H, 1, D, dtype=query.dtype)
        for j, blk in enumerate(blocks):
            v = value_pool[blk].repeat_interleave(H // Hkv, 0)[:, : n - j * bs]  # (H, used, D)
            out = out + w[..., j * bs : j * bs + v.shape[1]] @ v
        outs.append(out)
    return torch.stack(outs)  # (B, H, 1, D)


def _decode_gathered(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """Right values, the wrong method: each sequence's keys gathered into one tensor first."""
    B, H, _, D = query.shape
    bs, groups = key_pool.shape[2], H // key_pool.shape[1]
    out = []
    for b in range(B):
        n = int(seq_lens[b])
        blocks = block_table[b, : math.ceil(n / bs)].long()  # its physical blocks
        k = key_pool[blocks].transpose(0, 1).flatten(1, 2)[:, :n]  # (Hkv, n, D)
        v = value_pool[blocks].transpose(0, 1).flatten(1, 2)[:, :n]
        k, v = (t.repeat_interleave(groups, 0) for t in (k, v))  # (H, n, D)
        out.append(torch.softmax(query[b] @ k.mT / math.sqrt(D), -1) @ v)  # (H, 1, D)
    return torch.stack(out)


def _decode_whole_blocks(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    rounded = (seq_lens + key_pool.shape[2] - 1) // key_pool.shape[2] * key_pool.shape[2]
    return _decode_online(query, key_pool, value_pool, block_table, rounded)


def _decode_heads_repeated(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """Block by block, the key/value heads repeated (0, 1, 0, 1, ...) instead of interleaved."""
    G = query.shape[1] // key_pool.shape[1]
    spread = query.unflatten(1, (G, -1)).transpose(1, 2).flatten(1, 2)  # head g·Hkv + h -> h·G + g
    out = _decode_online(spread, key_pool, value_pool, block_table, seq_lens)
    return out.unflatten(1, (-1, G)).transpose(1, 2).flatten(1, 2)


def _decode_no_table(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    in_order = torch.arange(block_table.numel()).view(block_table.shape)  # blocks 0, 1, 2, ...
    return _decode_online(query, key_pool, value_pool, in_order, seq_lens)


def _decode_no_scale(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    D = query.shape[-1]
    return _decode_online(query * math.sqrt(D), key_pool, value_pool, block_table, seq_lens)


def _decode_by_private_helper(query, key_pool, value_pool, block_table, seq_lens) -> Tensor:
    """mha.paged's private loop, reached around paged_attention."""
    scale = query.shape[-1] ** -0.5
    return paged._paged_attention(query, key_pool, value_pool, block_table, seq_lens, scale)[0]


_HINT_DECODE = (
    "Sequence b's position t is in block block_table[b, t // block_size] at offset "
    "t % block_size; read its first seq_lens[b] positions, and let query head h use key/value "
    "head h // (H // Hkv); then softmax(q·k / sqrt(D)) · v."
)
_DECODE_BLOCKS = (
    "Read the cache one block at a time, key_pool[block_table[b, j]], and fold each block into "
    "a running max, sum and weighted sum (or keep only the scores, one number per key): never "
    "gather a sequence's keys or values into one tensor."
)
_NO_PAGED_ATTENTION = (
    "write the decode yourself: no function of mha.paged (paged_attention, its private "
    "helpers) and no ready-made attention (F.scaled_dot_product_attention, "
    "mha.scaled_dot_product_attention ...)."
)

PAGED_DECODE = Exercise(
    "check_paged_decode",
    "equals torch's SDPA over each sequence's own keys (float64, GQA and MQA); read block by "
    "block: no tensor as large as a whole sequence's keys",
    _decode_reference,
    _decode_cases,
    variants=(_decode_online, _decode_scores_first),
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
        (_decode_gathered, _DECODE_BLOCKS),
        (mha.paged_attention, _NO_PAGED_ATTENTION),
        (_decode_by_private_helper, _NO_PAGED_ATTENTION),
    ),
    hint=_HINT_DECODE,
    crash_hint=_HINT_DECODE,
    atol=1e-10,
    rtol=1e-8,
    call=_decode_run,
    forbidden=(*defined_in(paged), *defined_in(chunked_prefill), *NO_SDPA),
    forbidden_hint=_NO_PAGED_ATTENTION,
    rewrites=(mha.paged_attention,),
    params=("paged_decode",),
    doc="Check ``paged_decode(query, key_pool, value_pool, block_table, seq_lens) -> "
    "(B, H, 1, D)``: one decode step per sequence, its keys and values read through the block "
    "table one block at a time (no tensor as large as a whole sequence's keys).",
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


def _shared_by_private_take(p: int, t: int, n: int, bs: int) -> int:
    """The blocks handed out by PagedKVCache's private _take, counted."""
    pool = SimpleNamespace(_free=list(range(10**4)), _refs={})
    taken = {mha.PagedKVCache._take(pool) for _ in range(math.ceil(p / bs))}  # type: ignore
    return len(taken) + (n * (math.ceil((p + t) / bs) - p // bs) - 1 if t else 0)


_NO_CACHE = "count the blocks yourself, without a mha.PagedKVCache (or its private helpers)."

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
        lambda p, t, n, bs: -(-p // bs) if t == 0 else p // bs + n * (-(-(p + t) // bs) - p // bs),
        lambda p, t, n, bs: (
            math.ceil(p / bs) if not t else n * math.ceil((p + t) / bs) - (n - 1) * (p // bs)
        ),
    ),
    mistakes=(
        (_shared_by_cache, _NO_CACHE),
        (_shared_by_private_take, _NO_CACHE),
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
    forbidden=tuple(defined_in(paged)),
    forbidden_hint=_NO_CACHE,
    # the library's count is a PagedKVCache's own blocks_in_use: its entry point, the constructor
    rewrites=(mha.PagedKVCache.__init__,),
    params=("blocks_in_use",),
    doc="Check ``blocks_in_use(prompt_len, new_tokens, num_sequences, block_size) -> int``: the "
    "blocks of a paged cache in use after ``num_sequences`` sequences that share a prompt each "
    "decode ``new_tokens`` tokens.",
)


EXERCISES = publish(globals())
