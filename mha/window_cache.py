"""A paged cache for a sliding-window layer: blocks that fall out of the window go back to the pool.

A sliding-window layer (gpt-oss alternates them with full layers, Mistral used them throughout)
lets the query at position ``p`` see the keys ``p - window + 1 .. p`` only. Its cache therefore
never needs more than the last ``window`` positions of a sequence. In a paged pool that is a
matter of whole blocks: once every position of a block lies before the oldest key any present or
future query can see, the block is given back to the pool and its entry in the block table
becomes ``-1``. A sequence then holds at most ``ceil(window / block_size) + 1`` blocks while it
decodes, however long it grows (vLLM's hybrid KV-cache manager frees them the same way).

:class:`SlidingWindowPagedCache` is a :class:`mha.PagedKVCache` that does this on every write.
Its ``window`` attribute makes the paged attention pass that window to
:func:`mha.paged_varlen_attention`, which never reads a freed entry (so a prompt chunk must be
causal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

from . import validation as validate
from .paged import PagedKVCache

FREED = -1  # the table entry of a block given back to the pool


class SlidingWindowPagedCache(PagedKVCache):
    """A :class:`mha.PagedKVCache` for sliding-window attention that frees what no query can see.

    Before a sequence's new positions are written, the blocks holding only positions before
    ``seq_len - window + 1`` (the oldest key its next query sees) go back to the pool. As
    ``kv_cache=`` of :class:`mha.MultiHeadAttention` with ``is_causal=True`` it equals attention
    with the sliding-window mask aligned bottom-right: the query at position ``p`` sees keys
    ``p - window + 1 .. p``.

    Args:
        window: how many positions a query sees, itself included.
        block_size: positions per block.
        num_blocks: size of the pool, as in :class:`mha.PagedKVCache`.

    Shapes:
        as :class:`mha.PagedKVCache`; ``block_table`` holds ``-1`` in the columns of freed blocks
        too.
    """

    def __init__(self, window: int, block_size: int = 16, *, num_blocks: int | None = None) -> None:
        super().__init__(block_size, num_blocks=num_blocks)
        self.window = validate.positive_int("window", window)
        #: Blocks given back to the pool because they fell out of the window, in all.
        self.freed_blocks = 0

    def blocks_held(self, sequence: int) -> int:
        """How many blocks of the pool ``sequence`` holds now."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        return sum(b != FREED for b in self._tables[sequence])

    def update(
        self,
        key: Tensor,
        value: Tensor,
        *,
        sequences: list[int] | None = None,
        tokens: Sequence[Sequence[int]] | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Free the blocks the new positions' queries cannot see, then write them (see
        :meth:`mha.PagedKVCache.update`)."""
        rows = range(len(self._tables)) if sequences is None else sequences
        for r in rows:
            if isinstance(r, int) and 0 <= r < len(self._tables):  # the update checks the rest
                self._slide(r)
        return super().update(key, value, sequences=sequences, tokens=tokens)

    def _slide(self, row: int) -> None:
        """Give back the blocks of ``row`` wholly before the window of its next query."""
        assert self.window is not None  # set in __init__
        oldest = max(0, self._lens[row] - self.window + 1)  # the oldest key the next query sees
        table = self._tables[row]
        for col in range(oldest // self.block_size):  # blocks that end before it
            if table[col] != FREED:
                self._release(table[col])
                table[col] = FREED
                self.freed_blocks += 1

    def slot(self, sequence: int, position: int) -> int:
        """The pool slot of ``position``; a ValueError if its block left the window and was
        given back."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        validate.index("position", position, self._lens[sequence], "positions stored")
        if self._tables[sequence][position // self.block_size] == FREED:
            raise ValueError(
                f"position {position} of sequence {sequence} left the window of {self.window} "
                f"(the sequence holds {self._lens[sequence]} positions): its block was freed"
            )
        return super().slot(sequence, position)

    def fork(self, sequence: int, length: int | None = None) -> int:
        """Not supported: a fork would share blocks this cache frees as the window moves."""
        raise ValueError(
            "a SlidingWindowPagedCache does not fork sequences: its blocks are freed as the "
            "window moves; use mha.PagedKVCache to share a prefix"
        )

    def truncate(self, sequence: int, length: int) -> None:
        """Keep the first ``length`` positions (see :meth:`mha.PagedKVCache.truncate`), as long as
        the window of the next query still lies in blocks the sequence holds."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        length = validate.non_negative_int("length", length)
        oldest = max(0, length - self.window + 1) if self.window else 0
        freed = sum(b == FREED for b in self._tables[sequence])
        if length <= self._lens[sequence] and oldest // self.block_size < freed:
            raise ValueError(
                f"cannot truncate sequence {sequence} to {length} positions: the window of its "
                f"next query starts at position {oldest}, in a block already freed (the first "
                f"{freed * self.block_size} positions are gone)"
            )
        super().truncate(sequence, length)

    def free_sequence(self, sequence: int) -> None:
        """End ``sequence`` and give back the blocks it still holds."""
        n = len(self._tables)
        validate.index("sequence", sequence, n, f"the cache holds {n} sequences")
        self._tables[sequence] = [b for b in self._tables[sequence] if b != FREED]
        super().free_sequence(sequence)

    def bound(self) -> int:
        """The most blocks a decoding sequence holds: ``ceil(window / block_size) + 1``."""
        assert self.window is not None
        return math.ceil(self.window / self.block_size) + 1
