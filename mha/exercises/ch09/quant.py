"""Section 9.3, a quantised cache: the exercises as data for :mod:`.._harness`.

References: absmax int8 quantisation per token (scale over the channels) and per channel (scale
over the positions), written with torch's ``amax`` and ``round``, and the bytes of a quantised
cache counted by their definition; mistakes: no division by 127, truncation instead of rounding,
the scale over the wrong dim, 128 steps (which wrap around in int8), the scales or the values
forgotten in the byte count, and the library's own function, which the exercises ban. Then a static
per-tensor fp8 quantiser (vLLM's fp8 cache) that saturates, checked with a cast that gives NaN
beyond the grid as older PyTorch releases do, so that relying on the cast to clamp fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

import mha
from mha import kv_quant

from .._harness import Case, Exercise, defined_in, publish, tr, whole

# --- quantise per token / per channel ------------------------------------------------------------


def _absmax(x: Tensor, dim: int, q_max: float = 127.0) -> tuple[Tensor, Tensor]:
    scale = x.abs().amax(dim, keepdim=True) / q_max  # one scale per group
    return (x / scale).round().to(torch.int8), scale


def _quant_cases(what: str) -> list[Case]:
    g = torch.Generator().manual_seed(93)
    x = torch.randn(2, 3, 6, 8, generator=g)  # (B, Hkv, S, D), S != D
    y = torch.randn(1, 2, 5, 4, generator=g)
    y[..., 0] *= 30  # an outlier channel
    return [
        Case(f"{what}(x) for x (2, 3, 6, 8)", (x,)),
        Case(f"{what}(x) for x (1, 2, 5, 4) with an outlier channel", (y,)),
    ]


def _wrapped(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The bug: 128 steps; +128 does not fit in int8 and wraps around to -128."""
    scale = x.abs().amax(dim, keepdim=True) / 128
    return (x / scale).round().to(torch.int16).to(torch.int8), scale


def _truncated(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    scale = x.abs().amax(dim, keepdim=True) / 127
    return (x / scale).to(torch.int8), scale  # .to(int8) truncates towards 0


def _by_norm(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    scale = torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, keepdim=True) / 127
    return torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8), scale


_HINT_TOKEN = (
    "Per token: scale = x.abs().amax(dim=-1, keepdim=True) / 127, shape (..., S, 1); "
    "data = (x / scale).round().to(torch.int8)."
)
_NO_QUANTIZE = "write it yourself, without mha.quantize_kv (or any function of mha.kv_quant)."
#: Every function of mha.kv_quant (QuantizedKV's generated helpers too) and torch's quantizers.
QUANT_BANNED: tuple[Callable[..., Any], ...] = (
    *defined_in(kv_quant),
    torch.quantize_per_tensor,
    torch.quantize_per_channel,
)


def _by_private_make(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The pair built through QuantizedKV's private _make: mha.kv_quant reached around its ban."""
    return tuple(kv_quant.QuantizedKV._make(_absmax(x, dim)))  # type: ignore[return-value]


def _quantize_exercise(
    fn: str,
    success: str,
    dim: int,
    *,
    variants: Sequence[Callable[..., Any]],
    mistakes: Sequence[tuple[Callable[..., Any], str]],
    hint: str,
    doc: str,
) -> Exercise:
    """The exercise on ``fn(x) -> (data, scale)``: absmax int8 quantisation with one scale per
    group along ``dim``; data and scale compared in the reference's dtypes, the library's
    :func:`mha.quantize_kv` banned."""
    return Exercise(
        f"check_{fn}",
        success,
        lambda x: _absmax(x, dim),
        lambda: _quant_cases(fn),
        variants=variants,
        mistakes=mistakes,
        hint=hint,
        crash_hint=hint,
        outputs=("data", "scale"),
        exact_dtype=True,
        atol=1e-6,
        rtol=1e-5,
        forbidden=QUANT_BANNED,
        forbidden_hint=_NO_QUANTIZE,
        rewrites=(mha.quantize_kv,),
        params=(fn,),
        doc=doc,
    )


PER_TOKEN = _quantize_exercise(
    "quantize_per_token",
    "int8 data and one float scale per token, every number within half a step",
    -1,
    variants=(
        lambda x: (
            torch.round(x * 127 / x.abs().max(-1, keepdim=True).values).to(torch.int8),
            x.abs().max(-1, keepdim=True).values / 127,
        ),
        lambda x: _by_norm(x, -1),
    ),
    mistakes=(
        (
            lambda x: (
                (x / x.abs().amax(-1, keepdim=True)).round().to(torch.int8),
                x.abs().amax(-1, keepdim=True),
            ),
            "Dividing by max|x| maps the token onto [-1, 1]: three values. Spread it over the "
            "whole grid, -127 … 127: scale = max|x| / 127. " + _HINT_TOKEN,
        ),
        (
            lambda x: _truncated(x, -1),
            ".to(torch.int8) truncates towards 0, an error of up to a whole step: round first "
            "(half a step at most). " + _HINT_TOKEN,
        ),
        (
            lambda x: _absmax(x, -2),
            "That is one scale per channel (over the positions, dim -2); per token means one "
            "scale per position, over its D channels (dim -1). " + _HINT_TOKEN,
        ),
        (
            lambda x: _wrapped(x, -1),
            "int8 stops at 127: with 128 steps the largest number becomes +128, which wraps "
            "around to -128. Divide by 127. " + _HINT_TOKEN,
        ),
        (lambda x: tuple(mha.quantize_kv(x)), _NO_QUANTIZE),
        (lambda x: _by_private_make(x, -1), _NO_QUANTIZE),
    ),
    hint=_HINT_TOKEN,
    doc="Check ``quantize_per_token(x) -> (data, scale)``: absmax int8 quantisation of keys or "
    "values ``(..., S, D)``, data int8 ``(..., S, D)`` and scale ``(..., S, 1)``.",
)


_HINT_CHANNEL = (
    "Per channel: scale = x.abs().amax(dim=-2, keepdim=True) / 127, shape (..., 1, D); "
    "data = (x / scale).round().to(torch.int8). The grid of int8 ends at 127."
)

PER_CHANNEL = _quantize_exercise(
    "quantize_per_channel",
    "int8 data and one float scale per channel, no number wrapped around",
    -2,
    variants=(
        lambda x: _by_norm(x, -2),
        lambda x: tuple(
            t.transpose(-2, -1) for t in _absmax(x.transpose(-2, -1), -1)
        ),  # per token of the transpose
    ),
    mistakes=(
        (
            lambda x: _wrapped(x, -2),
            "The bug is still there: with scale = max|x| / 128 the largest number of each "
            "channel becomes 128, which int8 cannot hold; it wraps around to -128, the opposite "
            "sign. " + _HINT_CHANNEL,
        ),
        (
            lambda x: _absmax(x, -1),
            "That is one scale per token (dim -1); per channel means one scale per channel, "
            "over the S positions (dim -2). " + _HINT_CHANNEL,
        ),
        (
            lambda x: _truncated(x, -2),
            ".to(torch.int8) truncates towards 0: round first. " + _HINT_CHANNEL,
        ),
        (lambda x: tuple(mha.quantize_kv(x, granularity="channel")), _NO_QUANTIZE),
        (lambda x: _by_private_make(x, -2), _NO_QUANTIZE),
    ),
    hint=_HINT_CHANNEL,
    doc="Check ``quantize_per_channel(x) -> (data, scale)``: absmax int8 quantisation with one "
    "scale per channel, data int8 ``(..., S, D)`` and scale ``(..., 1, D)``.",
)


# --- bytes of a quantised cache ------------------------------------------------------------------


def _bytes_reference(B: int, Hkv: int, S: int, D: int, granularity: str) -> int:
    data = B * Hkv * S * D  # one byte per number
    scales = B * Hkv * (S if granularity == "token" else D)  # float32, 4 bytes each
    return 2 * (data + 4 * scales)  # keys and values


def _bytes_cases() -> list[Case]:
    return [
        Case(f"cache_bytes({B}, {Hkv}, {S}, {D}, {gran!r})", (B, Hkv, S, D, gran))
        for B, Hkv, S, D, gran in (
            (1, 8, 4096, 128, "token"),
            (1, 8, 4096, 128, "channel"),
            (4, 2, 100, 64, "token"),
            (3, 4, 50, 96, "channel"),
        )
    ]


def _bytes_by_cache(B: int, Hkv: int, S: int, D: int, granularity: str) -> int:
    x = torch.zeros(B, Hkv, S, D)
    return 2 * mha.quantize_kv(x, granularity=granularity).nbytes


_HINT_BYTES = (
    "Keys and values: 2 × (B·Hkv·S·D bytes of int8 + 4 bytes per float32 scale), with B·Hkv·S "
    "scales per token or B·Hkv·D per channel."
)

CACHE_BYTES = Exercise(
    "check_quantized_cache_bytes",
    "int8 data and float32 scales of keys and values, both granularities",
    _bytes_reference,
    _bytes_cases,
    variants=(
        lambda B, Hkv, S, D, g: 2 * B * Hkv * (S * D + 4 * {"token": S, "channel": D}[g]),
        lambda B, Hkv, S, D, g: sum(
            n * size
            for n, size in ((2 * B * Hkv * S * D, 1), (2 * B * Hkv * (S if g == "token" else D), 4))
        ),
    ),
    mistakes=(
        (_bytes_by_cache, _NO_QUANTIZE),
        (lambda B, Hkv, S, D, g: _by_private_make(torch.zeros(B, Hkv, S, D), -1), _NO_QUANTIZE),
        (
            lambda B, Hkv, S, D, g: 2 * B * Hkv * S * D,
            "The scales take memory too: a float32 (4 bytes) per token or per channel. "
            + _HINT_BYTES,
        ),
        (
            lambda B, Hkv, S, D, g: _bytes_reference(B, Hkv, S, D, g) // 2,
            "A cache holds keys and values: count both. " + _HINT_BYTES,
        ),
        (
            lambda B, Hkv, S, D, g: 2 * B * Hkv * (S * D + (S if g == "token" else D)),
            "A scale is a float32: 4 bytes, not 1. " + _HINT_BYTES,
        ),
        (
            lambda B, Hkv, S, D, g: 2 * B * Hkv * (S * D + 4 * (D if g == "token" else S)),
            "Per token there is one scale per position (S of them per head), per channel one "
            "per channel (D). " + _HINT_BYTES,
        ),
    ),
    hint=_HINT_BYTES,
    crash_hint=_HINT_BYTES,
    forbidden=QUANT_BANNED,
    forbidden_hint=_NO_QUANTIZE,
    rewrites=(mha.quantize_kv,),  # its QuantizedKV counts its own nbytes
    params=("cache_bytes",),
    doc="Check ``cache_bytes(B, Hkv, S, D, granularity) -> int``: the bytes an int8 KV cache "
    "of ``S`` positions holds with float32 scales per ``'token'`` or per ``'channel'``.",
)


# --- a static per-tensor fp8 scale that saturates -------------------------------------------------

FP8 = torch.float8_e4m3fn


def _static(x: Tensor, scale: float) -> tuple[Tensor, int]:
    """The reference: x / scale clamped to ±448 and cast; the count of |x / scale| > 448. Its data
    is read back to float32, as the checker reads the answer's."""
    scaled = x / scale
    return scaled.clamp(-448, 448).to(FP8).float(), int((scaled.abs() > 448).sum())


class _NonSaturatingCast(TorchFunctionMode):
    """Casts to float8_e4m3fn without saturating, as older PyTorch releases do: a number beyond
    ±448 becomes NaN (recent releases clamp it to ±448, which hides a missing clamp)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor) and out.dtype == FP8:
            sources = [
                a
                for a in args
                if isinstance(a, Tensor)
                and a.dtype != FP8
                and a.is_floating_point()
                and a.shape == out.shape
            ]
            if sources:  # a cast (x.to(...), x.type(...)) or a copy_ into fp8: the last is read
                beyond = sources[-1].detach().abs() > 448
                out.view(torch.uint8).masked_fill_(beyond, 0x7F)  # e4m3fn's NaN
        return out


def _static_call(answer: Callable[..., Any], case: Case) -> object:
    """The answer's ``(data, saturated)``, run under the non-saturating cast; ``data`` must be
    float8_e4m3fn and is read back to float32, ``saturated`` an int."""
    with _NonSaturatingCast():
        out = answer(*[a.clone() if isinstance(a, Tensor) else a for a in case.args])
    if not (isinstance(out, tuple) and len(out) == 2):
        return out  # the harness says what it should be
    data, saturated = out
    if not isinstance(data, Tensor) or data.dtype != FP8:
        got = data.dtype if isinstance(data, Tensor) else type(data).__name__
        raise TypeError(tr("data should be a torch.float8_e4m3fn tensor, got {got}", got=got))
    return data.float(), whole(saturated)


def _static_cases() -> list[Case]:
    g = torch.Generator().manual_seed(930)
    x = torch.randn(2, 3, 6, 8, generator=g)  # (B, Hkv, S, D)
    y = torch.randn(1, 2, 5, 4, generator=g)
    y[..., 0] *= 30  # an outlier channel, beyond a scale set by the others
    z = torch.randn(1, 1, 4, 8, generator=g)
    return [
        Case(
            "quantize_static(x, scale) for x (2, 3, 6, 8), scale = max|x| / 900",
            (x, float(x.abs().max() / 900)),
        ),
        Case("quantize_static(x, 0.01) for x (1, 2, 5, 4) with an outlier channel", (y, 0.01)),
        Case("quantize_static(x, 0.05) for x (1, 1, 4, 8), nothing beyond the grid", (z, 0.05)),
    ]


_HINT_STATIC = (
    "y = x / scale; data = y.clamp(-448, 448).to(torch.float8_e4m3fn); saturated = the number "
    "of |y| > 448, counted before the clamp."
)


def _static_no_clamp(x: Tensor, scale: float) -> tuple[Tensor, int]:
    y = x / scale
    return y.to(FP8), int((y.abs() > 448).sum())


def _static_per_token(x: Tensor, scale: float) -> tuple[Tensor, int]:
    own = x.abs().amax(-1, keepdim=True) / 448  # a scale of its own per token: never saturates
    return (x / own).to(FP8), 0


def _static_counted_after(x: Tensor, scale: float) -> tuple[Tensor, int]:
    data = (x / scale).clamp(-448, 448).to(FP8)
    return data, int((data.float().abs() > 448).sum())


QUANTIZE_STATIC = Exercise(
    "check_quantize_static",
    "float8 data clamped to ±448 before the cast (checked with a cast that gives NaN beyond the "
    "grid) and the count of saturated numbers",
    _static,
    _static_cases,
    variants=(
        lambda x, scale: (
            torch.where((x / scale).abs() > 448, (x / scale).sign() * 448, x / scale).to(FP8),
            torch.count_nonzero((x / scale).abs() > 448),
        ),
        lambda x, scale: (
            torch.clamp(x / scale, min=-448.0, max=448.0).to(torch.float8_e4m3fn),
            int(((x / scale) > 448).sum()) + int(((x / scale) < -448).sum()),
        ),
    ),
    mistakes=(
        (
            _static_no_clamp,
            "Without a clamp, the cast decides what happens beyond ±448: older PyTorch releases "
            "(and this checker) give NaN there. Clamp x / scale to [-448, 448] first. "
            + _HINT_STATIC,
        ),
        (
            _static_counted_after,
            "Count before clamping: after the clamp no number is beyond 448. " + _HINT_STATIC,
        ),
        (
            lambda x, scale: (
                (x * scale).clamp(-448, 448).to(FP8),
                int(((x * scale).abs() > 448).sum()),
            ),
            "A scale is what one unit of the grid is worth: store x / scale (read back as "
            "data · scale), not x · scale. " + _HINT_STATIC,
        ),
        (
            _static_per_token,
            "The scale is given: one static scale for the whole tensor. A scale of your own per "
            "token fits every token and never saturates; a static scale does, when later numbers "
            "are larger. " + _HINT_STATIC,
        ),
        (
            lambda x, scale: (
                tuple(mha.quantize_kv(x, dtype=FP8, scale=scale))[:1]
                + (mha.kv_quant.count_saturated(x, scale),)
            ),
            _NO_QUANTIZE,
        ),
        (lambda x, scale: (kv_quant._to_grid(x / scale, FP8), 0), _NO_QUANTIZE),
    ),
    hint=_HINT_STATIC,
    crash_hint=_HINT_STATIC,
    outputs=("data", "saturated"),
    call=_static_call,
    atol=0.0,
    rtol=0.0,
    forbidden=QUANT_BANNED,
    forbidden_hint=_NO_QUANTIZE,
    rewrites=(mha.quantize_kv, kv_quant.count_saturated),
    params=("quantize_static",),
    doc="Check ``quantize_static(x, scale) -> (data, saturated)``: ``x / scale`` stored as "
    "float8_e4m3fn, numbers beyond ±448 clamped (saturated), and how many were.",
)


EXERCISES = publish(globals())
