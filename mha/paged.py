"""A paged KV cache that is a pool of blocks, and attention that reads it through the block table.

vLLM's PagedAttention keeps every sequence's keys and values in fixed-size *blocks* of one
preallocated pool. A sequence owns a row of the *block table*: entry ``j`` is the physical block
holding its positions ``j·block_size … (j+1)·block_size - 1``. A decode step writes one token
per sequence into its block and copies nothing else; a block is taken from the pool when a
sequence reaches it and given back when the sequence ends, so sequences of unknown length share
one pool (continuous batching) without reserving ``max_len`` each. Sequences that start with the
same prompt share its blocks (reference-counted); a shared block that is only partly filled is
copied before one of them writes into it (copy-on-write). With ``prefix_caching=True`` the cache
finds shared prompts itself: full blocks are known by a hash chained over their tokens, kept
after their sequence ends, reused by later prompts and evicted least recently used first.

:func:`paged_attention` attends from one new query per sequence to that sequence's keys, read a
few blocks at a time through the table: no step gathers a whole sequence into one tensor.
:meth:`PagedKVCache.attend` is what :class:`mha.MultiHeadAttention` calls with the cache.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import validation as validate
from .chunked_prefill import TILE_KEYS, _paged_attention_rows, _paged_varlen_attention, _take
from .decoding import _merge_partials
from .flash import _flash_attention
from .multihead import _check_cache_step


class PagedKVCache:
    """A key/value cache in fixed-size blocks of one preallocated pool, found through a block table.

    Position ``t`` of sequence ``b`` lives in block ``block_table[b, t // block_size]`` at offset
    ``t % block_size``. The pools are allocated on the first :meth:`update` (which fixes the
    heads, head dims, dtype and device) and written in place afterwards: their storage stays the
    same while the pool has room. Rows of the block table are sequences: :meth:`add_sequence`
    admits one, :meth:`fork` admits one that shares another's prefix, :meth:`free_sequence` ends
    one and gives its blocks back. As ``kv_cache=`` of :class:`mha.MultiHeadAttention`,
    :meth:`attend` stores each step and attends through the block table.

    With ``prefix_caching=True`` the cache finds shared prefixes itself (vLLM's automatic prefix
    caching): a full block is known by a hash chained over its parent block's hash and its token
    ids (:meth:`block_hashes`); a sequence admitted with its prompt's token ids
    (``add_sequence(tokens)``) starts with the blocks of the longest cached prefix of whole
    blocks, always leaving at least one prompt token to compute; the blocks of ended sequences
    stay cached until the pool needs them, and are then reused least recently used first.
    Reference counts keep a block that a sequence uses from being freed or written: a shared or
    cached block about to be written is copied first (copy-on-write).

    Args:
        block_size: positions per block (vLLM's default is 16).
        num_blocks: size of the pool; ``None`` grows it by whole blocks (doubling) when it runs
            out (of free blocks, cached ones included); an int makes running out an error (a
            server must then evict or wait).
        prefix_caching: keep full blocks by the hash of their tokens and reuse them.

    Shapes:
        key_pool ``(num_blocks, Hkv, block_size, D)``, value_pool ``(num_blocks, Hkv, block_size,
        Dv)``, block_table ``(B, max_blocks)`` int32 (``-1`` past each sequence's blocks),
        seq_lens ``(B,)`` int64.
    """

    def __init__(
        self, block_size: int = 16, *, num_blocks: int | None = None, prefix_caching: bool = False
    ) -> None:
        self.block_size = validate.positive_int("block_size", block_size)
        self.num_blocks = (
            None if num_blocks is None else validate.positive_int("num_blocks", num_blocks)
        )
        self.prefix_caching = validate.flag("prefix_caching", prefix_caching)
        self.window: int | None = None  # every position stays visible (see mha.window_cache)
        self.key_pool: Tensor | None = None
        self.value_pool: Tensor | None = None
        self._tables: list[list[int]] = []  # per sequence: logical block -> physical block
        self._lens: list[int] = []  # per sequence: positions stored
        self._refs: list[int] = []  # per physical block: how many sequences use it
        self._free: list[int] = []  # free physical blocks holding nothing cached, taken last first
        # Prefix caching (all empty without it):
        self._tokens: list[list[int] | None] = []  # per sequence: its known token ids, in order
        self._hashes: list[list[str]] = []  # per sequence: the hashes of its full blocks
        self._block_hash: list[str | None] = []  # per physical block: its hash while cached
        self._cached: dict[str, int] = {}  # hash -> the physical block that holds it
        # Cached blocks that no sequence uses, least recently used first: the pool takes them
        # (and forgets their hash) only when no block without a hash is free.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: Full prompt blocks looked up by :meth:`add_sequence`, and how many were found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- what the cache holds -------------------------------------------------------------
    def __len__(self) -> int:
        """The number of positions every sequence holds (0 without sequences).

        Sequences of different lengths have no single length (``len`` is the ``S`` of
        :class:`mha.multihead.KVCacheProtocol`, from which ``rope=True`` continues the
        positions): a ValueError; read :attr:`seq_lens`.
        """
        lengths = set(self._lens)
        if len(lengths) > 1:
            raise ValueError(
                "the PagedKVCache's sequences hold different numbers of positions "
                f"({self._lens}), so it has no single length; read seq_lens (rope=True continues "
                "the positions after len(kv_cache), which needs sequences of one length)"
            )
        return next(iter(lengths), 0)

    def __bool__(self) -> bool:  # a cache is a cache even when empty or ragged
        return True

    @property
    def block_table(self) -> Tensor:
        """``(B, max_blocks)`` int32 on the pool's device; ``-1`` past a sequence's blocks."""
        width = max(map(len, self._tables), default=0)
        rows = [row + [-1] * (width - len(row)) for row in self._tables]
        return torch.tensor(rows, dtype=torch.int32, device=self._device).view(len(rows), width)

    @property
    def seq_lens(self) -> Tensor:
        """``(B,)`` int64 on the pool's device: positions stored per sequence."""
        return torch.tensor(self._lens, dtype=torch.int64, device=self._device)

    @property
    def blocks_in_use(self) -> int:
        """Physical blocks that at least one sequence uses (a shared block counts once)."""
        return sum(1 for r in self._refs if r > 0)

    @property
    def cached_blocks(self) -> int:
        """Blocks whose hash the prefix cache keeps (in use or not); 0 without prefix caching."""
        return len(self._cached)

    @property
    def evictable_blocks(self) -> list[int]:
        """Cached blocks that no sequence uses, least recently used first: the order in which
        the pool takes them back when no other block is free."""
        return list(self._evictable)

    @property
    def nbytes(self) -> int:
        """Bytes held by the blocks in use (free blocks of the pool serve other sequences)."""
        if self.key_pool is None or self.value_pool is None:
            return 0
        per_block = sum(t[0].numel() * t.element_size() for t in (self.key_pool, self.value_pool))
        return self.blocks_in_use * per_block

    @property
    def _device(self) -> torch.device | None:
        return None if self.key_pool is None else self.key_pool.device

    def slot(self, sequence: int, position: int) -> int:
        """The pool slot (``block * block_size + offset``) holding ``position`` of ``sequence``."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        length = self._lens[sequence]
        validate.index("position", position, length, f"{length} positions are stored")
        block = self._tables[sequence][position // self.block_size]
        return block * self.block_size + position % self.block_size

    # --- prefix caching -----------------------------------------------------------------------
    def block_hashes(self, tokens: Sequence[int] | Tensor) -> list[str]:
        """The hash of each full block of ``tokens`` (a partial last block has none).

        Block ``j``'s hash is SHA-256 over block ``j - 1``'s hash and block ``j``'s token ids,
        so it names the whole prefix up to the block's end: two prompts share block ``j``'s hash
        only if they agree on every token before it too (the keys of a block depend on all of
        them). Hex strings; SHA-256 makes a collision, which would read another prefix's keys,
        practically impossible.

        Shapes:
            tokens ``(T,)`` non-negative ints (a list or a 1-D integer tensor) -> ``T // block_size``
            hashes.
        """
        ids = _token_ids("tokens", tokens)
        return self._chain("", ids, len(ids) // self.block_size)

    def cached_prefix(self, tokens: Sequence[int] | Tensor) -> int:
        """How many of the prompt ``tokens``' first positions the prefix cache holds now: whole
        blocks, at most ``len(tokens) - 1`` positions (the last token is computed, so that its
        query gives the first output). 0 without prefix caching. Changes nothing."""
        ids = _token_ids("tokens", tokens)
        return len(self._lookup(ids)) * self.block_size

    def add_sequence(self, tokens: Sequence[int] | Tensor | None = None) -> int:
        """Admit a new sequence; returns its row of the block table (the last one).

        Without ``tokens`` it starts empty. With its prompt's token ids (``prefix_caching=True``
        only) it starts with the cached blocks of the prompt's longest cached prefix
        (:meth:`cached_prefix` positions, read from ``seq_lens[row]``): write the keys and values
        of the rest of the prompt, ``tokens[seq_lens[row]:]``, with :meth:`update`. The token
        ids let the cache hash the sequence's blocks as they fill, for later requests.
        """
        if tokens is None:
            ids: list[int] | None = [] if self.prefix_caching else None
            reused: list[int] = []
        else:
            if not self.prefix_caching:
                raise ValueError(
                    "tokens are for prefix caching: build the cache with prefix_caching=True "
                    "(or call add_sequence() without tokens)"
                )
            ids = _token_ids("tokens", tokens)
            reused = self._lookup(ids)
            self.prefix_queries += max(len(ids) - 1, 0) // self.block_size
            self.prefix_hits += len(reused)
            for block in reused:  # in use again: no longer evictable
                self._evictable.pop(block, None)
                self._refs[block] += 1
        self._tables.append(list(reused))
        self._lens.append(len(reused) * self.block_size)
        self._tokens.append(ids)
        self._hashes.append(self._chain("", ids, len(reused)) if ids is not None else [])
        return len(self._tables) - 1

    def _lookup(self, ids: list[int]) -> list[int]:
        """The cached physical blocks of the longest cached prefix of ``ids`` (whole blocks,
        leaving at least one token)."""
        if not self.prefix_caching:
            return []
        blocks = []
        for h in self._chain("", ids, max(len(ids) - 1, 0) // self.block_size):
            if h not in self._cached:
                break
            blocks.append(self._cached[h])
        return blocks

    def _chain(self, parent: str, ids: list[int], count: int, first: int = 0) -> list[str]:
        """Hashes of blocks ``first … first + count - 1`` of ``ids``, chained from ``parent``
        (the hash of block ``first - 1``; ``""`` before block 0)."""
        bs, hashes = self.block_size, []
        for j in range(first, first + count):
            digest = hashlib.sha256(parent.encode())
            digest.update(array("q", ids[j * bs : (j + 1) * bs]).tobytes())
            parent = digest.hexdigest()
            hashes.append(parent)
        return hashes

    def _register(self, row: int) -> None:
        """Hash the blocks of ``row`` that are full and whose token ids are known, and keep the
        new ones in the prefix cache (a hash already cached keeps its first block)."""
        ids, hashes = self._tokens[row], self._hashes[row]
        if ids is None:
            return
        full = min(self._lens[row], len(ids)) // self.block_size
        parent = hashes[-1] if hashes else ""
        for j, h in enumerate(
            self._chain(parent, ids, full - len(hashes), len(hashes)), len(hashes)
        ):
            hashes.append(h)
            block = self._tables[row][j]
            if h not in self._cached and self._block_hash[block] is None:
                self._cached[h], self._block_hash[block] = block, h

    # --- admitting and ending sequences (continuous batching) -------------------------------
    def fork(self, sequence: int, length: int | None = None) -> int:
        """Admit a sequence that starts with the first ``length`` positions of ``sequence``.

        The two share those blocks (nothing is copied); a shared block that is only partly
        filled is copied when either sequence writes into it. Returns the new row.
        """
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        stored = self._lens[sequence]
        length = stored if length is None else validate.non_negative_int("length", length)
        if length > stored:
            raise ValueError(f"length ({length}) must be at most sequence {sequence}'s {stored}")
        shared = self._tables[sequence][: math.ceil(length / self.block_size)]
        for block in shared:
            self._refs[block] += 1
        self._tables.append(list(shared))
        self._lens.append(length)
        ids = self._tokens[sequence]
        self._tokens.append(None if ids is None else ids[:length])
        self._hashes.append(self._hashes[sequence][: length // self.block_size])
        return n

    def free_sequence(self, sequence: int) -> None:
        """End ``sequence``: its row leaves the block table (the rows after it move up by one)
        and its blocks go back to the pool once no other sequence shares them. With prefix
        caching a full block stays cached until the pool needs it; the sequence's last blocks
        count as used longest ago, so its prefix, the part others share, is evicted last."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        blocks = self._tables.pop(sequence)
        for block in reversed(blocks) if self.prefix_caching else blocks:
            self._release(block)
        self._lens.pop(sequence)
        self._tokens.pop(sequence)
        self._hashes.pop(sequence)

    def truncate(self, sequence: int, length: int) -> None:
        """Keep the first ``length`` positions of ``sequence`` (e.g. drafted tokens that
        speculative decoding rejects); blocks it no longer reaches go back to the pool."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        stored = self._lens[sequence]
        length = validate.non_negative_int("length", length)
        if length > stored:
            raise ValueError(f"length ({length}) must be at most sequence {sequence}'s {stored}")
        row = self._tables[sequence]
        while len(row) > math.ceil(length / self.block_size):
            self._release(row.pop())
        self._lens[sequence] = length
        ids = self._tokens[sequence]
        if ids is not None:
            del ids[length:]
        del self._hashes[sequence][length // self.block_size :]

    def reset(self) -> None:
        """End every sequence; the pool stays allocated (and, with prefix caching, so do the
        cached blocks)."""
        while self._tables:
            self.free_sequence(len(self._tables) - 1)

    # --- writing and attending ----------------------------------------------------------------
    def update(
        self,
        key: Tensor,
        value: Tensor,
        *,
        sequences: list[int] | None = None,
        tokens: Sequence[Sequence[int]] | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Write the new keys and values into their sequences' blocks, in place.

        Only the ``S_new`` new positions of each sequence are written; the cache is neither
        copied nor gathered. Blocks are taken when a sequence reaches them.

        Args:
            key, value: the new tokens of each sequence.
            sequences: the rows of the block table they belong to; ``None`` means all rows
                (an empty cache first admits ``B`` sequences).
            tokens: with prefix caching, the token ids of the new positions (e.g. the generated
                ones), so that the blocks they fill are cached too. Positions whose ids were
                given to :meth:`add_sequence` need none.

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``, tokens ``(B, S_new)``;
            returns the pools ``(num_blocks, Hkv, block_size, D)`` and ``(num_blocks, Hkv,
            block_size, Dv)`` themselves (read them through :attr:`block_table` and
            :attr:`seq_lens`).
        """
        admitted = sequences is None and not self._tables  # rows this call admits
        rows = self._check_update(key, value, sequences)
        S_new = key.shape[2]
        try:
            ids = self._check_tokens(tokens, rows, S_new)  # for prefix caching, if given
            self._reserve(rows, S_new, key, value)
        except (TypeError, ValueError):  # bad tokens, or out of blocks: leave the cache as it was
            if admitted:
                for r in reversed(rows):
                    self.free_sequence(r)
            raise
        assert self.key_pool is not None and self.value_pool is not None  # for mypy
        if S_new:
            bs = self.block_size
            # Only the blocks that the new positions fall in: the table's other columns are
            # not touched, so a write costs the same at any length.
            first = [self._lens[r] // bs for r in rows]  # each row's first block written
            span = math.ceil(S_new / bs) + 1  # blocks S_new positions can touch
            cols = [self._tables[r][f : f + span] for r, f in zip(rows, first)]
            table = torch.tensor(
                [c + [0] * (span - len(c)) for c in cols], device=key.device
            )  # (B, span) physical blocks
            starts = torch.tensor([self._lens[r] % bs for r in rows], device=key.device)  # (B,)
            positions = starts[:, None] + torch.arange(S_new, device=key.device)  # (B, S_new)
            blocks = table.gather(1, positions // bs)  # (B, S_new) physical blocks
            offsets = positions % bs  # (B, S_new)
            # pool[block, :, offset] for every (sequence, new position): an in-place index_put
            self.key_pool[blocks, :, offsets] = key.transpose(1, 2)  # (B, S_new, Hkv, D)
            self.value_pool[blocks, :, offsets] = value.transpose(1, 2)  # (B, S_new, Hkv, Dv)
        for r in rows:
            self._lens[r] += S_new
        if self.prefix_caching:
            self._cache_full_blocks(rows, S_new, ids)
        return self.key_pool, self.value_pool

    def _cache_full_blocks(self, rows: list[int], S_new: int, ids: list[list[int]] | None) -> None:
        """After a write of ``S_new`` positions: the new token ids (if given) join each row's
        known ids, and the blocks just filled whose ids are known join the prefix cache."""
        for i, r in enumerate(rows):
            known = self._tokens[r]
            if ids is not None and known is not None:
                known.extend(ids[i][len(known) - (self._lens[r] - S_new) :])  # the new ones
            self._register(r)

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        dropout_p: float = 0.0,
        scale: float | None = None,
        attention: object = None,
    ) -> tuple[Tensor, None]:
        """Store ``key``, ``value`` (one row per sequence) and attend over each sequence's
        positions through the block table; what :class:`mha.MultiHeadAttention` calls.

        A decode step (``S_new = 1``) and a causal prompt chunk (the chunk is the last
        ``S_new`` positions of each sequence: the bottom-right alignment) are one
        :func:`mha.paged_varlen_attention` call over the pool. A chunk that is not causal
        attends to the positions cached before it through the block table and to itself, and
        the two partial results merge by their logsumexps. No step gathers a sequence's cache
        into one tensor.

        Args:
            query, key, value: the new queries, keys and values of every sequence.
            is_causal: each new query sees its sequence's cache and the new tokens up to itself.
            scale: multiplies the scores; defaults to ``1/sqrt(D)``.
            attn_mask, need_weights, dropout_p: what paged attention cannot do: a mask, the
                weights or dropout is a ValueError (use :class:`mha.KVCache` for them).
            attention: ignored (the blocks are read by paged attention, not by the layer's
                backend over contiguous keys).

        Shapes:
            query ``(B, H, S_new, D)``, key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``
            -> ``(B, H, S_new, Dv)`` and ``None`` (no weights).
        """
        _check_cache_step(query, key, value)
        if attn_mask is not None or need_weights:
            raise ValueError(
                "a PagedKVCache is read through paged_attention, which takes no attn_mask and "
                "returns no weights; got attn_mask "
                f"{None if attn_mask is None else validate.shape(attn_mask)} and need_weights="
                f"{need_weights} (use is_causal, or mha.KVCache)"
            )
        if validate.probability("dropout_p", dropout_p):
            raise ValueError(
                f"a PagedKVCache serves inference: attention dropout must be 0, got dropout_p="
                f"{dropout_p} (call the layer's .eval() first)"
            )
        validate.flag("is_causal", is_causal)
        checked = validate.scale(scale)
        scale = 1.0 / math.sqrt(query.shape[-1]) if checked is None else checked
        return _attend_paged(self, query, key, value, is_causal, scale), None

    def _check_update(self, key: Tensor, value: Tensor, sequences: list[int] | None) -> list[int]:
        validate.kv_step(key, value)
        B = key.shape[0]
        if self.key_pool is not None and self.value_pool is not None:
            validate.kv_fits(key, value, self.key_pool, self.value_pool, "Hkv")
        if sequences is None:
            if not self._tables:
                if B == 0:  # a block table has one row per sequence
                    raise ValueError(
                        f"key must hold at least one sequence, got key {validate.shape(key)}"
                    )
                for _ in range(B):
                    self.add_sequence()
            sequences = list(range(len(self._tables)))
        n = len(self._tables)
        rows = [
            validate.index("sequences", s, n, f"the cache holds {n} sequences") for s in sequences
        ]
        if len(set(rows)) != len(rows):
            raise ValueError(f"sequences must name each sequence once, got {rows}")
        if len(rows) != B:
            raise ValueError(
                f"the cache holds {n} sequences, got keys for {B}: key {validate.shape(key)} "
                f"for sequences {rows}"
            )
        return rows

    def _check_tokens(
        self, tokens: Sequence[Sequence[int]] | Tensor | None, rows: list[int], S_new: int
    ) -> list[list[int]] | None:
        """The token ids of an update's new positions, one list per row; they must continue
        each row's known ids (and agree with those already known for these positions)."""
        if tokens is None:
            return None
        if not self.prefix_caching:
            raise ValueError(
                "tokens are for prefix caching: build the cache with prefix_caching=True "
                "(or call update without tokens)"
            )
        if isinstance(tokens, Tensor):
            validate.integer_tensor("tokens", tokens, ndim=2)
            tokens = tokens.tolist()
        if not isinstance(tokens, Sequence) or len(tokens) != len(rows):
            raise ValueError(
                f"tokens must hold the new token ids of each of the {len(rows)} sequences "
                f"written, (B, S_new) = ({len(rows)}, {S_new}), got {_describe(tokens)}"
            )
        new = [_token_ids(f"tokens[{i}]", t) for i, t in enumerate(tokens)]
        for i, (r, ids) in enumerate(zip(rows, new)):
            known, start = self._tokens[r], self._lens[r]
            if len(ids) != S_new:
                raise ValueError(f"tokens[{i}] must hold S_new ({S_new}) token ids, got {len(ids)}")
            assert known is not None  # every row of a prefix-caching cache knows its ids
            if len(known) < start:
                raise ValueError(
                    f"sequence {r}'s token ids are known for its first {len(known)} of "
                    f"{start} positions only: tokens cannot continue them"
                )
            if known[start : start + S_new] != ids[: len(known) - start]:
                raise ValueError(
                    f"tokens[{i}] {ids} disagree with sequence {r}'s token ids for these "
                    f"positions, {known[start : start + S_new]}"
                )
        return new

    def _reserve(self, rows: list[int], S_new: int, key: Tensor, value: Tensor) -> None:
        """Give each row the blocks for ``S_new`` more positions, copying a shared or cached
        block that is about to be written (copy-on-write); check the pool's room before
        changing anything."""
        bs = self.block_size
        written = [  # rows whose partly filled last block is about to be written
            r for r in rows if S_new and self._lens[r] % bs
        ]
        copied = [r for r in written if not self._writable(self._tables[r][self._lens[r] // bs])]
        new = sum(math.ceil((self._lens[r] + S_new) / bs) - len(self._tables[r]) for r in rows)
        self._grow(new + len(copied), key, value)
        assert self.key_pool is not None and self.value_pool is not None  # for mypy
        for r in copied:  # copy-on-write: one block, the partly filled one
            j = self._lens[r] // bs
            if self._writable(self._tables[r][j]):  # the others copied it: now it is ours
                continue
            old, fresh = self._tables[r][j], self._take()
            self.key_pool[fresh] = self.key_pool[old]  # (Hkv, block_size, D)
            self.value_pool[fresh] = self.value_pool[old]
            self._release(old)
            self._tables[r][j] = fresh
        want = {r: math.ceil((self._lens[r] + S_new) / bs) for r in rows}  # blocks each needs
        missing = [r for r in rows if len(self._tables[r]) < want[r]]
        while missing:  # round-robin, so that the sequences' blocks interleave in the pool
            for r in missing:
                self._tables[r].append(self._take())
            missing = [r for r in missing if len(self._tables[r]) < want[r]]

    def _writable(self, block: int) -> bool:
        """Whether ``block`` may be written in place: one sequence uses it and the prefix cache
        does not keep it (a cached block's contents must stay those of its hash)."""
        return self._refs[block] == 1 and self._block_hash[block] is None

    def _grow(self, needed: int, key: Tensor, value: Tensor) -> None:
        """Make sure ``needed`` blocks are free (counting cached blocks no sequence uses):
        allocate the pool, or grow it by whole blocks."""
        have = 0 if self.key_pool is None else self.key_pool.shape[0]
        free = len(self._free) + len(self._evictable)
        if self.key_pool is not None and needed <= free:
            return
        if self.num_blocks is not None:
            if have:
                raise ValueError(
                    f"the pool is out of blocks: {needed} more needed, {free} free of "
                    f"num_blocks ({self.num_blocks}) blocks of {self.block_size} positions"
                )
            total = self.num_blocks
            if needed > total:
                raise ValueError(
                    f"the pool is out of blocks: {needed} needed, num_blocks ({total}) blocks "
                    f"of {self.block_size} positions"
                )
        else:
            total = max(2 * have, have + needed - free, 1)
        Hkv, D, Dv = key.shape[1], key.shape[-1], value.shape[-1]
        # Zeros, not empty memory: a slot not yet written is read (and weighted 0) beside the
        # written ones of its block, and 0 · NaN would be NaN.
        k = key.new_zeros(total, Hkv, self.block_size, D)  # (total, Hkv, block_size, D)
        v = value.new_zeros(total, Hkv, self.block_size, Dv)
        if self.key_pool is not None and self.value_pool is not None:  # grow: copy once
            k[:have], v[:have] = self.key_pool, self.value_pool
        self.key_pool, self.value_pool = k, v
        self._refs.extend([0] * (total - have))
        self._block_hash.extend([None] * (total - have))
        self._free = list(range(total - 1, have - 1, -1)) + self._free  # low numbers first

    def _take(self) -> int:
        """A free block for one sequence: one that holds nothing cached if there is one, else
        the least recently used cached block, whose hash the cache then forgets."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._block_hash[block]
            assert h is not None  # an evictable block is a cached one
            del self._cached[h]
            self._block_hash[block] = None
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        """One sequence less uses ``block``; with none left it is free, or, if cached,
        evictable (as the most recently used)."""
        if self._refs[block] <= 0:  # never: a block is released once per sequence using it
            raise RuntimeError(f"block {block} released more often than it was taken")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._block_hash[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None


def _token_ids(name: str, tokens: Any) -> list[int]:
    """Token ids as a list of non-negative ints, from a list of ints or a 1-D integer tensor."""
    if isinstance(tokens, Tensor):
        validate.integer_tensor(name, tokens, ndim=1)
        ids = tokens.tolist()
    elif isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes):
        ids = list(tokens)
    else:
        raise TypeError(
            f"{name} must be token ids, a list of ints or a 1-D integer tensor, got "
            f"{type(tokens).__name__}"
        )
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**63]
    if bad:
        raise ValueError(f"{name} must be non-negative int token ids, got {bad[0]!r} in {name}")
    return ids


def _describe(value: Any) -> str:
    return f"{len(value)} rows" if isinstance(value, Sequence) else type(value).__name__


def _check_decode_step(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float | None,
) -> tuple[int, int, float]:
    """Check the arguments of one paged decode step (:func:`validate.paged`, and a query of
    length 1); return the group size ``H // Hkv``, the block size and the scale (``1/sqrt(D)``
    if ``scale`` is None)."""
    groups, block_size = validate.paged(query, key_pool, value_pool, block_table, seq_lens)
    if query.shape[2] != 1:
        raise ValueError(
            f"query must be one decode step (B, H, 1, D), got query {validate.shape(query)}"
        )
    checked = validate.scale(scale)
    return groups, block_size, 1.0 / math.sqrt(query.shape[-1]) if checked is None else checked


def paged_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
) -> Tensor:
    """One decode step per sequence, its keys and values read through the block table.

    Sequence ``b``'s query attends to its first ``seq_lens[b]`` positions, which live in the
    blocks ``block_table[b, :ceil(seq_lens[b] / block_size)]`` of the pools. The blocks are
    read a few at a time with an online softmax (as in FlashAttention), so no tensor ever holds
    a whole sequence's keys. A sequence with no position gives zeros, as torch's SDPA does.
    The slots past ``seq_lens[b]`` in a sequence's last block are read and weighted 0, so they
    must hold finite numbers (a :class:`PagedKVCache`'s pool starts at zero).

    Args:
        query: one new query per sequence and head.
        key_pool, value_pool: the pools of a :class:`PagedKVCache` (or any with that layout).
        block_table: physical block numbers per sequence; entries past a sequence are ignored.
        seq_lens: positions per sequence.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.

    Shapes:
        query ``(B, H, 1, D)``, pools ``(N, Hkv, block_size, D)`` and ``(N, Hkv, block_size,
        Dv)``, block_table ``(B, M)`` int, seq_lens ``(B,)`` int; returns ``(B, H, 1, Dv)``.
        Grouped-query attention when ``H`` is a multiple of ``Hkv`` (query head ``i`` reads
        key/value head ``i // (H // Hkv)``).
    """
    _, _, scale = _check_decode_step(query, key_pool, value_pool, block_table, seq_lens, scale)
    out, _ = _paged_attention(query, key_pool, value_pool, block_table, seq_lens, scale)
    return out


def _paged_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """:func:`paged_attention` on checked arguments, for ``L`` queries that all see every stored
    position (a decode step, or a prompt chunk against what was cached before it).

    Shapes:
        query ``(B, H, L, D)``; returns out ``(B, H, L, Dv)`` and its logsumexp ``(B, H, L)``
        (float32 for float16/bfloat16 inputs).
    """
    whole = _paged_attention_rows(query, key_pool, value_pool, block_table, seq_lens, scale)
    if whole is not None:  # every score fits in one tile: two passes, softmax over whole rows
        return whole
    B, H, L, D = query.shape
    Hkv, bs, Dv = key_pool.shape[1], key_pool.shape[2], value_pool.shape[-1]
    compute = torch.float32 if query.dtype in validate.LOW_PRECISION else query.dtype
    dev = query.device
    # The G query heads that share key/value head h become G·L rows of one matrix, scaled once.
    q = (query.reshape(B * Hkv, -1, D) * scale).to(compute)  # (B·Hkv, G·L, D)
    lens = seq_lens.to(device=dev, dtype=torch.int64)  # (B,)
    needed = math.ceil(int(lens.max()) / bs) if B else 0
    # A step reads as many blocks of every sequence as fill TILE_KEYS numbers (1 MiB in float32):
    # a tile small enough to stay in the CPU's caches between its gather and its two products.
    per_step = max(1, min(needed, TILE_KEYS // max(1, B * Hkv * bs * max(D, Dv))))
    # The pool seen as (N·Hkv, bs, D): row n·Hkv + h is head h of block n, bs·D numbers in one
    # piece; gathering rows in (sequence, head, block) order lays each sequence's keys out as
    # one run per head. A -1 in the table (no block) reads block 0, which the bias masks out.
    blocks = block_table[:, :needed].long().clamp(min=0)  # (B, n) physical blocks
    rows = (blocks[:, None, :] * Hkv + torch.arange(Hkv, device=dev)[:, None]).view(B * Hkv, -1)
    past_end = torch.arange(needed * bs, device=dev) >= lens[:, None]  # (B, n·bs)
    bias = torch.zeros(B, Hkv, 1, needed * bs, dtype=compute, device=dev)
    bias.masked_fill_(past_end[:, None, None, :], -math.inf)  # 0, or -inf past the sequence
    bias = bias.view(B * Hkv, 1, -1)  # (B·Hkv, 1, n·bs)
    keys, values = key_pool.reshape(-1, bs, D), value_pool.reshape(-1, bs, Dv)
    # Every step gathers into the same two buffers, which stay in the CPU's caches.
    k_buf = keys.new_empty(B * Hkv * per_step, bs, D)  # (B·Hkv·per_step, bs, D)
    v_buf = values.new_empty(B * Hkv * per_step, bs, Dv)
    m = q.new_full((B * Hkv, q.shape[1], 1), -math.inf)  # running max of the scores
    l = q.new_zeros(B * Hkv, q.shape[1], 1)  # running sum of exp(scores - m)  # noqa: E741
    acc = q.new_zeros(B * Hkv, q.shape[1], Dv)  # running weighted sum of values
    for j in range(0, needed, per_step):  # per_step blocks of each sequence at a time
        c = min(per_step, needed - j)
        step = rows[:, j : j + c].flatten()  # (B·Hkv·c,) in (sequence, head, block) order
        k = _take(keys, step, k_buf).view(B * Hkv, c * bs, D)  # this step's keys, in k_buf
        v = _take(values, step, v_buf).view(B * Hkv, c * bs, Dv)
        scores = (q @ k.to(compute).transpose(1, 2)).add_(bias[..., j * bs : (j + c) * bs])
        m_new = torch.maximum(m, scores.detach().amax(-1, keepdim=True))  # (B·Hkv, G·L, 1)
        safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # a row with no key yet
        p = scores.sub_(safe).exp_()  # in place: the largest tensor of the step
        alpha = torch.exp(m - safe)  # rescales what was summed with the old max
        l.mul_(alpha).add_(p.sum(-1, keepdim=True))
        acc.mul_(alpha).baddbmm_(p, v.to(compute))  # (B·Hkv, G·L, Dv)
        m = m_new
    out = torch.where(l > 0, acc / l.clamp(min=torch.finfo(compute).tiny), 0.0)  # (B·Hkv, G·L, Dv)
    lse = torch.where(l > 0, m + torch.log(l), -math.inf)  # (B·Hkv, G·L, 1)
    out = out.reshape(B, H, L, Dv).to(query.dtype)  # (B, H, L, Dv)
    return out, lse.reshape(B, H, L)


def _attend_paged(
    cache: PagedKVCache, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> Tensor:
    """:meth:`PagedKVCache.attend` on checked arguments: store ``k``, ``v`` and attend over the
    cache through its block table.

    A decode step (``L = 1``) and a causal chunk (the chunk is the last ``L`` positions: the
    bottom-right alignment) are one :func:`mha.paged_varlen_attention` call over the pool, as an
    engine's mixed batch is. A chunk that is not causal (every new token sees every other)
    attends to the cached positions through the block table and to itself; the two partial
    results merge by their logsumexps.

    Shapes:
        q ``(B, H, L, D)``, k and v ``(B, Hkv, L, D)``; returns ``(B, H, L, D)``.
    """
    if cache.window is not None and not is_causal and q.shape[-2] > 1:  # before any write
        raise ValueError(
            f"a cache with a window of {cache.window} attends causally (each query sees the "
            f"positions up to itself): a chunk of {q.shape[-2]} new positions needs is_causal=True"
        )
    before = list(cache._lens)  # positions per sequence before this chunk
    key_pool, value_pool = cache.update(k, v)
    table = cache.block_table  # (B, max_blocks)
    B, H, L, D = q.shape
    if L == 0:  # nothing new: nothing to attend
        return q.new_zeros(B, H, 0, v.shape[-1])  # (B, H, 0, Dv)
    if is_causal or L == 1:  # decode steps and causal prompt chunks: one call, as engines run it
        packed = q.transpose(1, 2).reshape(B * L, H, D)  # (B·L, H, D) sequence after sequence
        starts = list(range(0, B * L + 1, L))  # every sequence has L queries, its last L positions
        out = _paged_varlen_attention(
            packed,
            key_pool,
            value_pool,
            table,
            starts,
            list(cache._lens),
            scale,
            None,
            cache.window,
        )  # (B·L, H, Dv)
        return out.view(B, L, H, -1).transpose(1, 2)  # (B, H, L, Dv)
    groups = q.shape[1] // k.shape[1]
    own = _flash_attention(q, k, v, None, is_causal, scale, groups=groups)  # (B, H, L, D), lse
    if len(before) != q.shape[0] or not max(before):  # nothing cached yet
        return own[0]
    lens = torch.tensor(before, device=q.device)  # (B,)
    cached = _paged_attention(q, key_pool, value_pool, table, lens, scale)
    lse_dtype = own[1].dtype
    out, _ = _merge_partials(
        torch.stack([cached[0], own[0]]), torch.stack([cached[1].to(lse_dtype), own[1]])
    )  # (B, H, L, D)
    return out.to(q.dtype)
