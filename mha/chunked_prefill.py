"""Chunked prefill: one attention call over the paged pool for prompt chunks and decode steps.

A serving engine that batches continuously has, at every step, some sequences that are still
reading their prompt and others that generate one token each. vLLM V1 runs them all in *one*
attention call per layer: the queries are packed end to end as in
:func:`mha.varlen_attention` (``cu_seqlens_q``), and every sequence reads its keys through its
row of the block table, as in :func:`mha.paged_attention`. A long prompt is cut into chunks of a
few hundred tokens, so that a prefill never stalls the decoding sequences for long: that is
*chunked prefill*. Before the call the engine has written this step's keys and values into the
pool, so sequence ``b``'s ``n_b`` queries are the **last** ``n_b`` of its ``seq_lens[b]``
positions: ``n_b = 1`` is a decode step, ``n_b > 1`` a prompt chunk after the chunks before it,
``n_b = 0`` a sequence that sits this step out.

:func:`paged_varlen_attention` reads the blocks a tile at a time with an online softmax (as
FlashAttention does), so its working memory is one tile of blocks, never a whole sequence's
cache. Sequences with the same number of queries run together: all decode steps of the batch
are one batched loop, each prompt-chunk length another.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from . import validation as validate

#: What one step of the loop holds at most, in numbers: its scores (8 MiB in float32) and its
#: gathered keys (1 MiB): the tile of blocks read per step shrinks when many rows or many
#: sequences share it, so that a gathered tile is still in the CPU's caches when it is used.
TILE_SCORES = 1 << 21
TILE_KEYS = 1 << 18
#: The most blocks of each sequence one step reads (256 positions with blocks of 16).
MAX_BLOCKS_PER_STEP = 16


def paged_varlen_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """A mixed batch of prompt chunks and decode steps, each reading its keys through the table.

    Sequence ``b``'s queries ``query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` are the last
    ``n_b`` of its ``seq_lens[b]`` positions, whose keys and values are already in the pools
    (blocks ``block_table[b, :ceil(seq_lens[b] / block_size)]``). The result equals, per
    sequence, attention of those queries over its first ``seq_lens[b]`` keys with the causal
    mask aligned bottom-right: the query at position ``p`` sees keys ``0 .. p``. The slots past
    ``seq_lens[b]`` in a sequence's last block are read and weighted 0, so they must hold
    finite numbers (a :class:`mha.PagedKVCache`'s pool starts at zero).

    Args:
        query: the queries of all sequences, packed end to end.
        key_pool, value_pool: the pools of a :class:`mha.PagedKVCache` (or any with that
            layout); ``Hkv`` heads: query head ``i`` reads key/value head ``i // (H // Hkv)``.
        block_table: physical block numbers per sequence; entries past a sequence, and with a
            window entries before it, are not read (they may be ``-1``).
        cu_seqlens_q: int32 prefix sums of the query counts ``n_b`` (``0`` allowed).
        seq_lens: positions stored per sequence, this step's included; ``n_b <= seq_lens[b]``.
        scale: multiplies the scores; defaults to ``1 / sqrt(D)``.
        sinks: a learned logit per query head, as in :func:`mha.scaled_dot_product_attention`:
            one more softmax column that hands over no value (gpt-oss).
        window: sliding-window attention: the query at position ``p`` sees keys
            ``p - window + 1 .. p`` only; blocks wholly before a window are not read.

    Shapes:
        query ``(total_q, H, D)``, pools ``(N, Hkv, block_size, D)`` and ``(N, Hkv, block_size,
        Dv)``, block_table ``(B, M)`` int, cu_seqlens_q ``(B + 1,)`` int32, seq_lens ``(B,)``
        int, sinks ``(H,)``; returns ``(total_q, H, Dv)``.
    """
    starts, lens, scale = validate.paged_varlen(
        query, key_pool, value_pool, block_table, cu_seqlens_q, seq_lens, scale, sinks, window
    )
    return _paged_varlen_attention(
        query, key_pool, value_pool, block_table, starts, lens, scale, sinks, window
    )


def _paged_varlen_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    starts: list[int],
    lens: list[int],
    scale: float,
    sinks: Tensor | None,
    window: int | None,
) -> Tensor:
    """:func:`paged_varlen_attention` on checked arguments: the sequences with ``n`` queries
    run together, one group per distinct ``n`` (all decode steps are one group).

    Shapes:
        query ``(total_q, H, D)``; returns ``(total_q, H, Dv)``.
    """
    counts = [b - a for a, b in zip(starts[:-1], starts[1:])]
    groups: dict[int, list[int]] = defaultdict(list)  # n -> the sequences with n queries
    for b, n in enumerate(counts):
        if n:
            groups[n].append(b)
    out = query.new_zeros(query.shape[0], query.shape[1], value_pool.shape[-1])  # (total_q, H, Dv)
    for n, seqs in groups.items():
        first = torch.tensor([starts[b] for b in seqs], device=query.device)  # (Bg,)
        rows = first[:, None] + torch.arange(n, device=query.device)  # (Bg, n) packed rows
        q = query[rows.flatten()]  # (Bg·n, H, D)
        lens_g = [lens[b] for b in seqs]
        o = _attend_group(
            q, key_pool, value_pool, block_table[seqs], lens_g, n, scale, sinks, window
        )
        out.index_copy_(0, rows.flatten(), o.to(out.dtype))  # (Bg·n, H, Dv) into place
    return out


def _attend_group(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    lens: list[int],
    n: int,
    scale: float,
    sinks: Tensor | None,
    window: int | None,
) -> Tensor:
    """``Bg`` sequences with ``n`` queries each, read a tile of blocks at a time.

    The ``G`` query heads that share a key/value head become ``G·n`` rows of one matrix, so
    each block is read once per key/value head, not once per query head.

    Shapes:
        query ``(Bg·n, H, D)``, block_table ``(Bg, M)``; returns ``(Bg·n, H, Dv)`` in the
        compute dtype (float32 for float16/bfloat16 inputs).
    """
    Bg, H, D = len(lens), query.shape[1], query.shape[2]
    Hkv, bs, Dv = key_pool.shape[1], key_pool.shape[2], value_pool.shape[-1]
    G, dev = H // Hkv, query.device
    compute = torch.promote_types(query.dtype, torch.float32)
    q = query.view(Bg, n, Hkv, G, D).permute(0, 2, 3, 1, 4)  # (Bg, Hkv, G, n, D)
    q = (q.reshape(Bg, Hkv, G * n, D) * scale).to(compute)  # (Bg, Hkv, G·n, D), row g·n + i
    first, last = validate.blocks_read([n] * Bg, lens, bs, window)
    steps = max(b - a for a, b in zip(first, last))  # blocks of the longest range
    per_step = max(
        1,
        min(
            MAX_BLOCKS_PER_STEP,
            TILE_SCORES // (Bg * H * n * bs),  # blocks whose scores fit the budget
            TILE_KEYS // (Bg * Hkv * bs * max(D, Dv)),  # blocks whose keys fit it
            steps,
        ),
    )
    S = torch.tensor(lens, device=dev)  # (Bg,)
    q_pos = S[:, None] - n + torch.arange(n, device=dev)  # (Bg, n) the queries' positions
    first_t = torch.tensor(first, device=dev)  # (Bg,)
    heads = torch.arange(Hkv, device=dev)[None, :, None]  # (1, Hkv, 1)
    offsets = torch.arange(bs, device=dev)  # (bs,)
    # The softmax state (m, l, acc); a sink is a first key of score sinks[h] and value 0.
    if sinks is None:
        m = q.new_full((Bg, Hkv, G * n, 1), -math.inf)  # running max of the scores
        l = q.new_zeros(Bg, Hkv, G * n, 1)  # running sum of exp(scores - m)  # noqa: E741
    else:
        sink = sinks.to(compute).view(1, Hkv, G, 1).expand(Bg, Hkv, G, n)  # (Bg, Hkv, G, n)
        m = sink.reshape(Bg, Hkv, G * n, 1).clone()  # (Bg, Hkv, G·n, 1)
        l = torch.ones_like(m)  # exp(sink - m)  # noqa: E741
    acc = q.new_zeros(Bg, Hkv, G * n, Dv)  # running weighted sum of values
    # Every step gathers into the same two buffers, which stay in the CPU's caches.
    k_buf = key_pool.new_empty(Bg * Hkv * per_step, bs, D)  # (Bg·Hkv·per_step, bs, D)
    v_buf = value_pool.new_empty(Bg * Hkv * per_step, bs, Dv)
    for t in range(0, steps, per_step):
        c = min(per_step, steps - t)
        cols = first_t[:, None] + t + torch.arange(c, device=dev)  # (Bg, c) table columns
        blocks = block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1))  # (Bg, c)
        # Past a sequence's range the entry may be -1 or another sequence's: read block 0 or
        # that block, and hide it below (its positions lie after the sequence's last one).
        blocks = blocks.long().clamp(min=0)[:, None, :]  # (Bg, 1, c)
        k = _gather(key_pool, blocks, heads, k_buf).to(compute)  # (Bg, Hkv, c·bs, D)
        v = _gather(value_pool, blocks, heads, v_buf).to(compute)  # (Bg, Hkv, c·bs, Dv)
        scores = q @ k.transpose(-2, -1)  # (Bg, Hkv, G·n, c·bs)
        if _needs_mask(first, lens, n, t, c, bs, window):
            k_pos = (cols[:, :, None] * bs + offsets).view(Bg, 1, c * bs)  # (Bg, 1, c·bs)
            keep = k_pos <= q_pos[:, :, None]  # (Bg, n, c·bs): causal, bottom-right
            if window is not None:
                keep &= k_pos > q_pos[:, :, None] - window  # and inside the window
            hidden = ~keep[:, None, None]  # (Bg, 1, 1, n, c·bs)
            scores.view(Bg, Hkv, G, n, c * bs).masked_fill_(hidden, -math.inf)
        # The max only shifts the exponents: detached, it keeps autograd right in place.
        m_new = torch.maximum(m, scores.detach().amax(-1, keepdim=True))  # (Bg, Hkv, G·n, 1)
        shift = torch.where(torch.isneginf(m_new), 0.0, m_new)  # a row with no key yet: 0
        p = scores.sub_(shift).exp_()  # in place: the largest tensor of the step
        alpha = torch.exp(m - shift)  # (Bg, Hkv, G·n, 1) rescales what was summed before
        l.mul_(alpha).add_(p.sum(-1, keepdim=True))  # (Bg, Hkv, G·n, 1)
        acc.mul_(alpha).add_(p @ v)  # (Bg, Hkv, G·n, Dv)
        m = m_new
    out = torch.where(
        l > 0, acc / l.clamp(min=torch.finfo(compute).tiny), 0.0
    )  # (Bg, Hkv, G·n, Dv)
    out = out.view(Bg, Hkv, G, n, Dv).permute(0, 3, 1, 2, 4)  # (Bg, n, Hkv, G, Dv)
    return out.reshape(Bg * n, H, Dv)  # (Bg·n, H, Dv)


def _gather(pool: Tensor, blocks: Tensor, heads: Tensor, buffer: Tensor) -> Tensor:
    """One tile: blocks ``blocks[b]`` of every sequence ``b``, head by head, as one run of keys.

    Shapes:
        pool ``(N, Hkv, block_size, D)``, blocks ``(Bg, 1, c)``, heads ``(1, Hkv, 1)``, buffer
        ``(at least Bg·Hkv·c, block_size, D)``; returns ``(Bg, Hkv, c·block_size, D)``.
    """
    N, Hkv, bs, D = pool.shape
    Bg, c = blocks.shape[0], blocks.shape[2]
    if not pool.is_contiguous():  # (reshaping it would copy the whole pool)
        return pool[blocks, heads].view(Bg, Hkv, c * bs, D)  # (Bg, Hkv, c, bs, D) as runs
    # The pool seen as (N·Hkv, bs, D): row block·Hkv + head is one piece of bs·D numbers, and
    # index_select (torch's fastest gather) lays them out in (sequence, head, block) order.
    rows = (blocks * Hkv + heads).flatten()  # (Bg·Hkv·c,)
    return _take(pool.view(N * Hkv, bs, D), rows, buffer).view(Bg, Hkv, c * bs, D)


def _take(pieces: Tensor, index: Tensor, buffer: Tensor) -> Tensor:
    """``pieces[index]`` written into the front of ``buffer``: a buffer reused by every step stays
    in the CPU's caches, where a fresh tensor per step would be fresh memory each time. When
    autograd must see the gather, a fresh tensor after all (``out=`` has no gradient).

    Shapes:
        pieces ``(P, ...)``, index ``(n,)``, buffer ``(at least n, ...)``; returns ``(n, ...)``.
    """
    if torch.is_grad_enabled() and pieces.requires_grad:
        return pieces.index_select(0, index)
    return torch.index_select(pieces, 0, index, out=buffer[: index.numel()])


def _paged_attention_rows(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor] | None:
    """:func:`mha.paged._paged_attention` in two passes, when every score of the call fits in
    one tile of ``TILE_KEYS`` numbers (a decode step over a few thousand positions): the first
    pass gathers each tile's keys and writes its scores, one softmax normalises whole rows, the
    second pass gathers the values. vLLM's first PagedAttention kernel kept a sequence's whole
    row of scores the same way. About twenty operations, where the running state takes over a
    hundred; ``None`` when the scores do not fit or autograd must see the call (``out=`` has no
    gradient): the running state then does it.

    Shapes:
        query ``(B, H, L, D)``; returns out ``(B, H, L, Dv)`` and its logsumexp ``(B, H, L)``.
    """
    B, H, L, D = query.shape
    Hkv, bs, Dv = key_pool.shape[1], key_pool.shape[2], value_pool.shape[-1]
    inputs = (query, key_pool, value_pool)
    if B == 0 or (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        return None
    dev = query.device
    lens = seq_lens.to(device=dev, dtype=torch.int64)  # (B,)
    needed = math.ceil(int(lens.max()) / bs)  # blocks of the longest sequence
    per_step = max(1, min(needed, TILE_KEYS // (B * Hkv * bs * max(D, Dv))))
    steps, tile = math.ceil(needed / per_step), per_step * bs  # tile: positions per step
    if needed == 0 or B * H * L * steps * tile > TILE_KEYS:
        return None
    compute = torch.float32 if query.dtype in validate.LOW_PRECISION else query.dtype
    q = (query.reshape(B * Hkv, -1, D) * scale).to(compute)  # (B·Hkv, G·L, D)
    # Row n·Hkv + h of the pool seen as (N·Hkv, bs, D) is head h of block n. Step t reads
    # per_step blocks of every sequence: idx[t]; block 0 pads the last step (masked below, as
    # is a -1 of the table).
    blocks = block_table[:, :needed].long().clamp(min=0)  # (B, n)
    idx = torch.zeros(B, Hkv, steps * per_step, dtype=torch.long, device=dev)
    idx[:, :, :needed] = blocks[:, None, :] * Hkv + torch.arange(Hkv, device=dev)[:, None]
    idx = idx.view(B * Hkv, steps, per_step).transpose(0, 1).contiguous()  # (T, B·Hkv, per_step)
    keys, values = key_pool.reshape(-1, bs, D), value_pool.reshape(-1, bs, Dv)
    k_buf = keys.new_empty(B * Hkv * per_step, bs, D)  # (B·Hkv·per_step, bs, D), every step's
    v_buf = values.new_empty(B * Hkv * per_step, bs, Dv)
    scores = q.new_empty(steps, B * Hkv, q.shape[1], tile)  # (T, B·Hkv, G·L, tile)
    for t in range(steps):  # first pass: keys -> scores[t], one piece of memory per step
        k = _take(keys, idx[t].view(-1), k_buf).view(B * Hkv, tile, D)
        torch.bmm(q, k.to(compute).transpose(1, 2), out=scores[t])
    first = int(lens.min()) // tile  # the steps before it hold no position past any end
    if first < steps:
        past_end = torch.arange(first * tile, steps * tile, device=dev) >= lens[:, None]
        past_end = past_end.view(B, steps - first, 1, 1, tile).transpose(0, 1)  # (T', B, 1, 1, t)
        rows = scores[first:].view(steps - first, B, Hkv, q.shape[1], tile)
        rows.masked_fill_(past_end, -math.inf)
    m = scores.amax(dim=(0, 3), keepdim=True)  # (1, B·Hkv, G·L, 1): each row's max
    m.nan_to_num_(neginf=0.0)  # a sequence with no position (a max of -inf): every exp is 0
    p = scores.sub_(m).exp_()  # (T, B·Hkv, G·L, tile), in place
    l = p.sum(dim=(0, 3)).unsqueeze(-1)  # (B·Hkv, G·L, 1)  # noqa: E741
    acc = q.new_zeros(B * Hkv, q.shape[1], Dv)
    for t in range(steps):  # second pass: values, weighted by exp(score - row's max)
        v = _take(values, idx[t].view(-1), v_buf).view(B * Hkv, tile, Dv)
        acc.baddbmm_(p[t], v.to(compute))  # (B·Hkv, G·L, Dv)
    out = acc.div_(l.clamp(min=torch.finfo(compute).tiny))  # a row with no key: 0 / tiny = 0
    lse = m[0] + torch.log(l)  # (B·Hkv, G·L, 1); -inf for a row with no key
    return out.reshape(B, H, L, Dv).to(query.dtype), lse.reshape(B, H, L)


def _needs_mask(
    first: list[int], lens: list[int], n: int, t: int, c: int, bs: int, window: int | None
) -> bool:
    """Whether some query of the group may not see some key of this step's tile (positions
    ``[(first + t)·bs, (first + t + c)·bs)`` per sequence): a key after the earliest query, or
    before the latest query's window. Most tiles of a long prefix need no mask at all."""
    for f, S in zip(first, lens):
        lo, hi = (f + t) * bs, (f + t + c) * bs  # the tile's positions [lo, hi)
        if hi - 1 > S - n or (window is not None and lo < S - window):
            return True
    return False
