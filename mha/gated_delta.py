"""The gated delta rule: linear attention whose state is a memory that corrects itself and forgets.

Linear attention (``mha/linear_attention.py``) keeps one ``(Dk, Dv)`` matrix, the sum of
``k_jᵀ v_j``, and reads it with each query. Read that matrix ``S`` as a *fast-weight memory*: it
maps a key to a value, ``kᵀ S``. Plain linear attention only ever adds to it, so after many tokens
a key reads back a blur of everything written under similar keys. The **delta rule** (Schlag et
al., 2021; Yang et al., 2024, "DeltaNet") writes only the correction: it reads what the memory
predicts for ``k_t``, and moves it a step ``β_t`` towards ``v_t``,

    S_t = S_{t-1} + k_t (β_t (v_t - k_tᵀ S_{t-1}))ᵀ,

and the **gated** delta rule (Yang et al., 2025, "Gated Delta Networks", the linear layers of
Qwen3-Next) first lets the whole memory fade by ``exp(g_t) ≤ 1``:

    S_t = exp(g_t) S_{t-1} + k_t (β_t (v_t - exp(g_t) k_tᵀ S_{t-1}))ᵀ,      out_t = q_tᵀ S_t / √Dk.

The state is ``(Dk, Dv)`` per head whatever the sequence length, where a softmax layer's KV cache
grows by one key and one value per token.

* :func:`gated_delta_rule` — both forms behind one call: ``chunk_size=None`` runs the recurrence
  above token by token (what decoding does); an integer runs the *chunked* form, which turns the
  ``chunk_size`` steps inside a chunk into matrix products and one triangular solve (the
  "UT transform" of the DeltaNet papers) and walks only from chunk to chunk (what a prompt does).
  Both give the same numbers, and both equal Hugging Face's torch reference for Qwen3-Next
  (``tests/test_gated_delta.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import validation as validate

__all__ = ["gated_delta_rule"]

_QKV = "(B, H, L, D)"


def gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int | None = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal gated delta rule over a sequence, by recurrence or by chunks.

    Args:
        query: the queries, expected L2-normalised along ``Dk`` (the model normalises them; this
            function scales them by ``1/√Dk`` and does not normalise).
        key: the keys, expected L2-normalised along ``Dk`` (the delta rule's step is stable for
            ``‖k‖ = 1`` and ``0 ≤ β ≤ 1``).
        value: the values written into the memory.
        g: the log of each token's decay: the memory is multiplied by ``exp(g_t)`` before token
            ``t`` writes, so ``g ≤ 0`` (``0`` keeps everything, very negative forgets).
        beta: each token's writing strength, usually a sigmoid in ``(0, 1)``: ``1`` replaces
            what the memory held for ``k_t`` by ``v_t``, ``0`` writes nothing.
        chunk_size: ``None`` for the token-by-token recurrence; otherwise the chunked form with
            chunks of this many tokens. A length that is not a multiple of ``chunk_size`` is
            padded at the end with tokens that write nothing (``β = 0``, ``g = 0``), whose
            outputs are dropped: the outputs and the final state are unchanged by the padding.
        initial_state: the memory before the first token (e.g. the final state of the previous
            chunk of a prompt); zeros when ``None``.
        output_final_state: also return the memory after the last token.

    Shapes:
        query ``(B, H, L, Dk)``, key ``(B, H, L, Dk)``, value ``(B, H, L, Dv)``, g and beta
        ``(B, H, L)``, initial_state ``(B, H, Dk, Dv)`` -> out ``(B, H, L, Dv)``, and the final
        state ``(B, H, Dk, Dv)`` with ``output_final_state=True``.
        A model with fewer query/key heads than value heads (Qwen3-Next: 16 and 32) repeats
        them first, ``query.repeat_interleave(H // Hk, dim=1)``, as Hugging Face's code does.

    Returns:
        ``out``, or ``(out, final_state)``. ``out`` has ``value``'s dtype; float16/bfloat16
        inputs are computed in float32 (the state is a running sum), and the state is returned
        in the dtype it was computed in (float32, or float64 for float64 inputs).
    """
    _check(query, key, value, g, beta, initial_state)
    if chunk_size is not None:
        chunk_size = validate.positive_int("chunk_size", chunk_size)
    output_final_state = validate.flag("output_final_state", output_final_state)
    compute = torch.float64 if value.dtype == torch.float64 else torch.float32
    q, k, v, g_, b = (t.to(compute) for t in (query, key, value, g, beta))
    q = q * q.shape[-1] ** -0.5  # (B, H, L, Dk)  the softmax's 1/√Dk, applied once
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    if initial_state is None:
        state = v.new_zeros(B, H, Dk, Dv)  # (B, H, Dk, Dv)
    else:
        state = initial_state.to(compute)  # (B, H, Dk, Dv)
    if chunk_size is None:
        out, state = _recurrent(q, k, v, g_, b, state)
    else:
        out, state = _chunked(q, k, v, g_, b, state, chunk_size)
    out = out.to(value.dtype)  # (B, H, L, Dv)
    return (out, state) if output_final_state else out


def _check(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> None:
    """Every argument's type and shape, with the shapes in the message."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        validate.tensor(name, t, floating=True, ndim=4, layout=_QKV)
    for name, t in (("g", g), ("beta", beta)):
        validate.tensor(name, t, floating=True, ndim=3, layout="(B, H, L)")
    if query.shape != key.shape:
        raise ValueError(
            f"query and key must have the same shape (B, H, L, Dk), got query "
            f"{validate.shape(query)} and key {validate.shape(key)}"
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value must have key's (B, H, L), got key {validate.shape(key)} and value "
            f"{validate.shape(value)}"
        )
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != key.shape[:3]:
            raise ValueError(
                f"{name} must have shape (B, H, L) = {tuple(key.shape[:3])}, got {name} "
                f"{validate.shape(t)} for key {validate.shape(key)}"
            )
    if state is not None:
        validate.tensor("initial_state", state, floating=True, ndim=4, layout="(B, H, Dk, Dv)")
        want = (*key.shape[:2], key.shape[-1], value.shape[-1])
        if tuple(state.shape) != want:
            raise ValueError(
                f"initial_state must have shape (B, H, Dk, Dv) = {want}, got initial_state "
                f"{validate.shape(state)} for key {validate.shape(key)} and value "
                f"{validate.shape(value)}"
            )


def _recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The definition, one token at a time: fade, read what the memory predicts, correct it."""
    outs = []
    for t in range(k.shape[2]):
        state = state * g[:, :, t, None, None].exp()  # (B, H, Dk, Dv)  forget a little
        k_t = k[:, :, t]  # (B, H, Dk)
        predicted = (k_t.unsqueeze(-2) @ state).squeeze(-2)  # (B, H, Dv)  k_tᵀ S
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)  # (B, H, Dv)  the correction
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)  # (B, H, Dk, Dv)  + k_t δ_tᵀ
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))  # (B, H, Dv)  q_tᵀ S_t
    return torch.stack(outs, dim=2), state  # (B, H, L, Dv), (B, H, Dk, Dv)


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, C: int
) -> tuple[Tensor, Tensor]:
    """The same recurrence, ``C`` tokens at a time.

    Inside a chunk, with ``γ_t = g_1 + … + g_t`` (the log of the decay since the chunk began)
    and ``S_0`` the state it starts from, unrolling the recurrence gives the corrections
    ``u_t = δ_t`` as the solution of one unit lower-triangular system,

        u_t + Σ_{s<t} β_t e^{γ_t-γ_s} (k_t·k_s) u_s = β_t v_t - β_t e^{γ_t} k_tᵀ S_0,

    then every output and the next state from matrix products:
    ``out_t = e^{γ_t} q_tᵀ S_0 + Σ_{s≤t} e^{γ_t-γ_s} (q_t·k_s) u_s`` and
    ``S_C = e^{γ_C} S_0 + Σ_s e^{γ_C-γ_s} k_s u_sᵀ``.
    """
    B, H, L, Dk = k.shape
    pad = -L % C  # padded tokens write nothing (β = 0) and keep the memory (g = 0)
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # (B, H, L + pad, D)
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))  # (B, H, L + pad)
    N = (L + pad) // C
    q, k, v = (t.unflatten(2, (N, C)) for t in (q, k, v))  # (B, H, N, C, D)
    gamma = g.unflatten(2, (N, C)).cumsum(-1)  # (B, H, N, C)  log-decay since the chunk began
    b = beta.unflatten(2, (N, C)).unsqueeze(-1)  # (B, H, N, C, 1)

    # decay from token s to token t of a chunk, e^{γ_t-γ_s} for s ≤ t; -inf above the diagonal
    # before exp, so that a large positive difference never overflows
    future = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)  # (C, C)
    log_decay = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # (B, H, N, C, C)
    decay = log_decay.masked_fill(future, float("-inf")).exp()  # (B, H, N, C, C)

    # the unit lower-triangular system (I + A) u = rhs, solved for v and for S_0's term at once
    A = (b * k @ k.transpose(-1, -2) * decay).tril(-1)  # (B, H, N, C, C)  β_t e^{..} k_t·k_s
    T = A + torch.eye(C, dtype=k.dtype, device=k.device)  # (B, H, N, C, C)
    rhs = torch.cat([b * v, b * gamma.exp().unsqueeze(-1) * k], dim=-1)  # (B, H, N, C, Dv+Dk)
    sol = torch.linalg.solve_triangular(T, rhs, upper=False, unitriangular=True)
    u_v, w = sol.split([v.shape[-1], Dk], dim=-1)  # (B, H, N, C, Dv), (B, H, N, C, Dk)

    attn = q @ k.transpose(-1, -2) * decay  # (B, H, N, C, C)  causal within the chunk
    q_in = q * gamma.exp().unsqueeze(-1)  # (B, H, N, C, Dk)  reads S_0 faded by e^{γ_t}
    k_out = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # (B, H, N, C, Dk)  fade to the end
    outs = []
    for n in range(N):  # only the chunks are sequential
        u = u_v[:, :, n] - w[:, :, n] @ state  # (B, H, C, Dv)  the corrections δ_t
        outs.append(q_in[:, :, n] @ state + attn[:, :, n] @ u)  # (B, H, C, Dv)
        chunk_decay = gamma[:, :, n, -1, None, None].exp()  # (B, H, 1, 1)  e^{γ_C}
        state = state * chunk_decay + k_out[:, :, n].transpose(-1, -2) @ u  # (B, H, Dk, Dv)
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :L]  # (B, H, L, Dv)  padding dropped
    return out, state
