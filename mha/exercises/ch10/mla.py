"""Section 10.3, DeepSeek's MLA faithfully: the exercises as data for :mod:`.._harness`.

References: ``W_UK`` absorbed into the query and ``W_UV`` applied after the weighted sum, written
with ``torch.einsum`` on the rows of Hugging Face's ``kv_b_proj.weight``; the FLOPs and bytes per
cached token of an absorbed decode step. Mistakes: the stacked weight split as ``[all W_UK; all
W_UV]`` instead of head by head, the other projection's rows, the heads read from the wrong axis;
the value sum or the rope part left out or counted twice, bytes per head, numbers for bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mha.models import deepseek_v3

from .._harness import Case, Exercise, defined_in, publish, randn64, whole

# --- absorbing W_UK into the query ----------------------------------------------------------------


def _per_head(kv_b_weight: Tensor, H: int) -> Tensor:
    """``kv_b_proj.weight`` ``(H·(Dn + Dv), C)`` as ``(H, Dn + Dv, C)``: head h's rows together."""
    return kv_b_weight.reshape(H, -1, kv_b_weight.shape[-1])


def _absorb_query_reference(q_nope: Tensor, kv_b_weight: Tensor, qk_nope_head_dim: int) -> Tensor:
    """``q̃_h = W_UK_hᵀ q_h``: the first ``Dn`` rows of each head's block of ``kv_b_proj``."""
    w_uk = _per_head(kv_b_weight, q_nope.shape[1])[:, :qk_nope_head_dim]  # (H, Dn, C)
    return torch.einsum("bhld,hdc->bhlc", q_nope, w_uk)  # (B, H, L, C)


def _absorb_cases(dim: str) -> Callable[[], list[Case]]:
    """Shapes (B, H, L, Dn, Dv, C) with Dn ≠ Dv (a wrong split shows) and Dn = Dv (only the
    values tell); the first argument is q_nope (dim "nope") or the weighted latents ("latent")."""

    def cases() -> list[Case]:
        g = torch.Generator().manual_seed(103)
        out = []
        for B, H, L, Dn, Dv, C in ((2, 4, 3, 8, 6, 16), (1, 3, 5, 4, 4, 8), (2, 2, 1, 6, 10, 12)):
            w = randn64(g, H * (Dn + Dv), C)
            x = randn64(g, B, H, L, Dn if dim == "nope" else C)
            name = "absorb_query" if dim == "nope" else "absorb_values"
            label = f"{name}(x {tuple(x.shape)}, kv_b_weight {tuple(w.shape)}, {Dn})"
            out.append(Case(label, (x, w, Dn)))
        return out

    return cases


def _absorb_query_by_loop(q_nope: Tensor, kv_b_weight: Tensor, qk_nope_head_dim: int) -> Tensor:
    H, C = q_nope.shape[1], kv_b_weight.shape[1]
    per = kv_b_weight.shape[0] // H
    heads = []
    for h in range(H):
        w_uk = kv_b_weight[h * per : h * per + qk_nope_head_dim]  # (Dn, C): k_h = w_uk @ c
        heads.append(q_nope[:, h] @ w_uk)  # (B, L, C)
    return torch.stack(heads, dim=1).reshape(*q_nope.shape[:-1], C)


def _absorb_query_by_split(q_nope: Tensor, kv_b_weight: Tensor, qk_nope_head_dim: int) -> Tensor:
    H = q_nope.shape[1]
    blocks = kv_b_weight.unflatten(0, (H, -1))  # (H, Dn + Dv, C)
    w_uk, _ = blocks.split([qk_nope_head_dim, blocks.shape[1] - qk_nope_head_dim], dim=1)
    return q_nope @ w_uk  # (B, H, L, Dn) @ (H, Dn, C)


def _stacked_split(kv_b_weight: Tensor, H: int, Dn: int, which: str) -> Tensor:
    """The weight read as [all heads' W_UK; all heads' W_UV] (the slip)."""
    Dv = kv_b_weight.shape[0] // H - Dn
    if which == "uk":
        return kv_b_weight[: H * Dn].view(H, Dn, -1)
    return kv_b_weight[H * Dn :].view(H, Dv, -1)


_HINT_ABSORB = (
    "kv_b_proj.weight stacks, head after head, Dn rows of W_UK then Dv rows of W_UV: view it "
    "as (H, Dn + Dv, C). Head h's key is k = W_UK_h c, so q·k = (W_UK_hᵀ q)·c: the absorbed "
    "query is q_nope @ W_UK_h, (B, H, L, C)."
)

ABSORB_QUERY = Exercise(
    "check_absorb_query",
    "each head's query mapped into the latent space by its own W_UK",
    _absorb_query_reference,
    _absorb_cases("nope"),
    variants=(_absorb_query_by_loop, _absorb_query_by_split),
    mistakes=(
        (
            lambda q, w, Dn: q @ _stacked_split(w, q.shape[1], Dn, "uk"),
            "The rows are grouped by head, not by projection: head h's block holds its Dn "
            "rows of W_UK followed by its Dv rows of W_UV. " + _HINT_ABSORB,
        ),
        (
            lambda q, w, Dn: q @ _per_head(w, q.shape[1])[:, -Dn:],
            "These are rows of W_UV (the last rows of each head's block): the key projection "
            "is the first Dn rows. " + _HINT_ABSORB,
        ),
        (
            lambda q, w, Dn: q @ w.view(-1, q.shape[1], w.shape[1]).transpose(0, 1)[:, :Dn],
            "The head index is the outer one in kv_b_proj's rows, (H, Dn + Dv, C), not the "
            "inner one. " + _HINT_ABSORB,
        ),
    ),
    hint=_HINT_ABSORB,
    crash_hint="q_nope is (B, H, L, Dn) and kv_b_weight (H·(Dn + Dv), C); return (B, H, L, C).",
    rewrites=(),  # DeepSeek's modules absorb inside their whole attention, no function of this
    params=("absorb_query",),
    doc="Check ``absorb_query(q_nope, kv_b_weight, qk_nope_head_dim) -> (B, H, L, C)``.",
)

# --- applying W_UV after the weighted sum ---------------------------------------------------------


def _absorb_values_reference(
    weighted_latent: Tensor, kv_b_weight: Tensor, qk_nope_head_dim: int
) -> Tensor:
    """``Σ p v_h = W_UV_h (Σ p c)``: the last ``Dv`` rows of each head's block."""
    w_uv = _per_head(kv_b_weight, weighted_latent.shape[1])[:, qk_nope_head_dim:]  # (H, Dv, C)
    return torch.einsum("bhlc,hvc->bhlv", weighted_latent, w_uv)  # (B, H, L, Dv)


def _absorb_values_by_loop(pc: Tensor, kv_b_weight: Tensor, qk_nope_head_dim: int) -> Tensor:
    H = pc.shape[1]
    per = kv_b_weight.shape[0] // H
    heads = [pc[:, h] @ kv_b_weight[h * per + qk_nope_head_dim : (h + 1) * per].T for h in range(H)]
    return torch.stack(heads, dim=1)  # (B, H, L, Dv)


def _absorb_values_by_linear(pc: Tensor, kv_b_weight: Tensor, qk_nope_head_dim: int) -> Tensor:
    """Expand every head's values as kv_b_proj would, then keep each head's own block."""
    H = pc.shape[1]
    full = torch.nn.functional.linear(pc, kv_b_weight)  # (B, H, L, H·(Dn + Dv)): all heads
    full = full.unflatten(-1, (H, -1))  # (B, H, L, H, Dn + Dv)
    own = full.diagonal(dim1=1, dim2=3).movedim(-1, 1)  # (B, H, L, Dn + Dv): head h's block
    return own[..., qk_nope_head_dim:]


_HINT_VALUES = (
    "Each head's block of kv_b_proj.weight, viewed as (H, Dn + Dv, C), ends with its Dv rows "
    "of W_UV; v = W_UV_h c, so Σ p v = W_UV_h (Σ p c): multiply the weighted latents by "
    "W_UV_hᵀ, (B, H, L, C) -> (B, H, L, Dv)."
)

ABSORB_VALUES = Exercise(
    "check_absorb_values",
    "each head's weighted latents expanded by its own W_UV, once, after the sum",
    _absorb_values_reference,
    _absorb_cases("latent"),
    variants=(_absorb_values_by_loop, _absorb_values_by_linear),
    mistakes=(
        (
            lambda pc, w, Dn: pc @ _stacked_split(w, pc.shape[1], Dn, "uv").transpose(-2, -1),
            "The rows are grouped by head, not by projection: head h's block holds its Dn "
            "rows of W_UK followed by its Dv rows of W_UV. " + _HINT_VALUES,
        ),
        (
            lambda pc, w, Dn: (
                pc @ _per_head(w, pc.shape[1])[:, : w.shape[0] // pc.shape[1] - Dn].mT
            ),
            "These are rows of W_UK (the first rows of each head's block): the value "
            "projection is the last Dv rows. " + _HINT_VALUES,
        ),
    ),
    hint=_HINT_VALUES,
    crash_hint="weighted_latent is (B, H, L, C) and kv_b_weight (H·(Dn + Dv), C); return "
    "(B, H, L, Dv).",
    rewrites=(),  # as absorb_query: only inside the modules' whole attention
    params=("absorb_values",),
    doc="Check ``absorb_values(weighted_latent, kv_b_weight, qk_nope_head_dim) -> (B, H, L, Dv)``.",
)

# --- the cost of an absorbed decode step ----------------------------------------------------------


def _decode_cost_reference(
    num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, nbytes: int
) -> tuple[int, int]:
    """Per cached token: every head scores C + R numbers and sums C; the entry is read once."""
    H, C, R = num_heads, kv_lora_rank, qk_rope_head_dim
    return H * (2 * (C + R) + 2 * C), (C + R) * nbytes


def _decode_cost_cases() -> list[Case]:
    shapes = (  # heads, latent, rope dims, bytes per number
        ("DeepSeek-V3, bfloat16", (128, 512, 64, 2)),
        ("DeepSeek-V2-Lite, float32", (16, 512, 64, 4)),
        ("toy, 8-bit", (4, 32, 8, 1)),
        ("no rope part, 16-bit", (8, 64, 0, 2)),
    )
    return [Case(f"mla_decode_cost{args} ({what})", args) for what, args in shapes]


def _decode_cost_by_head(H: int, C: int, R: int, nbytes: int) -> tuple[int, int]:
    flops = 0
    for _ in range(H):
        flops += 2 * C + 2 * R  # q̃·c and q_R·k_R, a multiply-add per number
        flops += 2 * C  # p · c into the weighted sum
    return flops, nbytes * C + nbytes * R


_HINT_COST = (
    "Per cached token, every one of the num_heads heads scores the whole entry (2 · "
    "(kv_lora_rank + qk_rope_head_dim) FLOPs) and adds the latent into its weighted sum (2 · "
    "kv_lora_rank FLOPs); the entry, kv_lora_rank + qk_rope_head_dim numbers, is read once for "
    "all heads."
)

_NO_COST = "count it yourself, without mha.models.deepseek_v3 (absorbed_decode_cost ...)."


def _cost_by_private_helper(H: int, C: int, R: int, nb: int) -> tuple[int, int]:
    """The sizes read through DeepSeek's module's private config reader, the counts by hand."""
    deepseek_v3._rope_config({"rope_theta": 10000.0, "rope_scaling": None})
    return _decode_cost_reference(H, C, R, nb)


MLA_DECODE_COST = Exercise(
    "check_mla_decode_cost",
    "FLOPs and bytes per cached token of an absorbed MLA decode step",
    _decode_cost_reference,
    _decode_cost_cases,
    variants=(
        _decode_cost_by_head,
        lambda H, C, R, nb: (2 * H * (2 * C + R), nb * (R + C)),
    ),
    mistakes=(
        (
            lambda H, C, R, nb: (H * 2 * (C + R), (C + R) * nb),
            "The weighted sum is missing: after the scores, every head adds p · c, 2 · "
            "kv_lora_rank FLOPs per cached token. " + _HINT_COST,
        ),
        (
            lambda H, C, R, nb: (H * 4 * (C + R), (C + R) * nb),
            "The value is the latent alone (kv_lora_rank numbers): the rope key takes part in "
            "the scores only. " + _HINT_COST,
        ),
        (
            lambda H, C, R, nb: (H * (2 * (C + R) + 2 * C), H * (C + R) * nb),
            "The cache entry is shared by all heads (MQA over the latents) and read once, not "
            "once per head: that is why the intensity is so high. " + _HINT_COST,
        ),
        (
            lambda H, C, R, nb: (H * (C + R + C), (C + R) * nb),
            "A multiply-add is 2 FLOPs. " + _HINT_COST,
        ),
        (
            lambda H, C, R, nb: (H * (2 * (C + R) + 2 * C), (2 * C + R) * nb),
            "The latent is read once and serves as key and value: kv_lora_rank + "
            "qk_rope_head_dim numbers. " + _HINT_COST,
        ),
        (
            lambda H, C, R, nb: (H * (2 * (C + R) + 2 * C), C + R),
            "These are numbers, not bytes: multiply by bytes_per_element.",
        ),
        (
            lambda H, C, R, nb: deepseek_v3.absorbed_decode_cost(H, C, R, bytes_per_element=nb),
            _NO_COST,
        ),
        (_cost_by_private_helper, _NO_COST),
    ),
    hint=_HINT_COST,
    crash_hint="mla_decode_cost(num_heads, kv_lora_rank, qk_rope_head_dim, bytes_per_element) "
    "returns two ints: (flops, bytes) per cached token.",
    convert=whole,
    outputs=("flops", "bytes"),
    forbidden=tuple(defined_in(deepseek_v3)),
    forbidden_hint=_NO_COST,
    rewrites=(deepseek_v3.absorbed_decode_cost,),
    params=("mla_decode_cost",),
    doc="Check ``mla_decode_cost(num_heads, kv_lora_rank, qk_rope_head_dim, bytes_per_element) "
    "-> (flops, bytes)`` per cached token of an absorbed decode step.",
)


EXERCISES = publish(globals())
