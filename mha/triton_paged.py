"""Paged attention as a Triton kernel: one decode step read through the block table (chapter 9).

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
