"""Checkers for chapter 5, attention on a GPU.

* :func:`check_online_softmax_update` — one tile of FlashAttention's online softmax, the running
  ``(m, l, acc)`` state compared after every tile with the exact softmax of all scores seen so far
  (``torch.softmax``), and with the usual slips recognised (no rescaling of ``acc`` or ``l``,
  normalising ``acc`` too early, NaN on rows whose keys are all hidden).
* :func:`check_kv_cache_step` — one decoding step with a key/value cache, run token by token and
  chunk by chunk against one causal pass of ``F.scaled_dot_product_attention`` over the whole
  sequence (not appending, attending to the new tokens only, top-left causal alignment).
* :func:`check_sdpa_backend_prediction` — which kernel ``F.scaled_dot_product_attention`` picks on
  the CPU for a handful of inputs, checked by running them (:func:`mha.hardware.sdpa_backends`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from ._check import ExerciseError, passed

__all__ = [
    "SDPA_CASES",
    "check_kv_cache_step",
    "check_online_softmax_update",
    "check_sdpa_backend_prediction",
    "sdpa_case_inputs",
]


def _call(fn: Callable[..., object], what: str, *args: object) -> object:
    """Call the learner's function; a crash becomes an ``ExerciseError`` quoting it."""
    try:
        return fn(*args)
    except ExerciseError:
        raise
    except Exception as err:  # the learner's bug, reported with what was being called
        raise ExerciseError(f"{what} raised {type(err).__name__}: {err}") from err


def _close(actual: object, expected: Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    """True if ``actual`` is a tensor of ``expected``'s shape with equal values (inf == inf)."""
    if not isinstance(actual, Tensor) or actual.shape != expected.shape:
        return False
    return bool(torch.allclose(actual.detach().to(expected.dtype), expected, atol=atol, rtol=rtol))


def _describe(actual: object, expected: Tensor) -> str:
    if not isinstance(actual, Tensor):
        return f"got {type(actual).__name__}, expected a tensor of shape {tuple(expected.shape)}"
    if actual.shape != expected.shape:
        return f"got shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    diff = (actual.detach().to(expected.dtype) - expected).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return f"largest difference {diff.max().item():.3g}"


# ----------------------------------------------------------------------------------------------
# The online-softmax update
# ----------------------------------------------------------------------------------------------

_HINT_M = (
    "m is the running maximum: m_new = torch.maximum(m, scores.amax(-1, keepdim=True)) — the "
    "larger of the old maximum and this tile's row maximum."
)
_HINT_L_RESCALE = (
    "l was measured relative to the old maximum. When the maximum grows, shrink it first: "
    "l_new = exp(m - m_new) * l + exp(scores - m_new).sum(-1, keepdim=True)."
)
_HINT_ACC_RESCALE = (
    "acc was accumulated relative to the old maximum: rescale it by exp(m - m_new) before adding "
    "this tile, acc_new = exp(m - m_new) * acc + exp(scores - m_new) @ value. Without it, tiles "
    "seen before the maximum grew get weights that are too large."
)
_HINT_ACC_NORMALISED = (
    "acc is the *unnormalised* numerator sum(exp(score - m) * value); divide by l only once, "
    "after the last tile (out = acc / l)."
)
_HINT_NAN = (
    "A row whose keys so far were all hidden has m = -inf, and exp(-inf - (-inf)) is NaN. Where "
    "m_new is -inf, subtract 0 instead of m_new (torch.where(torch.isneginf(m_new), 0, m_new)): "
    "then every exp is exactly 0 and the row stays m = -inf, l = 0, acc = 0."
)


def _reference_state(scores: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The exact ``(m, l, acc)`` after all keys in ``scores``/``value``, from the definitions."""
    m = scores.amax(-1, keepdim=True)  # (..., R, 1)
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - shift)  # (..., R, S) exactly 0 for hidden keys
    return m, p.sum(-1, keepdim=True), p @ value


def _wrong_states(
    m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, value: Tensor
) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """What the typical wrong updates return, from the same (correct) previous state."""
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    p = torch.exp(scores - m_new)
    alpha = torch.exp(m - m_new)
    l_ok = alpha * l + p.sum(-1, keepdim=True)
    return {
        "acc": (m_new, l_ok, acc + p @ value),
        "l": (m_new, l + p.sum(-1, keepdim=True), alpha * acc + p @ value),
    }


def check_online_softmax_update(update: Callable[..., tuple[Tensor, Tensor, Tensor]]) -> None:
    """Check ``update(m, l, acc, scores, value) -> (m, l, acc)``, one tile of online softmax.

    Shapes (as in :func:`mha.online_softmax_update`): ``m, l (..., R, 1)``, ``acc (..., R, Dv)``,
    ``scores (..., R, C)`` (already scaled and masked, ``-inf`` = hidden), ``value (..., C, Dv)``.
    The state starts at ``m = -inf, l = 0, acc = 0``; after every tile it must equal the exact
    maximum, denominator and numerator of all scores seen so far, and ``acc / l`` after the last
    tile must equal ``torch.softmax(all scores) @ all values``.
    """
    name = "check_online_softmax_update"
    g = torch.Generator().manual_seed(5)
    batch, R, C, Dv, n_tiles = 2, 6, 4, 3, 3
    # Later tiles hold larger scores, so the running maximum grows and rescaling matters.
    tiles = [torch.randn(batch, R, C, generator=g) * 2 + 2.5 * t for t in range(n_tiles)]
    values = [torch.randn(batch, C, Dv, generator=g) for _ in range(n_tiles)]

    # Second run: row 0 sees only hidden keys in the first tile, row 1 half of them hidden.
    masked_tiles = [t.clone() for t in tiles]
    masked_tiles[0][:, 0, :] = float("-inf")
    masked_tiles[0][:, 1, : C // 2] = float("-inf")

    for run, run_tiles in (("", tiles), (" (first tile hides every key of row 0)", masked_tiles)):
        m = torch.full((batch, R, 1), float("-inf"))
        l = torch.zeros(batch, R, 1)
        acc = torch.zeros(batch, R, Dv)
        for i, (scores, value) in enumerate(zip(run_tiles, values)):
            what = f"update(...) on tile {i}{run}"
            result = _call(
                update, what, m.clone(), l.clone(), acc.clone(), scores.clone(), value.clone()
            )
            if not isinstance(result, tuple) or len(result) != 3:
                raise ExerciseError(
                    f"{what} should return a tuple (m, l, acc), got {type(result).__name__}."
                )
            m_new, l_new, acc_new = result
            m_ref, l_ref, acc_ref = _reference_state(
                torch.cat(run_tiles[: i + 1], -1), torch.cat(values[: i + 1], -2)
            )
            for got, ref in ((m_new, m_ref), (l_new, l_ref), (acc_new, acc_ref)):
                if isinstance(got, Tensor) and torch.isnan(got).any():
                    raise ExerciseError(f"{what} returned NaN. {_HINT_NAN}")
            if not _close(m_new, m_ref):
                raise ExerciseError(f"{what}: m is wrong ({_describe(m_new, m_ref)}). {_HINT_M}")
            wrong = _wrong_states(m, l, acc, scores, value) if i > 0 else {}
            if not _close(l_new, l_ref):
                hint = (
                    _HINT_L_RESCALE
                    if "l" in wrong and _close(l_new, wrong["l"][1])
                    else (
                        "l is the running denominator sum(exp(score - m)) over every key seen so far, "
                        "relative to the current maximum m_new. " + _HINT_L_RESCALE
                    )
                )
                raise ExerciseError(f"{what}: l is wrong ({_describe(l_new, l_ref)}). {hint}")
            if not _close(acc_new, acc_ref):
                if "acc" in wrong and _close(acc_new, wrong["acc"][2]):
                    hint = _HINT_ACC_RESCALE
                elif _close(acc_new, acc_ref / l_ref.clamp_min(1e-30)):
                    hint = _HINT_ACC_NORMALISED
                else:
                    hint = (
                        "acc_new = exp(m - m_new) * acc + exp(scores - m_new) @ value. "
                        + _HINT_ACC_RESCALE
                    )
                raise ExerciseError(f"{what}: acc is wrong ({_describe(acc_new, acc_ref)}). {hint}")
            m, l, acc = m_new.detach(), l_new.detach(), acc_new.detach()

        out = acc / l
        expected = torch.softmax(torch.cat(run_tiles, -1), dim=-1) @ torch.cat(values, -2)
        if not _close(out, expected):
            raise ExerciseError(
                f"acc / l after the last tile{run} differs from softmax(scores) @ value "
                f"({_describe(out, expected)}). {_HINT_ACC_RESCALE}"
            )
    passed(
        name,
        f"{n_tiles} tiles, the state matches softmax(scores) @ value after every tile, hidden rows included",
    )


# ----------------------------------------------------------------------------------------------
# One decoding step with a key/value cache
# ----------------------------------------------------------------------------------------------

_HINT_APPEND = (
    "Append this step's keys and values to the cache along the sequence axis "
    "(torch.cat([k_cache, k_new], dim=-2), the same for v) and return the grown cache: the next "
    "step must see every token so far."
)
_HINT_ONLY_NEW = (
    "The queries attended only to this step's tokens. Attend over the whole cache (the old "
    "tokens and the new ones), after appending."
)
_HINT_TOP_LEFT = (
    "is_causal=True in PyTorch is aligned top-left: query 0 sees key 0 only. With a cache the T "
    "new queries are the *last* T positions of the S keys, so query i may see keys 0..S-T+i: use "
    "the bottom-right mask torch.ones(T, S, dtype=torch.bool).tril(S - T) as attn_mask."
)
_HINT_NO_MASK = (
    "With several new tokens in one step (a prompt chunk), each new query must not see the new "
    "tokens after it: pass the bottom-right causal mask torch.ones(T, S, dtype=torch.bool).tril(S - T)."
)


def check_kv_cache_step(step: Callable[..., tuple[Tensor, Tensor, Tensor]]) -> None:
    """Check ``step(q, k_new, v_new, k_cache, v_cache) -> (out, k_cache, v_cache)``.

    Shapes: ``q, k_new, v_new (B, H, T, D)`` for the ``T`` new tokens; ``k_cache, v_cache
    (B, H, S_old, D)`` (``S_old`` may be 0); the returned caches are ``(B, H, S_old + T, D)`` and
    ``out (B, H, T, D)``. A sequence is decoded as a prompt of 4 tokens, 3 single tokens and a
    chunk of 2; every output row must equal the same row of one causal
    ``F.scaled_dot_product_attention`` pass over the whole sequence.
    """
    name = "check_kv_cache_step"
    g = torch.Generator().manual_seed(7)
    B, H, D = 2, 2, 8
    chunks = [4, 1, 1, 1, 2]
    N = sum(chunks)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, D)

    k_cache = torch.empty(B, H, 0, D)
    v_cache = torch.empty(B, H, 0, D)
    start = 0
    for T in chunks:
        stop = start + T
        new = slice(start, stop)
        what = f"step(...) for tokens {start}..{stop - 1} with {start} cached"
        result = _call(
            step, what, q[:, :, new], k[:, :, new], v[:, :, new], k_cache.clone(), v_cache.clone()
        )
        if not isinstance(result, tuple) or len(result) != 3:
            raise ExerciseError(
                f"{what} should return a tuple (out, k_cache, v_cache), got {type(result).__name__}."
            )
        out, k_next, v_next = result
        for label, got, ref in (
            ("k_cache", k_next, k[:, :, :stop]),
            ("v_cache", v_next, v[:, :, :stop]),
        ):
            if not _close(got, ref):
                raise ExerciseError(
                    f"{what}: the returned {label} should hold the {stop} tokens so far, "
                    f"{_describe(got, ref)}. {_HINT_APPEND}"
                )
        expected = full[:, :, new]
        if not _close(out, expected):
            qn, kn, vn = q[:, :, new], k[:, :, new], v[:, :, new]
            S = stop
            only_new = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
            only_new_full = F.scaled_dot_product_attention(qn, kn, vn)
            top_left = F.scaled_dot_product_attention(qn, k[:, :, :S], v[:, :, :S], is_causal=True)
            no_mask = F.scaled_dot_product_attention(qn, k[:, :, :S], v[:, :, :S])
            if start > 0 and (_close(out, only_new) or _close(out, only_new_full)):
                hint = _HINT_ONLY_NEW
            elif start > 0 and _close(out, top_left):
                hint = _HINT_TOP_LEFT
            elif T > 1 and _close(out, no_mask):
                hint = _HINT_NO_MASK
            else:
                hint = (
                    "After appending, attend from the new queries to the whole cache with a "
                    "bottom-right causal mask. " + _HINT_TOP_LEFT
                )
            raise ExerciseError(f"{what}: out is wrong ({_describe(out, expected)}). {hint}")
        k_cache, v_cache = k_next.detach(), v_next.detach()
        start = stop
    passed(name, f"{N} tokens decoded in steps of {chunks} equal one causal pass over the sequence")


# ----------------------------------------------------------------------------------------------
# Predict which SDPA kernel runs on the CPU
# ----------------------------------------------------------------------------------------------

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


def sdpa_case_inputs(name: str) -> tuple[tuple[Tensor, ...], dict[str, object]]:
    """The positional and keyword arguments of ``F.scaled_dot_product_attention`` for a case.

    Args:
        name: one of :data:`SDPA_CASES`.

    Returns:
        ``(args, kwargs)`` with CPU tensors drawn from a fixed seed.
    """
    if name not in SDPA_CASES:
        raise ValueError(f"name must be one of {list(SDPA_CASES)}, got {name!r}")
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    q, k, v = randn(2, 4, 128, 64), randn(2, 4, 128, 64), randn(2, 4, 128, 64)
    kwargs: dict[str, object] = {}
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
        q = randn(2, 4, 128, 128)[..., ::2]  # (2, 4, 128, 64) with stride 2 in the last dim
    return (q, k, v), kwargs


def _cpu_backend(name: str) -> tuple[str, str]:
    """Which kernel torch picks on the CPU for a case, and its reason when it is not flash."""
    from ..hardware import sdpa_backends

    args, kwargs = sdpa_case_inputs(name)
    report = sdpa_backends(*args, **kwargs)
    flash = report.status("FLASH_ATTENTION")
    if report.default is not None:
        picked = {"FLASH_ATTENTION": "flash", "MATH": "math"}.get(report.default, report.default)
    else:  # torch cannot say: flash runs whenever it can on the CPU, math otherwise
        picked = "flash" if flash.runs else "math"
    return picked, flash.reason


def check_sdpa_backend_prediction(predictions: Mapping[str, str]) -> None:
    """Check a prediction ``{case name: "flash" or "math"}`` for every case of :data:`SDPA_CASES`.

    The truth is found on this machine, not tabulated: :func:`mha.hardware.sdpa_backends` runs each
    case on the CPU with only the flash kernel allowed (``torch.nn.attention.sdpa_kernel``) and asks
    torch's dispatcher which kernel it picks; when the CPU flash kernel refuses the inputs,
    ``F.scaled_dot_product_attention`` falls back to the math backend.
    """
    name = "check_sdpa_backend_prediction"
    if not isinstance(predictions, Mapping):
        raise ExerciseError(
            f"predictions should be a dict {{case: 'flash' or 'math'}}, got {type(predictions).__name__}."
        )
    missing = [c for c in SDPA_CASES if c not in predictions]
    unknown = [c for c in predictions if c not in SDPA_CASES]
    if missing or unknown:
        raise ExerciseError(
            f"predictions should have exactly the keys {list(SDPA_CASES)}; "
            f"missing {missing}, unknown {unknown}."
        )
    for case, guess in predictions.items():
        if guess not in ("flash", "math"):
            raise ExerciseError(
                f"predictions[{case!r}] should be 'flash' or 'math', got {guess!r}."
            )
    truth = {case: _cpu_backend(case) for case in SDPA_CASES}
    wrong = [(case, *truth[case]) for case in SDPA_CASES if predictions[case] != truth[case][0]]
    if wrong:
        case, actual, reason = wrong[0]
        if actual == "flash":
            hint = (
                "The CPU flash kernel accepts masks (bool or float), is_causal, and float32, "
                "float64, bfloat16 and float16 inputs; what it needs is 4-D tensors with a "
                "contiguous last dim, equal head dims and no dropout."
            )
        else:
            hint = f"torch refuses the flash kernel here and says: {reason.rstrip('.')}."
        raise ExerciseError(
            f"{len(wrong)} of {len(SDPA_CASES)} predictions are wrong. First: {case!r} "
            f"({SDPA_CASES[case]}) runs the {actual} kernel, you predicted {predictions[case]}. {hint}"
        )
    n_flash = sum(picked == "flash" for picked, _ in truth.values())
    passed(
        name,
        f"all {len(SDPA_CASES)} predictions right ({n_flash} flash, {len(SDPA_CASES) - n_flash} math)",
    )
