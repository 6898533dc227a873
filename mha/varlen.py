"""Packed (variable-length) attention: FlashAttention's ``cu_seqlens`` layout in plain PyTorch.

A batch of sequences of different lengths can be padded to the longest one, ``(B, H, L_max, D)``,
and the padding masked out; every padded position still costs memory and work. Serving engines
and packed pretraining instead *pack* the sequences end to end along one token axis,

    query ``(total_q, H, D)`` with ``total_q = L_0 + L_1 + … + L_{B-1}``,

and describe where each sequence starts with prefix sums of the lengths, ``cu_seqlens``
(cumulative sequence lengths): ``cu_seqlens_q = [0, L_0, L_0 + L_1, …, total_q]``, ``B + 1``
int32 numbers. Sequence ``b``'s queries are ``query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``;
its keys and values are found the same way through ``cu_seqlens_k``. No token attends across a
sequence boundary.

``is_causal`` is aligned **bottom-right** in each sequence, as FlashAttention (since 2.1) does:
the last query of a sequence sees all of its keys, i.e. query ``i`` of ``L`` sees key ``j`` of
``S`` when ``j <= i + (S - L)`` (measured from the *ends*: a key may not lie closer to the end
than the query does). With ``L = S`` this is the usual causal mask; with ``L < S`` (new tokens
after a cache) the queries see the whole past; with ``L > S`` the first ``L - S`` queries see no
key at all and return zeros, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import validation as validate


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Attention over packed sequences, each attending only within itself.

    Args:
        query: the queries of all sequences, packed end to end.
        key: the keys of all sequences, packed the same way (``Hkv`` heads: grouped-query
            attention when ``H`` is a multiple of ``Hkv``; query head ``i`` reads key head
            ``i // (H // Hkv)``).
        value: the values, packed as the keys.
        cu_seqlens_q: int32 prefix sums of the query lengths, ``[0, L_0, L_0 + L_1, …, total_q]``.
            A repeated value is an empty sequence (allowed: it contributes no rows).
        cu_seqlens_k: int32 prefix sums of the key lengths; the same number of sequences.
        is_causal: causal attention aligned bottom-right in each sequence (FlashAttention >= 2.1);
            a query that sees no key (``L > S``) returns zeros.
        scale: factor applied to the scores; defaults to ``1 / sqrt(D)``.

    Shapes:
        query ``(total_q, H, D)``, key ``(total_k, Hkv, D)``, value ``(total_k, Hkv, Dv)``,
        cu_seqlens ``(B + 1,)`` -> ``(total_q, H, Dv)``.
    """
    group = validate.packed_qkv(query, key, value)
    starts_q, starts_k = validate.cu_seqlens_pair(
        cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0]
    )
    validate.flag("is_causal", is_causal)
    scale = validate.scale(scale)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])  # (total_q, H, Dv)
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 > q0:  # an empty sequence contributes no rows
            out[q0:q1] = _attend_one(
                query[q0:q1], key[k0:k1], value[k0:k1], group, is_causal, scale
            )
    return out


def _attend_one(
    q: Tensor, k: Tensor, v: Tensor, group: int, is_causal: bool, scale: float
) -> Tensor:
    """One sequence: ``(L, H, D)``, ``(S, Hkv, D)``, ``(S, Hkv, Dv)`` -> ``(L, H, Dv)``."""
    L, S = q.shape[0], k.shape[0]
    q = q.transpose(0, 1)  # (H, L, D)
    k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # (H, S, D)
    v = v.transpose(0, 1).repeat_interleave(group, dim=0)  # (H, S, Dv)
    # Float16/bfloat16: scores and softmax in float32, as the course's other kernels do.
    work = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale  # (H, L, S)
    i = torch.arange(L, device=q.device)[:, None]  # (L, 1) query positions
    j = torch.arange(S, device=q.device)[None, :]  # (1, S) key positions
    # Causal, bottom-right: a key may not lie closer to the sequence's end than the query.
    keep = (j - S <= i - L) if is_causal else torch.ones(L, S, dtype=torch.bool, device=q.device)
    scores = scores.masked_fill(~keep, float("-inf"))  # (H, L, S)
    weights = torch.softmax(scores, dim=-1)  # (H, L, S); NaN in a row that sees no key
    weights = weights.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # such a row: zeros
    out = weights @ v.to(work)  # (H, L, Dv)
    return out.transpose(0, 1).to(q.dtype)  # (L, H, Dv)


def pack(sequences: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Pack sequences end to end: the packed tensor and its ``cu_seqlens``.

    Args:
        sequences: ``B`` tensors ``(L_b, H, D)`` (any lengths, ``0`` included; the same
            trailing dims).

    Shapes:
        returns ``(L_0 + … + L_{B-1}, H, D)`` and cu_seqlens ``(B + 1,)`` int32.
    """
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise TypeError(f"sequences must be a non-empty list of tensors, got {sequences!r:.60}")
    for i, s in enumerate(sequences):
        validate.tensor(f"sequences[{i}]", s)
        if s.dim() < 1 or s.shape[1:] != sequences[0].shape[1:]:
            raise ValueError(
                f"sequences must share their trailing dims, got sequences[0] "
                f"{validate.shape(sequences[0])} and sequences[{i}] {validate.shape(s)}"
            )
    lengths = torch.tensor([s.shape[0] for s in sequences])  # (B,)
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)  # (B + 1,)
    cu_seqlens[1:] = lengths.cumsum(0)
    return torch.cat(list(sequences)), cu_seqlens  # (total, H, D), (B + 1,)


def unpack(packed: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """The sequences of a packed tensor, as views: ``B`` tensors ``(L_b, …)``."""
    validate.tensor("packed", packed)
    starts = validate.cu_seqlens("cu_seqlens", cu_seqlens, packed.shape[0], "packed")
    return [packed[a:b] for a, b in zip(starts[:-1], starts[1:])]
