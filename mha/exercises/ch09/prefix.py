"""Section 9.6, prefix caching: the exercises as data for :mod:`.._harness` (cascade attention's
is in :mod:`.cascade`).

References: how many positions of a new prompt a prefix cache reuses (the longest prefix of whole
blocks that an earlier prompt already filled, always leaving one token to compute), and the
chained hash of every full block (SHA-256 over the parent block's hash and the block's token ids);
mistakes: tokens counted instead of whole blocks, no token left to compute, blocks matched by
their own tokens wherever they stand, blocks for positions, a hash without its parent, a hash for
the partial last block, and the library's own functions (every function of ``mha.paged``), which
the exercises ban.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from array import array

from mha import paged

from .._harness import Case, Exercise, defined_in, publish

# --- which blocks a new request reuses ----------------------------------------------------------


def _reused_reference(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    limit = max(len(prompt) - 1, 0) // block_size  # whole blocks that leave a token to compute
    best = 0
    for p in earlier:  # every full block of an earlier prompt is cached
        n = 0
        while n < min(limit, len(p) // block_size) and (
            p[: (n + 1) * block_size] == prompt[: (n + 1) * block_size]
        ):
            n += 1
        best = max(best, n)
    return best * block_size


def _reused_cases() -> list[Case]:
    a, b, c = list(range(8)), list(range(8, 16)), list(range(16, 20))
    x, y = [30, 31, 32, 33], [40, 41, 42, 43]
    system = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 2]
    return [
        Case(f"reused_positions({e}, {p}, {bs}){what}", (e, p, bs))
        for e, p, bs, what in (
            ([a + b + c], a + b + [99, 98], 8, " (two whole blocks in common)"),
            ([a + b], a + b, 8, " (the same prompt again: one token left to compute)"),
            (
                [a[:4] + x, a[4:] + y],
                a[:4] + y + [5],
                4,
                " (block 1's tokens after another block 0)",
            ),
            ([], a + b, 8, " (an empty cache)"),
            (
                [system + [1, 2], system[:8] + [0] * 8],
                system + [3, 3, 3],
                4,
                " (the longest of two)",
            ),
            ([a[:10]], a[:10] + [50, 51, 52], 4, " (10 tokens in common, 2 whole blocks)"),
            ([a + b], a[:5], 8, " (a prompt shorter than a block)"),
            ([a[:4]], a[:4] + [9], 4, " (a whole block, then one token)"),
        )
    ]


def _chain_hashes(tokens: list[int], block_size: int) -> list[str]:
    """The course's chained block hashes, written out with hashlib (not the library's)."""
    parent, hashes = "", []
    for j in range(len(tokens) // block_size):
        block = tokens[j * block_size : (j + 1) * block_size]
        parent = hashlib.sha256(parent.encode() + array("q", block).tobytes()).hexdigest()
        hashes.append(parent)
    return hashes


def _reused_by_hashes(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    """As an engine does it: a set of cached chain hashes, looked up block by block."""
    cached = {h for p in earlier for h in _chain_hashes(p, block_size)}
    found = 0
    for h in _chain_hashes(prompt[: max(len(prompt) - 1, 0)], block_size):
        if h not in cached:
            break
        found += 1
    return found * block_size


def _common_tokens(earlier: list[list[int]], prompt: list[int]) -> int:
    """The longest run of equal tokens from the start, against any earlier prompt, leaving the
    prompt's last token out."""
    common = max(
        (
            sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(p, prompt)))
            for p in earlier
        ),
        default=0,
    )
    return min(common, max(len(prompt) - 1, 0))


def _reused_by_common_prefix(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    """The longest run of equal tokens, rounded down to whole blocks."""
    return _common_tokens(earlier, prompt) // block_size * block_size


def _reused_tokens(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    return _common_tokens(earlier, prompt)


def _reused_no_token_left(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    return _reused_reference(earlier, prompt + [-1], block_size)


def _reused_by_block_tokens(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    """Blocks known by their own tokens only, wherever they stood."""
    seen = {
        tuple(p[j : j + block_size])
        for p in earlier
        for j in range(0, len(p) - block_size + 1, block_size)
    }
    n = 0
    while (n + 1) * block_size < len(prompt) and tuple(
        prompt[n * block_size : (n + 1) * block_size]
    ) in seen:
        n += 1
    return n * block_size


def _library_cache(earlier: list[list[int]], block_size: int) -> paged.PagedKVCache:
    """A PagedKVCache that holds the earlier prompts' block hashes, set up by hand (its
    constructor untouched), so that the first function of mha.paged called is the asked one."""
    cache = paged.PagedKVCache.__new__(paged.PagedKVCache)
    cache.block_size, cache.prefix_caching = block_size, True
    cache._cached = {h: 0 for p in earlier for h in _chain_hashes(p, block_size)}
    return cache


def _reused_by_library(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    return _library_cache(earlier, block_size).cached_prefix(prompt)


def _reused_by_private_helper(earlier: list[list[int]], prompt: list[int], block_size: int) -> int:
    """mha.paged's private lookup, reached around cached_prefix."""
    return len(_library_cache(earlier, block_size)._lookup(list(prompt))) * block_size


_HINT_REUSED = (
    "A cached block j is found only if some earlier prompt agrees with the new one on every token "
    "of blocks 0 ... j (its hash is chained over all of them), and only whole blocks count; keep at "
    "least one prompt token to compute: at most (len(prompt) - 1) // block_size blocks. Return "
    "positions, blocks × block_size."
)
_NO_LOOKUP = (
    "write it yourself, without mha.PagedKVCache (cached_prefix, block_hashes or their helpers)."
)

REUSED_PREFIX = Exercise(
    "check_reused_prefix",
    "the longest common prefix of whole blocks, chained, with one prompt token left to compute",
    _reused_reference,
    _reused_cases,
    variants=(_reused_by_hashes, _reused_by_common_prefix),
    mistakes=(
        (
            _reused_tokens,
            "This counts equal tokens; the cache holds whole blocks, and a block is reused only "
            "when all its tokens match. " + _HINT_REUSED,
        ),
        (
            _reused_no_token_left,
            "Nothing would be left to compute: the last prompt token's query gives the first "
            "output token, so it is computed even when its block is cached. " + _HINT_REUSED,
        ),
        (
            _reused_by_block_tokens,
            "Blocks matched by their own tokens alone: the same tokens after a different "
            "beginning have other keys (other positions, other attention before them), so a "
            "block matches only if everything before it matches too. " + _HINT_REUSED,
        ),
        (
            lambda earlier, prompt, block_size: (
                _reused_reference(earlier, prompt, block_size) // block_size
            ),
            "That is the number of blocks; return positions (blocks × block_size).",
        ),
        (_reused_by_library, _NO_LOOKUP),
        (_reused_by_private_helper, _NO_LOOKUP),
    ),
    hint=_HINT_REUSED,
    crash_hint=_HINT_REUSED,
    exact_dtype=True,
    forbidden=tuple(defined_in(paged)),
    forbidden_hint=_NO_LOOKUP,
    rewrites=(paged.PagedKVCache.cached_prefix,),
    params=("reused_positions",),
    doc="Check ``reused_positions(earlier, prompt, block_size) -> int``: the positions of "
    "``prompt`` that a prefix cache holding the full blocks of the ``earlier`` prompts gives it.",
)


# --- the chained block hash ---------------------------------------------------------------------


def _hashes_reference(tokens: list[int], block_size: int) -> list[str]:
    return _chain_hashes(list(tokens), block_size)


def _hashes_cases() -> list[Case]:
    return [
        Case(f"block_hashes({t}, {bs}){what}", (t, bs))
        for t, bs, what in (
            (list(range(20)), 8, " (two full blocks and a partial one)"),
            ([5, 5, 5, 5] * 4, 4, " (four blocks of the same tokens)"),
            ([3, 1, 4], 4, " (shorter than a block)"),
            ([], 4, " (no tokens)"),
            (list(range(100, 133)), 16, ""),
        )
    ]


def _hashes_by_struct(tokens: list[int], block_size: int) -> list[str]:
    hashes: list[str] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = hashlib.sha256((hashes[-1] if hashes else "").encode())
        digest.update(struct.pack(f"{len(block)}q", *block))
        hashes.append(digest.hexdigest())
    return hashes


def _hashes_by_accumulate(tokens: list[int], block_size: int) -> list[str]:
    blocks = [
        tokens[i : i + block_size]
        for i in range(0, len(tokens) // block_size * block_size, block_size)
    ]
    step = lambda parent, block: hashlib.sha256(  # noqa: E731
        parent.encode() + b"".join(t.to_bytes(8, "little", signed=True) for t in block)
    ).hexdigest()
    return list(itertools.accumulate(blocks, step, initial=""))[1:]


def _hashes_no_parent(tokens: list[int], block_size: int) -> list[str]:
    return [
        hashlib.sha256(array("q", tokens[j : j + block_size]).tobytes()).hexdigest()
        for j in range(0, len(tokens) // block_size * block_size, block_size)
    ]


def _hashes_with_partial(tokens: list[int], block_size: int) -> list[str]:
    return _chain_hashes(tokens + [0] * (-len(tokens) % block_size), block_size)


def _hashes_by_library(tokens: list[int], block_size: int) -> list[str]:
    return _library_cache([], block_size).block_hashes(tokens)


def _hashes_by_private_helper(tokens: list[int], block_size: int) -> list[str]:
    """mha.paged's private chain, reached around block_hashes."""
    return _library_cache([], block_size)._chain("", list(tokens), len(tokens) // block_size)


_HINT_HASHES = (
    "One hash per FULL block: block j's is hashlib.sha256(parent.encode() + array('q', "
    "block).tobytes()).hexdigest(), where parent is block j - 1's hash ('' for block 0)."
)
_NO_HASHES = (
    "write it yourself with hashlib, without mha.PagedKVCache (block_hashes or its helpers)."
)

BLOCK_HASHES = Exercise(
    "check_block_hashes",
    "one SHA-256 per full block, each chained over its parent's hash",
    _hashes_reference,
    _hashes_cases,
    variants=(_hashes_by_struct, _hashes_by_accumulate),
    mistakes=(
        (
            _hashes_no_parent,
            "Each block is hashed alone: the same tokens after a different beginning would get "
            "the same hash, yet their keys differ (their positions, and the attention before them "
            "in every layer). Start each hash from the parent's. " + _HINT_HASHES,
        ),
        (
            _hashes_with_partial,
            "The partial last block has no hash: it still fills, so its keys are not final and "
            "no other request can share it. " + _HINT_HASHES,
        ),
        (_hashes_by_library, _NO_HASHES),
        (_hashes_by_private_helper, _NO_HASHES),
    ),
    hint=_HINT_HASHES,
    crash_hint=_HINT_HASHES,
    forbidden=tuple(defined_in(paged)),
    forbidden_hint=_NO_HASHES,
    rewrites=(paged.PagedKVCache.block_hashes,),
    params=("block_hashes",),
    doc="Check ``block_hashes(tokens, block_size) -> list[str]``: the hex SHA-256 of every full "
    "block, chained over its parent block's hash.",
)


EXERCISES = publish(globals())
