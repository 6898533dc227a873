"""Caches that serve: a preallocated cache and split-KV (FlashDecoding) attention.

:class:`mha.KVCache` grows with ``torch.cat``: every step copies the whole cache into a new
tensor, so decoding ``N`` tokens copies ``O(N²)`` numbers. Serving systems do better in two ways:

* :class:`PreallocatedKVCache` allocates ``max_len`` positions once and writes each step's keys
  and values into the next free rows (Hugging Face's "static cache" works like this).
* :class:`mha.PagedKVCache` (``mha/paged.py``) keeps a pool of fixed-size blocks and a *block
  table* per sequence (vLLM's PagedAttention): memory is taken a block at a time, when a sequence
  needs it, so many sequences of unknown length share one pool without reserving ``max_len`` each.

Both can be passed as ``kv_cache=`` to :class:`mha.MultiHeadAttention` and give the same outputs
as :class:`mha.KVCache`: each provides ``attend``, the attention over what it holds.

:func:`flash_decoding` is the attention of one decoding step split over the keys: each split
gives a partial output and its logsumexp, and :func:`merge_partials` combines them exactly. A
learned sink (gpt-oss) is one more column of the whole softmax row: it joins the merged result
once, not once per split.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import validation as validate
from .attention import check_arguments
from .flash import _flash_attention
from .multihead import ContiguousCache


class PreallocatedKVCache(ContiguousCache):
    """A key/value cache with room for ``max_len`` positions, allocated once.

    The buffers are allocated on the first :meth:`update` (which fixes batch, heads, head dims,
    dtype and device); every update writes into the next free rows, and returns views of the
    rows filled so far: no step copies the old keys again. :meth:`reset` keeps the buffers for
    the next sequence. ``attend`` (from :class:`mha.multihead.ContiguousCache`) writes and
    attends over those views.

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


def merge_partials(
    out: Tensor, lse: Tensor, *, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Combine attention over disjoint sets of keys from each set's output and logsumexp.

    The result is the attention over all the keys at once, and its logsumexp. With ``sinks``
    (gpt-oss's learned sink, as in :func:`mha.scaled_dot_product_attention`) it is the attention
    whose softmax row also holds the sink's column: the sink joins the merged row once, never
    once per split (see :func:`_add_sink`).

    Args:
        out: each split's attention output, normalised over its own keys.
        lse: each split's logsumexp of the scores (``-inf`` for a split that saw no key).
        sinks: a logit per head for the whole row, or ``None`` for plain attention.

    Shapes:
        out ``(splits, ..., L, Dv)``, lse ``(splits, ..., L)``, sinks broadcasting to ``...``
        (e.g. ``(H,)`` for ``out (splits, B, H, L, Dv)``); returns ``(..., L, Dv)`` and the
        total ``(..., L)``, which counts the sink's column when there is one. A split that saw
        no key has ``lse_i = -inf`` and weight 0. lse is out's dtype, or float32 for
        float16/bfloat16 outputs; the sinks are used in lse's dtype.
    """
    validate.partials(out, lse)
    if sinks is not None:
        validate.split_sinks(sinks, validate.shape(out))
    merged, total = _merge_partials(out, lse)  # (..., L, Dv), (..., L): all keys, no sink
    if sinks is None:
        return merged, total
    return _add_sink(merged, total, sinks.to(lse.dtype))


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


def _add_sink(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Give merged attention the sink's column: the row's denominator gains ``exp(sinks)`` once.

    ``out`` is attention over all the keys and ``lse`` their logsumexp. The sink leaves the keys
    the share ``1 - p_sink = sigmoid(lse - sink) = exp(lse - lse_total)``, where ``lse_total`` is
    the logsumexp of the whole row, sink included.

    Shapes:
        out ``(..., L, Dv)``, lse ``(..., L)``, sinks broadcasting to ``...``; returns
        ``(..., L, Dv)`` and ``lse_total (..., L)``.
    """
    total = torch.logaddexp(lse, sinks[..., None])  # (..., L): lse_total, the sink counted once
    safe = torch.where(torch.isneginf(total), 0.0, total)  # no key and a sink of -inf: 0, not NaN
    kept = torch.exp(lse - safe).unsqueeze(-1)  # (..., L, 1): 1 - p_sink, the keys' share
    return out * kept, total  # (..., L, Dv), (..., L)


def flash_decoding(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    num_splits: int = 4,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention split over the keys (FlashDecoding): equal to one pass, more parallel work.

    The ``S`` keys are cut into contiguous chunks of ``ceil(S / num_splits)`` keys (the last one
    may be shorter), so there are at most ``num_splits`` of them, and fewer when ``num_splits``
    does not fit the rounding: ``S < num_splits``, but also e.g. ``S = 9``, ``num_splits = 4``,
    which gives 3 chunks of 3. Each chunk's attention gives a partial output and its logsumexp (on a GPU, the chunks run
    as separate programs at the same time), and :func:`merge_partials` combines them; a sink joins
    the merged row once, after the merge. Float16 and bfloat16 inputs keep the partials and their
    statistics in float32.

    Args:
        query, key, value: as in :func:`mha.scaled_dot_product_attention` (no mask: every query
            sees every key, as in one decoding step over the cache).
        num_splits: how many chunks of keys to attend to separately.
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        enable_gqa: key/value may have fewer heads (grouped-query attention).
        sinks: a learned logit per head (gpt-oss's sink), as in
            :func:`mha.scaled_dot_product_attention`; ``None`` for plain attention.

    Shapes:
        query ``(..., L, D)`` (``L = 1`` when decoding), key ``(..., S, D)``, value
        ``(..., S, Dv)``, sinks broadcasting to ``query.shape[:-2]`` (e.g. ``(H,)``); returns
        ``(..., L, Dv)``.
    """
    groups, scale = check_arguments(query, key, value, None, False, scale, enable_gqa)
    num_splits = validate.positive_int("num_splits", num_splits)
    if sinks is not None:
        validate.sinks(sinks, validate.shape(query))
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
    out, lse = _merge_partials(torch.stack(outs), torch.stack(lses))  # (..., L, Dv), (..., L)
    if sinks is not None:  # one column of the whole row: added once, after the merge
        out, _ = _add_sink(out, lse, sinks.to(compute))  # (..., L, Dv)
    return out.to(query.dtype)
