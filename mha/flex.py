"""The course's masks as FlexAttention ``mask_mod`` and ``score_mod`` functions.

FlexAttention (``torch.nn.attention.flex_attention``) takes attention's variations as two small
functions of the indices instead of as dense ``(L, S)`` tensors:

* a **mask_mod** ``(b, h, q_idx, kv_idx) -> bool``: may query ``q_idx`` attend to key ``kv_idx``
  (in batch ``b``, head ``h``)? ``True`` = attend, the keep-mask convention of :mod:`mha.masks`;
* a **score_mod** ``(score, b, h, q_idx, kv_idx) -> score``: change one score before the softmax
  (a bias such as ALiBi).

FlexAttention calls them on index tensors (vmapped, or traced into a compiled kernel), so they
must be written with tensor operations: ``&`` and ``|``, never ``and``, ``or`` or ``if``.
Whatever changes from batch to batch (lengths, document ids, a window size) is read from a
*tensor* the function captures: a compiled kernel then serves every new value without compiling
again. Combine mask_mods with ``torch.nn.attention.flex_attention.and_masks``/``or_masks``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import validation as validate

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal attention (top-left aligned, as :func:`mha.causal_mask`): keys up to the query."""
    return q_idx >= kv_idx


def sliding_window(window: int | Tensor) -> MaskMod:
    """Causal local attention, as :func:`mha.sliding_window_mask`: the ``window`` latest keys.

    Args:
        window: keys a query sees, itself included; a 0-dim integer tensor lets a compiled kernel
            take a new window size (changed in place) without compiling again.
    """
    if isinstance(window, Tensor):
        validate.integer_tensor("window", window, ndim=0)
        if int(window) <= 0:  # checked now; a value written in place later is the caller's
            raise ValueError(f"window must be positive, got {int(window)}")
    else:
        validate.positive_int("window", window)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx - kv_idx  # how far the key lies behind the query
        return (distance >= 0) & (distance < window)

    return mask_mod


def padding(lengths: Tensor) -> MaskMod:
    """Hide the padding keys at the end of each sequence, as :func:`mha.padding_mask`.

    Shapes:
        lengths: ``(B,)``, the number of real tokens of each sequence.
    """
    validate.integer_tensor("lengths", lengths, ndim=1)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got a minimum of {int(lengths.min())}")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < lengths[b]

    return mask_mod


def document(doc_ids: Tensor) -> MaskMod:
    """Attend within one's own document only: several documents packed into one sequence.

    Combine it with :func:`causal` for a packed batch of causal language-model samples.

    Shapes:
        doc_ids: ``(S,)``, the document each position belongs to (queries and keys share it).
    """
    validate.integer_tensor("doc_ids", doc_ids, ndim=1)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return doc_ids[q_idx] == doc_ids[kv_idx]

    return mask_mod


def packed_documents(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None, *, is_causal: bool = False
) -> MaskMod:
    """Packed sequences as one long one, FlashAttention's ``cu_seqlens`` layout as a mask_mod.

    Query ``q_idx`` (of the packed queries) may attend to key ``kv_idx`` (of the packed keys)
    only if both belong to the same sequence, and, with ``is_causal``, if the key lies no closer
    to the end of its sequence than the query does: bottom-right alignment per sequence, as in
    :func:`mha.varlen_attention` and FlashAttention >= 2.1. Use it with ``B = 1`` and the
    packed tokens as the sequence axis: ``(1, H, total_q, D)``.

    Args:
        cu_seqlens_q: ``(B + 1,)`` int32 prefix sums of the query lengths.
        cu_seqlens_k: the same for the keys; defaults to ``cu_seqlens_q`` (self-attention).
        is_causal: causal within each sequence, aligned bottom-right.
    """
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        validate.tensor(name, c, ndim=1, layout="(B + 1,)")
    # No packed tensor to compare with here: the last offset is the packed length.
    total_q, total_k = (int(c[-1]) if c.numel() else 0 for c in (cu_seqlens_q, cu_seqlens_k))
    validate.cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "the packed queries")
    validate.cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "the packed keys")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"shapes {validate.shape(cu_seqlens_q)} and {validate.shape(cu_seqlens_k)}"
        )
    validate.flag("is_causal", is_causal)
    lengths_q, lengths_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()  # (B,) each
    ids = torch.arange(lengths_q.numel(), device=cu_seqlens_q.device)  # (B,)
    doc_q = ids.repeat_interleave(lengths_q)  # (total_q,) the sequence of each query
    doc_k = ids.repeat_interleave(lengths_k)  # (total_k,) the sequence of each key
    end_q, end_k = cu_seqlens_q[1:].long(), cu_seqlens_k[1:].long()  # (B,) where each ends

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = doc_q[q_idx] == doc_k[kv_idx]
        if not is_causal:
            return same
        # Distances to the sequence's end: a key may not lie closer to it than the query.
        return same & (kv_idx - end_k[doc_k[kv_idx]] <= q_idx - end_q[doc_q[q_idx]])

    return mask_mod


def block_pattern(pattern: Tensor, block_size: int) -> MaskMod:
    """A block-sparse mask (BigBird's blocks): ``pattern[r, c]`` keeps or hides a whole block.

    Shapes:
        pattern: ``(ceil(L / block_size), ceil(S / block_size))`` bool, one entry per block of
        ``block_size`` queries and ``block_size`` keys.
    """
    validate.tensor("pattern", pattern, ndim=2)
    if pattern.dtype != torch.bool:
        raise TypeError(f"pattern must be a bool tensor, got dtype {pattern.dtype}")
    block_size = validate.positive_int("block_size", block_size)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return pattern[q_idx // block_size, kv_idx // block_size]

    return mask_mod


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's slope of each head, as in the ALiBi paper's code and BLOOM.

    For a power of two ``H`` the slopes are the geometric sequence ``m_h = 2^(-8h/H)`` for
    ``h = 1..H``: from ``2^(-8/H)`` down to ``2^-8``. For other ``H`` (BLOOM has 112 heads) the
    reference code of the ALiBi paper (Press et al., 2022), and BLOOM after it, keeps the sequence
    of the nearest lower power of two ``n = 2^floor(log2 H)``, ``2^(-8i/n)`` for ``i = 1..n``, and
    takes the ``H - n`` slopes still missing from the sequence for ``2n``, ``2^(-8i/(2n))``, at its
    odd ``i = 1, 3, 5, …`` (the values that fall between the first ``n``), appended after them.
    ``2^(-8h/H)`` would be a different set of slopes from the one those models were trained with.

    Shapes:
        returns ``(H,)`` float32.
    """
    H = validate.positive_int("num_heads", num_heads)
    n = 1 << (H.bit_length() - 1)  # 2^floor(log2 H), the largest power of two <= H
    slopes = 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float32) / n)  # (n,)
    if n == H:
        return slopes
    odd = torch.arange(1, 2 * (H - n), 2, dtype=torch.float32)  # (H - n,) i = 1, 3, 5, ...
    extra = 2.0 ** (-8.0 * odd / (2 * n))  # (H - n,) from the sequence for 2n
    return torch.cat([slopes, extra])  # (H,)


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi as a score_mod: head ``h`` subtracts ``slopes[h] * (q_idx - kv_idx)``.

    A bias only; combine it with the :func:`causal` mask_mod (as ALiBi models do).

    Shapes:
        slopes: ``(H,)``, e.g. :func:`alibi_slopes`.
    """
    validate.tensor("slopes", slopes, floating=True, ndim=1)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score - slopes[h] * (q_idx - kv_idx)

    return score_mod
