"""KV-cache quantisation: keys and values stored in 8 bits, with a float scale beside them.

A decode step reads the whole cache, so its bytes set the speed (section 8.3) and its size sets
how many sequences fit. Storing each number in 8 bits instead of 16 halves both. *Absmax*
quantisation maps a group of numbers onto the 8-bit grid by one float scale per group:

    scale = max |x| over the group / q_max,   stored = round(x / scale),   read = stored · scale

with ``q_max = 127`` for int8 (the grid -127 … 127, a step of ``scale``; rounding errs by at most
half a step) and ``q_max = 448`` for ``torch.float8_e4m3fn`` (a floating grid: 3 mantissa bits,
so the error is relative, at most 1/16 of the number, down to the smallest subnormal step).

*Which* numbers share a scale is the design choice:

* **per token** (``granularity="token"``): one scale per (batch, head, position), over the ``D``
  channels of that token's vector, shape ``(B, Hkv, S, 1)``. New tokens are quantised as they
  arrive, without touching the old ones: what a cache needs.
* **per channel** (``granularity="channel"``): one scale per (batch, head, channel), over the
  ``S`` positions, shape ``(B, Hkv, 1, D)``. Keys of real models have a few channels of much
  larger magnitude than the rest; a per-token scale set by such an outlier leaves the small
  channels only a few steps. Per-channel scales isolate the outliers (KIVI quantises keys this
  way, values per token), but they need all the positions of a group before quantising.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import validation as validate
from .multihead import ContiguousCache

#: Granularities: the dim the scale is taken over (its max), for ``(B, Hkv, S, D)``.
GRANULARITIES = {"token": -1, "channel": -2}
#: The largest magnitude of each storage dtype's grid.
Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class QuantizedKV(NamedTuple):
    """Quantised keys or values: the 8-bit ``data`` and the float32 ``scale`` per group.

    Shapes:
        data ``(..., S, D)`` int8 or float8_e4m3fn; scale ``(..., S, 1)`` (per token) or
        ``(..., 1, D)`` (per channel) float32.
    """

    data: Tensor
    scale: Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The numbers read back, ``data · scale``, as ``dtype``: ``(..., S, D)``."""
        return (self.data.to(torch.float32) * self.scale).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the data and of the scales."""
        return sum(t.numel() * t.element_size() for t in self)


def quantize_kv(
    x: Tensor, *, granularity: str = "token", dtype: torch.dtype = torch.int8
) -> QuantizedKV:
    """Absmax-quantise keys or values to 8 bits, one scale per token or per channel.

    Args:
        x: keys or values, floating.
        granularity: ``"token"`` (one scale per position, over ``D``) or ``"channel"`` (one scale
            per channel, over ``S``).
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Shapes:
        x ``(..., S, D)`` -> data ``(..., S, D)``, scale ``(..., S, 1)`` or ``(..., 1, D)``.
    """
    validate.tensor("x", x, floating=True)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., S, D), got shape {validate.shape(x)}")
    validate.one_of("granularity", granularity, tuple(GRANULARITIES))
    if dtype not in Q_MAX:
        raise TypeError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    q_max = Q_MAX[dtype]
    amax = x.detach().abs().to(torch.float32).amax(GRANULARITIES[granularity], keepdim=True)
    scale = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))  # all-zero group: 1
    scaled = x.to(torch.float32) / scale  # (..., S, D), within [-q_max, q_max]
    if dtype == torch.int8:
        data = scaled.round().clamp(-q_max, q_max).to(torch.int8)  # round to the nearest step
    else:
        data = scaled.clamp(-q_max, q_max).to(dtype)  # the cast rounds to the nearest fp8 number
    return QuantizedKV(data, scale)


class QuantizedKVCache(ContiguousCache):
    """A KV cache that stores keys and values in 8 bits, quantised per token as they arrive.

    Pass it as ``kv_cache=`` to :class:`mha.MultiHeadAttention` like :class:`mha.KVCache`.
    ``update`` quantises only the new tokens (per-token scales never change once written) and
    returns the whole cache read back in the new tokens' dtype: what attention then sees
    (``attend``, from :class:`mha.multihead.ContiguousCache`, attends over it).

    Args:
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Shapes:
        key ``(B, Hkv, S, D)``, value ``(B, Hkv, S, Dv)``; stored data of the same shapes in
        8 bits, scales ``(B, Hkv, S, 1)`` float32.
    """

    def __init__(self, dtype: torch.dtype = torch.int8) -> None:
        if dtype not in Q_MAX:
            raise TypeError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
        self.dtype = dtype
        self.float_dtype = torch.float32  # the dtype of the keys given (set by the first update)
        self.key: QuantizedKV | None = None
        self.value: QuantizedKV | None = None

    def __len__(self) -> int:
        return 0 if self.key is None else self.key.data.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes held: 8-bit keys and values plus their float32 scales."""
        return sum(part.nbytes for part in (self.key, self.value) if part is not None)

    def reset(self) -> None:
        self.key = self.value = None

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Quantise and append this step's keys and values; return all of them read back.

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``; returns
            ``(B, Hkv, S, D)`` and ``(B, Hkv, S, Dv)`` in ``key``'s dtype.
        """
        validate.kv_step(key, value)
        new_k = quantize_kv(key, dtype=self.dtype)  # data (B, Hkv, S_new, D), scale (..., 1)
        new_v = quantize_kv(value, dtype=self.dtype)
        if self.key is None or self.value is None:
            self.key, self.value, self.float_dtype = new_k, new_v, key.dtype
        else:
            # Zero-length stand-ins with the cache's shapes and float dtype, for the shared check.
            stored_k = self.key.data[..., :0, :].to(self.float_dtype)  # (B, Hkv, 0, D)
            stored_v = self.value.data[..., :0, :].to(self.float_dtype)  # (B, Hkv, 0, Dv)
            validate.kv_fits(key, value, stored_k, stored_v, "(B, Hkv)")
            self.key = QuantizedKV(*(torch.cat(p, dim=-2) for p in zip(self.key, new_k)))
            self.value = QuantizedKV(*(torch.cat(p, dim=-2) for p in zip(self.value, new_v)))
        return self.key.dequantize(key.dtype), self.value.dequantize(value.dtype)
