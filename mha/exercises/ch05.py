"""Exercises of chapter 5, attention on a GPU, as data for :mod:`._harness`.

References: the online-softmax state by its definition, one causal SDPA pass for decoding with a
cache, the kernel torch really picks (:mod:`mha.hardware`); mistakes: no rescaling, ``acc``
normalised too early, NaN on hidden rows, no append, the wrong causal alignment.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..hardware import sdpa_backends
from ._harness import Case, Exercise, ExerciseError, Mistake

_HINT_ACC_RESCALE = (
    "acc was accumulated relative to the old maximum: rescale it by exp(m - m_new) before adding "
    "this tile, acc_new = exp(m - m_new) * acc + exp(scores - m_new) @ value. Without it, tiles "
    "seen before the maximum grew get weights that are too large."
)
_HINT_L_RESCALE = (
    "l was measured relative to the old maximum. When the maximum grows, shrink it first: "
    "l_new = exp(m - m_new) * l + exp(scores - m_new).sum(-1, keepdim=True)."
)
_HINT_M = (
    "m is the running maximum: m_new = torch.maximum(m, scores.amax(-1, keepdim=True)) — the "
    "larger of the old maximum and this tile's row maximum."
)


def _update(
    m: Tensor,
    l: Tensor,
    acc: Tensor,
    scores: Tensor,
    value: Tensor,
    *,
    guard: bool = True,
    running_max: bool = True,
    rescale_l: bool = True,
    rescale_acc: bool = True,
    normalised: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One online-softmax update: right with the defaults, or with one of the usual slips."""
    tile_max = scores.amax(-1, keepdim=True)  # (..., R, 1)
    m_new = torch.maximum(m, tile_max)
    # A row that has seen only hidden keys keeps m = -inf: shift by 0 there, or exp gives NaN.
    shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new) if guard else m_new
    p = torch.exp(scores - shift)  # (..., R, C) this tile's unnormalised weights
    alpha = torch.exp(m - shift)  # (..., R, 1) how much the old state shrinks
    l_new = (alpha if rescale_l else 1.0) * l + p.sum(-1, keepdim=True)  # (..., R, 1)
    acc_new = (alpha if rescale_acc else 1.0) * acc + p @ value  # (..., R, Dv)
    if normalised:  # FlashAttention-1's normalised output, kept in the slot of acc
        acc_new = acc_new / l_new.clamp_min(1e-30)
    return (m_new if running_max else tile_max), l_new, acc_new


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


ONLINE_SOFTMAX_UPDATE = Exercise(
    "check_online_softmax_update",
    "3 tiles, the state matches softmax(scores) @ value after every tile, hidden rows included",
    _update,
    _online_cases,
    (
        Mistake(partial(_update, rescale_acc=False), _HINT_ACC_RESCALE),
        Mistake(partial(_update, rescale_l=False), _HINT_L_RESCALE),
        Mistake(
            partial(_update, normalised=True),
            "acc is the *unnormalised* numerator sum(exp(score - m) * value); divide by l only "
            "once, after the last tile (out = acc / l).",
        ),
        Mistake(
            partial(_update, guard=False),
            "A row whose keys so far were all hidden has m = -inf, and exp(-inf - (-inf)) is "
            "NaN. Where m_new is -inf, subtract 0 instead of m_new (torch.where("
            "torch.isneginf(m_new), 0, m_new)): then every exp is exactly 0 and the row stays "
            "m = -inf, l = 0, acc = 0.",
        ),
        Mistake(partial(_update, running_max=False), _HINT_M),
    ),
    hint={
        "m": _HINT_M,
        "l": "l is the running denominator sum(exp(score - m)) over every key seen so far, "
        "relative to the current maximum m_new. " + _HINT_L_RESCALE,
        "acc": "acc_new = exp(m - m_new) * acc + exp(scores - m_new) @ value. " + _HINT_ACC_RESCALE,
    },
    outputs=("m", "l", "acc"),
    params=("update",),
    doc="Check ``update(m, l, acc, scores, value) -> (m, l, acc)``, one tile of online softmax "
    "(shapes as in :func:`mha.online_softmax_update`): after every tile, the exact state of all "
    "the scores seen so far.",
)

_HINT_TOP_LEFT = (
    "is_causal=True in PyTorch is aligned top-left: query 0 sees key 0 only. With a cache the T "
    "new queries are the *last* T positions of the S keys, so query i may see keys 0..S-T+i: use "
    "the bottom-right mask torch.ones(T, S, dtype=torch.bool).tril(S - T) as attn_mask."
)


def _step(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    mask: str = "bottom-right",
    keys: str = "all",
    append: bool = True,
):
    """One decoding step: right with the defaults, or with one of the usual slips."""
    k = torch.cat([k_cache, k_new], dim=-2)  # (B, H, S, D)
    v = torch.cat([v_cache, v_new], dim=-2)  # (B, H, S, D)
    k_seen, v_seen = (k, v) if keys == "all" else (k_new, v_new)
    T, S = q.shape[-2], k_seen.shape[-2]
    ones = torch.ones(T, S, dtype=torch.bool)  # (T, S)
    attn_mask = {"bottom-right": ones.tril(S - T), "top-left": ones.tril(), "none": None}[mask]
    out = F.scaled_dot_product_attention(q, k_seen, v_seen, attn_mask=attn_mask)  # (B, H, T, D)
    return (out, k, v) if append else (out, k_cache, v_cache)


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


KV_CACHE_STEP = Exercise(
    "check_kv_cache_step",
    "9 tokens decoded in steps of [4, 1, 1, 1, 2] equal one causal pass over the sequence",
    _step,
    _kv_cases,
    (
        Mistake(
            partial(_step, append=False),
            "Append this step's keys and values to the cache along the sequence axis "
            "(torch.cat([k_cache, k_new], dim=-2), the same for v) and return the grown "
            "cache: the next step must see every token so far.",
        ),
        Mistake(
            partial(_step, keys="new", mask="top-left"),
            "The queries attended only to this step's tokens. Attend over the whole cache "
            "(the old tokens and the new ones), after appending.",
        ),
        Mistake(partial(_step, mask="top-left"), _HINT_TOP_LEFT),
        Mistake(
            partial(_step, mask="none"),
            "With several new tokens in one step (a prompt chunk), each new query must not "
            "see the new tokens after it: pass the bottom-right causal mask "
            "torch.ones(T, S, dtype=torch.bool).tril(S - T).",
        ),
    ),
    hint={
        "out": "After appending, attend from the new queries to the whole cache with a "
        "bottom-right causal mask. " + _HINT_TOP_LEFT,
        **dict.fromkeys(
            ("k_cache", "v_cache"),
            "The returned caches hold every token so far: torch.cat([cache, new], dim=-2).",
        ),
    },
    outputs=("out", "k_cache", "v_cache"),
    params=("step",),
    doc="Check ``step(q, k_new, v_new, k_cache, v_cache) -> (out, k_cache, v_cache)`` (B, H, T, "
    "D) against one causal SDPA pass: a prompt of 4 tokens, 3 single tokens, a chunk of 2.",
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
    kwargs: dict[str, Any] = {}
    if name == "bool_mask":
        kwargs["attn_mask"] = torch.rand(128, 128, generator=g) > 0.3
    elif name == "causal":
        kwargs["is_causal"] = True
    elif name == "bfloat16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    elif name == "three_dims":
        q, k, v = q.reshape(8, 128, 64), k.reshape(8, 128, 64), v.reshape(8, 128, 64)
    elif name == "dropout":
        kwargs["dropout_p"] = 0.1
    elif name == "value_dim":
        v = v[..., :32].contiguous()
    elif name == "strided_last_dim":
        q = torch.randn(2, 4, 128, 128, generator=g)[..., ::2]  # (2, 4, 128, 64), stride 2
    return (q, k, v), kwargs


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
    "The CPU flash kernel accepts masks (bool or float), is_causal, and float32, float64, "
    "bfloat16 and float16 inputs; what it needs is a contiguous last dim, equal head dims and no "
    "dropout (and, up to torch 2.13, 4-D tensors: torch 2.14 runs it on 3-D ones too)."
)


def _backend_hint(case: str) -> str:
    picked, reason = _cpu_backend(case)
    if picked == "flash":
        return _HINT_FLASH
    return f"torch refuses the flash kernel here and says: {reason.rstrip('.')}."


def _as_backends(predictions: object) -> tuple[str, ...]:
    if not isinstance(predictions, Mapping):
        raise ExerciseError(
            "predictions should be a dict {case: 'flash' or 'math'}, got "
            f"{type(predictions).__name__}."
        )
    missing = [c for c in SDPA_CASES if c not in predictions]
    unknown = [c for c in predictions if c not in SDPA_CASES]
    if missing or unknown:
        raise ExerciseError(
            f"predictions should have exactly the keys {list(SDPA_CASES)}; missing {missing}, "
            f"unknown {unknown}."
        )
    for case, guess in predictions.items():
        if guess not in ("flash", "math"):
            raise ExerciseError(
                f"predictions[{case!r}] should be 'flash' or 'math', got {guess!r}."
            )
    return tuple(predictions[c] for c in SDPA_CASES)


SDPA_BACKEND_PREDICTION = Exercise(
    "check_sdpa_backend_prediction",
    lambda want: (
        f"all {len(want)} predictions right ({want.count('flash')} flash, "
        f"{want.count('math')} math)"
    ),
    lambda: {case: _cpu_backend(case)[0] for case in SDPA_CASES},
    mistakes=(Mistake(lambda truth: {**truth, "bool_mask": "math"}, _HINT_FLASH),),
    hint=_backend_hint,
    outputs=tuple(SDPA_CASES),
    prediction=True,
    report_all=True,
    convert=_as_backends,
    params=("predictions",),
    doc="Check a prediction {case: 'flash' or 'math'} for every case of ``SDPA_CASES``, against "
    "the kernel torch picks on this machine's CPU (:func:`mha.hardware.sdpa_backends`).",
)

EXERCISES = (ONLINE_SOFTMAX_UPDATE, KV_CACHE_STEP, SDPA_BACKEND_PREDICTION)
check_online_softmax_update = ONLINE_SOFTMAX_UPDATE.checker()
check_kv_cache_step = KV_CACHE_STEP.checker()
check_sdpa_backend_prediction = SDPA_BACKEND_PREDICTION.checker()
