"""Chapter 5, attention on a GPU: the exercises as data for :mod:`._harness`; the backend
prediction is checked against the kernel torch really picks (:mod:`mha.hardware`)."""

from __future__ import annotations

import copy
import math
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

import mha

from .. import decoding, flash, kv_quant, multihead, paged
from ..lab.hardware import sdpa_backends
from ._harness import (
    Case,
    Exercise,
    ExerciseError,
    as_mapping,
    defined_in,
    never_larger,
    publish,
    tr,
)

_ACC = "acc_new = exp(m - m_new) * acc + exp(scores - m_new) @ value"
_HINT_ACC_RESCALE = f"Rescale the old acc to the new maximum: {_ACC}."
_HINT_L_RESCALE = "Rescale the old l: l_new = exp(m - m_new) * l + exp(scores - m_new).sum(-1)."
_HINT_M = "m is the running maximum: m_new = torch.maximum(m, scores.amax(-1, keepdim=True))."


def _update(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor, **slip: bool):
    """One online-softmax update: right without ``slip``, or with one of the usual slips."""
    tile_max = scores.amax(-1, keepdim=True)  # (..., R, 1)
    m_new = torch.maximum(m, tile_max)
    # A row that has seen only hidden keys keeps m = -inf: shift by 0 there, or exp gives NaN.
    shift = m_new if slip.get("no_guard") else torch.where(torch.isneginf(m_new), 0.0, m_new)
    p = torch.exp(scores - shift)  # (..., R, C) this tile's unnormalised weights
    alpha = torch.exp(m - shift)  # (..., R, 1) how much the old state shrinks
    l_new = (1.0 if slip.get("keep_l") else alpha) * l + p.sum(-1, keepdim=True)  # (..., R, 1)
    acc_new = (1.0 if slip.get("keep_acc") else alpha) * acc + p @ value  # (..., R, Dv)
    if slip.get("normalised"):  # FlashAttention-1's normalised output, kept in the slot of acc
        acc_new = acc_new / l_new.clamp_min(1e-30)
    return (tile_max if slip.get("tile_max") else m_new), l_new, acc_new


def _state(scores: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The exact ``(m, l, acc)`` after all the keys of ``scores``/``value``, by definition."""
    m = scores.amax(-1, keepdim=True)  # (..., R, 1)
    p = torch.exp(scores - torch.where(torch.isneginf(m), torch.zeros_like(m), m))  # (..., R, S)
    return m, p.sum(-1, keepdim=True), p @ value


def _online_cases() -> list[Case]:
    g = torch.Generator().manual_seed(5)
    batch, R, C, Dv, n_tiles = 2, 6, 4, 3, 3
    # Later tiles hold larger scores, so the running maximum grows and rescaling matters.
    tiles = [torch.randn(batch, R, C, generator=g) * 2 + 2.5 * t for t in range(n_tiles)]
    values = [torch.randn(batch, C, Dv, generator=g) for _ in range(n_tiles)]
    # Second run: row 0 sees only hidden keys in the first tile, row 1 half of them hidden.
    masked = [t.clone() for t in tiles]
    masked[0][:, 0, :] = float("-inf")
    masked[0][:, 1, : C // 2] = float("-inf")
    cases = []
    for run, run_tiles in (("", tiles), (" (first tile hides every key of row 0)", masked)):
        state = (
            torch.full((batch, R, 1), float("-inf")),
            torch.zeros(batch, R, 1),
            torch.zeros(batch, R, Dv),
        )
        for i in range(n_tiles):
            seen = _state(torch.cat(run_tiles[: i + 1], -1), torch.cat(values[: i + 1], -2))
            args = (*state, run_tiles[i], values[i])
            cases.append(Case(f"update(...) on tile {i}{run}", args, expected=seen))
            state = seen
    return cases


_ONCE = "acc is the *unnormalised* sum; divide by l once, after the last tile."
_GUARD = "exp(-inf - (-inf)) is NaN: where m_new is -inf subtract 0 (torch.where(torch.isneginf(m_new), 0, m_new))."
_NO_LIBRARY = (
    "write the update yourself, without mha.online_softmax_update or any other function of "
    "mha.flash."
)


def _update_out_of_place(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor):
    m_new = torch.maximum(m, scores.max(-1, keepdim=True).values)
    safe = m_new.nan_to_num(neginf=0.0)  # 0 where no key was visible yet
    p, alpha = (scores - safe).exp(), (m - safe).exp()
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ value


def _update_by_private_helper(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor):
    """The tile folded into a fresh state from mha.flash's private _empty_state by the library's
    update, then merged into the old one: the library reached around its public name."""
    fresh = flash._empty_state(scores, value.shape[-1])  # (..., R, 1), (..., R, 1), (..., R, Dv)
    m_t, l_t, acc_t = flash.online_softmax_update(*fresh, scores, value)
    m_new = torch.maximum(m, m_t)
    safe = m_new.nan_to_num(neginf=0.0)
    a, b = (m - safe).exp(), (m_t - safe).exp()
    return m_new, a * l + b * l_t, a * acc + b * acc_t


def _update_by_where(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor):
    m_new = torch.max(m, scores.amax(-1, keepdim=True))
    unseen = torch.isneginf(m_new)  # no visible key yet: the state stays empty
    alpha = torch.where(unseen, 1.0, torch.exp(m - m_new))
    p = torch.where(unseen, 0.0, torch.exp(scores - m_new))
    return (
        m_new,
        l * alpha + p.sum(-1, keepdim=True),
        acc * alpha + torch.einsum("...rc,...cd->...rd", p, value),
    )


ONLINE_SOFTMAX_UPDATE = Exercise(
    "check_online_softmax_update",
    "3 tiles, the state matches softmax(scores) @ value after every tile, hidden rows included",
    _update,
    _online_cases,
    variants=(_update_out_of_place, _update_by_where),
    mistakes=(
        (partial(_update, keep_acc=True), _HINT_ACC_RESCALE),
        (partial(_update, keep_l=True), _HINT_L_RESCALE),
        (partial(_update, normalised=True), _ONCE),
        (partial(_update, no_guard=True), _GUARD),
        (partial(_update, tile_max=True), _HINT_M),
        (mha.online_softmax_update, _NO_LIBRARY),
        (lambda *args: flash.online_softmax_update(*args), _NO_LIBRARY),
        (_update_by_private_helper, _NO_LIBRARY),
    ),
    hint={"m": _HINT_M, "l": _HINT_L_RESCALE, "acc": _HINT_ACC_RESCALE},
    outputs=("m", "l", "acc"),
    forbidden=tuple(defined_in(flash)),
    rewrites=(flash.online_softmax_update,),
    forbidden_hint=_NO_LIBRARY,
    params=("update",),
    doc="Check ``update(m, l, acc, scores, value) -> (m, l, acc)``, one tile of online softmax "
    "(shapes as in :func:`mha.online_softmax_update`): after every tile, the exact state of all "
    "the scores seen so far.",
)

_BOTTOM_RIGHT = "the bottom-right mask torch.ones(T, S, dtype=torch.bool).tril(S - T)"
_HINT_TOP_LEFT = (
    f"is_causal is top-left; the T new queries are the last T of S: use {_BOTTOM_RIGHT}."
)


def _step(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, **slip: Any):
    """One decoding step: right without ``slip``, or with one of the usual slips."""
    k = torch.cat([k_cache, k_new], dim=-2)  # (B, H, S, D)
    v = torch.cat([v_cache, v_new], dim=-2)  # (B, H, S, D)
    if slip.get("order") == "new first":
        k, v = torch.cat([k_new, k_cache], dim=-2), torch.cat([v_new, v_cache], dim=-2)
    k_seen, v_seen = (k_new, v_new) if slip.get("keys") == "new" else (k, v)
    T, S = q.shape[-2], k_seen.shape[-2]
    ones = torch.ones(T, S, dtype=torch.bool)  # (T, S)
    masks = {"bottom-right": ones.tril(S - T), "top-left": ones.tril(), "none": None}
    out = F.scaled_dot_product_attention(q, k_seen, v_seen, masks[slip.get("mask", "bottom-right")])
    return (out, k_cache, v_cache) if slip.get("append") is False else (out, k, v)


def _kv_cases() -> list[Case]:
    """A prompt of 4 tokens, 3 single tokens and a chunk of 2, against one causal pass."""
    g = torch.Generator().manual_seed(7)
    B, H, D = 2, 2, 8
    q, k, v = (torch.randn(B, H, 9, D, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, D)
    cases, start = [], 0
    for stop in (4, 5, 6, 7, 9):
        new, old = slice(start, stop), slice(0, start)
        args = (q[:, :, new], k[:, :, new], v[:, :, new], k[:, :, old], v[:, :, old])
        expected = (full[:, :, new], k[:, :, :stop], v[:, :, :stop])
        label = f"step(...) for tokens {start}..{stop - 1} with {start} cached"
        cases.append(Case(label, args, expected=expected))
        start = stop
    return cases


_GROWN = "Return the grown cache, torch.cat([k_cache, k_new], dim=-2) (the same for v)."
_WHOLE = "Attend over the whole cache (old and new tokens), after appending."
_CHUNK = f"A chunk's queries must not see later new tokens: {_BOTTOM_RIGHT}."


class NotAppended(Exception):
    """A returned cache is not the old one with the new tokens after it."""


def _step_run(answer: Callable[..., Any], case: Case) -> Any:
    """The answer's ``(out, k_cache, v_cache)`` on ``case``; raises :class:`NotAppended` when a
    returned cache of the right shape does not hold the old cache, unchanged, then the new tokens."""
    got = answer(*(t.clone() for t in case.args))
    if not (isinstance(got, tuple) and len(got) == 3):
        return got
    _, k_new, v_new, k_cache, v_cache = case.args
    S_old = k_cache.shape[-2]
    for name, grown, old, new in (
        ("k_cache", got[1], k_cache, k_new),
        ("v_cache", got[2], v_cache, v_new),
    ):
        right_shape = isinstance(grown, Tensor) and grown.shape == torch.cat([old, new], -2).shape
        if right_shape and not (
            torch.equal(grown[..., :S_old, :], old) and torch.equal(grown[..., S_old:, :], new)
        ):
            message = "{name} is not the old cache, unchanged, with this step's tokens after it"
            raise NotAppended(tr(message, name=name))
    return got


_EMPTY_CACHE = multihead.KVCache()  # made on import; the mistake below starts from a copy of it


def _step_by_library(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor):
    """mha.KVCache's own update and attend (bottom-right causal)."""
    cache = copy.copy(_EMPTY_CACHE)
    cache.update(k_cache, v_cache)
    out, _ = cache.attend(q, k_new, v_new, is_causal=True)
    return out, cache.key, cache.value


def _step_by_private_helper(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor
):
    """Checked by mha.multihead's private _check_cache_step, then right: around the public name."""
    multihead._check_cache_step(q, k_new, v_new)
    return _step(q, k_new, v_new, k_cache, v_cache)


def _step_by_hand(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor):
    """A buffer filled by slices, attention written out, the mask from positions."""
    S_old, T = k_cache.shape[-2], k_new.shape[-2]
    k = k_new.new_empty(*k_new.shape[:-2], S_old + T, k_new.shape[-1])  # (B, H, S, D)
    v = v_new.new_empty(*v_new.shape[:-2], S_old + T, v_new.shape[-1])  # (B, H, S, D)
    k[..., :S_old, :], k[..., S_old:, :] = k_cache, k_new
    v[..., :S_old, :], v[..., S_old:, :] = v_cache, v_new
    position = torch.arange(S_old, S_old + T)[:, None]  # (T, 1) where each new query sits
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = torch.where(torch.arange(S_old + T) <= position, scores, -math.inf)
    return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v), k, v


def _cache_methods(cls: type) -> list[Callable[..., Any]]:
    """Every method ``cls`` itself defines (its module's functions whose qualname it heads)."""
    module = sys.modules[cls.__module__]
    return [f for f in defined_in(module) if f.__qualname__.split(".")[0] == cls.__name__]


#: A cache step is what mha's caches do: every function of mha.multihead (KVCache, and
#: MultiHeadAttention, whose forward runs a cache) and the methods of the other caches.
_CACHE_BANNED = (
    *defined_in(multihead),
    *_cache_methods(decoding.PreallocatedKVCache),
    *_cache_methods(kv_quant.QuantizedKVCache),
    *_cache_methods(paged.PagedKVCache),
)
_NO_CACHE = (
    "keep the cache yourself: no mha cache (KVCache, PreallocatedKVCache ...) and no function "
    "of mha.multihead (MultiHeadAttention with kv_cache= ...)."
)
_ORDER = (
    "Append: the old tokens first, this step's after them, torch.cat([k_cache, k_new], dim=-2)."
)


KV_CACHE_STEP = Exercise(
    "check_kv_cache_step",
    "9 tokens decoded in steps of [4, 1, 1, 1, 2] equal one causal pass over the sequence; each "
    "step returned the old cache unchanged with its own keys and values after it",
    _step,
    _kv_cases,
    variants=(
        _step_by_hand,
        lambda q, k_new, v_new, k_cache, v_cache: (
            F.scaled_dot_product_attention(
                q,
                torch.cat([k_cache, k_new], -2),
                torch.cat([v_cache, v_new], -2),
                attn_mask=mha.causal_mask_bottom_right(
                    q.shape[-2], k_cache.shape[-2] + q.shape[-2]
                ),
            ),
            torch.cat([k_cache, k_new], -2),
            torch.cat([v_cache, v_new], -2),
        ),
    ),
    mistakes=(
        (partial(_step, append=False), _GROWN),
        (partial(_step, keys="new", mask="top-left"), _WHOLE),
        (partial(_step, mask="top-left"), _HINT_TOP_LEFT),
        (partial(_step, mask="none"), _CHUNK),
        (partial(_step, order="new first"), _ORDER),
        (_step_by_library, _NO_CACHE),
        (_step_by_private_helper, _NO_CACHE),
    ),
    hint={
        "out": f"Attend to the whole cache after appending, with {_BOTTOM_RIGHT}.",
        **dict.fromkeys(
            ("k_cache", "v_cache"), "Return every token so far: torch.cat(..., dim=-2)."
        ),
    },
    crash_hint=_ORDER,
    outputs=("out", "k_cache", "v_cache"),
    call=_step_run,
    forbidden=_CACHE_BANNED,
    rewrites=(multihead.KVCache.update, multihead.ContiguousCache.attend),
    forbidden_hint=_NO_CACHE,
    params=("step",),
    doc="Check ``step(q, k_new, v_new, k_cache, v_cache) -> (out, k_cache, v_cache)`` (B, H, T, "
    "D) against one causal SDPA pass: a prompt of 4 tokens, 3 single tokens, a chunk of 2; the "
    "caches returned must be the old ones with the new tokens appended, and no mha cache may "
    "do the step.",
)

#: The inputs of the prediction exercise: name -> what is special about them.
SDPA_CASES: dict[str, str] = {
    "plain": "(B, H, L, D) = (2, 4, 128, 64) float32, no mask",
    "bool_mask": "the same with a (128, 128) bool keep-mask",
    "causal": "the same with is_causal=True",
    "bfloat16": "the same in bfloat16",
    "three_dims": "(B·H, L, D) = (8, 128, 64): heads folded into the batch, 3-D tensors",
    "dropout": "the same 4-D inputs with dropout_p=0.1, as in training",
    "value_dim": "value head dim 32 while query and key have 64",
    "strided_last_dim": "query = x[..., ::2]: the last dim has stride 2",
}


def sdpa_case_inputs(name: str) -> tuple[tuple[Tensor, Tensor, Tensor], dict[str, Any]]:
    """The positional and keyword arguments of ``F.scaled_dot_product_attention`` for a case.

    Args:
        name: one of :data:`SDPA_CASES`.

    Returns:
        ``(args, kwargs)`` with CPU tensors drawn from a fixed seed.
    """
    if name not in SDPA_CASES:
        raise ValueError(f"name must be one of {list(SDPA_CASES)}, got {name!r}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, generator=g) for _ in range(3))  # (B, H, L, D)
    kwargs: dict[str, Any] = {"causal": {"is_causal": True}, "dropout": {"dropout_p": 0.1}}
    if name == "bool_mask":
        kwargs[name] = {"attn_mask": torch.rand(128, 128, generator=g) > 0.3}
    elif name in ("bfloat16", "three_dims"):
        q, k, v = (t.bfloat16() if name == "bfloat16" else t.reshape(8, 128, 64) for t in (q, k, v))
    elif name == "value_dim":
        v = v[..., :32].contiguous()
    elif name == "strided_last_dim":
        q = torch.randn(2, 4, 128, 128, generator=g)[..., ::2]  # (2, 4, 128, 64), stride 2
    return (q, k, v), kwargs.get(name, {})


@cache  # the answer depends only on this machine and this torch
def _cpu_backend(name: str) -> tuple[str, str]:
    """Which kernel torch picks on the CPU for a case, and its reason when it is not flash."""
    args, kwargs = sdpa_case_inputs(name)
    report = sdpa_backends(*args, **kwargs)
    flash = report.status("FLASH_ATTENTION")
    if report.default is not None:
        picked = {"FLASH_ATTENTION": "flash", "MATH": "math"}.get(report.default, report.default)
    else:  # torch cannot say: flash runs whenever it can on the CPU, math otherwise
        picked = "flash" if flash.runs else "math"
    return picked, flash.reason


_HINT_FLASH = (
    "The CPU flash kernel takes masks, is_causal and any float dtype; it needs a contiguous last "
    "dim, equal head dims, no dropout (and up to torch 2.13 4-D tensors)."
)


def _backend_hint(case: str) -> str:
    picked, reason = _cpu_backend(case)
    if picked == "flash":
        return tr(_HINT_FLASH)
    message = "torch refuses the flash kernel here and says: {reason}."
    return tr(message, reason=reason.rstrip("."))


def _as_backends(predictions: object) -> tuple[str, ...]:
    predictions = as_mapping(predictions, list(SDPA_CASES))
    for case, guess in predictions.items():
        if guess not in ("flash", "math"):
            message = "predictions[{case!r}] should be 'flash' or 'math', got {guess!r}."
            raise ExerciseError(tr(message, case=case, guess=guess))
    return tuple(predictions[c] for c in SDPA_CASES)


SDPA_BACKEND_PREDICTION = Exercise(
    "check_sdpa_backend_prediction",
    lambda want: tr(
        "all {0} predictions right ({1} flash, {2} math)",
        len(want),
        want.count("flash"),
        want.count("math"),
    ),
    lambda: {case: _cpu_backend(case)[0] for case in SDPA_CASES},
    prediction=True,
    variants=(lambda truth: dict(truth), lambda truth: dict(reversed(truth.items()))),
    mistakes=((lambda truth: {**truth, "bool_mask": "math"}, _HINT_FLASH),),
    hint=_backend_hint,
    outputs=tuple(SDPA_CASES),
    report_all=True,
    convert=_as_backends,
    params=("predictions",),
    doc="Check a prediction {case: 'flash' or 'math'} for every case of ``SDPA_CASES``, against "
    "the kernel torch picks on this machine's CPU (:func:`mha.hardware.sdpa_backends`).",
)


# --- 5.1: three steps placed on the A100's roofline ----------------------------------------------

#: The machine of the roofline exercise: an A100's published bfloat16 tensor-core peak and
#: memory bandwidth (FLOP/s, bytes/s).
A100_ROOFS = (312e12, 2.0e12)
#: The steps to place, with q (B, H, L, D) and k, v (B, H, S, D) in bfloat16.
ROOFLINE_STEPS: dict[str, str] = {
    "scores": "scores = q @ k.transpose(-2, -1), B=1 H=16 L=S=4096 D=64, the (L, S) result written",
    "fused_prefill": "fused attention (each input read once, out written once), B=1 H=16 "
    "L=S=4096 D=64",
    "fused_decode": "fused attention for one new token, L=1, against S=4096 cached keys and values",
}


@cache  # shapes only: the same counts on every machine
def _step_counts(name: str) -> tuple[int, int]:
    """FLOPs (counted by FlopCounterMode on meta tensors) and bytes (the nbytes of every tensor
    the step reads or writes) of one step of :data:`ROOFLINE_STEPS`."""
    L = 1 if name == "fused_decode" else 4096
    q = torch.empty(1, 16, L, 64, device="meta", dtype=torch.bfloat16)  # (B, H, L, D)
    k, v = (torch.empty(1, 16, 4096, 64, device="meta", dtype=q.dtype) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        if name == "scores":
            out = q @ k.transpose(-2, -1)  # (B, H, L, S)
            moved: tuple[Tensor, ...] = (q, k, out)  # k, v: (B, H, S, D)
        else:
            out = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
            moved = (q, k, v, out)
    return counter.get_total_flops(), sum(t.nbytes for t in moved)


def _roofline_truth() -> tuple[dict, dict]:
    balance = A100_ROOFS[0] / A100_ROOFS[1]  # FLOP/byte where the roofs meet
    intensity = tuple(f / b for f, b in map(_step_counts, ROOFLINE_STEPS))
    return _placed(intensity, tuple("memory" if i < balance else "compute" for i in intensity))


def _as_placements(answer: object) -> tuple[tuple[float, ...], tuple[str, ...]]:
    pair = cast("tuple[object, object]", answer)  # the checker's two parameters
    intensity = as_mapping(pair[0], list(ROOFLINE_STEPS), "intensity")
    bound = as_mapping(pair[1], list(ROOFLINE_STEPS), "bound")
    for step in ROOFLINE_STEPS:
        value, side = intensity[step], bound[step]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            message = "intensity[{step!r}] should be a number, got {value!r}."
            raise ExerciseError(tr(message, step=step, value=value))
        if side not in ("memory", "compute"):
            message = "bound[{step!r}] should be 'memory' or 'compute', got {side!r}."
            raise ExerciseError(tr(message, step=step, side=side))
    return (
        tuple(float(intensity[s]) for s in ROOFLINE_STEPS),
        tuple(str(bound[s]) for s in ROOFLINE_STEPS),
    )


def _placed(intensity: tuple[float, ...], bound: tuple[str, ...]) -> tuple[dict, dict]:
    return dict(zip(ROOFLINE_STEPS, intensity)), dict(zip(ROOFLINE_STEPS, bound))


def _slipped_placement(truth: tuple[dict, dict], **slip: Any) -> tuple[dict, dict]:
    """The true placement with one usual slip: ``scale`` on every intensity, or ``step`` given
    another ``intensity`` and/or ``bound``."""
    intensity, bound = dict(truth[0]), dict(truth[1])
    intensity = {s: i * slip.get("scale", 1.0) for s, i in intensity.items()}
    if "step" in slip:
        intensity[slip["step"]] = slip.get("intensity", intensity[slip["step"]])
        bound[slip["step"]] = slip.get("bound", bound[slip["step"]])
    return intensity, bound


def _by_formula(t: object) -> tuple[dict, dict]:
    L, S, D = 4096, 4096, 64  # per head, 2 bytes per number
    scores = 2 * L * S * D / (2 * (L * D + S * D + L * S))
    prefill = 4 * L * S * D / (2 * (2 * L * D + 2 * S * D))
    decode = 4 * S * D / (2 * (2 * D + 2 * S * D))
    return (
        {"fused_decode": decode, "scores": scores, "fused_prefill": prefill},
        {"scores": "memory", "fused_prefill": "compute", "fused_decode": "memory"},
    )


_ROOF_FLOPS = "A multiply-add is 2 FLOPs: a (L, D) by (D, S) product does 2·L·S·D of them."
_ROOF_BYTES = "bfloat16 takes 2 bytes per number: bytes = 2 × the numbers read and written."
_ROOF_WRITE = (
    "The scores step writes its (L, S) result to memory: L·S numbers per head, far more than q "
    "and k. Count every tensor a step reads or writes."
)
_ROOF_MATMUL = (
    "A matrix product is not compute-bound by nature: with its (L, S) output written, the scores "
    "step does about 62 FLOP/byte, below the A100's balance of 156."
)
_ROOF_DECODE = (
    "Fusing cannot help one query: it reads all of K and V (2·S·D numbers) for 4·S·D FLOPs, "
    "about 1 FLOP per byte, far below the balance."
)
ROOFLINE_PLACEMENT = Exercise(
    "check_roofline_placement",
    "three intensities within 2% of counted FLOPs / counted bytes, each step on the right side "
    "of the A100's ridge (156 FLOP/byte)",
    _roofline_truth,
    prediction=True,
    variants=(lambda t: (dict(reversed(t[0].items())), dict(t[1])), _by_formula),
    mistakes=(
        (partial(_slipped_placement, scale=0.5), _ROOF_FLOPS),
        (partial(_slipped_placement, scale=2.0), _ROOF_BYTES),
        (partial(_slipped_placement, step="scores", bound="compute"), _ROOF_MATMUL),
        (
            partial(_slipped_placement, step="scores", intensity=2048.0, bound="compute"),
            _ROOF_WRITE,
        ),
        (partial(_slipped_placement, step="fused_decode", bound="compute"), _ROOF_DECODE),
    ),
    hint={
        "intensity": "I = FLOPs / bytes moved: 2 FLOPs per multiply-add, 2 bytes per bfloat16 "
        "number, every tensor the step reads or writes counted once.",
        "bound": "Memory-bound where I < P / W = 312e12 / 2.0e12 = 156 FLOP/byte, compute-bound "
        "above.",
    },
    atol=0.0,
    rtol=0.02,
    outputs=("intensity", "bound"),
    report_all=True,
    convert=_as_placements,
    doc="Check the arithmetic intensity (FLOP/byte) and the side of the A100's ridge ('memory' or "
    "'compute') predicted for each step of ``ROOFLINE_STEPS``, against FLOPs counted by "
    "FlopCounterMode and the bytes of the tensors each step reads and writes.",
)


# --- 5.4: the tiles a bottom-right sliding window leaves -----------------------------------------


class WholeMask(Exception):
    """An answer made a tensor as large as the (L, S) mask."""


@dataclass(frozen=True)
class _Guarded(Case):
    """A case run under the guard: no tensor of ``limit`` elements or more."""

    limit: int = 0


def _window_keep(L: int, S: int, window: int, rows: range | None = None) -> Tensor:
    """The (L, S) keep-mask (only its ``rows``, if given): the L queries are the last L positions
    of the S keys (bottom-right), and query i sees the ``window`` most recent keys up to its own
    position, itself included."""
    rows = range(L) if rows is None else rows
    position = torch.tensor(rows)[:, None] + (S - L)  # (L, 1) where query i sits among the keys
    behind = position - torch.arange(S)[None, :]  # (L, S) how far key j lies behind query i
    return (behind >= 0) & (behind < window)


def _visible_by_library(L: int, S: int, block_size: int, window: int) -> Tensor:
    return flash.visible_blocks(_window_keep(L, S, window), L, S, block_size)


def _visible_slip(L: int, S: int, block_size: int, window: int, **slip: bool) -> Tensor:
    """The grid from the tiles' bounds: right without ``slip``, or with one of the usual slips."""
    offset = 0 if slip.get("top_left") else S - L
    rows = math.ceil(L / block_size) if not slip.get("floor") else L // block_size
    q0 = torch.arange(rows)[:, None] * block_size  # (R, 1) first query of each block
    q1 = torch.clamp(q0 + block_size, max=L)  # (R, 1) one past its last query
    k0 = torch.arange(math.ceil(S / block_size))[None, :] * block_size  # (1, C) first key
    k1 = torch.clamp(k0 + block_size, max=S)  # (1, C) one past its last key
    newest = q1 - 1 + offset  # (R, 1) the last key the block's last query may see
    oldest = q0 + offset - window + (0 if slip.get("off_by_one") else 1)  # first key of the first
    if slip.get("corner"):  # only the block's first query against the tile's first key
        return (k0 <= q0 + offset) & (k0 >= oldest)
    after = k0 <= newest  # (R, C) some key of the tile not after the block's last query
    window_ok = torch.ones_like(after) if slip.get("no_window") else k1 - 1 >= oldest
    return after & window_ok


def _visible_by_loops(L: int, S: int, block_size: int, window: int) -> Tensor:
    rows, cols = -(-L // block_size), -(-S // block_size)
    grid = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        first, last = r * block_size + S - L, min(r * block_size + block_size, L) - 1 + S - L
        for c in range(cols):
            keys = range(c * block_size, min(c * block_size + block_size, S))
            # pairs seen: key j with first - window < j <= last, j in the tile
            grid[r, c] = any(first - window < j <= last for j in keys)
    return grid


def _visible_by_tile_masks(L: int, S: int, block_size: int, window: int) -> Tensor:
    """One small (block_size, block_size) mask per tile, as a kernel builds inside a tile."""
    rows, cols = -(-L // block_size), -(-S // block_size)
    grid = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        i = torch.arange(r * block_size, min(r * block_size + block_size, L)) + (S - L)
        for c in range(cols):
            j = torch.arange(c * block_size, min(c * block_size + block_size, S))
            behind = i[:, None] - j[None, :]  # (rows of the block, keys of the tile)
            grid[r, c] = ((behind >= 0) & (behind < window)).any()
    return grid


def _visible_by_library_rows(L: int, S: int, block_size: int, window: int) -> Tensor:
    """One block of query rows at a time through mha.flash.visible_blocks, as 5.4 counts
    BigBird's tiles: no (L, S) mask, but the library's function."""
    rows = []
    for r in range(0, L, block_size):
        block = range(r, min(r + block_size, L))
        keep = _window_keep(L, S, window, block)  # (rows of the block, S)
        rows.append(flash.visible_blocks(keep, len(block), S, block_size))
    return torch.cat(rows)  # (ceil(L / b), ceil(S / b))


def _visible_by_private_schedule(L: int, S: int, block_size: int, window: int) -> Tensor:
    """One block of query rows at a time, its tiles listed by mha.flash's private _tile_schedule:
    the library reached around its public names."""
    grid = torch.zeros(-(-L // block_size), -(-S // block_size), dtype=torch.bool)
    for r in range(grid.shape[0]):
        block = range(r * block_size, min(r * block_size + block_size, L))
        keep = _window_keep(L, S, window, block)  # (rows of the block, S)
        for tile in flash._tile_schedule(len(block), S, block_size, False, keep):
            grid[r, tile.k0 // block_size] = True
    return grid


def _window_cases() -> list[Case]:
    specs = (  # L, S, block_size, window
        (256, 256, 64, 100),
        (100, 300, 32, 64),
        (192, 320, 32, 97),
        (300, 100, 32, 50),
        (64, 640, 64, 1000),
        (200, 500, 32, 70),
    )
    return [
        _Guarded(
            f"my_visible_tiles(L={L}, S={S}, block_size={b}, window={w})",
            (L, S, b, w),
            limit=L * S,
        )
        for L, S, b, w in specs
    ]


def _call_without_mask(answer: Callable[..., Any], case: Case) -> Any:
    """The answer's grid on ``case``, made with no tensor of L·S elements or more."""
    seen: list[tuple[int, ...]] = []
    try:
        with never_larger(getattr(case, "limit", 0) or 1, "{shape}") as seen:
            return answer(*case.args)
    except ExerciseError:
        if not seen:  # a banned call: watch's own error
            raise
        message = "it made a tensor of L·S elements or more, as large as the whole (L, S) mask"
        raise WholeMask(tr(message)) from None


_NO_FLASH = (
    "work the tiles out yourself, with no function of mha.flash (tile_schedule, visible_blocks, "
    "_tile_schedule ...)."
)
_TILE_MASK = (
    "Make no (L, S) mask: decide each tile from its bounds, the first and last query of the "
    "block and the first and last key of the tile."
)
_TOP_LEFT = (
    "Bottom-right: the L queries are the last L of the S positions, so query i sits at "
    "position i + S - L; with L ≠ S that shifts the band."
)
_WINDOW_EDGE = (
    "The window holds `window` keys, the query's own included: query p sees keys "
    "p - window + 1 .. p, so a tile is in reach when its last key is at least "
    "first_query - window + 1."
)
_NO_WINDOW = "A window also hides the old keys: a tile whose last key lies `window` or more behind the block's first query is hidden."
_CORNERS = (
    "Checking one corner is not enough: a tile is visible when SOME query of the block sees SOME "
    "key of the tile; compare the block's last query with the tile's first key, and its first "
    "query with the tile's last key."
)
_PARTIAL = (
    "Count the last, partial block too: ceil(L / block_size) rows and ceil(S / block_size) columns."
)
VISIBLE_TILES = Exercise(
    "check_visible_tiles",
    "the tiles mha.flash.visible_blocks finds in the bottom-right sliding-window mask (L < S, "
    "L > S, partial tiles, a window wider than S), with no tensor of L·S elements",
    _visible_by_library,
    _window_cases,
    variants=(_visible_slip, _visible_by_loops, _visible_by_tile_masks),
    mistakes=(
        (lambda L, S, b, w: flash.visible_blocks(_window_keep(L, S, w), L, S, b), _TILE_MASK),
        (_visible_by_library_rows, _NO_FLASH),
        (_visible_by_private_schedule, _NO_FLASH),
        (partial(_visible_slip, top_left=True), _TOP_LEFT),
        (partial(_visible_slip, off_by_one=True), _WINDOW_EDGE),
        (partial(_visible_slip, no_window=True), _NO_WINDOW),
        (partial(_visible_slip, corner=True), _CORNERS),
        (partial(_visible_slip, floor=True), _PARTIAL),
    ),
    hint="Tile (r, c) is visible when some query of block r sees some key of tile c: key j is "
    "seen by the query at position p = i + S - L when p - window < j <= p.",
    crash_hint="Return a bool tensor of shape (ceil(L / block_size), ceil(S / block_size)).",
    exact_dtype=True,
    call=_call_without_mask,
    forbidden=tuple(defined_in(flash)),
    rewrites=(flash.visible_blocks,),
    forbidden_hint=_NO_FLASH,
    params=("my_visible_tiles",),
    doc="Check ``my_visible_tiles(L, S, block_size, window) -> (ceil(L/b), ceil(S/b)) bool``, the "
    "tiles of a bottom-right causal sliding window, against ``mha.flash.visible_blocks`` on the "
    "whole mask, under a guard against any tensor of L·S elements; no function of mha.flash.",
)


# --- 5.3: the whole tiled forward, the capstone, in its own module --------------------------------

# Published with the exercises above.
from ._flash_forward import FLASH_FORWARD  # noqa: E402, F401

EXERCISES = publish(globals())
