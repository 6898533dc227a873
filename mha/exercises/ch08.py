"""Chapter 8, attention in today's models: the exercises as data for :mod:`._harness`.

References: RoPE as complex multiplication (``torch.polar``), a prefix-LM ``mask_mod`` against the
dense mask built by broadcasting (the learner's evaluated by FlexAttention's ``create_mask``), the
FLOPs and bytes of a decode step counted as the chapter's ``attention_traffic``, the merge of
split-KV partials by the full softmax over the concatenated scores, a block table read by its
definition, the bytes of a KV cache summed layer by layer; mistakes: neighbour (interleaved)
pairs, the frequency exponent without its 2, the rotation backwards, the positions ignored;
``and``/``or`` on tensors, the prefix not read at ``b``, causal only, prefix only, ``&`` for
``|``, the prefix off by one or tested on the query, the diagonal missing, causality backwards;
FLOPs per kv head or halved, the batch missing (in both counts or in the bytes), only K read,
the cache read per query head, the query and output left out or counted per kv head, numbers
for bytes; partials averaged, ``exp(lse)`` without the shift (overflow), no renormalisation,
the shift by the first split's lse (NaN for an empty split), the weights broadcast along the
rows; the table skipped, block and offset swapped, sequence and block swapped; only keys cached,
query heads for kv heads, the window ignored, applied to every layer, to none when
``window_layers`` is None, to the wrong layers, or kept at its full size for a short context,
MLA counted as heads, without its RoPE key or twice; and the library's own functions, which the
exercises ban.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

import mha
from mha.flex import MaskMod
from mha.kv_memory import CONFIGS, AttentionConfig

from ._harness import Case, Exercise, ExerciseError, as_int, publish, tr


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# --- RoPE -----------------------------------------------------------------------------------------


def _rope_reference(x: Tensor, positions: Tensor) -> Tensor:
    """Pair (x_i, x_{i+D/2}) as the complex number x_i + j·x_{i+D/2}, times e^{j·p·θ_i}."""
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)  # (D/2,)
    turn = torch.polar(
        torch.ones(()).double(), positions.double()[:, None] * theta
    )  # (L, D/2) complex
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * turn  # (..., L, D/2)
    return torch.cat([z.real, z.imag], dim=-1)  # (..., L, D)


def _rope_slip(x: Tensor, positions: Tensor, **slip: bool) -> Tensor:
    """RoPE with one of the usual slips."""
    D = x.shape[-1]
    i = torch.arange(D // 2, dtype=torch.float64)  # pair index
    theta = 10000.0 ** (-i / D if slip.get("no_two") else -2 * i / D)  # (D/2,)
    pos = torch.arange(x.shape[-2]) if slip.get("ignore_positions") else positions
    angles = pos.double()[:, None] * theta  # (L, D/2)
    cos, sin = angles.cos(), angles.sin()
    if slip.get("backwards"):
        sin = -sin
    if slip.get("interleaved"):  # pairs (2i, 2i + 1), RoFormer's layout
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)  # (..., L, D)


def _rope_case(label: str, x: Tensor, positions: Tensor) -> Case:
    """A RoPE written in float32 (as models do) turns by angles p·θ rounded to float32: an error
    of about p · 1e-7 radians, which the tolerance allows (a wrong rotation is off by O(1))."""
    tol = 1e-6 * max(1, int(positions.abs().max()))
    return Case(label, (x, positions), atol=tol, rtol=tol)


def _rope_cases() -> list[Case]:
    g = torch.Generator().manual_seed(80)
    return [
        _rope_case(
            "rope(x, positions) with x (2, 3, 6, 8), positions 0…5",
            _randn(g, 2, 3, 6, 8),
            torch.arange(6),
        ),
        _rope_case(
            "rope(x, positions) with x (4, 16), positions [5, 900, 17, 3]",
            _randn(g, 4, 16),
            torch.tensor([5, 900, 17, 3]),
        ),
    ]


def _rope_hugging_face(x: Tensor, positions: Tensor) -> Tensor:
    """Hugging Face's way, in float32: cos and sin of shape (L, D), and rotate_half."""
    D = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # (D/2,)
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # (L, D)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def _rope_by_rotation_matrices(x: Tensor, positions: Tensor) -> Tensor:
    """Each pair times its 2×2 rotation matrix [[cos, -sin], [sin, cos]]."""
    D = x.shape[-1]
    theta = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    a = positions.double()[:, None] * theta  # (L, D/2)
    rot = torch.stack(
        [torch.stack([a.cos(), -a.sin()], -1), torch.stack([a.sin(), a.cos()], -1)], -2
    )  # (L, D/2, 2, 2)
    pairs = torch.stack([x[..., : D // 2], x[..., D // 2 :]], -1)  # (..., L, D/2, 2)
    turned = (rot @ pairs.unsqueeze(-1)).squeeze(-1)  # (..., L, D/2, 2)
    return torch.cat([turned[..., 0], turned[..., 1]], -1)


_HINT_ROPE = (
    "Pair coordinate i with i + D/2 (x1, x2 = the two halves) and turn each pair by "
    "p·θ_i with θ_i = 10000 ** (-2i / D), i = 0 … D/2-1: "
    "(x1·cos - x2·sin, x2·cos + x1·sin)."
)


def _rope_mistake(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, positions: _rope_slip(x, positions, **{name: True})


_NO_APPLY_ROPE = "write the rotation yourself, without mha.apply_rope."
ROPE = Exercise(
    "check_rope",
    "equals RoPE as complex multiplication (rotate-half pairs, base 10000, float64)",
    _rope_reference,
    _rope_cases,
    variants=(partial(_rope_slip), _rope_hugging_face, _rope_by_rotation_matrices),
    mistakes=(
        (
            _rope_mistake("interleaved"),
            "These are neighbour pairs (2i, 2i + 1), RoFormer's layout (and Meta's Llama code); "
            "Hugging Face transformers' Llama (and this course) pairs coordinate i with i + D/2. "
            + _HINT_ROPE,
        ),
        (
            _rope_mistake("no_two"),
            "The exponent is -2i/D (i counts pairs, 2i the coordinates): with -i/D the slowest "
            "pair turns at 10000 ** -0.5 instead of about 1/10000. " + _HINT_ROPE,
        ),
        (
            _rope_mistake("backwards"),
            "The pairs turn the wrong way: the sine's sign is flipped. " + _HINT_ROPE,
        ),
        (
            _rope_mistake("ignore_positions"),
            "Use the positions you are given (they need not be 0 … L-1, e.g. while decoding). "
            + _HINT_ROPE,
        ),
        (mha.apply_rope, _NO_APPLY_ROPE),
        (lambda x, positions: mha.apply_rope(x, positions), _NO_APPLY_ROPE),
    ),
    hint=_HINT_ROPE,
    crash_hint="x is (..., L, D) and positions (L,): the angles positions[:, None] * theta are "
    "(L, D/2) and broadcast over the leading dims.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=(mha.apply_rope,),
    forbidden_hint=_NO_APPLY_ROPE,
    params=("rope",),
    doc="Check ``rope(x, positions) -> (..., L, D)``: x ``(..., L, D)`` rotated by RoPE with "
    "base 10000 and rotate-half pairs, ``positions`` an integer tensor ``(L,)``.",
)


# --- a prefix-LM mask_mod for FlexAttention -------------------------------------------------------


def _prefix_lm_reference(prefix_lengths: Tensor) -> MaskMod:
    """A key is visible if it is in the sequence's prefix or not after the query."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < prefix_lengths[b]) | (kv_idx <= q_idx)

    return mask_mod


def _prefix_lm_dense(prefix_lengths: Tensor, L: int) -> Tensor:
    """The prefix-LM keep-mask as a dense ``(B, 1, L, L)`` tensor, built by broadcasting."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]  # (L, 1), (1, S)
    in_prefix = j < prefix_lengths[:, None, None]  # (B, 1, S)
    return (in_prefix | (j <= i)).unsqueeze(1)  # (B, 1, L, S)


def _prefix_lm_cases() -> list[Case]:
    """Prefixes of 0 (causal), 1, a few and the whole sequence, several per batch."""
    cases = []
    for prefixes, L in (([3, 0, 8], 8), ([1, 5], 12), ([6, 2, 10, 4], 10)):
        p = torch.tensor(prefixes)
        label = f"create_mask(prefix_lm(torch.tensor({prefixes})), {len(prefixes)}, 1, {L}, {L})"
        cases.append(Case(label, (p, L), expected=_prefix_lm_dense(p, L)))
    return cases


def _prefix_lm_mask(answer: Callable[[Tensor], object], case: Case) -> object:
    """The learner's mask_mod evaluated by FlexAttention's own ``create_mask`` (it vmaps the
    function over every (b, h, q_idx, kv_idx)): ``(B, 1, L, S)``."""
    from torch.nn.attention.flex_attention import create_mask  # only when a check runs

    prefix_lengths, L = case.args
    mask_mod = answer(prefix_lengths.clone())
    if mask_mod is None:
        return None  # the stub's factory: not attempted
    if not callable(mask_mod):
        kind = type(mask_mod).__name__
        raise ExerciseError(
            tr("prefix_lm should return a mask_mod function, got {kind}.", kind=kind)
        )
    return create_mask(mask_mod, len(prefix_lengths), 1, L, L, device="cpu")


def _prefix_lm_by_or_masks(prefix_lengths: Tensor) -> MaskMod:
    """FlexAttention's own combinator: causal, or in the prefix."""
    from torch.nn.attention.flex_attention import or_masks

    def in_prefix(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < prefix_lengths[b]

    return or_masks(mha.flex.causal, in_prefix)


def _prefix_mod(keep: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[[Tensor], MaskMod]:
    """``prefix_lengths -> mask_mod`` from ``keep(prefix, q_idx, kv_idx)``, prefix read at b."""
    return lambda p: lambda b, h, q, kv: keep(p[b], q, kv)


_HINT_PREFIX_LM = (
    "Query q_idx may see key kv_idx if the key is in sequence b's prefix "
    "(kv_idx < prefix_lengths[b]) or not after the query (kv_idx <= q_idx): join the two "
    "with |."
)

PREFIX_LM = Exercise(
    "check_prefix_lm",
    "bidirectional inside each sequence's prefix, causal after it (prefixes 0 … L)",
    _prefix_lm_reference,
    _prefix_lm_cases,
    variants=(
        _prefix_mod(lambda p, q, kv: ~((kv > q) & (kv >= p))),
        _prefix_lm_by_or_masks,
        _prefix_mod(lambda p, q, kv: kv < torch.maximum(q + 1, p)),
    ),
    mistakes=(
        (
            lambda p: lambda b, h, q, kv: (kv < p[b]) or (kv <= q),
            "A mask_mod is called on tensors (FlexAttention vmaps it), and Python's and, or, "
            "not and if need a single True or False: combine conditions with |, & and ~ "
            "(or torch.where). " + _HINT_PREFIX_LM,
        ),
        (
            lambda p: lambda b, h, q, kv: (kv < p) | (kv <= q),
            "prefix_lengths holds one prefix per sequence: the mask_mod sees one b at a time "
            "and reads its sequence's with prefix_lengths[b]. " + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: kv <= q),
            "This is plain causal attention: the prefix is missing. Every query may also see "
            "the whole prefix, including the prefix keys after it. " + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: kv < p),
            "After the prefix, attention is causal: a query also sees every key up to itself "
            "(kv_idx <= q_idx), not only the prefix. " + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: (kv < p) & (kv <= q)),
            "Both conditions with & keep only prefix keys that are also causal: the prefix "
            "becomes causal too. A key is visible if either holds: |. " + _HINT_PREFIX_LM,
        ),
        (
            lambda p: lambda b, h, q, kv: (kv < p[0]) | (kv <= q),
            "Every sequence has its own prefix: read prefix_lengths[b], not sequence 0's. "
            + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: (kv <= p) | (kv <= q)),
            "Off by one: a prefix of p tokens holds positions 0 … p-1, so the test is "
            "kv_idx < prefix_lengths[b], not <=. " + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: (q < p) | (kv <= q)),
            "A prefix query sees the whole prefix, not the tokens after it: the prefix test is "
            "on the key (kv_idx < prefix), not on the query. " + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: (kv < p) | (kv < q)),
            "A query also sees itself: the causal part is kv_idx <= q_idx, not <. "
            + _HINT_PREFIX_LM,
        ),
        (
            _prefix_mod(lambda p, q, kv: (kv < p) | (kv >= q)),
            "The causal part is backwards: a query sees the keys before it, kv_idx <= q_idx. "
            + _HINT_PREFIX_LM,
        ),
    ),
    hint=_HINT_PREFIX_LM,
    crash_hint="prefix_lm(prefix_lengths) returns a mask_mod(b, h, q_idx, kv_idx); FlexAttention "
    "calls it on 0-dim integer tensors and it must return a bool tensor (prefix_lengths[b] is "
    "sequence b's prefix).",
    call=_prefix_lm_mask,
    params=("prefix_lm",),
    doc="Check ``prefix_lm(prefix_lengths) -> mask_mod``: a FlexAttention ``mask_mod(b, h, q_idx, "
    "kv_idx)`` for a prefix LM, bidirectional among the first ``prefix_lengths[b]`` tokens of "
    "sequence ``b`` and causal after them; ``prefix_lengths`` an integer tensor ``(B,)``. The "
    "checker evaluates it with ``torch.nn.attention.flex_attention.create_mask``.",
)


# --- the traffic of a decode step ---------------------------------------------------------------


def _decode_traffic_reference(
    batch: int, num_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, nbytes: int
) -> tuple[int, int]:
    """(FLOPs, bytes) of one decode step, counted as the chapter's ``attention_traffic`` (L = 1):
    4D FLOPs per (query head, key); each query and output once, each cached key and value once."""
    flops = batch * num_heads * 4 * head_dim * seq_len
    numbers = batch * (2 * num_heads * head_dim + 2 * num_kv_heads * seq_len * head_dim)
    return flops, numbers * nbytes


def _decode_traffic_cases() -> list[Case]:
    shapes = (  # batch, query heads, kv heads, cached tokens, head dim, bytes per number
        ("one sequence, MHA, 16-bit", (1, 32, 32, 4096, 128, 2)),
        ("8 sequences, GQA with 8 kv heads, 16-bit", (8, 32, 8, 1024, 128, 2)),
        ("4 sequences, MQA, float32", (4, 71, 1, 2048, 64, 4)),
        ("3 sequences, GQA with 4 kv heads, 8-bit", (3, 16, 4, 100, 256, 1)),
    )
    return [Case(f"decode_traffic{args} ({what})", args) for what, args in shapes]


def _whole(value: object) -> object:
    """A count as an int if it is one (an integral float, a numpy or 0-dim tensor integer); a
    pair of counts as a tuple. Anything else is left for the checker to reject."""
    if isinstance(value, (tuple, list)):
        return tuple(_whole(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, (bool, int)) and hasattr(value, "__index__"):
        try:
            return value.__index__()
        except TypeError:  # a float tensor
            return value
    return value


def _traffic(flops: Callable[..., int], numbers: Callable[..., int], times_bytes: bool = True):
    """A decode-traffic answer from its FLOP count and its count of numbers moved."""

    def answer(B: int, H: int, Hkv: int, S: int, D: int, nb: int) -> tuple[int, int]:
        moved = numbers(B, H, Hkv, S, D)
        return flops(B, H, Hkv, S, D), moved * nb if times_bytes else moved

    return answer


def _right_flops(B: int, H: int, Hkv: int, S: int, D: int) -> int:
    return B * H * 4 * D * S


def _right_numbers(B: int, H: int, Hkv: int, S: int, D: int) -> int:
    return B * (2 * H * D + 2 * Hkv * S * D)


def _decode_traffic_by_head(
    batch: int, num_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, nbytes: int
) -> tuple[int, int]:
    """Head by head: each query head's pairs, queries and outputs; each kv head's cache."""
    flops = moved = 0
    for _ in range(batch):
        for _ in range(num_heads):
            flops += seq_len * (2 * head_dim + 2 * head_dim)  # q·k, then p·v
            moved += 2 * head_dim * nbytes  # its query in, its output out
        moved += num_kv_heads * 2 * seq_len * head_dim * nbytes  # K and V of the cache
    return flops, moved


_HINT_TRAFFIC = {
    "flops": "FLOPs = batch · num_heads · 4 · head_dim · seq_len: every query head scores "
    "seq_len keys (q·k, 2·head_dim FLOPs each) and sums as many values (2·head_dim each).",
    "bytes": "bytes = batch · bytes_per_element · (2 · num_heads · head_dim + 2 · num_kv_heads "
    "· seq_len · head_dim): each query head reads its query and writes its output, each "
    "key/value head's keys and values are read once.",
}

DECODE_TRAFFIC = Exercise(
    "check_decode_traffic",
    "FLOPs and bytes of a decode step, for MHA, GQA and MQA, as attention_traffic counts",
    _decode_traffic_reference,
    _decode_traffic_cases,
    variants=(
        _traffic(_right_flops, _right_numbers),
        _decode_traffic_by_head,
        lambda B, H, Hkv, S, D, nb: (
            2 * (2 * D * S * H * B),
            nb * B * 2 * D * (H + Hkv * S),
        ),
    ),
    mistakes=(
        (
            _traffic(lambda B, H, Hkv, S, D: B * Hkv * 4 * D * S, _right_numbers),
            "Every query head computes its own q·k and p·v over all seq_len keys, even when it "
            "shares its key/value head: the FLOPs count num_heads, not num_kv_heads.",
        ),
        (
            _traffic(lambda B, H, Hkv, S, D: B * H * 2 * D * S, _right_numbers),
            "Half the FLOPs: per (query head, key), q·k is head_dim multiply-adds, 2·head_dim "
            "FLOPs, and the weighted sum of the values another 2·head_dim: 4·head_dim.",
        ),
        (
            _traffic(lambda B, H, Hkv, S, D: B * H * D * S, _right_numbers),
            "A multiply-add is 2 FLOPs, and there are two products per (query head, key): q·k "
            "and p·v, 4·head_dim FLOPs in all.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: 2 * D * (H + Hkv * S)),
            "Each sequence reads its own cache (and its own query and output): the bytes grow "
            "with the batch as the FLOPs do, so batching does not raise attention's intensity.",
        ),
        (
            _traffic(
                lambda B, H, Hkv, S, D: H * 4 * D * S, lambda B, H, Hkv, S, D: 2 * D * (H + Hkv * S)
            ),
            "The batch is missing: each of the batch's sequences does its own step, with its "
            "own query and its own cache. Multiply FLOPs and bytes by batch.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * (2 * H * D + Hkv * S * D)),
            "The cache holds keys and values, and the step reads both: 2 · num_kv_heads · "
            "seq_len · head_dim numbers per sequence.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * (2 * H * D + 2 * H * S * D)),
            "A key/value head is read once for all the query heads that share it: the cache "
            "read counts num_kv_heads, not num_heads (that sharing is GQA's saving).",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * 2 * Hkv * S * D),
            "Count as attention_traffic does: besides the cache, each query head reads its "
            "query and writes its output, 2 · num_heads · head_dim numbers per sequence.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * (2 * Hkv * D + 2 * Hkv * S * D)),
            "Queries and outputs belong to the query heads: 2 · num_heads · head_dim numbers, "
            "not 2 · num_kv_heads · head_dim.",
        ),
        (
            _traffic(_right_flops, _right_numbers, times_bytes=False),
            "These are numbers, not bytes: multiply by bytes_per_element.",
        ),
    ),
    hint=_HINT_TRAFFIC,
    crash_hint="decode_traffic(batch, num_heads, num_kv_heads, seq_len, head_dim, "
    "bytes_per_element) takes six ints and returns a tuple (flops, bytes).",
    outputs=("flops", "bytes"),
    convert=_whole,
    params=("decode_traffic",),
    doc="Check ``decode_traffic(batch, num_heads, num_kv_heads, seq_len, head_dim, "
    "bytes_per_element) -> (flops, bytes)``: one decode step of attention (one new query per "
    "sequence over a cache of ``seq_len`` tokens), counted as the chapter's "
    "``attention_traffic``.",
)


# --- merging split-KV partials ------------------------------------------------------------------


def _merge_reference(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    """The merged output, written as a softmax over the two partials' logsumexps."""
    w = torch.softmax(torch.stack([lse1, lse2]), dim=0).unsqueeze(-1)  # (2, ..., L, 1)
    return w[0] * out1 + w[1] * out2  # (..., L, Dv)


def _merge_cases() -> list[Case]:
    """Two splits of real attention: with several query rows (L = Dv, so that weights broadcast
    along the wrong axis still run), with scores near 1000 (exp(lse) overflows), and with an empty
    first split (its output 0, its lse -inf, as a split-KV program that saw no key leaves them)."""
    g = torch.Generator().manual_seed(81)
    cases = []
    for what, size, L, Dv, first in (
        ("moderate scores, L = 4 queries", 1.0, 4, 4, slice(0, 15)),
        ("scores near 1000", 1000.0, 1, 8, slice(0, 15)),
        ("an empty first split (out1 = 0, lse1 = -inf)", 1.0, 3, 5, slice(0, 0)),
    ):
        q, k, v = _randn(g, 2, 3, L, 16), _randn(g, 2, 3, 40, 16), _randn(g, 2, 3, 40, Dv)
        scores = q @ k.transpose(-2, -1) + size  # (B, H, L, S): a shift leaves softmax alone
        parts = []
        for keys in (first, slice(first.stop, 40)):
            s = scores[..., keys]  # (B, H, L, S_i); no key: out_i = 0, lse_i = -inf
            parts += [torch.softmax(s, -1) @ v[..., keys, :], torch.logsumexp(s, -1)]
        expected = torch.softmax(scores, -1) @ v  # (B, H, L, Dv): attention over all 40 keys
        cases.append(
            Case(f"merge(out1, lse1, out2, lse2) with {what}", tuple(parts), expected=expected)
        )
    return cases


def _merge_no_shift(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    e1, e2 = lse1.exp().unsqueeze(-1), lse2.exp().unsqueeze(-1)  # overflow to inf near 1000
    return (e1 * out1 + e2 * out2) / (e1 + e2)


def _merge_no_renormalise(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    m = torch.maximum(lse1, lse2)
    return (lse1 - m).exp().unsqueeze(-1) * out1 + (lse2 - m).exp().unsqueeze(-1) * out2


def _merge_by_max_shift(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    m = torch.maximum(lse1, lse2)[..., None]
    w1, w2 = (lse1[..., None] - m).exp(), (lse2[..., None] - m).exp()
    return (w1 * out1 + w2 * out2) / (w1 + w2)


def _merge_shift_by_first(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    w2 = (lse2 - lse1).exp().unsqueeze(-1)  # exp(lse2 - lse1) / exp(0): inf if lse1 = -inf
    return (out1 + w2 * out2) / (1 + w2)


def _merge_along_rows(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> Tensor:
    w = torch.softmax(torch.stack([lse1, lse2]), dim=0).unsqueeze(-2)  # (2, ..., 1, L)
    return w[0] * out1 + w[1] * out2  # weight of row l multiplies column l


_HINT_MERGE = (
    "Each partial was divided by its own sum exp(lse_i); the whole row's sum is exp(lse) with "
    "lse = logsumexp(lse1, lse2), so out = exp(lse1 - lse)·out1 + exp(lse2 - lse)·out2 "
    "(lse_i broadcast over Dv with [..., None])."
)
_NO_MERGE_PARTIALS = "merge the partials yourself, without mha.merge_partials."

MERGE_PARTIALS = Exercise(
    "check_merge_partials",
    "equals attention over all 40 keys, also where exp(lse) overflows (float64)",
    _merge_reference,
    _merge_cases,
    variants=(
        _merge_by_max_shift,
        lambda out1, lse1, out2, lse2: (
            torch.exp(lse1 - torch.logaddexp(lse1, lse2))[..., None] * out1
            + torch.exp(lse2 - torch.logaddexp(lse1, lse2))[..., None] * out2
        ),
        lambda out1, lse1, out2, lse2: torch.lerp(
            out2, out1, torch.sigmoid(lse1 - lse2).unsqueeze(-1)
        ),
    ),
    mistakes=(
        (
            lambda out1, lse1, out2, lse2: (out1 + out2) / 2,
            "An average weighs both splits alike; a split whose keys score higher must count "
            "more, by its softmax mass exp(lse_i). " + _HINT_MERGE,
        ),
        (
            _merge_no_shift,
            "exp(lse) overflows for large scores (inf / inf = NaN): subtract the largest lse "
            "(or the total logsumexp) before exp, as softmax does. " + _HINT_MERGE,
        ),
        (
            _merge_no_renormalise,
            "After shifting by the maximum the weights exp(lse_i - m) no longer sum to 1: "
            "divide by their sum (or shift by the total lse instead). " + _HINT_MERGE,
        ),
        (
            _merge_shift_by_first,
            "Shift by the largest lse (or the total), not by lse1: a split that saw no key has "
            "lse1 = -inf, and exp(lse2 - lse1) = inf gives inf / inf = NaN. " + _HINT_MERGE,
        ),
        (
            _merge_along_rows,
            "lse_i holds one number per query row: give it a last dim of 1, lse_i[..., None], "
            "so that it broadcasts over Dv; unsqueezed elsewhere it weighs the wrong entries. "
            + _HINT_MERGE,
        ),
        (
            lambda out1, lse1, out2, lse2: mha.merge_partials(
                torch.stack([out1, out2]), torch.stack([lse1, lse2])
            )[0],
            _NO_MERGE_PARTIALS,
        ),
    ),
    hint=_HINT_MERGE,
    crash_hint="out_i is (..., L, Dv) and lse_i (..., L): give the weights a last dim of 1 "
    "(lse[..., None]) to broadcast over Dv.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=(mha.merge_partials, mha.flash_decoding),
    forbidden_hint=_NO_MERGE_PARTIALS,
    params=("merge",),
    doc="Check ``merge(out1, lse1, out2, lse2) -> out``: combine the attention outputs "
    "``(..., L, Dv)`` of two disjoint sets of keys and their row logsumexps ``(..., L)`` into "
    "attention over all the keys.",
)


# --- reading a block table ----------------------------------------------------------------------


def _slot_reference(block_table: Sequence[Sequence[int]], block_size: int, seq: int, t: int) -> int:
    block, offset = divmod(t, block_size)  # logical block, position inside it
    return block_table[seq][block] * block_size + offset


def _lookup_cases() -> list[Case]:
    table4 = [[7, 2, 9, 4], [0, 11, 5, 14], [3, 8, 13, 1], [10, 6, 15, 12]]
    table2 = [[5, 0, 3], [2, 4, 1]]
    cases = [
        Case("slot(block_table, 4, seq, t) for 4 sequences, t = 0…15", (table4, 4)),
        Case("slot(block_table, 16, seq, t) for 2 sequences, t = 0…47", (table2, 16)),
    ]
    return [Case(c.label, c.args, expected=_every_slot(_slot_reference, c)) for c in cases]


def _every_slot(answer: Callable[..., object], case: Case) -> Tensor:
    """The answer for every (sequence, position) the table covers: ``(sequences, positions)``."""
    table, block_size = case.args
    positions = len(table[0]) * block_size
    slots = [
        [
            as_int(answer([list(r) for r in table], block_size, b, t), f"slot(…, {b}, {t})")
            for t in range(positions)
        ]
        for b in range(len(table))
    ]
    return torch.tensor(slots)


_HINT_LOOKUP = (
    "Position t is in logical block t // block_size at offset t % block_size; the table maps "
    "the logical block to a physical one: block_table[seq][t // block_size] * block_size "
    "+ t % block_size."
)


def _slot_by_paged_cache(block_table: list[list[int]], block_size: int, seq: int, t: int) -> int:
    """Read the slot from a PagedKVCache whose table is replaced by the given one."""
    cache = mha.PagedKVCache(block_size=block_size)
    cache.block_table, cache.length = block_table, len(block_table[0]) * block_size
    return cache.slot(seq, t)


PAGE_LOOKUP = Exercise(
    "check_page_lookup",
    "every (sequence, position) lands in its pool slot",
    _slot_reference,
    _lookup_cases,
    variants=(
        _slot_by_paged_cache,
        lambda table, bs, seq, t: table[seq][t // bs] * bs + (t - t // bs * bs),
    ),
    mistakes=(
        (
            lambda table, bs, seq, t: t,
            "The slot of position t is not t: the sequence's blocks are scattered over the "
            "pool; look the logical block up in the block table. " + _HINT_LOOKUP,
        ),
        (
            lambda table, bs, seq, t: table[seq][t % bs] * bs + t // bs,
            "Block and offset are swapped: the block index is t // block_size, the offset "
            "t % block_size. " + _HINT_LOOKUP,
        ),
        (
            lambda table, bs, seq, t: table[t // bs][seq] * bs + t % bs,
            "The table has one row per sequence: block_table[seq][block], not "
            "block_table[block][seq]. " + _HINT_LOOKUP,
        ),
        (
            lambda table, bs, seq, t: table[seq][t // bs] * len(table[seq]) + t % bs,
            "A physical block holds block_size slots: multiply the block by block_size, not by "
            "the number of blocks. " + _HINT_LOOKUP,
        ),
    ),
    hint=_HINT_LOOKUP,
    crash_hint=_HINT_LOOKUP,
    call=lambda answer, case: _every_slot(answer, case),
    params=("slot",),
    doc="Check ``slot(block_table, block_size, seq, t) -> int``: the pool slot that holds "
    "position ``t`` of sequence ``seq`` in a paged KV cache, ``block_table`` one list of "
    "physical blocks per sequence.",
)

# --- the bytes of a KV cache ----------------------------------------------------------------------


def _cache_bytes_reference(config: AttentionConfig, seq_len: int, nbytes: int) -> int:
    """Per layer: the tokens it keeps (a windowed layer at most its window) times the numbers
    cached per token (a key and a value per kv head, or MLA's latent and RoPE key)."""
    if config.kv_lora_rank is not None:  # MLA: one latent and one shared RoPE key per token
        per_token = config.kv_lora_rank + config.qk_rope_head_dim
    else:  # MHA, GQA, MQA: a key and a value per key/value head
        per_token = 2 * config.num_kv_heads * config.head_dim
    W, local = config.sliding_window, config.window_layers
    tokens = 0
    for layer in range(config.num_layers):
        windowed = W is not None and (local is None or layer in local)
        tokens += min(seq_len, W) if windowed and W is not None else seq_len
    return tokens * per_token * nbytes


def _cache_bytes_cases() -> list[Case]:
    """Every kind of the chapter's table (published configurations), contexts shorter and longer
    than the windows, toy shapes that change one field at a time, and 1, 2, 4 bytes a number."""
    mla = {"kv_lora_rank": 12, "qk_rope_head_dim": 4}
    toys = {  # GQA with windows in the odd layers; MLA without a RoPE key; MLA, one window
        "toy-windowed-odd": AttentionConfig("toy", 5, 8, 2, 16, 6, window_layers=(1, 3)),
        "toy-MLA-no-rope": AttentionConfig("toy", 3, 4, 4, 8, kv_lora_rank=24),
        "toy-MLA-windowed": AttentionConfig("toy", 4, 4, 4, 8, 5, window_layers=(0,), **mla),
    }
    calls = (
        ("Llama-2-7B", 4096, 1),
        ("Llama-3-8B", 1000, 2),
        ("Falcon-7B", 2048, 4),
        ("Gemma-2-9B", 8192, 2),
        ("toy-windowed-odd", 20, 4),
        ("Mistral-7B-v0.1", 10000, 2),
        ("Mistral-7B-v0.1", 1000, 1),
        ("toy-windowed-odd", 4, 2),
        ("DeepSeek-V2", 4096, 2),
        ("toy-MLA-no-rope", 50, 8),
        ("toy-MLA-windowed", 9, 2),
    )
    cases = []
    for name, seq_len, nbytes in calls:
        config = toys.get(name) or CONFIGS[name]
        shown = f"CONFIGS[{name!r}]" if name in CONFIGS else repr(config)
        cases.append(Case(f"cache_bytes({shown}, {seq_len}, {nbytes})", (config, seq_len, nbytes)))
    return cases


def _cache_bytes_by_counting(config: AttentionConfig, seq_len: int, nbytes: int) -> int:
    """Windowed layers and global layers counted, not walked."""
    if config.kv_lora_rank is None:
        per_token = config.num_kv_heads * config.head_dim * 2
    else:
        per_token = config.qk_rope_head_dim + config.kv_lora_rank
    if config.sliding_window is None:
        local = 0
    elif config.window_layers is None:
        local = config.num_layers
    else:
        local = len(set(config.window_layers))
    kept = local * min(seq_len, config.sliding_window or seq_len)
    kept += (config.num_layers - local) * seq_len
    return nbytes * per_token * kept


def _cache_bytes_layers(
    config: AttentionConfig,
    seq_len: int,
    nbytes: int,
    *,
    windowed: Callable[[int], bool],
    kept: Callable[[int, int], int] = min,
    per_token: Callable[[AttentionConfig], int] | None = None,
) -> int:
    """The reference's sum with one of the usual slips: which layers are windowed, how many
    tokens a windowed layer keeps, the numbers per token."""
    per = (per_token or _numbers_per_token)(config)
    W = config.sliding_window
    tokens = sum(
        kept(seq_len, W) if W is not None and windowed(layer) else seq_len
        for layer in range(config.num_layers)
    )
    return tokens * per * nbytes


def _numbers_per_token(config: AttentionConfig) -> int:
    if config.kv_lora_rank is not None:
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_kv_heads * config.head_dim


def _cache_slip(**slip: Any) -> Callable[[AttentionConfig, int, int], int]:
    """``cache_bytes`` with a slip: ``per_token`` (a function of the config), ``windowed`` (a
    function of the config and the layer) or ``kept`` (tokens of a windowed layer)."""

    def answer(config: AttentionConfig, seq_len: int, nbytes: int) -> int:
        local = config.window_layers
        default = lambda layer: local is None or layer in local  # noqa: E731
        windowed = slip.get("windowed")
        return _cache_bytes_layers(
            config,
            seq_len,
            nbytes,
            windowed=partial(windowed, config) if windowed else default,
            kept=slip.get("kept", min),
            per_token=slip.get("per_token"),
        )

    return answer


def _heads_per_token(count_heads: Callable[[AttentionConfig], int]) -> Callable[..., int]:
    """Numbers per token of a slip in the head count, MLA's layers right."""
    return lambda c: _numbers_per_token(c) if c.kv_lora_rank is not None else count_heads(c)


def _mla_per_token(mla: Callable[[AttentionConfig], int]) -> Callable[..., int]:
    """Numbers per token of a slip in MLA's latent, the other layers right."""
    return lambda c: mla(c) if c.kv_lora_rank is not None else _numbers_per_token(c)


_PER_TOKEN_PROPERTY = vars(AttentionConfig)["elements_per_token_per_layer"]
_NO_KV_CACHE_BYTES = (
    "count the bytes yourself, without mha.kv_cache_bytes or the config's "
    "elements_per_token_per_layer and uses_window."
)
_HINT_CACHE_BYTES = (
    "Sum over the layers: tokens kept × numbers per token × bytes_per_element. A layer keeps "
    "min(seq_len, sliding_window) tokens if it uses the window (window_layers=None: every "
    "layer), else seq_len; a token holds 2 · num_kv_heads · head_dim numbers, or "
    "kv_lora_rank + qk_rope_head_dim under MLA."
)

CACHE_BYTES = Exercise(
    "check_cache_bytes",
    "bytes of MHA, GQA, MQA, sliding-window and MLA caches, published configurations included",
    _cache_bytes_reference,
    _cache_bytes_cases,
    variants=(
        _cache_bytes_by_counting,
        _cache_slip(),
        lambda config, seq_len, nbytes: (
            nbytes
            * sum(
                (
                    config.kv_lora_rank + config.qk_rope_head_dim
                    if config.kv_lora_rank
                    else 2 * config.num_kv_heads * config.head_dim
                )
                * (
                    seq_len
                    if config.sliding_window is None
                    or config.window_layers is not None
                    and layer not in config.window_layers
                    else min(seq_len, config.sliding_window)
                )
                for layer in range(config.num_layers)
            )
        ),
    ),
    mistakes=(
        (
            lambda config, seq_len, nbytes: mha.kv_cache_bytes(
                config, seq_len, bytes_per_element=nbytes
            ),
            _NO_KV_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=lambda c: c.elements_per_token_per_layer),
            _NO_KV_CACHE_BYTES,
        ),
        (
            lambda config, seq_len, nbytes: _cache_bytes_reference(config, seq_len, 1),
            "These are numbers, not bytes: multiply by bytes_per_element. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=_heads_per_token(lambda c: c.num_kv_heads * c.head_dim)),
            "Only the keys: a cached token holds a key and a value per key/value head, "
            "2 · num_kv_heads · head_dim numbers. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=_heads_per_token(lambda c: 2 * c.num_heads * c.head_dim)),
            "The cache holds the key/value heads only: num_kv_heads, not num_heads (GQA and MQA "
            "share each of them among several query heads). " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(
                windowed=lambda c, layer: c.window_layers is not None and layer in c.window_layers
            ),
            "window_layers=None means every layer uses the window (Mistral); only a tuple names "
            "some of them. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(
                windowed=lambda c, layer: (
                    c.window_layers is not None and layer not in c.window_layers
                )
            ),
            "Local and global are swapped: the layers listed in window_layers are the windowed "
            "ones. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(windowed=lambda config, layer: False),
            "The window is ignored: a sliding-window layer keeps only the last sliding_window "
            "tokens (a rolling buffer), min(seq_len, sliding_window). " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(windowed=lambda config, layer: True),
            "Only the layers in window_layers use the window (Gemma 2 alternates local and "
            "global layers); the others keep all seq_len tokens. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(kept=lambda seq_len, window: window),
            "While the context is shorter than the window, a windowed layer holds only seq_len "
            "tokens: min(seq_len, sliding_window), not sliding_window. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=lambda c: 2 * c.num_kv_heads * c.head_dim),
            "An MLA layer (kv_lora_rank set) caches no keys and values per head: one latent of "
            "kv_lora_rank numbers and one shared RoPE key of qk_rope_head_dim per token, from "
            "which every head rebuilds its keys and values. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=_mla_per_token(lambda c: c.kv_lora_rank or 0)),
            "MLA also caches its decoupled RoPE key, qk_rope_head_dim numbers per token and "
            "layer, next to the latent: kv_lora_rank + qk_rope_head_dim. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(
                per_token=_mla_per_token(lambda c: 2 * ((c.kv_lora_rank or 0) + c.qk_rope_head_dim))
            ),
            "MLA's latent is cached once and serves as both key and value: kv_lora_rank + "
            "qk_rope_head_dim numbers, not twice that. " + _HINT_CACHE_BYTES,
        ),
    ),
    hint=_HINT_CACHE_BYTES,
    crash_hint="cache_bytes(config, seq_len, bytes_per_element) reads the fields of an "
    "mha.AttentionConfig (num_layers, num_kv_heads, head_dim, sliding_window, window_layers, "
    "kv_lora_rank, qk_rope_head_dim) and returns an int.",
    convert=_whole,
    forbidden=(mha.kv_cache_bytes, _PER_TOKEN_PROPERTY.fget, AttentionConfig.uses_window),
    forbidden_hint=_NO_KV_CACHE_BYTES,
    params=("cache_bytes",),
    doc="Check ``cache_bytes(config, seq_len, bytes_per_element) -> int``: the bytes of key/value "
    "cache of one sequence of ``seq_len`` tokens for an ``mha.AttentionConfig`` (MHA, GQA, MQA, "
    "sliding-window layers, MLA), as ``mha.kv_cache_bytes`` counts them.",
)


EXERCISES = publish(globals())
