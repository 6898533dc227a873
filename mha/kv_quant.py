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
* **per tensor** (``granularity="tensor"``): one scale for the whole tensor, shape
  ``(1, 1, 1, 1)``: what vLLM's ``--kv-cache-dtype fp8`` keeps, a ``k_scale`` and a ``v_scale``
  per layer. Such a scale is *static*: given (``scale=``, read from a checkpoint) or calibrated
  once on the first batch, then fixed; numbers that later land beyond the grid *saturate*
  (they are clamped to ``±q_max``; :func:`count_saturated` counts them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import validation as validate
from .multihead import ContiguousCache

#: Granularities: the dim the scale is taken over (its max), for ``(B, Hkv, S, D)``; None: all.
GRANULARITIES: dict[str, int | None] = {"token": -1, "channel": -2, "tensor": None}
#: The largest magnitude of each storage dtype's grid.
Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class QuantizedKV(NamedTuple):
    """Quantised keys or values: the 8-bit ``data`` and the float32 ``scale`` per group.

    Shapes:
        data ``(..., S, D)`` int8 or float8_e4m3fn; scale ``(..., S, 1)`` (per token),
        ``(..., 1, D)`` (per channel) or ``(1, ..., 1)`` (per tensor) float32.
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


def _static_scale(name: str, value: object) -> float:
    """A given (static) scale: a positive finite number, or a one-element tensor holding one."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be one number (a per-tensor scale), got a tensor of shape "
                f"{validate.shape(value)}"
            )
        value = value.item()
    return validate.positive_float(name, value)


def _dtype(dtype: object) -> float:
    """The largest magnitude of the storage ``dtype``'s grid."""
    if dtype not in Q_MAX:
        raise TypeError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    return Q_MAX[dtype]  # type: ignore[index]


def _to_grid(scaled: Tensor, dtype: torch.dtype) -> Tensor:
    """``x / scale`` stored in ``dtype``: clamped to ``±q_max`` (numbers beyond saturate; a
    float8_e4m3fn cast of a number beyond 448 is NaN in older PyTorch), then rounded to the grid."""
    q_max = Q_MAX[dtype]
    clamped = scaled.clamp(-q_max, q_max)
    if dtype == torch.int8:
        return clamped.round().to(torch.int8)  # round to the nearest step
    return clamped.to(dtype)  # the cast rounds to the nearest fp8 number


def quantize_kv(
    x: Tensor,
    *,
    granularity: str | None = None,
    dtype: torch.dtype = torch.int8,
    scale: float | Tensor | None = None,
) -> QuantizedKV:
    """Absmax-quantise keys or values to 8 bits, one scale per token, per channel or per tensor.

    Args:
        x: keys or values, floating.
        granularity: ``"token"`` (one scale per position, over ``D``), ``"channel"`` (one scale
            per channel, over ``S``) or ``"tensor"`` (one scale over all of ``x``); default
            ``"token"``, or ``"tensor"`` when ``scale`` is given.
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        scale: a static per-tensor scale (a positive number): ``x / scale`` is stored, and
            numbers beyond the grid saturate at ``±q_max`` instead of setting the scale.

    Shapes:
        x ``(..., S, D)`` -> data ``(..., S, D)``, scale ``(..., S, 1)``, ``(..., 1, D)`` or
        ``(1, ..., 1)``.
    """
    validate.tensor("x", x, floating=True)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., S, D), got shape {validate.shape(x)}")
    if granularity is None:
        granularity = "token" if scale is None else "tensor"
    validate.one_of("granularity", granularity, tuple(GRANULARITIES))
    q_max = _dtype(dtype)
    ones = (1,) * x.dim()
    if scale is not None:
        if granularity != "tensor":
            raise ValueError(
                "scale is a static per-tensor scale: granularity must be 'tensor', "
                f"got {granularity!r}"
            )
        s = _static_scale("scale", scale)
        scale_t = torch.full(ones, s, dtype=torch.float32, device=x.device)  # (1, ..., 1)
    else:
        dim = GRANULARITIES[granularity]
        magnitude = x.detach().abs().to(torch.float32)
        amax = magnitude.amax().reshape(ones) if dim is None else magnitude.amax(dim, keepdim=True)
        scale_t = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))  # all-zero group: 1
    return QuantizedKV(_to_grid(x.to(torch.float32) / scale_t, dtype), scale_t)


def count_saturated(
    x: Tensor, scale: float | Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn
) -> int:
    """How many numbers of ``x`` lie beyond the grid of a static ``scale``: ``|x| / scale >
    q_max``, the ones :func:`quantize_kv` with that ``scale`` clamps to ``±q_max``."""
    validate.tensor("x", x, floating=True)
    q_max, s = _dtype(dtype), _static_scale("scale", scale)
    return int((x.detach().abs().to(torch.float32) / s > q_max).sum())


class QuantizedKVCache(ContiguousCache):
    """A KV cache that stores keys and values in 8 bits, quantised as they arrive.

    Pass it as ``kv_cache=`` to :class:`mha.MultiHeadAttention` like :class:`mha.KVCache`.
    ``update`` quantises only the new tokens and returns the whole cache read back in the new
    tokens' dtype: what attention then sees (``attend``, from
    :class:`mha.multihead.ContiguousCache`, attends over it).

    With ``granularity="token"`` each token gets its own scale, final when it arrives. With
    ``"tensor"`` (vLLM's ``--kv-cache-dtype fp8``) the keys share one static ``k_scale`` and the
    values one ``v_scale``: given, or calibrated on the first update (``amax / q_max`` of its
    keys, and of its values) and then fixed, so that later numbers beyond the grid saturate;
    ``saturated`` counts them. vLLM calibrates with ``amax / 200`` for keys and ``amax / 100``
    for values, leaving room for larger later tokens; pass such scales to do the same.

    Args:
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        granularity: ``"token"`` or ``"tensor"``.
        k_scale, v_scale: static per-tensor scales (``"tensor"`` only); None: calibrated.

    Shapes:
        key ``(B, Hkv, S, D)``, value ``(B, Hkv, S, Dv)``; stored data of the same shapes in
        8 bits, scales ``(B, Hkv, S, 1)`` float32 per token, or ``(1, 1, 1, 1)`` per tensor.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.int8,
        *,
        granularity: str = "token",
        k_scale: float | Tensor | None = None,
        v_scale: float | Tensor | None = None,
    ) -> None:
        _dtype(dtype)
        if granularity == "channel":
            raise ValueError(
                "granularity must be 'token' or 'tensor' for a cache, got 'channel': a "
                "per-channel scale needs every position before the first is stored"
            )
        validate.one_of("granularity", granularity, ("token", "tensor"))
        for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
            if given is not None and granularity != "tensor":
                raise ValueError(
                    f"{name} is a static per-tensor scale: granularity must be 'tensor', "
                    f"got {granularity!r}"
                )
        self.dtype, self.granularity = dtype, granularity
        self.k_scale = None if k_scale is None else _static_scale("k_scale", k_scale)
        self.v_scale = None if v_scale is None else _static_scale("v_scale", v_scale)
        self.saturated = {"key": 0, "value": 0}  # numbers clamped to the grid's end so far
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
        """Empty the cache; static scales stay (they belong to the layer, not to a sequence)."""
        self.key = self.value = None
        self.saturated = {"key": 0, "value": 0}

    def _quantize(self, x: Tensor, name: str) -> QuantizedKV:
        """``x`` quantised per token, or with the static scale ``name`` (calibrated if None)."""
        if self.granularity == "token":
            return quantize_kv(x, dtype=self.dtype)
        scale = getattr(self, name)
        if scale is None:  # calibration: the first update sets the scale for good
            scale = quantize_kv(x, granularity="tensor", dtype=self.dtype).scale.item()
            setattr(self, name, scale)
        self.saturated["key" if name == "k_scale" else "value"] += count_saturated(
            x, scale, dtype=self.dtype
        )
        return quantize_kv(x, dtype=self.dtype, scale=scale)

    def _append(self, stored: QuantizedKV, new: QuantizedKV) -> QuantizedKV:
        """The tokens appended: data concatenated, and the scales too unless one per tensor."""
        data = torch.cat((stored.data, new.data), dim=-2)
        if self.granularity == "tensor":
            return QuantizedKV(data, stored.scale)  # the same static scale
        return QuantizedKV(data, torch.cat((stored.scale, new.scale), dim=-2))

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Quantise and append this step's keys and values; return all of them read back.

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``; returns
            ``(B, Hkv, S, D)`` and ``(B, Hkv, S, Dv)`` in ``key``'s dtype.
        """
        validate.kv_step(key, value)
        if self.key is None or self.value is None:
            self.float_dtype = key.dtype
            self.key, self.value = self._quantize(key, "k_scale"), self._quantize(value, "v_scale")
        else:
            # Zero-length stand-ins with the cache's shapes and float dtype, for the shared check.
            stored_k = self.key.data[..., :0, :].to(self.float_dtype)  # (B, Hkv, 0, D)
            stored_v = self.value.data[..., :0, :].to(self.float_dtype)  # (B, Hkv, 0, Dv)
            validate.kv_fits(key, value, stored_k, stored_v, "(B, Hkv)")
            self.key = self._append(self.key, self._quantize(key, "k_scale"))
            self.value = self._append(self.value, self._quantize(value, "v_scale"))
        return self.key.dequantize(key.dtype), self.value.dequantize(value.dtype)
