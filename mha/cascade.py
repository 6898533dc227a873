"""Shared-prefix (cascade) attention: a prompt that many sequences share, read once for all.

When many requests start with the same system prompt, a paged cache stores its blocks once
and every sequence's block table points at them (prefix caching): memory is shared. Attention
still reads those blocks once *per sequence*, unless the prefix is attended separately.
FlashInfer's cascade attention splits each sequence's keys into two disjoint sets, the shared
prefix and the sequence's own keys:

* all the batch's queries attend to the prefix in **one** batched call (the prefix's keys are
  read once, by every query at the same time: a matrix product instead of ``B`` vector ones);
* each sequence's queries attend to its own keys, packed as in :func:`mha.varlen_attention`;
* the two partial outputs merge by their logsumexps (:func:`mha.merge_partials`), exactly as
  the splits of :func:`mha.flash_decoding` do.

Memory sharing becomes bandwidth sharing: the prefix is read once per step, not once per
sequence.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import validation as validate
from .decoding import _merge_partials
from .flash import _flash_attention
from .masks import _causal_mask


def cascade_attention(
    query: Tensor,
    prefix_key: Tensor,
    prefix_value: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    scale: float | None = None,
) -> Tensor:
    """Attention of packed sequences that all start with one shared prefix.

    Sequence ``b``'s keys are the ``P`` prefix keys followed by its own
    ``key[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``; its queries
    ``query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` are the last ``L_b`` of those
    ``P + S_b`` positions. The result equals, per sequence, attention over prefix and own
    keys with the causal mask aligned bottom-right over that whole length (so with
    ``L_b <= S_b`` every query sees the whole prefix). The prefix is attended once for the
    whole batch, the own keys sequence by sequence, and the two merge by logsumexp.

    Args:
        query: the queries of all sequences, packed end to end.
        prefix_key, prefix_value: the shared prefix, the same for every sequence.
        key, value: each sequence's own keys and values, packed end to end.
        cu_seqlens_q: int32 prefix sums of the query counts (``0`` allowed).
        cu_seqlens_k: int32 prefix sums of the own key counts; as many sequences.
        scale: multiplies the scores; defaults to ``1 / sqrt(D)``.

    Shapes:
        query ``(total_q, H, D)``, prefix_key ``(P, Hkv, D)``, prefix_value ``(P, Hkv, Dv)``,
        key ``(total_k, Hkv, D)``, value ``(total_k, Hkv, Dv)``, cu_seqlens ``(B + 1,)``;
        returns ``(total_q, H, Dv)``. Query head ``i`` reads key/value head ``i // (H // Hkv)``.
    """
    groups = validate.packed_qkv(query, key, value)
    validate.shared_prefix(prefix_key, prefix_value, key, value)
    starts_q, starts_k = validate.cu_seqlens_pair(
        cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0]
    )
    checked = validate.scale(scale)
    scale = 1.0 / math.sqrt(query.shape[-1]) if checked is None else checked
    return _cascade_attention(
        query, prefix_key, prefix_value, key, value, starts_q, starts_k, scale, groups
    )


def _cascade_attention(
    query: Tensor,
    prefix_key: Tensor,
    prefix_value: Tensor,
    key: Tensor,
    value: Tensor,
    starts_q: list[int],
    starts_k: list[int],
    scale: float,
    groups: int,
) -> Tensor:
    """:func:`cascade_attention` on checked arguments (offsets as lists of ints).

    Shapes:
        as :func:`cascade_attention`; returns ``(total_q, H, Dv)``.
    """
    q = query.transpose(0, 1)  # (H, total_q, D): the whole batch's queries, head by head
    shared = _flash_attention(
        q,
        prefix_key.transpose(0, 1),  # (Hkv, P, D)
        prefix_value.transpose(0, 1),  # (Hkv, P, Dv)
        _prefix_mask(starts_q, starts_k, prefix_key.shape[0], query.device),
        False,
        scale,
        groups=groups,
    )  # one call for all sequences: (H, total_q, Dv), lse (H, total_q)
    own_out = q.new_zeros(q.shape[0], q.shape[1], value.shape[-1])  # (H, total_q, Dv)
    own_lse = torch.full_like(shared[1], -math.inf)  # (H, total_q): no own key yet
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0:  # a sequence without queries this step
            continue
        L, S = q1 - q0, k1 - k0
        keep = _causal_mask(L, S, diagonal=S - L, device=q.device)  # (L_b, S_b) bottom-right
        own_out[:, q0:q1], own_lse[:, q0:q1] = _flash_attention(
            q[:, q0:q1],  # (H, L_b, D)
            key[k0:k1].transpose(0, 1),  # (Hkv, S_b, D)
            value[k0:k1].transpose(0, 1),  # (Hkv, S_b, Dv)
            keep,
            False,
            scale,
            groups=groups,
        )
    out, _ = _merge_partials(
        torch.stack([shared[0], own_out]), torch.stack([shared[1], own_lse])
    )  # (H, total_q, Dv): the two disjoint sets of keys, merged by logsumexp
    return out.transpose(0, 1).to(query.dtype)  # (total_q, H, Dv)


def _prefix_mask(
    starts_q: list[int], starts_k: list[int], P: int, device: torch.device
) -> Tensor | None:
    """Which prefix keys each query sees: all of them, unless a sequence has more queries than
    own keys (``L_b > S_b``); then its first queries sit inside the prefix, and the bottom-right
    causal mask hides the prefix keys after them. ``None`` when every query sees every key.

    Shapes:
        returns ``(total_q, P)`` bool or ``None``.
    """
    lags = [
        (q1 - q0) - (k1 - k0)  # how far the first query reaches back into the prefix
        for q0, q1, k0, k1 in zip(starts_q[:-1], starts_q[1:], starts_k[:-1], starts_k[1:])
    ]
    if max(lags, default=0) <= 0 or not P:
        return None
    counts = torch.tensor([b - a for a, b in zip(starts_q[:-1], starts_q[1:])], device=device)
    lag = torch.tensor(lags, device=device).repeat_interleave(counts)  # (total_q,)
    first = torch.tensor(starts_q[:-1], device=device).repeat_interleave(counts)  # (total_q,)
    i = torch.arange(starts_q[-1], device=device) - first  # (total_q,) index in its sequence
    last_seen = P + i - lag  # (total_q,) the last prefix key the query sees (at P + S_b - L_b + i)
    return torch.arange(P, device=device) <= last_seen[:, None]  # (total_q, P)
