"""Section 9.7, hybrid caches: the exercises as data for :mod:`.._harness`.

References: which blocks a sliding-window layer gives back before its next write (the held blocks
wholly before the window of the first new query, as :class:`mha.SlidingWindowPagedCache` frees
them), and the bytes a request holds per kind of layer in a hybrid stack once it has decoded
``seq_len`` tokens (whole blocks for the full and sliding layers, one fixed state per linear
layer); mistakes: the window of the chunk's last query, the window of the last stored position,
the block of the oldest visible key freed too, blocks already freed counted again, logical
columns for physical blocks; a window as a rolling buffer of positions, the bound for the count,
positions for blocks, a state that grows, a kind counted once; and the library's own classes
(every function of ``mha.window_cache`` and ``mha.hybrid_cache``, with the pools they build on),
which the exercises ban.
"""

from __future__ import annotations

import math

from mha import hybrid_cache, kv_memory, paged, window_cache
from mha.models import state_pool

from .._harness import Case, Exercise, defined_in, publish, slipped

FREED = -1  # a table entry whose block went back to the pool

# --- which blocks a window layer frees --------------------------------------------------------


def _free_reference(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    oldest = max(0, seq_len - window + 1)  # the oldest key the chunk's first query sees
    return [b for b in table[: oldest // block_size] if b != FREED]


def _free_cases() -> list[Case]:
    return [
        Case(f"blocks_to_free({t}, {s}, {n}, {w}, {bs}){what}", (t, s, n, w, bs))
        for t, s, n, w, bs, what in (
            ([3, 7, 1, 4, 9], 18, 1, 8, 4, " (a decode step)"),
            ([5, 2, 8, 6], 14, 6, 6, 4, " (a chunk of 6 new positions)"),
            ([-1, -1, 4, 0, 2, 6], 23, 1, 9, 4, " (two blocks given back earlier)"),
            ([0, 1, 2, 3], 13, 1, 6, 4, " (the window starts on a block boundary)"),
            ([2], 3, 1, 8, 16, " (shorter than the window)"),
            ([4, 5, 6], 9, 1, 1, 4, " (a window of 1: the query sees itself)"),
            ([9, 8, 7, 6, 5], 5, 2, 3, 1, " (blocks of one position)"),
            ([-1] * 6 + list(range(30, 43)), 300, 1, 128, 16, " (W = 128, blocks of 16)"),
            ([], 0, 4, 4, 4, " (an empty sequence, its first chunk)"),
        )
    ]


def _free_by_last_position(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    """Block by block: free it when its last position is older than the first query's window."""
    first_query = seq_len  # the new positions are seq_len, seq_len + 1, ...
    return [
        block
        for col, block in enumerate(table)
        if block >= 0 and (col + 1) * block_size - 1 < first_query - window + 1
    ]


def _free_by_what_is_needed(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    """The columns every new query needs, from the first one's window to the last one: the
    blocks before the lowest of them go."""
    needed = {
        p // block_size
        for q in range(seq_len, seq_len + n_queries)
        for p in range(max(0, q - window + 1), q + 1)
    }
    return [b for col, b in enumerate(table) if col < min(needed) and b != FREED]


def _free_last_query(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    return _free_reference(table, seq_len + n_queries - 1, 1, window, block_size)


def _free_from_last_stored(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    oldest = max(0, seq_len - window)  # the window of position seq_len - 1
    return [b for b in table[: oldest // block_size] if b != FREED]


def _free_oldest_block_too(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    oldest = max(0, seq_len - window + 1)
    return [b for b in table[: -(-oldest // block_size)] if b != FREED]


def _free_again(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    return list(table[: max(0, seq_len - window + 1) // block_size])


def _free_columns(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    oldest = max(0, seq_len - window + 1)
    return [col for col in range(oldest // block_size) if table[col] != FREED]


def _window_cache(
    table: list[int], seq_len: int, window: int, block_size: int
) -> window_cache.SlidingWindowPagedCache:
    """A SlidingWindowPagedCache holding one sequence with ``table``, set up by hand (its
    constructor untouched), so that the first function of mha.window_cache called is the asked
    one."""
    cache = window_cache.SlidingWindowPagedCache.__new__(window_cache.SlidingWindowPagedCache)
    cache.window, cache.block_size, cache.freed_blocks = window, block_size, 0
    cache._tables, cache._lens = [list(table)], [seq_len]
    cache._refs = [1] * (max(table, default=0) + 1)
    return cache


def _free_by_library(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    import torch

    cache = _window_cache(table, seq_len, window, block_size)
    new = torch.zeros(1, 1, n_queries, 1)  # (B, Hkv, n, D): the chunk's keys and values
    cache.update(new, new)  # frees, then writes
    return [b for b, now in zip(table, cache._tables[0]) if b != FREED and now == FREED]


def _free_by_private_helper(
    table: list[int], seq_len: int, n_queries: int, window: int, block_size: int
) -> list[int]:
    """mha.window_cache's private _slide, reached around update."""
    cache = _window_cache(table, seq_len, window, block_size)
    cache._slide(0)
    return [b for b, now in zip(table, cache._tables[0]) if b != FREED and now == FREED]


_HINT_FREE = (
    "The new positions are seq_len, seq_len + 1, ...; the first of them sees keys seq_len - "
    "window + 1 ... seq_len, and every later one sees less of the past. A block can go when all "
    "its positions are older than that: the columns before max(0, seq_len - window + 1) // "
    "block_size. Return the physical ids held there (table entries that are not -1), in table "
    "order."
)
_NO_WINDOW_CACHE = (
    "write it yourself, without mha.SlidingWindowPagedCache (its update, attend or helpers)."
)

BLOCKS_TO_FREE = Exercise(
    "check_blocks_to_free",
    "the held blocks wholly before the first new query's window, for decode steps and chunks",
    _free_reference,
    _free_cases,
    variants=(_free_by_last_position, _free_by_what_is_needed),
    mistakes=(
        (
            _free_last_query,
            "That is the window of the chunk's last query: the first new query still needs keys "
            "back to seq_len - window + 1, so those blocks must stay until it has run. "
            + _HINT_FREE,
        ),
        (
            _free_from_last_stored,
            "That is the window of the last stored position, seq_len - 1; the next query is at "
            "seq_len and sees one position less of the past, so one more position can go. "
            + _HINT_FREE,
        ),
        (
            _free_oldest_block_too,
            "The block that holds the oldest visible key is still read: free only the blocks "
            "whose every position is older (round down, //). " + _HINT_FREE,
        ),
        (
            _free_again,
            "-1 marks a block already given back: give back only blocks the sequence still "
            "holds. " + _HINT_FREE,
        ),
        (
            _free_columns,
            "Those are columns of the block table; return the physical blocks they hold "
            "(table[col]), which go back to the pool. " + _HINT_FREE,
        ),
        (_free_by_library, _NO_WINDOW_CACHE),
        (_free_by_private_helper, _NO_WINDOW_CACHE),
    ),
    hint=_HINT_FREE,
    crash_hint=_HINT_FREE,
    exact_dtype=True,
    forbidden=(*defined_in(window_cache), *defined_in(hybrid_cache)),
    forbidden_hint=_NO_WINDOW_CACHE,
    rewrites=(window_cache.SlidingWindowPagedCache.update,),
    params=("blocks_to_free",),
    doc="Check ``blocks_to_free(table, seq_len, n_queries, window, block_size) -> list[int]``: "
    "the physical blocks a sliding-window layer gives back before writing ``n_queries`` new "
    "positions of a sequence that holds ``seq_len`` in the blocks of ``table``.",
)


# --- the bytes of a hybrid stack ----------------------------------------------------------------


def _bytes_reference(
    layer_types: list[str],
    seq_len: int,
    window: int | None,
    block_size: int,
    position_bytes: int,
    state_bytes: int,
) -> dict[str, int]:
    block = block_size * position_bytes
    per_layer = {}
    if "full" in layer_types:
        per_layer["full"] = math.ceil(seq_len / block_size) * block
    if "sliding" in layer_types:
        assert window is not None
        first = max(0, seq_len - window) // block_size  # freed before the last step's write
        per_layer["sliding"] = ((seq_len - 1) // block_size - first + 1) * block
    if "linear" in layer_types:
        per_layer["linear"] = state_bytes
    return {kind: layer_types.count(kind) * b for kind, b in per_layer.items()}


def _bytes_cases() -> list[Case]:
    oss, nxt = ["sliding", "full"] * 2, ["linear"] * 3 + ["full"]
    return [
        Case(
            f"hybrid_bytes({t}, {s}, {w}, {bs}, {pb}, {sb}){what}",
            (t, s, w, bs, pb, sb),
        )
        for t, s, w, bs, pb, sb, what in (
            (oss, 4096, 128, 16, 256, 0, " (gpt-oss-like, 4K)"),
            (oss, 4100, 128, 16, 256, 0, " (a window across 9 blocks)"),
            (nxt, 1000, None, 16, 64, 5632, " (Qwen3-Next-like)"),
            (oss, 50, 128, 16, 256, 0, " (shorter than the window)"),
            (["sliding"] * 3, 1000, 100, 16, 32, 0, " (a window of 100, blocks of 16)"),
            (["full", "sliding", "linear", "linear"], 333, 32, 8, 32, 1000, " (three kinds)"),
            (nxt + oss, 1, 4, 4, 8, 100, " (one token)"),
        )
    ]


def _bytes_by_layers(
    layer_types: list[str],
    seq_len: int,
    window: int | None,
    block_size: int,
    position_bytes: int,
    state_bytes: int,
) -> dict[str, int]:
    """Layer by layer, the blocks held as the set of columns the last query's window spans."""
    out: dict[str, int] = {}
    for kind in layer_types:
        if kind == "linear":
            held = state_bytes
        else:
            start = 0 if kind == "full" else max(0, seq_len - 1 - (window or 0) + 1)
            columns = {p // block_size for p in range(start, seq_len)}
            held = len(columns) * block_size * position_bytes
        out[kind] = out.get(kind, 0) + held
    return out


def _bytes_by_simulation(
    layer_types: list[str],
    seq_len: int,
    window: int | None,
    block_size: int,
    position_bytes: int,
    state_bytes: int,
) -> dict[str, int]:
    """A decode simulated token by token: a block taken when a position opens one, the blocks
    wholly before the next query's window given back before each write."""
    held: dict[str, int] = {}
    for kind in dict.fromkeys(layer_types):
        if kind == "linear":
            held[kind] = state_bytes
            continue
        blocks: set[int] = set()
        for p in range(seq_len):  # write position p
            if kind == "sliding":
                oldest = max(0, p - (window or 0) + 1)
                blocks = {c for c in blocks if (c + 1) * block_size > oldest}
            blocks.add(p // block_size)
        held[kind] = len(blocks) * block_size * position_bytes
    return {kind: sum(held[k] for k in layer_types if k == kind) for kind in held}


def _bytes_slip(
    layer_types: list[str],
    seq_len: int,
    window: int | None,
    block_size: int,
    position_bytes: int,
    state_bytes: int,
    **slip: bool,
) -> dict[str, int]:
    """The reference with one of the usual slips: a rolling buffer of exactly ``window``
    positions, the bound ``ceil(window / block_size) + 1`` taken as the count, the full layers'
    positions instead of whole blocks, a linear state that grows, each kind counted once."""
    kinds = list(dict.fromkeys(layer_types)) if slip.get("once_per_kind") else layer_types
    out = _bytes_reference(kinds, seq_len, window, block_size, position_bytes, state_bytes)
    sliding, full = kinds.count("sliding"), kinds.count("full")
    if "sliding" in out and window is not None and slip.get("rolling_buffer"):
        out["sliding"] = sliding * min(seq_len, window) * position_bytes
    if "sliding" in out and window is not None and slip.get("bound"):
        blocks = min(math.ceil(seq_len / block_size), math.ceil(window / block_size) + 1)
        out["sliding"] = sliding * blocks * block_size * position_bytes
    if "full" in out and slip.get("positions"):
        out["full"] = full * seq_len * position_bytes
    if "linear" in out and slip.get("growing_state"):
        out["linear"] *= seq_len
    return out


def _bytes_by_library(
    layer_types: list[str],
    seq_len: int,
    window: int | None,
    block_size: int,
    position_bytes: int,
    state_bytes: int,
) -> dict[str, int]:
    """A HybridCache's report, its constructor untouched (it would fill real pools)."""
    cache = hybrid_cache.HybridCache.__new__(hybrid_cache.HybridCache)
    cache.layer_types, cache.layers = tuple(layer_types), []
    return cache.nbytes_by_kind()


_HINT_BYTES = (
    "Per layer of each kind: a full layer holds ceil(seq_len / block_size) blocks; a sliding "
    "layer the blocks from column max(0, seq_len - window) // block_size to (seq_len - 1) // "
    "block_size (the others were given back before the last step's write); a block is "
    "block_size × position_bytes; a linear layer holds state_bytes whatever seq_len. Sum over "
    "the layers of each kind; one entry per kind present."
)
_NO_HYBRID_CACHE = (
    "count it yourself, without mha.HybridCache, its caches and pools, or mha.kv_cache_bytes."
)

HYBRID_BYTES = Exercise(
    "check_hybrid_bytes",
    "whole blocks for full and sliding layers, one fixed state per linear layer, per kind",
    _bytes_reference,
    _bytes_cases,
    variants=(_bytes_by_layers, _bytes_by_simulation),
    mistakes=(
        (
            slipped(_bytes_slip, "rolling_buffer"),
            "That is a rolling buffer of exactly window positions; a paged layer holds whole "
            "blocks, and the window rarely starts on a block boundary. " + _HINT_BYTES,
        ),
        (
            slipped(_bytes_slip, "bound"),
            "ceil(window / block_size) + 1 is the most a sliding layer holds; count the blocks "
            "the window spans now (one fewer when it starts on a block boundary). " + _HINT_BYTES,
        ),
        (
            slipped(_bytes_slip, "positions"),
            "A full layer's last block is taken whole, however few of its positions are "
            "written: round seq_len up to whole blocks. " + _HINT_BYTES,
        ),
        (
            slipped(_bytes_slip, "growing_state"),
            "A linear layer's state does not grow with the text: state_bytes per request, after "
            "one token or a million. " + _HINT_BYTES,
        ),
        (
            slipped(_bytes_slip, "once_per_kind"),
            "Counted once per kind: every layer of a kind holds its own blocks or its own "
            "state, so multiply by how many layers of that kind the stack has. " + _HINT_BYTES,
        ),
        (_bytes_by_library, _NO_HYBRID_CACHE),
    ),
    hint=_HINT_BYTES,
    crash_hint=_HINT_BYTES,
    exact_dtype=True,
    forbidden=(
        *defined_in(hybrid_cache),
        *defined_in(window_cache),
        *defined_in(paged),
        *defined_in(state_pool),
        kv_memory.kv_cache_bytes,
    ),
    forbidden_hint=_NO_HYBRID_CACHE,
    rewrites=(hybrid_cache.HybridCache.nbytes_by_kind,),
    params=("hybrid_bytes",),
    doc="Check ``hybrid_bytes(layer_types, seq_len, window, block_size, position_bytes, "
    "state_bytes) -> dict[str, int]``: the bytes one request holds per kind of layer once it has "
    "decoded ``seq_len`` tokens.",
)


EXERCISES = publish(globals())
