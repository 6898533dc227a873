"""Section 10.5, Gated DeltaNet: the exercises as data for :mod:`.._harness`.

* one step of the gated delta rule (fade, read, correct); mistakes: no fading, the correction read
  from the unfaded memory, the fading after the write, no correction (linear attention), no
  ``beta``, ``g`` used as a factor instead of a log, and ``mha.gated_delta_rule``, banned;
* the half-life of a constant gate; mistakes: 1/e instead of 1/2, the sign, log10, a linear fade;
* the corrections of a chunk as one triangular solve, checked as one (a solver called, as many
  torch calls for 16 tokens as for 8); mistakes: the decay left out, the diagonal counted twice,
  ``beta`` on the wrong index or left out, the sign of the system, no system at all, the token
  recurrence instead of the solve, and ``mha.gated_delta_rule`` and its private helpers, banned;
* the decoding memory of a hybrid stack (Qwen3-Next); mistakes: every layer a softmax layer,
  the states grown with the length, only keys cached, the states sized by key heads, ``Dk + Dv``
  for ``Dk · Dv``, the layer types ignored.

The decoding step of the layer's short convolution is in :mod:`.conv_step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

import mha
from mha import gated_delta
from mha.models import gated_deltanet

from .._harness import Case, Exercise, defined_in, publish, randn64, slipped, tr, whole

_NO_GATED_DELTA = "write the step yourself, without mha.gated_delta_rule."
#: Every function of mha.gated_delta (the rule, its recurrence and chunked form) and of the
#: Qwen3-Next layer built on it.
DELTA_BANNED = (*defined_in(gated_delta), *defined_in(gated_deltanet))

# --- one step of the gated delta rule -------------------------------------------------------------


def _step_reference(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """Fade by e^g, read what the faded memory gives for k, write β times the error under k."""
    faded = state * g.exp()[..., None, None]  # (..., Dk, Dv)
    predicted = (k.unsqueeze(-2) @ faded).squeeze(-2)  # (..., Dv)  kᵀ S
    return faded + k.unsqueeze(-1) * (beta[..., None] * (v - predicted)).unsqueeze(-2)


def _step_slip(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **slip: Any) -> Tensor:
    decay = g[..., None, None] if slip.get("g_as_factor") else g.exp()[..., None, None]
    if slip.get("no_fade"):
        decay = torch.ones_like(decay)
    faded = state * decay  # (..., Dk, Dv)
    read_from = state if slip.get("read_unfaded") else faded
    predicted = torch.einsum("...k,...kv->...v", k, read_from)  # (..., Dv)
    error = v if slip.get("no_correction") else v - predicted  # (..., Dv)
    step = error if slip.get("no_beta") else beta[..., None] * error  # (..., Dv)
    if slip.get("fade_after"):
        return (state + torch.einsum("...k,...v->...kv", k, v - (k.unsqueeze(-2) @ state)
                .squeeze(-2)) * beta[..., None, None]) * decay  # fmt: skip
    return faded + torch.einsum("...k,...v->...kv", k, step)


def _step_by_matrices(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """S' = e^g (I - β k kᵀ) S + β k vᵀ: the same step as a transition matrix and a write."""
    Dk = k.shape[-1]
    kk = k.unsqueeze(-1) * k.unsqueeze(-2)  # (..., Dk, Dk)
    eye = torch.eye(Dk, dtype=k.dtype)
    b = beta[..., None, None]
    return g.exp()[..., None, None] * (eye - b * kk) @ state + b * k.unsqueeze(-1) * v.unsqueeze(-2)


def _unit(g: torch.Generator, *shape: int) -> Tensor:
    return F.normalize(randn64(g, *shape), dim=-1)


def _step_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(105)
    cases = []
    for batch, Dk, Dv in (((), 4, 3), ((2, 3), 8, 5), ((5,), 6, 6)):
        state = randn64(gen, *batch, Dk, Dv)
        k, v = _unit(gen, *batch, Dk), randn64(gen, *batch, Dv)
        g = -torch.rand(batch, generator=gen, dtype=torch.float64) * 2  # log-decays in (-2, 0]
        beta = torch.rand(batch, generator=gen, dtype=torch.float64)
        label = f"step(state {(*batch, Dk, Dv)}, k {(*batch, Dk)}, v {(*batch, Dv)}, g, beta)"
        cases.append(Case(label, (state, k, v, g, beta)))
    return cases


_HINT_STEP = (
    "Three moves: fade, S = exp(g) · state; read what the faded memory holds for k, "
    "kᵀ S (shape (..., Dv)); write the error, S + k ⊗ β (v - kᵀ S)."
)


def _step_by_private_recurrence(state, k, v, g, beta) -> Tensor:
    """mha.gated_delta's private token loop on one token, reached around gated_delta_rule."""
    Dk, Dv = state.shape[-2:]
    k1, v1 = k.reshape(1, -1, 1, Dk), v.reshape(1, -1, 1, Dv)  # (1, N, 1, D): one token
    _, new = gated_delta._recurrent(
        k1,
        k1,
        v1,
        g.reshape(1, -1, 1),
        beta.reshape(1, -1, 1),
        state.reshape(1, -1, Dk, Dv),
    )
    return new.reshape(state.shape)


DELTA_STEP = Exercise(
    "check_delta_step",
    "one step of the gated delta rule on batches of memories, Dk ≠ Dv included",
    _step_reference,
    _step_cases,
    variants=(lambda *args: _step_slip(*args), _step_by_matrices),
    mistakes=(
        (mha.gated_delta_rule, _NO_GATED_DELTA),
        (_step_by_private_recurrence, _NO_GATED_DELTA),
        (
            slipped(_step_slip, "no_fade"),
            "The gate is missing: the memory first fades, multiplied by exp(g) ≤ 1. " + _HINT_STEP,
        ),
        (
            slipped(_step_slip, "g_as_factor"),
            "g is the log of the decay: multiply by exp(g), not by g (g ≤ 0 would flip the "
            "memory's sign). " + _HINT_STEP,
        ),
        (
            slipped(_step_slip, "read_unfaded"),
            "Read the memory after it faded: the error is v minus what the *faded* memory "
            "predicts, kᵀ (exp(g) · state). " + _HINT_STEP,
        ),
        (
            slipped(_step_slip, "fade_after"),
            "Fade first, then correct: fading after the write also shrinks the new value. "
            + _HINT_STEP,
        ),
        (
            slipped(_step_slip, "no_correction"),
            "That is linear attention's write, k ⊗ β v: the delta rule writes only the error, "
            "v minus what the memory already predicts for k. " + _HINT_STEP,
        ),
        (
            slipped(_step_slip, "no_beta"),
            "Scale the error by beta, the token's writing strength. " + _HINT_STEP,
        ),
    ),
    hint=_HINT_STEP,
    crash_hint="state is (..., Dk, Dv), k (..., Dk), v (..., Dv), g and beta (...): add the "
    "missing dims with [..., None] before broadcasting.",
    forbidden=DELTA_BANNED,
    forbidden_hint=_NO_GATED_DELTA,
    rewrites=(mha.gated_delta_rule,),
    params=("delta_step",),
    doc="Check ``delta_step(state, k, v, g, beta) -> new_state``: one token of the gated delta "
    "rule, state ``(..., Dk, Dv)``, k ``(..., Dk)``, v ``(..., Dv)``, g and beta ``(...)``.",
)

# --- the gate's half-life ---------------------------------------------------------------------


def _half_life_reference(g: Tensor) -> Tensor:
    """exp(g · t) = 1/2  <=>  t = ln(1/2) / g = -ln 2 / g."""
    return -torch.log(torch.tensor(2.0, dtype=g.dtype)) / g


def _half_life_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1050)
    return [
        Case("half_life(tensor([-0.01]))", (torch.tensor([-0.01], dtype=torch.float64),)),
        Case(
            "half_life(g) with g (3, 4) in (-2, -0.001)",
            (-torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2 - 1e-3,),
        ),
        Case("half_life(tensor(-0.5))", (torch.tensor(-0.5, dtype=torch.float64),)),
    ]


_HINT_HALF_LIFE = (
    "After t tokens with the same log-decay g the memory is multiplied by exp(g · t); "
    "solve exp(g · t) = 1/2 for t (g < 0, so t > 0)."
)

HALF_LIFE = Exercise(
    "check_half_life",
    "the tokens after which a constant gate leaves half of the memory",
    _half_life_reference,
    _half_life_cases,
    variants=(
        lambda g: math.log(0.5) / g,
        lambda g: torch.log(torch.full_like(g, 0.5)) / g,
    ),
    mistakes=(
        (
            lambda g: -1 / g,
            "That is when exp(g · t) reaches 1/e, not 1/2: the half-life is ln 2 times that. "
            + _HINT_HALF_LIFE,
        ),
        (
            lambda g: math.log(2) / g,
            "A half-life is a positive number of tokens, and g is negative. " + _HINT_HALF_LIFE,
        ),
        (
            lambda g: -math.log10(2) / g,
            "The decay is exp(g · t): use the natural logarithm. " + _HINT_HALF_LIFE,
        ),
        (
            lambda g: 0.5 / -g,
            "The memory does not fade linearly, by |g| per token: it is multiplied by exp(g) "
            "per token. " + _HINT_HALF_LIFE,
        ),
    ),
    hint=_HINT_HALF_LIFE,
    crash_hint="g is a tensor of log-decays (any shape); return a tensor of the same shape.",
    rewrites=(),  # arithmetic
    params=("half_life",),
    doc="Check ``half_life(g) -> tokens``: how many tokens a constant log-decay ``g < 0`` takes "
    "to halve the memory, elementwise over a tensor.",
)

# --- the corrections of a chunk ----------------------------------------------------------------


def _corrections_reference(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """(I + A) u = β v with A[t, s] = β_t e^{γ_t-γ_s} k_t·k_s below the diagonal, γ = cumsum(g)."""
    gamma = g.cumsum(-1)  # (..., C)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).tril(-1).exp().tril(-1)  # (..., C, C)
    A = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay  # (..., C, C)
    T = A + torch.eye(k.shape[-2], dtype=k.dtype)  # (..., C, C)
    return torch.linalg.solve_triangular(T, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)


def _corrections_by_recurrence(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """Run the gated delta rule from an empty memory and keep each token's correction."""
    state = k.new_zeros(*k.shape[:-2], k.shape[-1], v.shape[-1])  # (..., Dk, Dv)
    us = []
    for t in range(k.shape[-2]):
        state = state * g[..., t, None, None].exp()
        u = beta[..., t, None] * (v[..., t, :] - (k[..., t, None, :] @ state).squeeze(-2))
        state = state + k[..., t, :, None] * u[..., None, :]
        us.append(u)
    return torch.stack(us, dim=-2)  # (..., C, Dv)


def _corrections_slip(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **slip: Any) -> Tensor:
    C = k.shape[-2]
    gamma = g.cumsum(-1)  # (..., C)
    below = torch.ones(C, C, dtype=torch.bool).tril(0 if slip.get("diagonal") else -1)
    log_decay = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # (..., C, C)
    decay = log_decay.masked_fill(~below, float("-inf")).exp()  # (..., C, C)
    if slip.get("no_decay"):
        decay = below.to(k.dtype)
    b_row = beta.unsqueeze(-2) if slip.get("beta_column") else beta.unsqueeze(-1)
    A = (k @ k.transpose(-1, -2)) * decay  # (..., C, C)
    A = A if slip.get("no_beta_in_A") else A * b_row
    if slip.get("minus"):
        A = -A
    if slip.get("no_system"):
        A = torch.zeros_like(A)
    T = A + torch.eye(C, dtype=k.dtype)  # (..., C, C)
    return torch.linalg.solve(T, beta.unsqueeze(-1) * v)  # (..., C, Dv)


def _corrections_inputs(gen: torch.Generator, batch: tuple[int, ...], C: int, Dk: int, Dv: int):
    k, v = _unit(gen, *batch, C, Dk), randn64(gen, *batch, C, Dv)
    g = -torch.rand((*batch, C), generator=gen, dtype=torch.float64)  # log-decays in (-1, 0]
    beta = torch.rand((*batch, C), generator=gen, dtype=torch.float64) * 0.8 + 0.2
    return k, v, g, beta


def _corrections_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1005)
    cases = []
    for batch, C, Dk, Dv in (((), 4, 3, 2), ((2, 3), 8, 8, 5), ((4,), 16, 6, 7)):
        label = f"corrections(k {(*batch, C, Dk)}, v {(*batch, C, Dv)}, g, beta)"
        cases.append(Case(label, _corrections_inputs(gen, batch, C, Dk, Dv)))
    return cases


#: What counts as solving the chunk's system at once.
SOLVERS = (
    torch.linalg.solve_triangular,
    torch.linalg.solve,
    torch.linalg.solve_ex,
    torch.linalg.inv,
    torch.linalg.inv_ex,
    torch.linalg.lu_solve,
    torch.triangular_solve,
    torch.inverse,
    Tensor.inverse,
)


class _Calls(TorchFunctionMode):
    """Counts the torch calls made while it is active, and notes a call of a solver."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.solved = 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        self.solved = self.solved or any(func is f for f in SOLVERS)
        return func(*args, **(kwargs or {}))


class TokenLoop(Exception):
    """The answer's torch calls grow with the chunk's length: it walks the tokens."""


class NoSolve(Exception):
    """The answer never called a linear solver."""


def _counted(answer: Callable[..., Any], args: tuple) -> tuple[Any, _Calls]:
    calls = _Calls()
    with calls:
        out = answer(*(t.clone() for t in args))
    return out, calls


def _corrections_run(answer: Callable[..., Any], case: Case) -> object:
    """The answer's corrections; on the chunk of 16 tokens, also its torch calls compared with
    those it makes on a chunk of 8 (same batch and head dims), and whether it solved a system."""
    out, calls = _counted(answer, case.args)
    k = case.args[0]
    if out is None or k.shape[-2] != 16:
        return out
    twin = _corrections_inputs(torch.Generator().manual_seed(16), tuple(k.shape[:-2]), 8, 6, 7)
    _, shorter = _counted(answer, twin)
    if calls.count != shorter.count:
        message = "made more torch calls for a chunk of 16 tokens than for one of 8: a loop over the tokens"
        raise TokenLoop(tr(message))
    if not calls.solved:
        message = "never called a linear solver (torch.linalg.solve_triangular, solve or inv)"
        raise NoSolve(tr(message))
    return out


def _corrections_by_inverse(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """T⁻¹ once, then one product: the same system, solved through its inverse."""
    C = k.shape[-2]
    gamma = g.cumsum(-1)[..., :, None]  # (..., C, 1)
    earlier = torch.arange(C)[None, :] < torch.arange(C)[:, None]  # (C, C): s < t
    decay = torch.where(earlier, (gamma - gamma.mT).clamp(max=0).exp(), 0.0)  # (..., C, C)
    T = torch.eye(C, dtype=k.dtype) + beta[..., :, None] * (k @ k.mT) * decay
    return torch.linalg.inv(T) @ (beta[..., None] * v)  # (..., C, Dv)


def _corrections_by_library(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """gated_delta_rule read with q = k: out_t = v_t - u_t/β_t + u_t, so u_t follows."""
    C, Dk, Dv = k.shape[-2], k.shape[-1], v.shape[-1]
    k4, v4 = k.reshape(1, -1, C, Dk), v.reshape(1, -1, C, Dv)  # (1, N, C, D)
    out = mha.gated_delta_rule(k4 * Dk**0.5, k4, v4, g.reshape(1, -1, C), beta.reshape(1, -1, C))
    assert isinstance(out, Tensor)
    b = beta[..., None]
    return b * (out.reshape(*v.shape[:-1], Dv) - v) / (b - 1)


def _corrections_by_private_helper(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """mha.gated_delta's private token loop, reached around gated_delta_rule, read as above."""
    C, Dk, Dv = k.shape[-2], k.shape[-1], v.shape[-1]
    k4, v4 = k.reshape(1, -1, C, Dk), v.reshape(1, -1, C, Dv)  # (1, N, C, D)
    state = k.new_zeros(1, k4.shape[1], Dk, Dv)
    out, _ = gated_delta._recurrent(k4, k4, v4, g.reshape(1, -1, C), beta.reshape(1, -1, C), state)
    b = beta[..., None]
    return b * (out.reshape(*v.shape[:-1], Dv) - v) / (b - 1)


_HINT_CORRECTIONS = (
    "With γ = g.cumsum(-1), token t's correction is u_t = β_t (v_t - Σ_{s<t} e^{γ_t-γ_s} "
    "(k_t·k_s) u_s): move the sum to the left, (I + A) u = β v with A[t, s] = β_t e^{γ_t-γ_s} "
    "k_t·k_s for s < t (0 on and above the diagonal), and solve the triangular system."
)
_CORRECTIONS_SOLVE = (
    "Right values, but the exercise is the chunk form: build the whole chunk's system "
    "(I + A) u = β v with tensor operations and solve it once "
    "(torch.linalg.solve_triangular), with no loop over the chunk's tokens."
)
_NO_CHUNKED = (
    "solve the chunk yourself, without mha.gated_delta_rule (or any function of mha.gated_delta)."
)


CHUNK_CORRECTIONS = Exercise(
    "check_chunk_corrections",
    "every token's correction u_t of a chunk; a linear solver called, and as many torch calls "
    "for 16 tokens as for 8 (no loop over the tokens)",
    _corrections_reference,
    _corrections_cases,
    variants=(lambda *args: _corrections_slip(*args), _corrections_by_inverse),
    mistakes=(
        (
            slipped(_corrections_slip, "no_system"),
            "β v alone is linear attention's write: each correction also subtracts what the "
            "earlier tokens of the chunk already wrote under k_t. " + _HINT_CORRECTIONS,
        ),
        (
            slipped(_corrections_slip, "no_decay"),
            "Between token s and token t the memory fades by e^{γ_t-γ_s}: weight A[t, s] by it. "
            + _HINT_CORRECTIONS,
        ),
        (
            slipped(_corrections_slip, "diagonal"),
            "A is strictly lower-triangular: the identity already stands for u_t itself, and "
            "token t reads only what tokens s < t wrote. " + _HINT_CORRECTIONS,
        ),
        (
            slipped(_corrections_slip, "beta_column"),
            "Row t of A is scaled by β_t, the strength of the token being corrected, not by "
            "β_s. " + _HINT_CORRECTIONS,
        ),
        (
            slipped(_corrections_slip, "no_beta_in_A"),
            "The whole error of token t is scaled by β_t, the part read from earlier tokens "
            "too: A[t, s] carries β_t. " + _HINT_CORRECTIONS,
        ),
        (
            slipped(_corrections_slip, "minus"),
            "Moving the subtracted sum to the left gives I + A, not I - A. " + _HINT_CORRECTIONS,
        ),
        (_corrections_by_recurrence, _CORRECTIONS_SOLVE),
        (_corrections_by_library, _NO_CHUNKED),
        (_corrections_by_private_helper, _NO_CHUNKED),
    ),
    hint=_HINT_CORRECTIONS,
    crash_hint="k is (..., C, Dk), v (..., C, Dv), g and beta (..., C); "
    "torch.linalg.solve_triangular(T, B, upper=False) solves T X = B for a lower-triangular T.",
    call=_corrections_run,
    forbidden=DELTA_BANNED,
    forbidden_hint=_NO_CHUNKED,
    rewrites=(mha.gated_delta_rule,),
    params=("corrections",),
    doc="Check ``corrections(k, v, g, beta) -> u (..., C, Dv)``: the corrections of a chunk that "
    "starts from an empty memory, k ``(..., C, Dk)``, v ``(..., C, Dv)``, g and beta ``(..., C)``; "
    "by one linear solve (torch.linalg.solve_triangular), without a loop over the tokens.",
)

# --- the decoding memory of a hybrid stack --------------------------------------------------------

#: Qwen3-Next-80B-A3B's attention fields (its config.json; also transformers' Qwen3NextConfig
#: defaults): 48 layers, every fourth a full-attention layer.
QWEN3_NEXT = {
    "num_hidden_layers": 48,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}


def _memory_reference(config: dict, seq_len: int, nbytes: int) -> int:
    """Full-attention layers: a key and a value per kv head and token; linear layers: one
    (Dk, Dv) state per value head, whatever the length."""
    kinds = config["layer_types"]
    kv = 2 * config["num_key_value_heads"] * config["head_dim"] * seq_len
    state = (
        config["linear_num_value_heads"]
        * config["linear_key_head_dim"]
        * config["linear_value_head_dim"]
    )
    return nbytes * sum(kv if kind == "full_attention" else state for kind in kinds)


def _memory_slip(config: dict, seq_len: int, nbytes: int, **slip: Any) -> int:
    c = config
    kinds = list(c["layer_types"])
    if slip.get("all_full"):
        kinds = ["full_attention"] * c["num_hidden_layers"]
    if slip.get("interval"):  # the layer types ignored: every fourth layer assumed full
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "x" for i in range(len(kinds))]
    full = kinds.count("full_attention")
    per_token = (1 if slip.get("keys_only") else 2) * c["num_key_value_heads"] * c["head_dim"]
    heads = c["linear_num_key_heads"] if slip.get("key_heads") else c["linear_num_value_heads"]
    Dk, Dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    state = heads * (Dk + Dv if slip.get("sum_dims") else Dk * Dv)
    if slip.get("state_grows"):
        state *= seq_len
    return nbytes * (full * per_token * seq_len + (len(kinds) - full) * state)


def _memory_by_layers(config: dict, seq_len: int, nbytes: int) -> int:
    total = 0
    for kind in config["layer_types"]:
        if kind == "full_attention":  # keys and values: (2, Hkv, seq_len, D)
            total += 2 * config["num_key_value_heads"] * seq_len * config["head_dim"] * nbytes
        else:  # one state (H_v, Dk, Dv)
            H, Dk = config["linear_num_value_heads"], config["linear_key_head_dim"]
            total += H * Dk * config["linear_value_head_dim"] * nbytes
    return total


def _toy(layer_types: list[str], **fields: int) -> dict:
    toy = dict(QWEN3_NEXT, num_hidden_layers=len(layer_types), layer_types=layer_types)
    return toy | fields


def _memory_cases() -> list[Case]:
    L, F_ = "linear_attention", "full_attention"
    configs = {
        "QWEN3_NEXT": QWEN3_NEXT,
        "toy, full layers 0 and 2": _toy([F_, L, F_, L, L], head_dim=64, linear_key_head_dim=32),
        "toy, linear only": _toy([L] * 3, linear_num_value_heads=4, linear_value_head_dim=16),
        "toy, full only": _toy([F_] * 2, num_key_value_heads=4),
        "toy, 1:1": _toy([L, F_] * 3, linear_num_key_heads=2, linear_num_value_heads=6),
    }
    calls = (
        ("QWEN3_NEXT", 4096, 2),
        ("QWEN3_NEXT", 262144, 2),
        ("QWEN3_NEXT", 1, 4),
        ("toy, full layers 0 and 2", 100, 4),
        ("toy, linear only", 1000, 2),
        ("toy, full only", 30, 1),
        ("toy, 1:1", 77, 2),
    )
    return [
        Case(f"decode_memory({name}, {seq_len}, {nbytes})", (configs[name], seq_len, nbytes))
        for name, seq_len, nbytes in calls
    ]


_HINT_MEMORY = (
    "Walk config['layer_types']: a 'full_attention' layer caches 2 · num_key_value_heads · "
    "head_dim numbers per token (seq_len tokens); a 'linear_attention' layer keeps one state of "
    "linear_num_value_heads · linear_key_head_dim · linear_value_head_dim numbers, whatever "
    "seq_len. Times bytes_per_element."
)


DECODE_MEMORY = Exercise(
    "check_decode_memory",
    "KV cache plus delta-rule states of hybrid stacks, Qwen3-Next's included",
    _memory_reference,
    _memory_cases,
    variants=(_memory_by_layers, lambda *args: _memory_slip(*args)),
    mistakes=(
        (
            slipped(_memory_slip, "all_full"),
            "Only the 'full_attention' layers keep a KV cache; the linear layers keep a "
            "fixed-size state. " + _HINT_MEMORY,
        ),
        (
            slipped(_memory_slip, "state_grows"),
            "A linear layer's state does not grow with the sequence: one (Dk, Dv) matrix per "
            "value head, for any seq_len. " + _HINT_MEMORY,
        ),
        (
            slipped(_memory_slip, "keys_only"),
            "A full-attention layer caches a key and a value per kv head and token. "
            + _HINT_MEMORY,
        ),
        (
            slipped(_memory_slip, "key_heads"),
            "There is one state per value head (linear_num_value_heads): the key heads are "
            "shared by several value heads, as in GQA. " + _HINT_MEMORY,
        ),
        (
            slipped(_memory_slip, "sum_dims"),
            "A state is a (Dk, Dv) matrix: Dk · Dv numbers per head, not Dk + Dv. " + _HINT_MEMORY,
        ),
        (
            slipped(_memory_slip, "interval"),
            "Read which layers are full from config['layer_types'], not from a fixed every "
            "fourth layer. " + _HINT_MEMORY,
        ),
    ),
    hint=_HINT_MEMORY,
    crash_hint="config is a dict with Hugging Face's field names (layer_types, "
    "num_key_value_heads, head_dim, linear_num_value_heads, linear_key_head_dim, "
    "linear_value_head_dim); return an int.",
    convert=whole,
    rewrites=(),  # arithmetic over a config: mha has no hybrid-memory function
    params=("decode_memory",),
    doc="Check ``decode_memory(config, seq_len, bytes_per_element) -> int``: the bytes a hybrid "
    "stack keeps to decode one sequence of ``seq_len`` tokens (KV cache of the full-attention "
    "layers plus the gated delta rule's states), for a config dict with HF's field names.",
)


EXERCISES = publish(globals())
