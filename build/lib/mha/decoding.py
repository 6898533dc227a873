"""Caches that serve: a preallocated cache, a paged cache, and split-KV (FlashDecoding) attention.

:class:`mha.KVCache` grows with ``torch.cat``: every step copies the whole cache into a new
tensor, so decoding ``N`` tokens copies ``O(N²)`` numbers. Serving systems do better in two ways:

* :class:`PreallocatedKVCache` allocates ``max_len`` positions once and writes each step's keys
  and values into the next free rows (Hugging Face's "static cache" works like this).
* :class:`PagedKVCache` keeps a pool of fixed-size blocks and a *block table* per sequence
  (vLLM's PagedAttention): memory is taken a block at a time, when a sequence needs it, so many
  sequences of unknown length share one pool without reserving ``max_len`` each.

Both follow :class:`mha.multihead.KVCacheProtocol`, so either can be passed as ``kv_cache=`` to
:class:`mha.MultiHeadAttention` and gives the same outputs as :class:`mha.KVCache`.

:func:`flash_decoding` is the attention of one decoding step split over the keys: each split
gives a partial output and its logsumexp, and :func:`merge_partials` combines them exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import validation as validate
from .attention import check_arguments
from .flash import _flash_attention


class PreallocatedKVCache:
    """A key/value cache with room for ``max_len`` positions, allocated once.

    The buffers are allocated on the first :meth:`update` (which fixes batch, heads, head dims,
    dtype and device); every update writes into the next free rows, and returns views of the
    rows filled so far: no step copies the old keys again. :meth:`reset` keeps the buffers for
    the next sequence.

    Args:
        max_len: the most positions it can hold; one more is an error, not a silent reallocation.

    Shapes:
        buffers ``(B, Hkv, max_len, D)`` and ``(B, Hkv, max_len, Dv)``.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = validate.positive_int("max_len", max_len)
        self.key_buffer: Tensor | None = None
        self.value_buffer: Tensor | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold: all ``max_len`` positions, used or not."""
        if self.key_buffer is None or self.value_buffer is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.key_buffer, self.value_buffer))

    def reset(self) -> None:
        """Forget the sequence; the buffers stay allocated for the next one."""
        self.length = 0

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys and values after the stored ones; return all of them.

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``; returns views
            ``(B, Hkv, S, D)`` and ``(B, Hkv, S, Dv)`` with ``S = len(self)``. ``S_new = 0``
            stores nothing and returns what the cache holds.
        """
        validate.kv_step(key, value)
        B, Hkv, S_new, D = key.shape
        if self.length == 0 and not self._buffers_fit(key, value):  # first use, or new shapes
            self.key_buffer = key.new_empty(B, Hkv, self.max_len, D)  # (B, Hkv, max_len, D)
            self.value_buffer = value.new_empty(B, Hkv, self.max_len, value.shape[-1])
        assert self.key_buffer is not None and self.value_buffer is not None  # for mypy
        validate.kv_fits(key, value, self.key_buffer, self.value_buffer, "(B, Hkv)")
        start, end = self.length, self.length + S_new
        if end > self.max_len:
            raise ValueError(
                f"the cache is full: max_len ({self.max_len}) positions, {start} stored, "
                f"{S_new} more given (key {validate.shape(key)})"
            )
        self.key_buffer[:, :, start:end] = key  # write in place: no copy of the old rows
        self.value_buffer[:, :, start:end] = value
        self.length = end
        return self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]  # (B, Hkv, S, D)

    def _buffers_fit(self, key: Tensor, value: Tensor) -> bool:
        kb, vb = self.key_buffer, self.value_buffer
        if kb is None or vb is None:
            return False
        return (kb.shape[:2], kb.shape[-1], vb.shape[-1], kb.dtype, vb.dtype, kb.device) == (
            key.shape[:2],
            key.shape[-1],
            value.shape[-1],
            key.dtype,
            value.dtype,
            key.device,
        )


class PagedKVCache:
    """A key/value cache in fixed-size blocks from a shared pool, found through a block table.

    Every sequence of the batch has its own row of :attr:`block_table`: entry ``j`` is the
    physical block that holds its positions ``j·block_size … (j+1)·block_size - 1``. A block is
    taken from the pool only when a sequence reaches it, so at most ``block_size - 1`` positions
    per sequence are reserved but unused. Position ``t`` of sequence ``b`` lives in slot
    ``block_table[b][t // block_size] * block_size + t % block_size`` of the pool.

    Args:
        block_size: positions per block (vLLM uses 16 by default).
        num_blocks: size of the pool; ``None`` grows it as needed, an int makes running out an
            error (what a server does when its memory is full: it must evict or wait).

    Shapes:
        pools ``(num_blocks, Hkv, block_size, D)`` and ``(num_blocks, Hkv, block_size, Dv)``.
    """

    def __init__(self, block_size: int = 16, num_blocks: int | None = None) -> None:
        self.block_size = validate.positive_int("block_size", block_size)
        self.num_blocks = (
            None if num_blocks is None else validate.positive_int("num_blocks", num_blocks)
        )
        self.key_pool: Tensor | None = None
        self.value_pool: Tensor | None = None
        self.block_table: list[list[int]] = []  # per sequence: logical block -> physical block
        self.free_blocks: list[int] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes held by the blocks in use (the pool's free blocks serve other sequences)."""
        if self.key_pool is None or self.value_pool is None:
            return 0
        used = sum(len(row) for row in self.block_table)
        per_block = sum(t[0].numel() * t.element_size() for t in (self.key_pool, self.value_pool))
        return used * per_block

    def reset(self) -> None:
        """Give every block back to the pool (the pool stays allocated)."""
        for row in self.block_table:
            self.free_blocks.extend(row)
        self.free_blocks.sort()
        self.block_table, self.length = [], 0

    def slot(self, sequence: int, position: int) -> int:
        """The pool slot (``block * block_size + offset``) holding ``position`` of ``sequence``."""
        n = len(self.block_table)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        validate.index("position", position, self.length, f"{self.length} positions are stored")
        block = self.block_table[sequence][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys and values into the sequences' blocks; return all of them.

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)`` with ``B >= 1``; returns the
            gathered ``(B, Hkv, S, D)`` and ``(B, Hkv, S, Dv)`` with ``S = len(self)``.
            ``S_new = 0`` stores nothing and returns what the cache holds.
        """
        validate.kv_step(key, value)
        B, Hkv, S_new, D = key.shape
        if B == 0:  # a block table has one row per sequence
            raise ValueError(f"key must hold at least one sequence, got key {validate.shape(key)}")
        if self.key_pool is not None and self.value_pool is not None:
            validate.kv_fits(key, value, self.key_pool, self.value_pool, "Hkv")
        if self.block_table and len(self.block_table) != B:
            raise ValueError(
                f"the cache holds {len(self.block_table)} sequences, got keys for {B}: "
                f"key {validate.shape(key)}"
            )
        if self.key_pool is None or self.value_pool is None:
            self._grow(key, value, 1)
        assert self.key_pool is not None and self.value_pool is not None  # for mypy
        self.block_table = self.block_table or [[] for _ in range(B)]
        start, end = self.length, self.length + S_new
        self._allocate(end, key, value)
        positions = torch.arange(start, end, device=key.device)  # (S_new,)
        # int64 even when no block is taken yet (zero new tokens): an empty table must still index
        table = torch.tensor(self.block_table, dtype=torch.int64, device=key.device)  # (B, blocks)
        blocks = table[:, positions // self.block_size]  # (B, S_new) physical blocks
        offsets = positions % self.block_size  # (S_new,)
        # pool[block, :, offset] for every (sequence, new position): indices in dims 0 and 2
        self.key_pool[blocks, :, offsets] = key.transpose(1, 2)  # (B, S_new, Hkv, D)
        self.value_pool[blocks, :, offsets] = value.transpose(1, 2)  # (B, S_new, Hkv, Dv)
        self.length = end
        return self._gather(self.key_pool, table), self._gather(self.value_pool, table)

    def _gather(self, pool: Tensor, table: Tensor) -> Tensor:
        """The sequences' blocks in logical order, cut to ``len(self)``: ``(B, Hkv, S, D)``."""
        blocks = pool[table]  # (B, n, Hkv, block_size, D)
        B, n, Hkv, bs, D = blocks.shape
        out = blocks.transpose(1, 2).reshape(B, Hkv, n * bs, D)  # (B, Hkv, n·block_size, D)
        return out[:, :, : self.length]  # (B, Hkv, S, D)

    def _allocate(self, end: int, key: Tensor, value: Tensor) -> None:
        """Give every sequence the blocks it needs to hold ``end`` positions, round-robin."""
        needed = math.ceil(end / self.block_size)
        missing = len(self.block_table) * (needed - len(self.block_table[0]))
        if missing > len(self.free_blocks):  # grow (or fail) before anything changes
            if self.num_blocks is not None:
                raise ValueError(
                    f"the pool is out of blocks: {missing} more needed, {len(self.free_blocks)} "
                    f"free of num_blocks ({self.num_blocks}) blocks of {self.block_size} positions"
                )
            self._grow(key, value, missing - len(self.free_blocks))
        while len(self.block_table[0]) < needed:
            for row in self.block_table:
                row.append(self.free_blocks.pop(0))

    def _grow(self, key: Tensor, value: Tensor, more: int) -> None:
        """Add at least ``more`` blocks to the pool (doubling it); a fixed pool is made whole."""
        have = 0 if self.key_pool is None else self.key_pool.shape[0]
        new = self.num_blocks if self.num_blocks is not None else max(2 * have, have + more)
        Hkv, D, Dv = key.shape[1], key.shape[-1], value.shape[-1]
        k = key.new_empty(new - have, Hkv, self.block_size, D)  # (new blocks, Hkv, bs, D)
        v = value.new_empty(new - have, Hkv, self.block_size, Dv)
        self.key_pool = k if self.key_pool is None else torch.cat([self.key_pool, k])
        self.value_pool = v if self.value_pool is None else torch.cat([self.value_pool, v])
        self.free_blocks.extend(range(have, new))


def merge_partials(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over disjoint sets of keys from each set's output and logsumexp.

    The result is the attention over all the keys at once, and its logsumexp.

    Shapes:
        out ``(splits, ..., L, Dv)``, lse ``(splits, ..., L)``; returns ``(..., L, Dv)`` and the
        total ``(..., L)``. A split that saw no key has ``lse_i = -inf`` and weight 0. lse is
        out's dtype, or float32 for float16/bfloat16 outputs.
    """
    validate.partials(out, lse)
    return _merge_partials(out, lse)


def _merge_partials(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`merge_partials` on checked partials.

    Each partial output is normalised by its own denominator ``exp(lse_i)``; the full softmax
    divides by their sum ``exp(lse)``, so partial ``i`` counts with weight ``exp(lse_i - lse)``.
    Subtracting ``lse`` first keeps every exponent ``<= 0``: nothing can overflow.

    Shapes:
        out ``(splits, ..., L, Dv)``, lse ``(splits, ..., L)``; returns ``(..., L, Dv)`` and
        ``(..., L)``.
    """
    total = torch.logsumexp(lse, dim=0)  # (..., L)
    safe = torch.where(torch.isneginf(total), 0.0, total)  # a row with no key at all: weights 0
    weights = torch.exp(lse - safe).unsqueeze(-1)  # (splits, ..., L, 1)
    return (weights * out).sum(0), total  # (..., L, Dv), (..., L)


def flash_decoding(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    num_splits: int = 4,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Attention split over the keys (FlashDecoding): equal to one pass, more parallel work.

    The ``S`` keys are cut into contiguous chunks of ``ceil(S / num_splits)`` keys (the last one
    may be shorter), so there are at most ``num_splits`` of them, and fewer when ``num_splits``
    does not fit the rounding: ``S < num_splits``, but also e.g. ``S = 9``, ``num_splits = 4``,
    which gives 3 chunks of 3. Each chunk's attention gives a partial output and its logsumexp (on a GPU, the chunks run
    as separate programs at the same time), and :func:`merge_partials` combines them. Float16 and
    bfloat16 inputs keep the partials and their statistics in float32.

    Args:
        query, key, value: as in :func:`mha.scaled_dot_product_attention` (no mask: every query
            sees every key, as in one decoding step over the cache).
        num_splits: how many chunks of keys to attend to separately.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        enable_gqa: key/value may have fewer heads (grouped-query attention).

    Shapes:
        query ``(..., L, D)`` (``L = 1`` when decoding), key ``(..., S, D)``, value
        ``(..., S, Dv)``; returns ``(..., L, Dv)``.
    """
    groups, scale = check_arguments(query, key, value, None, False, scale, enable_gqa)
    num_splits = validate.positive_int("num_splits", num_splits)
    S = key.shape[-2]
    compute = torch.float32 if query.dtype in validate.LOW_PRECISION else query.dtype
    q, k, v = (t.to(compute) for t in (query, key, value))
    # Keys per split; the last split may be shorter. With no key at all (S = 0) one empty split
    # gives zeros and lse = -inf, the zeros torch's SDPA returns for S = 0.
    chunk = max(1, math.ceil(S / num_splits))
    partials = [
        _flash_attention(
            q, k[..., i : i + chunk, :], v[..., i : i + chunk, :], None, False, scale, groups=groups
        )  # (..., L, Dv), (..., L)
        for i in range(0, max(S, 1), chunk)
    ]
    outs, lses = zip(*partials)
    out, _ = _merge_partials(torch.stack(outs), torch.stack(lses))  # (..., L, Dv)
    return out.to(query.dtype)
