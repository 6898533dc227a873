"""Chapter 5, attention on a GPU: the exercises as data for :mod:`._harness`; the backend
prediction is checked against the kernel torch really picks (:mod:`mha.hardware`)."""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import mha

from .. import flash
from ..lab.hardware import sdpa_backends
from ._harness import Case, Exercise, ExerciseError, as_mapping, publish, tr

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
_NO_LIBRARY = "write the update yourself, without mha.online_softmax_update."


def _update_out_of_place(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor):
    m_new = torch.maximum(m, scores.max(-1, keepdim=True).values)
    safe = m_new.nan_to_num(neginf=0.0)  # 0 where no key was visible yet
    p, alpha = (scores - safe).exp(), (m - safe).exp()
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ value


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
    ),
    hint={"m": _HINT_M, "l": _HINT_L_RESCALE, "acc": _HINT_ACC_RESCALE},
    outputs=("m", "l", "acc"),
    forbidden=(mha.online_softmax_update,),
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


def _module_step(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor):
    """Through mha.KVCache and mha.scaled_dot_product_attention."""
    kv = mha.KVCache()
    if k_cache.shape[-2]:
        kv.update(k_cache, v_cache)
    k, v = kv.update(k_new, v_new)
    keep = mha.causal_mask_bottom_right(q.shape[-2], k.shape[-2])
    return mha.scaled_dot_product_attention(q, k, v, keep), k, v


KV_CACHE_STEP = Exercise(
    "check_kv_cache_step",
    "9 tokens decoded in steps of [4, 1, 1, 1, 2] equal one causal pass over the sequence",
    _step,
    _kv_cases,
    variants=(
        _module_step,
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
    ),
    hint={
        "out": f"Attend to the whole cache after appending, with {_BOTTOM_RIGHT}.",
        **dict.fromkeys(
            ("k_cache", "v_cache"), "Return every token so far: torch.cat(..., dim=-2)."
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

EXERCISES = publish(globals())
