"""A paged KV cache that is a pool of blocks, and attention that reads it through the block table.

vLLM's PagedAttention keeps every sequence's keys and values in fixed-size *blocks* of one
preallocated pool. A sequence owns a row of the *block table*: entry ``j`` is the physical block
holding its positions ``j·block_size … (j+1)·block_size - 1``. A decode step writes one token
per sequence into its block and copies nothing else; a block is taken from the pool when a
sequence reaches it and given back when the sequence ends, so sequences of unknown length share
one pool (continuous batching) without reserving ``max_len`` each. Sequences that start with the
same prompt share its blocks (reference-counted); a shared block that is only partly filled is
copied before one of them writes into it (copy-on-write).

:func:`paged_attention` attends from one new query per sequence to that sequence's keys, read a
few blocks at a time through the table: no step gathers a whole sequence into one tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import validation as validate
from .decoding import _merge_partials
from .flash import _flash_attention

#: Blocks read per step of :func:`paged_attention`'s loop (512 positions with blocks of 16): the
#: working memory is this many blocks per sequence, never a whole long sequence.
BLOCKS_PER_STEP = 32


class PagedKVCache:
    """A key/value cache in fixed-size blocks of one preallocated pool, found through a block table.

    Position ``t`` of sequence ``b`` lives in block ``block_table[b, t // block_size]`` at offset
    ``t % block_size``. The pools are allocated on the first :meth:`update` (which fixes the
    heads, head dims, dtype and device) and written in place afterwards: their storage stays the
    same while the pool has room. Rows of the block table are sequences: :meth:`add_sequence`
    admits one, :meth:`fork` admits one that shares another's prefix, :meth:`free_sequence` ends
    one and gives its blocks back.

    Args:
        block_size: positions per block (vLLM's default is 16).
        num_blocks: size of the pool; ``None`` grows it by whole blocks (doubling) when it runs
            out; an int makes running out an error (a server must then evict or wait).

    Shapes:
        key_pool ``(num_blocks, Hkv, block_size, D)``, value_pool ``(num_blocks, Hkv, block_size,
        Dv)``, block_table ``(B, max_blocks)`` int32 (``-1`` past each sequence's blocks),
        seq_lens ``(B,)`` int64.
    """

    def __init__(self, block_size: int = 16, *, num_blocks: int | None = None) -> None:
        self.block_size = validate.positive_int("block_size", block_size)
        self.num_blocks = (
            None if num_blocks is None else validate.positive_int("num_blocks", num_blocks)
        )
        self.key_pool: Tensor | None = None
        self.value_pool: Tensor | None = None
        self._tables: list[list[int]] = []  # per sequence: logical block -> physical block
        self._lens: list[int] = []  # per sequence: positions stored
        self._refs: list[int] = []  # per physical block: how many sequences use it
        self._free: list[int] = []  # free physical blocks, the next one taken last

    # --- what the cache holds -------------------------------------------------------------
    def __len__(self) -> int:
        """The longest sequence's length (all of them, when the batch decodes in step)."""
        return max(self._lens, default=0)

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

    # --- admitting and ending sequences (continuous batching) -------------------------------
    def add_sequence(self) -> int:
        """Admit a new, empty sequence; returns its row of the block table (the last one)."""
        self._tables.append([])
        self._lens.append(0)
        return len(self._tables) - 1

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
        return n

    def free_sequence(self, sequence: int) -> None:
        """End ``sequence``: its blocks go back to the pool (once no other sequence shares them),
        and its row leaves the block table (the rows after it move up by one)."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        for block in self._tables.pop(sequence):
            self._release(block)
        self._lens.pop(sequence)

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

    def reset(self) -> None:
        """End every sequence; the pool stays allocated."""
        while self._tables:
            self.free_sequence(len(self._tables) - 1)

    # --- writing ------------------------------------------------------------------------------
    def update(
        self, key: Tensor, value: Tensor, *, sequences: list[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Write the new keys and values into their sequences' blocks, in place.

        Only the ``S_new`` new positions of each sequence are written; the cache is neither
        copied nor gathered. Blocks are taken when a sequence reaches them.

        Args:
            key, value: the new tokens of each sequence.
            sequences: the rows of the block table they belong to; ``None`` means all rows
                (an empty cache first admits ``B`` sequences).

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``; returns the pools
            ``(num_blocks, Hkv, block_size, D)`` and ``(num_blocks, Hkv, block_size, Dv)``
            themselves (read them through :attr:`block_table` and :attr:`seq_lens`).
        """
        admitted = sequences is None and not self._tables  # rows this call admits
        rows = self._check_update(key, value, sequences)
        S_new = key.shape[2]
        try:
            self._reserve(rows, S_new, key, value)
        except ValueError:  # out of blocks: leave the cache as it was
            if admitted:
                self._tables.clear()
                self._lens.clear()
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
        return self.key_pool, self.value_pool

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

    def _reserve(self, rows: list[int], S_new: int, key: Tensor, value: Tensor) -> None:
        """Give each row the blocks for ``S_new`` more positions, copying a shared block that is
        about to be written (copy-on-write); check the pool's room before changing anything."""
        bs = self.block_size
        shared = [
            r
            for r in rows
            if S_new and self._lens[r] % bs and self._refs[self._tables[r][self._lens[r] // bs]] > 1
        ]
        new = sum(math.ceil((self._lens[r] + S_new) / bs) - len(self._tables[r]) for r in rows)
        self._grow(new + len(shared), key, value)
        assert self.key_pool is not None and self.value_pool is not None  # for mypy
        for r in shared:  # copy-on-write: one block, the partly filled one
            j = self._lens[r] // bs
            if self._refs[self._tables[r][j]] == 1:  # the others copied it: now it is ours
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

    def _grow(self, needed: int, key: Tensor, value: Tensor) -> None:
        """Make sure ``needed`` blocks are free: allocate the pool, or grow it by whole blocks."""
        have = 0 if self.key_pool is None else self.key_pool.shape[0]
        if self.key_pool is not None and needed <= len(self._free):
            return
        if self.num_blocks is not None:
            if have:
                raise ValueError(
                    f"the pool is out of blocks: {needed} more needed, {len(self._free)} free of "
                    f"num_blocks ({self.num_blocks}) blocks of {self.block_size} positions"
                )
            total = self.num_blocks
            if needed > total:
                raise ValueError(
                    f"the pool is out of blocks: {needed} needed, num_blocks ({total}) blocks "
                    f"of {self.block_size} positions"
                )
        else:
            total = max(2 * have, have + needed - len(self._free), 1)
        Hkv, D, Dv = key.shape[1], key.shape[-1], value.shape[-1]
        # Zeros, not empty memory: a slot not yet written is read (and weighted 0) beside the
        # written ones of its block, and 0 · NaN would be NaN.
        k = key.new_zeros(total, Hkv, self.block_size, D)  # (total, Hkv, block_size, D)
        v = value.new_zeros(total, Hkv, self.block_size, Dv)
        if self.key_pool is not None and self.value_pool is not None:  # grow: copy once
            k[:have], v[:have] = self.key_pool, self.value_pool
        self.key_pool, self.value_pool = k, v
        self._refs.extend([0] * (total - have))
        self._free = list(range(total - 1, have - 1, -1)) + self._free  # low numbers first

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)


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
    B, H, L, D = query.shape
    Hkv, bs, Dv = key_pool.shape[1], key_pool.shape[2], value_pool.shape[-1]
    compute = torch.float32 if query.dtype in validate.LOW_PRECISION else query.dtype
    dev = query.device
    # The G query heads that share key/value head h become G·L rows of one matrix, scaled once.
    q = (query.reshape(B, Hkv, -1, D) * scale).to(compute)  # (B, Hkv, G·L, D)
    lens = seq_lens.to(device=dev, dtype=torch.int64)  # (B,)
    needed = math.ceil(int(lens.max()) / bs) if B else 0
    # Once for every block the loop reads. The pool seen as (N·Hkv, bs, D): row n·Hkv + h is
    # head h of block n, bs·D numbers in one piece; gathering rows in (sequence, head, block)
    # order lays each sequence's keys out as one run per head (index_select, torch's fastest
    # gather). A -1 in the table (no block) reads block 0, which the bias then masks out.
    blocks = block_table[:, :needed].long().clamp(min=0)  # (B, n) physical blocks
    rows = blocks[:, None, :] * Hkv + torch.arange(Hkv, device=dev)[:, None]  # (B, Hkv, n)
    past_end = torch.arange(needed * bs, device=dev) >= lens[:, None]  # (B, n·bs)
    bias = torch.zeros(B, 1, 1, needed * bs, dtype=compute, device=dev)
    bias.masked_fill_(past_end[:, None, None, :], -math.inf)  # 0, or -inf past the sequence
    keys, values = key_pool.reshape(-1, bs, D), value_pool.reshape(-1, bs, Dv)
    m = q.new_full((B, Hkv, q.shape[2], 1), -math.inf)  # running max of the scores
    l = q.new_zeros(B, Hkv, q.shape[2], 1)  # running sum of exp(scores - m)  # noqa: E741
    acc = q.new_zeros(B, Hkv, q.shape[2], Dv)  # running weighted sum of values
    for j in range(0, needed, BLOCKS_PER_STEP):  # up to BLOCKS_PER_STEP blocks of each sequence
        step = rows[:, :, j : j + BLOCKS_PER_STEP]  # (B, Hkv, c)
        c = step.shape[2]
        k = keys.index_select(0, step.flatten()).view(B, Hkv, c * bs, D).to(compute)
        v = values.index_select(0, step.flatten()).view(B, Hkv, c * bs, Dv).to(compute)
        scores = (q @ k.transpose(-2, -1)).add_(
            bias[..., j * bs : (j + c) * bs]
        )  # (B, Hkv, G·L, c·bs)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))  # (B, Hkv, G·L, 1)
        safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # a row with no key yet
        p = scores.sub_(safe).exp_()  # in place: the largest tensor of the step
        alpha = torch.exp(m - safe)  # rescales what was summed with the old max
        l = alpha * l + p.sum(-1, keepdim=True)  # noqa: E741
        acc = alpha * acc + p @ v  # (B, Hkv, G·L, Dv)
        m = m_new
    out = torch.where(l > 0, acc / l.clamp(min=torch.finfo(compute).tiny), 0.0)  # (B, Hkv, G·L, Dv)
    lse = torch.where(l > 0, m + torch.log(l), -math.inf)  # (B, Hkv, G·L, 1)
    out = out.reshape(B, H, L, Dv).to(query.dtype)  # (B, H, L, Dv)
    return out, lse.reshape(B, H, L)


def _attend_paged(
    cache: PagedKVCache, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> Tensor:
    """What :class:`mha.MultiHeadAttention` does with a paged ``kv_cache``: store ``k``, ``v`` and
    attend over the cache through its block table.

    A decode step (``L = 1``) is one :func:`paged_attention`. A chunk of ``L`` tokens attends to
    the cached positions through the block table and to itself (causally when ``is_causal``:
    the chunk is the last ``L`` positions, so this is the bottom-right alignment); the two
    partial results merge by their logsumexps.

    Shapes:
        q ``(B, H, L, D)``, k and v ``(B, Hkv, L, D)``; returns ``(B, H, L, D)``.
    """
    before = list(cache._lens)  # positions per sequence before this chunk
    key_pool, value_pool = cache.update(k, v)
    table = cache.block_table  # (B, max_blocks)
    if q.shape[2] == 1:
        lens = cache.seq_lens  # (B,) including the new token
        return _paged_attention(q, key_pool, value_pool, table, lens, scale)[0]
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
