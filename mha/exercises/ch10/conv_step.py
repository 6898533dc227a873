"""Section 10.5, the layer around the rule: the decoding step of Gated DeltaNet's short causal
convolution, as data for :mod:`.._harness`.

The learner's step, with a rolling state, is stepped over whole sequences against the full pass,
the state checked to stay ``(B, C, K - 1)`` and no tensor to outgrow one window; mistakes: the
state not shifted, shifted at the wrong end or kept newest first, the kernel flipped, SiLU left
out, the window returned as the state, a buffer of the whole sequence, and torch's convolutions
and ``GatedDeltaNet`` (and its private ``_convolve``), banned.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mha.models import gated_deltanet

from .._harness import (
    Case,
    Exercise,
    ExerciseError,
    defined_in,
    never_larger,
    publish,
    randn64,
    slipped,
    tr,
)

# --- the short convolution's decode step ----------------------------------------------------------

#: The convolutions torch has ready-made: the step is to find which tap meets which input itself.
CONVOLUTIONS = (
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    torch.convolution,
    torch._convolution,
    torch.nn.Conv1d.forward,
)
_NO_CONV = (
    "write the step yourself: a sum over the window's K taps, without F.conv1d (or another torch "
    "convolution) and without the course's GatedDeltaNet or its helpers."
)


def _conv_step_reference(x_t: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The kept K - 1 inputs then x_t make the window (oldest first); weight[:, -1] meets x_t, as
    in nn.Conv1d (no flip); SiLU; the new state is the window without its oldest input."""
    window = torch.cat([conv_state, x_t.unsqueeze(-1)], dim=-1)  # (B, C, K)
    return F.silu((window * weight).sum(-1)), window[..., 1:]  # (B, C), (B, C, K-1)


def _conv_slip(
    x_t: Tensor, conv_state: Tensor, weight: Tensor, **slip: Any
) -> tuple[Tensor, Tensor]:
    if slip.get("newest_first"):  # the state kept newest first, read with the kernel reversed
        window = torch.cat([x_t.unsqueeze(-1), conv_state], dim=-1)  # (B, C, K): x_t first
        y = (window * weight.flip(-1)).sum(-1)
        return F.silu(y), window[..., :-1]
    window = torch.cat([conv_state, x_t.unsqueeze(-1)], dim=-1)  # (B, C, K)
    kernel = weight.flip(-1) if slip.get("flipped") else weight  # (C, K)
    y = (window * kernel).sum(-1)  # (B, C)
    y = y if slip.get("no_silu") else F.silu(y)
    if slip.get("no_shift"):
        return y, conv_state
    if slip.get("wrong_end"):  # x_t put in front, the newest kept input dropped
        return y, torch.cat([x_t.unsqueeze(-1), conv_state[..., :-1]], dim=-1)
    if slip.get("grows"):
        return y, window
    return y, window[..., 1:]


def _conv_step_by_roll(x_t: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The kept taps by einsum plus the newest tap; the state rolled left, x_t written last."""
    y = torch.einsum("bck,ck->bc", conv_state, weight[:, :-1]) + x_t * weight[:, -1]
    new = conv_state.roll(-1, dims=-1)  # (B, C, K-1): the oldest input moves to the end ...
    new[..., -1] = x_t  # ... where x_t overwrites it
    return F.silu(y), new


def _conv_step_by_taps(x_t: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """One tap at a time; SiLU written out as y · sigmoid(y)."""
    K = weight.shape[-1]
    y = weight[:, K - 1] * x_t  # (B, C)
    for j in range(K - 1):
        y = y + weight[:, j] * conv_state[..., j]
    new = torch.cat([conv_state[..., 1:], x_t[..., None]], dim=-1)  # (B, C, K-1)
    return y * torch.sigmoid(y), new


def _conv_step_by_library(x_t: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """torch's depthwise convolution on the window: right, and banned."""
    window = torch.cat([conv_state, x_t.unsqueeze(-1)], dim=-1)  # (B, C, K)
    y = F.conv1d(window, weight.unsqueeze(1), groups=weight.shape[0])[..., 0]  # (B, C)
    return F.silu(y), window[..., 1:]


def _conv_step_by_private_helper(
    x_t: Tensor, conv_state: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor]:
    """GatedDeltaNet's private _convolve on one token, reached around the layer's forward."""
    C, K = weight.shape
    conv = torch.nn.Conv1d(C, C, K, groups=C, bias=False, dtype=weight.dtype)
    conv.weight.data.copy_(weight.unsqueeze(1))
    layer, cache = SimpleNamespace(K=K, conv1d=conv), SimpleNamespace(conv=conv_state)
    y = gated_deltanet.GatedDeltaNet._convolve(layer, x_t.unsqueeze(-1), cache)  # type: ignore[arg-type]
    return y[..., 0], cache.conv


class _ConvWithHistory:
    """Keeps every input of the sequence and convolves the last K of them: right values, but a
    buffer that grows by one input per token."""

    def __init__(self) -> None:
        self.history: Tensor | None = None
        self.last: Tensor | None = None

    def __call__(self, x_t: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        if self.history is None or self.last is None or not torch.equal(conv_state, self.last):
            self.history = conv_state  # a new sequence
        self.history = torch.cat([self.history, x_t.unsqueeze(-1)], dim=-1)  # (B, C, grows)
        K = weight.shape[-1]
        y = F.silu((self.history[..., -K:] * weight).sum(-1))  # (B, C)
        self.last = self.history[..., 1 - K :]
        return y, self.last


class StateShape(Exception):
    """The state the answer returned is not ``(B, C, K - 1)``."""


class WholeHistory(Exception):
    """The answer made a tensor larger than one window ``(B, C, K)``: it keeps more than the
    state."""


def _conv_inputs(seed: int, B: int, C: int, K: int, T: int, prompt: int) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    seq, weight = randn64(gen, B, C, prompt + T), randn64(gen, C, K) * 0.5  # (B, C, P+T), (C, K)
    return seq, weight


def _conv_cases() -> list[Case]:
    """Sequences of T tokens from a zero state, or after a prompt of P tokens; expected: the full
    pass's outputs for the T tokens, ``(B, C, T)``, and the state after each, ``(B, C, K-1, T)``."""
    cases = []
    for seed, (B, C, K, T, P) in enumerate(((2, 6, 4, 9, 0), (1, 5, 2, 7, 0), (3, 8, 3, 12, 5))):
        seq, weight = _conv_inputs(1055 + seed, B, C, K, T, P)
        padded = F.pad(seq, (K - 1, 0))  # (B, C, K-1+P+T): zeros before the first token
        full = F.silu(F.conv1d(padded, weight.unsqueeze(1), groups=C))  # (B, C, P+T)
        states = torch.stack([padded[..., P + t + 1 : P + t + K] for t in range(T)], dim=-1)
        x, state0 = seq[..., P:], padded[..., P : P + K - 1]  # (B, C, T), (B, C, K-1)
        start = f"after a prompt of {P} tokens" if P else "from a zero state"
        label = f"conv_step over x {(B, C, T)} token by token, K = {K}, {start}"
        cases.append(Case(label, (x, state0, weight), expected=(full[..., P:], states)))
    return cases


def _conv_run(answer: Callable[..., Any], case: Case) -> object:
    """The answer stepped over the case's tokens: its outputs ``(B, C, T)`` and states
    ``(B, C, K-1, T)``; each step checked to return a ``(B, C, K-1)`` state and to make no tensor
    larger than one window."""
    x, state, weight = case.args
    (B, C, T), K = x.shape, weight.shape[-1]
    ys, states = [], []
    for t in range(T):
        args = (x[..., t].clone(), state.clone(), weight.clone())
        try:
            with never_larger(B * C * K + 1, "larger than one window"):
                out = answer(*args)
        except ExerciseError as err:
            if err.banned is not None:
                raise
            message = "made a tensor larger than one window (B, C, K) = {window}: a buffer that grows with the sequence"
            raise WholeHistory(tr(message, window=(B, C, K))) from None
        if out is None:
            return None
        if not (isinstance(out, tuple) and len(out) == 2):
            message = "conv_step should return (y_t, new_state), got {kind}"
            raise TypeError(tr(message, kind=type(out).__name__))
        y, state = out
        if not isinstance(state, Tensor) or tuple(state.shape) != (B, C, K - 1):
            got = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
            message = "after token {t} the state is {got}, expected (B, C, K - 1) = {want}"
            raise StateShape(tr(message, t=t, got=got, want=(B, C, K - 1)))
        if not isinstance(y, Tensor) or tuple(y.shape) != (B, C):
            got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise TypeError(tr("y_t should be (B, C) = {want}, got {got}", want=(B, C), got=got))
        ys.append(y)
        states.append(state)
    return torch.stack(ys, dim=-1), torch.stack(states, dim=-1)


_HINT_CONV = (
    "Put x_t after the kept inputs: window = (B, C, K), oldest first; y_t = silu(Σ_j "
    "weight[:, j] · window[..., j]) (weight[:, K-1] meets x_t, as in nn.Conv1d); the new state "
    "is the window without its oldest input, window[..., 1:]."
)


CONV_STEP = Exercise(
    "check_conv_step",
    "outputs and states of three sequences, token by token, equal the full-pass causal "
    "convolution (K = 4, 2 and 3, one after a prompt); the state stayed (B, C, K - 1) and no "
    "tensor outgrew one window (B, C, K)",
    _conv_step_reference,
    _conv_cases,
    variants=(_conv_step_by_roll, _conv_step_by_taps, lambda *args: _conv_slip(*args)),
    mistakes=(
        (_conv_step_by_library, _NO_CONV),
        (_conv_step_by_private_helper, _NO_CONV),
        (
            slipped(_conv_slip, "no_shift"),
            "The state must move on by one token: drop its oldest input and append x_t, or every "
            "later step convolves stale inputs. " + _HINT_CONV,
        ),
        (
            slipped(_conv_slip, "newest_first"),
            "Keep the state oldest first, as the layer and the full pass lay out the inputs "
            "(the last column is the latest input). " + _HINT_CONV,
        ),
        (
            slipped(_conv_slip, "wrong_end"),
            "Shift the state towards the start: drop its first (oldest) input and append x_t "
            "at the end, where the window reads the latest input. " + _HINT_CONV,
        ),
        (
            slipped(_conv_slip, "flipped"),
            "nn.Conv1d does not flip its kernel (it computes a cross-correlation): weight[:, K-1] "
            "multiplies the newest input x_t and weight[:, 0] the oldest kept one. " + _HINT_CONV,
        ),
        (
            slipped(_conv_slip, "no_silu"),
            "The layer applies SiLU right after the convolution, and the step includes it: "
            "y_t = silu(…). " + _HINT_CONV,
        ),
        (
            slipped(_conv_slip, "grows"),
            "The state keeps only the last K - 1 inputs: return the window without its oldest "
            "input, so it stays (B, C, K - 1) however long the text. " + _HINT_CONV,
        ),
        (
            _ConvWithHistory(),
            "Everything the step may remember is the state: keep no list or buffer of the "
            "sequence's inputs; the window is the state plus x_t. " + _HINT_CONV,
        ),
    ),
    hint=_HINT_CONV,
    crash_hint="x_t is (B, C), conv_state (B, C, K - 1) oldest first, weight (C, K); return "
    "(y_t (B, C), new_state (B, C, K - 1)).",
    outputs=("y_t", "new_state"),
    call=_conv_run,
    forbidden=(*defined_in(gated_deltanet), *CONVOLUTIONS),
    forbidden_hint=_NO_CONV,
    rewrites=(F.conv1d, gated_deltanet.GatedDeltaNet.forward),
    params=("conv_step",),
    doc="Check ``conv_step(x_t, conv_state, weight) -> (y_t, new_state)``: one decoding step of "
    "Qwen3-Next's short causal depthwise convolution and its SiLU, x_t ``(B, C)``, conv_state "
    "``(B, C, K - 1)`` (the last inputs, oldest first), weight ``(C, K)``; stepped over whole "
    "sequences and compared with the full pass.",
)


EXERCISES = publish(globals())
