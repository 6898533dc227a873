"""Paged attention as Triton kernels that read the cache through the block table (chapter 9).

:func:`triton_paged_attention` computes what :func:`mha.paged_attention` computes, as one GPU
kernel. Each *program* owns one sequence and one key/value head: the ``G = H / Hkv`` query heads
that share that head are the rows of its tile, so a block of keys is read once for all of them
(grouped-query attention saves memory traffic here, not only memory). The program looks up its
sequence's length and walks its row of the block table: for each logical block it loads the
physical block number, then that block's keys and values, and updates the running softmax state
``m, l, acc`` exactly as the FlashAttention kernel of chapter 6 does for a tile of keys. A slot
past the sequence's length is masked when it is loaded, so its contents never matter.

A decode step has one query row per head, too few for tensor-core ``tl.dot`` tiles (at least 16
rows), so the scores and the weighted sum are broadcast products reduced with ``tl.sum``: the
step is bound by reading the cache, not by arithmetic (chapter 8.3).

:func:`triton_paged_varlen_attention` computes what :func:`mha.paged_varlen_attention` computes
(prompt chunks and decode steps of many sequences in one call, as vLLM V1 runs a serving step),
also as one kernel. A program owns a tile of one sequence's queries and one key/value head: its
rows are the ``G`` query heads of that group at ``BLOCK_Q`` consecutive positions, so a prompt
chunk fills tiles of 16 rows or more and the scores are tensor-core ``tl.dot`` products. It walks
the range of keys its rows can see (causal from the bottom right, inside the window) a tile of
``BLOCK_N`` positions at a time, looks each position's physical block up in the table and loads
the keys and values where they lie in the pool: no gathered copy, and no block outside the range
is ever read.

Where the kernel runs is decided as in :mod:`mha.triton_flash` (``TRITON_INTERPRET=1`` before the
first ``import triton`` runs it in Triton's CPU interpreter, which is how the tests run it
without a GPU).
"""

# No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations.

import torch
from torch import Tensor

from . import validation as validate
from .paged import _check_decode_step
from .triton_flash import (
    HAS_TRITON,
    LOG2E,
    MAX_HEAD_DIM,
    _check_device,
    _check_dtype,
    _check_mode,
    _require_triton,
    tl,
    triton,
)


# The kernel's layout groups related arguments and terms; the formatter leaves it alone.
# fmt: off
@triton.jit
def _paged_decode_kernel(
    Q, KPool, VPool, Table, Lens, Out,  # query (B, H, 1, D), pools (N, Hkv, bs, D|Dv), ...
    stride_qb, stride_qh, stride_qd,  # query strides (its length is 1: no stride needed)
    stride_kn, stride_kh, stride_ks, stride_kd,  # key pool: block, head, slot, lane
    stride_vn, stride_vh, stride_vs, stride_vd,
    stride_tb, stride_tm,  # block table (B, M)
    stride_ob, stride_oh, stride_od,  # out (B, H, 1, Dv)
    qk_scale,  # scale * log2(e): scores in base-2 units, ready for exp2
    GROUPS: tl.constexpr,  # query heads per key/value head
    BLOCK_G: tl.constexpr,  # GROUPS rounded up to a power of two
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # D and its power-of-two lanes
    VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,  # Dv and its lanes
    BLOCK_SIZE: tl.constexpr,  # positions per pool block
    BLOCK_S: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
):
    # step 1 - which sequence and which key/value head
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)  # (BLOCK_G,) the query heads of this group
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    offs_s = tl.arange(0, BLOCK_S)  # (BLOCK_S,) slots inside one block
    heads = kvh * GROUPS + offs_g  # (BLOCK_G,) query head numbers
    # end of step 1

    # step 2 - the group's queries, and the sequence's length
    q_mask = (offs_g[:, None] < GROUPS) & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_G, BLOCK_D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_D)
    seq_len = tl.load(Lens + b)  # positions stored for this sequence
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)  # its blocks: the first entries of its table row
    # end of step 2

    # step 3 - the running state
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    # end of step 3

    for j in range(0, num_blocks):
        # step 4 - look up the physical block, load its keys
        block = tl.load(Table + b * stride_tb + j * stride_tm).to(tl.int64)
        positions = j * BLOCK_SIZE + offs_s  # (BLOCK_S,) logical positions of these slots
        keep = (offs_s < BLOCK_SIZE) & (positions < seq_len)  # (BLOCK_S,) slots holding a token
        k_ptrs = (KPool + block * stride_kn + kvh * stride_kh
                  + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd)  # (BLOCK_S, BLOCK_D)
        k = tl.load(k_ptrs, mask=keep[:, None] & (offs_d[None, :] < HEAD_DIM),
                    other=0.0).to(tl.float32)
        # end of step 4

        # step 5 - scores and the online-softmax update
        scores = tl.sum(q[:, None, :] * k[None, :, :], 2) * qk_scale  # (BLOCK_G, BLOCK_S)
        scores = tl.where(keep[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))  # (BLOCK_G,)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - shift[:, None])  # (BLOCK_G, BLOCK_S)
        alpha = tl.exp2(m - shift)  # (BLOCK_G,)
        l = alpha * l + tl.sum(p, 1)
        v_ptrs = (VPool + block * stride_vn + kvh * stride_vh
                  + offs_s[:, None] * stride_vs + offs_dv[None, :] * stride_vd)  # (BLOCK_S, BLOCK_DV)
        v = tl.load(v_ptrs, mask=keep[:, None] & (offs_dv[None, :] < VALUE_DIM),
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)  # (BLOCK_G, BLOCK_DV)
        m = m_new
        # end of step 5

    # step 6 - normalise (an empty sequence gives zeros, as SDPA) and store
    l = tl.where(l == 0.0, 1.0, l)
    out = acc / l[:, None]  # (BLOCK_G, BLOCK_DV)
    o_mask = (offs_g[:, None] < GROUPS) & (offs_dv[None, :] < VALUE_DIM)
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=o_mask)
    # end of step 6
# fmt: on


def is_interpreted() -> bool:
    """Whether the kernel runs in Triton's CPU interpreter (decided when this module was imported)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_decode_kernel, InterpretedFunction)


def triton_paged_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
) -> Tensor:
    """:func:`mha.paged_attention` as one Triton kernel: a program per (sequence, key/value head).

    Args:
        query, key_pool, value_pool, block_table, seq_lens, scale: as :func:`mha.paged_attention`.

    Shapes:
        query ``(B, H, 1, D)``, pools ``(N, Hkv, block_size, D)`` and ``(N, Hkv, block_size, Dv)``,
        block_table ``(B, M)``, seq_lens ``(B,)``; returns ``(B, H, 1, Dv)`` in query's dtype.
    """
    groups, block_size, scale = _check_decode_step(
        query, key_pool, value_pool, block_table, seq_lens, scale
    )
    _require_triton()
    _check_dtype("query", query)
    for name, D in (("key_pool", key_pool.shape[-1]), ("value_pool", value_pool.shape[-1])):
        if not 1 <= D <= MAX_HEAD_DIM:
            raise ValueError(
                f"head dim must be in [1, {MAX_HEAD_DIM}], got {name} {validate.shape(key_pool)}"
            )
    interpreted = is_interpreted()
    _check_mode(interpreted)
    _check_device(query, interpreted)
    B, H, _, D = query.shape
    Hkv, Dv = key_pool.shape[1], value_pool.shape[-1]
    out = query.new_empty(B, H, 1, Dv)  # (B, H, 1, Dv)
    if out.numel() == 0:
        return out
    lens = seq_lens.to(torch.int32).contiguous()  # (B,)
    grid = (B, Hkv)  # one program per (sequence, key/value head)
    _paged_decode_kernel[grid](
        query,
        key_pool,
        value_pool,
        block_table,
        lens,
        out,
        query.stride(0),
        query.stride(1),
        query.stride(3),
        *key_pool.stride(),
        *value_pool.stride(),
        *block_table.stride(),
        out.stride(0),
        out.stride(1),
        out.stride(3),
        scale * LOG2E,
        GROUPS=groups,
        BLOCK_G=triton.next_power_of_2(groups),
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        VALUE_DIM=Dv,
        BLOCK_DV=triton.next_power_of_2(Dv),
        BLOCK_SIZE=block_size,
        BLOCK_S=triton.next_power_of_2(block_size),
        num_warps=4,
    )
    return out


# fmt: off
@triton.jit
def _paged_varlen_kernel(
    Q, KPool, VPool, Table, CuQ, Lens, Sinks, Out,  # query (total_q, H, D), pools, ...
    stride_qt, stride_qh, stride_qd,  # query: packed row, head, lane
    stride_kn, stride_kh, stride_ks, stride_kd,  # key pool: block, head, slot, lane
    stride_vn, stride_vh, stride_vs, stride_vd,
    stride_tb, stride_tm,  # block table (B, M)
    stride_ot, stride_oh, stride_od,  # out (total_q, H, Dv)
    qk_scale,  # scale * log2(e): scores in base-2 units, ready for exp2
    window,  # keys p - window + 1 .. p (read only with HAS_WINDOW)
    GROUPS: tl.constexpr,  # query heads per key/value head
    BLOCK_G: tl.constexpr,  # GROUPS rounded up to a power of two
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # D and its lanes (a power of two >= 16)
    VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,  # Dv and its lanes
    BLOCK_SIZE: tl.constexpr,  # positions per pool block (any size)
    BLOCK_Q: tl.constexpr,  # query positions per tile
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q * BLOCK_G
    BLOCK_N: tl.constexpr,  # key positions per loop step
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute on float32 copies (bfloat16 in the interpreter)
):
    # step 1 - which sequence, which tile of its queries, which key/value head
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(CuQ + b)  # the sequence's first packed query row
    n = tl.load(CuQ + b + 1) - q_start  # its queries this step (0: it sits the step out)
    if tile * BLOCK_Q >= n:
        return  # the grid is sized for the longest chunk: shorter ones have fewer tiles
    seq_len = tl.load(Lens + b)  # positions stored, this step's included
    # end of step 1

    # step 2 - the tile's rows: row r is query tile·BLOCK_Q + r // BLOCK_G, head r % BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    tok = tile * BLOCK_Q + offs_m // BLOCK_G  # (BLOCK_M,) the query's index among the n
    g = offs_m % BLOCK_G  # (BLOCK_M,) its head within the group
    heads = kvh * GROUPS + g  # (BLOCK_M,) query head numbers
    row_ok = (tok < n) & (g < GROUPS)  # (BLOCK_M,) rows past the chunk or the group are padding
    q_pos = seq_len - n + tok  # (BLOCK_M,) the last n positions are the queries (bottom right)
    rows = (q_start + tok).to(tl.int64)  # (BLOCK_M,) packed rows; total_q·H·D may pass 2^31
    q_ptrs = (Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)  # (BLOCK_M, BLOCK_D)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # end of step 2

    # step 3 - the keys any row of the tile sees: [lo, hi), and the running state
    hi = tl.minimum(seq_len - n + (tile + 1) * BLOCK_Q, seq_len)  # past the tile's last query
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - n + tile * BLOCK_Q - window + 1, 0)  # its first query's window
    else:
        lo = 0
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # end of step 3

    # Key tiles wholly before lo or from hi on are never visited: their blocks are not read.
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        # step 4 - each key position's physical block, then its keys where they lie
        pos = start + offs_n  # (BLOCK_N,) logical key positions
        load_ok = (pos >= lo) & (pos < hi)  # (BLOCK_N,) table entries outside may be -1
        block = tl.load(Table + b * stride_tb + (pos // BLOCK_SIZE) * stride_tm,
                        mask=load_ok, other=0).to(tl.int64)  # (BLOCK_N,)
        slot = pos % BLOCK_SIZE  # (BLOCK_N,)
        # K is read as K^T, (BLOCK_D, BLOCK_N), so that q @ k^T is a plain tl.dot.
        k = tl.load(KPool + block[None, :] * stride_kn + kvh * stride_kh
                    + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=load_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        # end of step 4

        # step 5 - scores, the causal and window masks, the online-softmax update
        scores = tl.dot(q, k, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N) float32
        keep = load_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # causal, bottom-right
        if HAS_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))  # (BLOCK_M,)
        # A row with no key yet keeps m = -inf: shift by 0, so its weights are 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - shift[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m - shift)  # (BLOCK_M,)
        l = alpha * l + tl.sum(p, 1)
        v = tl.load(VPool + block[:, None] * stride_vn + kvh * stride_vh
                    + slot[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                    mask=load_ok[:, None] & (offs_dv[None, :] < VALUE_DIM), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        # p in the value dtype: the second product runs on the tensor cores too.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
        # end of step 5

    # step 6 - the sink: one more logit per head in the denominator, with no value
    if HAS_SINKS:
        sink = tl.load(Sinks + heads, mask=g < GROUPS, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634  # log2(e): into the scores' base-2 units
        m_end = tl.maximum(m, sink)  # (BLOCK_M,) finite: rescale rather than risk overflow
        alpha = tl.exp2(m - m_end)
        l = alpha * l + tl.exp2(sink - m_end)
        acc = acc * alpha[:, None]
    # end of step 6

    # step 7 - normalise and store (every real row saw its own key: l > 0 there)
    l = tl.where(l == 0.0, 1.0, l)
    out = acc / l[:, None]  # (BLOCK_M, BLOCK_DV)
    tl.store(Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < VALUE_DIM))
    # end of step 7
# fmt: on


def varlen_tiles(
    max_queries: int, groups: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int, int]:
    """The tiles of :func:`triton_paged_varlen_attention`: ``(BLOCK_Q, BLOCK_M, BLOCK_N)``.

    A tile's rows are the ``G`` query heads (rounded up to a power of two) at ``BLOCK_Q`` query
    positions: at least 16 rows (the tensor cores' smallest tile); above that only as many
    positions as the longest chunk has, and at most 64 rows unless one group is wider. A batch of
    decode steps thus runs 16-row tiles, and a batch with a prompt chunk 64-row ones. Key tiles
    are 64 positions, 32 for wide heads or float32 (two tiles of keys and values must fit in
    shared memory).
    """
    block_g = triton.next_power_of_2(groups)
    block_m = max(block_g, min(64, max(16, triton.next_power_of_2(max_queries) * block_g)))
    block_n = 32 if dtype == torch.float32 or head_dim > 64 else 64
    return block_m // block_g, block_m, block_n


def triton_paged_varlen_attention(
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
    """:func:`mha.paged_varlen_attention` as one Triton kernel: a program per (sequence, tile of
    its queries, key/value head).

    Sequence ``b``'s ``n_b`` queries are the last of its ``seq_lens[b]`` positions: the query at
    position ``p`` sees keys ``0 .. p`` (``p - window + 1 .. p`` with a window), read through
    ``block_table[b]``. A sequence with ``n_b = 0`` launches programs that return at once.

    Args:
        query, key_pool, value_pool, block_table, cu_seqlens_q, seq_lens, scale, sinks, window:
            as :func:`mha.paged_varlen_attention`. Slots past a sequence's length and table
            entries outside the keys its queries see are never read.

    Shapes:
        query ``(total_q, H, D)``, pools ``(N, Hkv, block_size, D)`` and ``(N, Hkv, block_size,
        Dv)``, block_table ``(B, M)``, cu_seqlens_q ``(B + 1,)`` int32, seq_lens ``(B,)``,
        sinks ``(H,)``; returns ``(total_q, H, Dv)`` in query's dtype.
    """
    starts, _, scale = validate.paged_varlen(
        query, key_pool, value_pool, block_table, cu_seqlens_q, seq_lens, scale, sinks, window
    )
    _require_triton()
    _check_dtype("query", query)
    for name, pool in (("key_pool", key_pool), ("value_pool", value_pool)):
        if not 1 <= pool.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(
                f"head dim must be in [1, {MAX_HEAD_DIM}], got {name} {validate.shape(pool)}"
            )
    interpreted = is_interpreted()
    _check_mode(interpreted)
    _check_device(query, interpreted)
    total_q, H, D = query.shape
    Hkv, block_size, Dv = key_pool.shape[1], key_pool.shape[2], value_pool.shape[-1]
    groups = H // Hkv
    out = query.new_empty(total_q, H, Dv)  # (total_q, H, Dv): every row belongs to a sequence
    max_queries = max(b - a for a, b in zip(starts[:-1], starts[1:]))
    if out.numel() == 0 or max_queries == 0:
        return out
    block_q, block_m, block_n = varlen_tiles(max_queries, groups, max(D, Dv), query.dtype)
    B = len(starts) - 1
    grid = (B, triton.cdiv(max_queries, block_q), Hkv)  # (sequence, query tile, kv head)
    _paged_varlen_kernel[grid](
        query,
        key_pool,
        value_pool,
        block_table,
        cu_seqlens_q.contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        out if sinks is None else sinks.contiguous(),  # (never read without sinks)
        out,
        *query.stride(),
        *key_pool.stride(),
        *value_pool.stride(),
        *block_table.stride(),
        *out.stride(),
        scale * LOG2E,
        0 if window is None else window,
        GROUPS=groups,
        BLOCK_G=triton.next_power_of_2(groups),
        HEAD_DIM=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        VALUE_DIM=Dv,
        BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        UPCAST=interpreted and query.dtype == torch.bfloat16,
        num_warps=4,
        num_stages=2,
    )
    return out
