"""Section 10.1, sinks and windows (gpt-oss): the exercises as data for :mod:`.._harness`.

References: attention with a sink written as torch's SDPA scaled by the mass the keys keep,
``sigmoid(logsumexp(scores) - sink)``; split-KV partials merged with the sink as one more split
that hands over 0, checked against one pass; StreamingLLM's keep-mask by its definition; YaRN's
speeds in float64. Mistakes: the sink ignored (or undone by renormalising), scaled like a score, or
given a value; in the merge, the sink added per split, scaled, ignored, taken for the keys' share,
broadcast along the rows, or ``exp(lse)`` without a shift (overflow), and ``mha.merge_partials``
(every function of ``mha.decoding`` banned); the window one
token too wide, the sinks visible to earlier queries, the sinks forgotten; position interpolation
for every pair, the ramp reversed, the 2π forgotten, the boundaries rounded, the speed multiplied; and ``mha.yarn_frequencies``, which the
exercise bans.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import mha
from mha import attention, chunked_prefill, decoding, flash, masks
from mha import rope as rope_library
from mha.models import deepseek_v3, gpt_oss

from .._harness import Case, Exercise, defined_in, publish, randn64

# --- attention with a sink ------------------------------------------------------------------------


def _sink_reference(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tensor:
    """torch's attention, times the mass the keys keep when the sink takes its share."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, H, L, 1)
    kept = torch.sigmoid(lse - sinks[:, None, None])  # (B, H, L, 1) = 1 - p_sink
    return F.scaled_dot_product_attention(q, k, v) * kept  # (B, H, L, Dv)


def _sink_cases() -> list[Case]:
    g = torch.Generator().manual_seed(100)
    cases = []
    for B, H, L, S, D, Dv in ((2, 3, 5, 7, 8, 8), (1, 4, 6, 6, 16, 5)):
        q, k, v = randn64(g, B, H, L, D), randn64(g, B, H, S, D), randn64(g, B, H, S, Dv)
        sinks = randn64(g, H) * 3
        label = f"attend(q, k, v, sinks) with q {(B, H, L, D)}, k {(B, H, S, D)}, sinks ({H},)"
        cases.append(Case(label, (q, k, v, sinks)))
    return cases


def _sink_by_extra_column(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tensor:
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, L, S)
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, L, 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)  # (B, H, L, S + 1)
    return weights[..., :-1] @ v


def _sink_by_exponentials(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tensor:
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    m = torch.maximum(scores.amax(-1, keepdim=True), sinks[:, None, None])  # shift for exp
    e = (scores - m).exp()
    return (e @ v) / (e.sum(-1, keepdim=True) + (sinks[:, None, None] - m).exp())


def _sink_slip(**slip: object) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    def answer(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tensor:
        scale = q.shape[-1] ** -0.5
        scores = q @ k.transpose(-2, -1) * scale
        sink = sinks * scale if slip.get("scaled") else sinks
        column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)
        if slip.get("value_ones"):  # a sink token whose value is all ones
            ones = torch.ones_like(v[..., :1, :])
            return weights @ torch.cat([v, ones], dim=-2)
        return weights[..., :-1] @ v

    return answer


_HINT_SINK = (
    "The sink is one more column of scores, the same logit sinks[h] for every query of head h "
    "(not scaled: it is a logit already); softmax over the S + 1 columns, then drop the sink's "
    "column and multiply the S key weights by v: the sink takes mass and hands over no value."
)

_NO_SINKS = (
    "write the sink yourself: no function of mha.attention (mha.scaled_dot_product_attention "
    "takes sinks=), mha.flash or gpt-oss's module."
)

SINK_ATTENTION = Exercise(
    "check_sink_attention",
    "equals torch's attention scaled by the mass the sink leaves, 1 - p_sink",
    _sink_reference,
    _sink_cases,
    variants=(_sink_by_extra_column, _sink_by_exponentials),
    mistakes=(
        (
            lambda q, k, v, sinks: F.scaled_dot_product_attention(q, k, v),
            "This is attention without the sink: its weights sum to 1 (so do the key weights "
            "renormalised after dropping the sink's column). " + _HINT_SINK,
        ),
        (
            _sink_slip(scaled=True),
            "The sink was multiplied by 1/sqrt(D) like a score; it is a learned logit, used as "
            "it is. " + _HINT_SINK,
        ),
        (
            _sink_slip(value_ones=True),
            "The sink hands over no value (a zero vector), not ones. " + _HINT_SINK,
        ),
        (lambda q, k, v, sinks: mha.scaled_dot_product_attention(q, k, v, sinks=sinks), _NO_SINKS),
        (
            lambda q, k, v, sinks: attention._attention(
                q, k, v, None, 0.0, False, q.shape[-1] ** -0.5, sinks=sinks
            ),
            _NO_SINKS,
        ),
    ),
    hint=_HINT_SINK,
    forbidden=(
        *defined_in(attention),
        *defined_in(flash),
        *defined_in(chunked_prefill),
        *defined_in(gpt_oss),
    ),
    forbidden_hint=_NO_SINKS,
    rewrites=(mha.scaled_dot_product_attention,),  # its sinks= does what the learner writes
    params=("attend",),
    doc="Check ``attend(q, k, v, sinks) -> (B, H, L, Dv)``: attention with a sink logit per head.",
)

# --- split-KV partials merged with a sink ---------------------------------------------------------


def _merge_with_sink_reference(outs: Tensor, lses: Tensor, sinks: Tensor) -> Tensor:
    """The sink as one more split that saw one key of score ``sinks[h]`` and hands over 0."""
    sink = sinks[:, None].expand_as(lses[0])[None]  # (1, B, H, L)
    weights = torch.softmax(torch.cat([lses, sink]), dim=0)  # (n + 1, B, H, L)
    return (weights[:-1, ..., None] * outs).sum(0)  # (B, H, L, Dv): the sink's share gives 0


def _merge_with_sink_cases() -> list[Case]:
    """Real split-KV partials (float64) and, as expected, one pass over all the keys with the sink
    column: query heads sharing key/value heads (GQA), L = H (so that sinks broadcast along the
    query rows still run), a first split that saw no key (out 0, lse -inf), and scores and sinks
    near 1000 (exp(lse) overflows)."""
    g = torch.Generator().manual_seed(102)
    cases = []
    for what, (B, H, Hkv, L, S, Dv), bounds, shift in (
        (
            "4 splits of 6 keys, 8 query heads over 2 key/value heads (GQA), L = 1",
            (2, 8, 2, 1, 24, 16),
            (0, 6, 12, 18, 24),
            0.0,
        ),
        (
            "3 splits, the first saw no key (out 0, lse -inf), H = L = 4",
            (2, 4, 4, 4, 20, 8),
            (0, 0, 7, 20),
            0.0,
        ),
        ("2 splits, scores and sinks near 1000, L = 3", (1, 4, 2, 3, 30, 8), (0, 13, 30), 1000.0),
    ):
        q, k, v = randn64(g, B, H, L, 16), randn64(g, B, Hkv, S, 16), randn64(g, B, Hkv, S, Dv)
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # (B, H, S, ·): GQA
        scores = q @ k.transpose(-2, -1) / 4.0 + shift  # (B, H, L, S), D = 16
        sinks = math.log(S) + shift + randn64(g, H)  # (H,): near a row's lse, a fair share
        outs, lses = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            s = scores[..., a:b]  # (B, H, L, S_i); no key: out_i = 0, lse_i = -inf
            outs.append(torch.softmax(s, -1) @ v[..., a:b, :])
            lses.append(torch.logsumexp(s, -1))
        column = sinks[:, None, None].expand(B, H, L, 1)  # (B, H, L, 1)
        weights = torch.softmax(torch.cat([scores, column], -1), -1)  # (B, H, L, S + 1)
        expected = weights[..., :-1] @ v  # (B, H, L, Dv): one pass with the sink
        label = f"merge_with_sink(outs, lses, sinks) with {what}"
        cases.append(Case(label, (torch.stack(outs), torch.stack(lses), sinks), expected=expected))
    return cases


def _merge_then_sink(outs: Tensor, lses: Tensor, sinks: Tensor) -> Tensor:
    """Merge by the largest lse, then the section's two lines."""
    m = lses.amax(0)  # (B, H, L)
    w = (lses - m).exp()  # (n, B, H, L)
    lse = m + w.sum(0).log()
    out = (w[..., None] * outs).sum(0) / w.sum(0)[..., None]  # (B, H, L, Dv): no sink yet
    total = torch.logaddexp(lse, sinks[:, None])  # (B, H, L): the sink counted once
    return out * (lse - total).exp()[..., None]


def _merge_then_sigmoid(outs: Tensor, lses: Tensor, sinks: Tensor) -> Tensor:
    lse = torch.logsumexp(lses, dim=0)  # (B, H, L)
    out = (torch.exp(lses - lse)[..., None] * outs).sum(0)
    return out * torch.sigmoid(lse - sinks.view(-1, 1))[..., None]  # times 1 - p_sink


def _one_denominator(outs: Tensor, lses: Tensor, sinks: Tensor) -> Tensor:
    s = sinks[:, None].expand_as(lses[0])  # (B, H, L)
    m = torch.maximum(lses.amax(0), s)  # shift by the largest term, the sink's included
    w = (lses - m).exp()  # (n, B, H, L)
    return (w[..., None] * outs).sum(0) / (w.sum(0) + (s - m).exp())[..., None]


def _merge_with_sink_slip(**slip: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    def answer(outs: Tensor, lses: Tensor, sinks: Tensor) -> Tensor:
        s = sinks[None, :] if slip.get("along_rows") else sinks[:, None]  # (H, 1): one per head
        if slip.get("scaled"):
            s = s * outs.shape[-1] ** -0.5
        if slip.get("no_shift"):  # exp(lse) overflows near 1000: inf / inf
            e = lses.exp()
            return (e[..., None] * outs).sum(0) / (e.sum(0) + s.exp())[..., None]
        if slip.get("per_split"):  # every split's softmax gets the sink's column
            outs = outs * torch.sigmoid(lses - s)[..., None]
            lses = torch.logaddexp(lses, s)
        lse = torch.logsumexp(lses, dim=0)  # (B, H, L)
        out = (torch.exp(lses - lse)[..., None] * outs).sum(0)
        if slip.get("ignored") or slip.get("per_split"):
            return out
        if slip.get("sink_share"):
            return out * torch.sigmoid(s - lse)[..., None]  # p_sink instead of 1 - p_sink
        total = torch.logaddexp(lse, s.squeeze(0) if slip.get("along_rows") else s)
        return out * (lse - total).exp()[..., None]

    return answer


_HINT_MERGE_SINK = (
    "Merge the splits first: lse = logsumexp over the splits of lse_i, out = the sum of "
    "exp(lse_i - lse)·out_i. Then add the sink once, as one more column of the whole row: "
    "lse_total = logaddexp(lse, sinks[h]) and out·exp(lse - lse_total), which is "
    "out·sigmoid(lse - sinks[h])."
)

_NO_MERGE_WITH_SINK = (
    "merge the partials and add the sink yourself: no function of mha.decoding "
    "(mha.merge_partials takes sinks=) or mha.attention."
)

MERGE_WITH_SINK = Exercise(
    "check_merge_with_sink",
    "equals one pass with the sink over all the keys: GQA heads, a split that saw no key, "
    "lse near 1000 (float64)",
    _merge_with_sink_reference,
    _merge_with_sink_cases,
    variants=(_merge_then_sink, _merge_then_sigmoid, _one_denominator),
    mistakes=(
        (
            _merge_with_sink_slip(ignored=True),
            "This is the merge without the sink: the rows' weights still sum to 1. "
            + _HINT_MERGE_SINK,
        ),
        (
            _merge_with_sink_slip(per_split=True),
            "The sink was added in every split, so the merged denominator counts exp(sinks[h]) "
            "once per split: a sink of sinks[h] + ln(splits). It is one column of the whole row. "
            + _HINT_MERGE_SINK,
        ),
        (
            _merge_with_sink_slip(scaled=True),
            "The sink was multiplied by a 1/sqrt(D); it is a learned logit, used as it is. "
            + _HINT_MERGE_SINK,
        ),
        (
            _merge_with_sink_slip(sink_share=True),
            "The output was multiplied by the sink's share p_sink = sigmoid(sinks[h] - lse); "
            "the keys keep 1 - p_sink = sigmoid(lse - sinks[h]). " + _HINT_MERGE_SINK,
        ),
        (
            _merge_with_sink_slip(no_shift=True),
            "exp(lse) overflows for large scores (inf / inf = NaN): work with differences of "
            "logsumexps (logsumexp, logaddexp, or subtract the largest term before exp). "
            + _HINT_MERGE_SINK,
        ),
        (
            _merge_with_sink_slip(along_rows=True),
            "sinks holds one logit per head, (H,), and lse is (B, H, L): give the sinks a dim "
            "for the query rows, sinks[:, None]; without it they line up with L. "
            + _HINT_MERGE_SINK,
        ),
        (
            lambda outs, lses, sinks: mha.merge_partials(outs, lses, sinks=sinks)[0],
            _NO_MERGE_WITH_SINK,
        ),
        (
            lambda outs, lses, sinks: decoding._add_sink(
                *decoding._merge_partials(outs, lses), sinks
            )[0],
            _NO_MERGE_WITH_SINK,
        ),
    ),
    hint=_HINT_MERGE_SINK,
    crash_hint="outs is (n, B, H, L, Dv), lses (n, B, H, L) and sinks (H,): sinks[:, None] "
    "broadcasts over (B, H, L), and lse[..., None] over Dv.",
    atol=1e-10,
    rtol=1e-8,
    forbidden=(*defined_in(decoding), *defined_in(attention), *defined_in(chunked_prefill)),
    forbidden_hint=_NO_MERGE_WITH_SINK,
    rewrites=(mha.merge_partials,),  # its sinks= does what the learner writes
    params=("merge_with_sink",),
    doc="Check ``merge_with_sink(outs, lses, sinks) -> (B, H, L, Dv)``: split-KV partials "
    "``outs (n, B, H, L, Dv)`` and their logsumexps ``lses (n, B, H, L)`` merged into attention "
    "over all the keys with one sink logit per head, ``sinks (H,)``.",
)

# --- StreamingLLM's mask: a window plus the first tokens --------------------------------------------


def _streaming_reference(L: int, window: int, num_sinks: int) -> Tensor:
    i = torch.arange(L)[:, None]  # (L, 1) query
    j = torch.arange(L)[None, :]  # (1, L) key
    return (j <= i) & ((i - j < window) | (j < num_sinks))  # (L, L)


def _streaming_cases() -> list[Case]:
    return [
        Case(f"streaming_mask({L}, window={w}, num_sinks={n})", (L, w, n))
        for L, w, n in ((10, 3, 2), (12, 4, 1), (6, 8, 2), (9, 2, 4), (7, 3, 0))
    ]


def _streaming_by_loops(L: int, window: int, num_sinks: int) -> Tensor:
    keep = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        keep[i, max(0, i - window + 1) : i + 1] = True  # the window
        keep[i, : min(num_sinks, i + 1)] = True  # the first tokens, if already seen
    return keep


def _streaming_by_tril(L: int, window: int, num_sinks: int) -> Tensor:
    ones = torch.ones(L, L, dtype=torch.bool)
    band = torch.tril(ones) & ~torch.tril(ones, diagonal=-window)
    first = torch.zeros(L, L, dtype=torch.bool)
    first[:, :num_sinks] = True
    return band | (first & torch.tril(ones))


def _streaming_slip(keep: Callable[[Tensor, Tensor, int, int], Tensor]) -> Callable[..., Tensor]:
    def answer(L: int, window: int, num_sinks: int) -> Tensor:
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        return keep(i, j, window, num_sinks)

    return answer


_HINT_STREAMING = (
    "Query i may see key j if j <= i (causal) and either j is one of the first num_sinks tokens "
    "or j is among the window most recent tokens, i - j < window (itself included)."
)


def _streaming_by_library_window(L: int, window: int, num_sinks: int) -> Tensor:
    """mha.sliding_window_mask for the window, the first columns added by hand."""
    first = torch.arange(L)[None, :] < num_sinks  # (1, L)
    causal = torch.arange(L)[None, :] <= torch.arange(L)[:, None]  # (L, L)
    return mha.sliding_window_mask(L, window=window) | first & causal


_NO_MASKS = (
    "build the mask yourself, without mha.sliding_window_mask (or any function of mha.masks)."
)

STREAMING_MASK = Exercise(
    "check_streaming_mask",
    "StreamingLLM's keep-mask: the first tokens and a causal window",
    _streaming_reference,
    _streaming_cases,
    variants=(_streaming_by_loops, _streaming_by_tril),
    mistakes=(
        (
            _streaming_slip(lambda i, j, w, n: (j <= i) & (i - j < w)),
            "This is a plain sliding window: the first num_sinks tokens are missing once they "
            "leave the window. " + _HINT_STREAMING,
        ),
        (
            _streaming_slip(lambda i, j, w, n: (j <= i) & (i - j <= w) | (j <= i) & (j < n)),
            "The window is one token too wide: with window = w a query sees itself and the w - 1 "
            "tokens before it. " + _HINT_STREAMING,
        ),
        (
            _streaming_slip(lambda i, j, w, n: (j <= i) & (i - j < w) | (j < n)),
            "An early query sees a first token that comes after it: the sink tokens must obey "
            "causality too. " + _HINT_STREAMING,
        ),
        (_streaming_by_library_window, _NO_MASKS),
        (
            lambda L, window, num_sinks: (
                masks._causal_mask(L, L) & ~masks._causal_mask(L, L, diagonal=-window)
                | masks._causal_mask(L, L) & (torch.arange(L) < num_sinks)
            ),
            _NO_MASKS,
        ),
    ),
    hint=_HINT_STREAMING,
    forbidden=tuple(defined_in(masks)),
    forbidden_hint=_NO_MASKS,
    rewrites=(mha.sliding_window_mask,),  # the window part; the sinks are the learner's
    params=("streaming_mask",),
    doc="Check ``streaming_mask(L, window, num_sinks) -> (L, L)`` bool keep-mask.",
)

# --- YaRN's speeds --------------------------------------------------------------------------------


def _yarn_speeds(D: int, base: float, factor: float, L0: int, **slip: bool) -> Tensor:
    """YaRN's RoPE speeds (beta_fast 32, beta_slow 1, no rounding), in float64, or a slip."""
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    if slip.get("all"):
        return theta / factor

    def pair(turns: float) -> float:
        two_pi = 1.0 if slip.get("no_two_pi") else 2 * math.pi
        return D * math.log(L0 / (turns * two_pi)) / (2 * math.log(base))

    low, high = max(pair(32.0), 0.0), min(pair(1.0), D - 1.0)
    if slip.get("rounded"):
        low, high = math.floor(low), math.ceil(high)
    i = torch.arange(D // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)  # 0: keep the speed, 1: interpolate
    if slip.get("reversed"):
        ramp = 1 - ramp
    slow = theta * factor if slip.get("multiplied") else theta / factor
    return theta * (1 - ramp) + slow * ramp


def _yarn_cases() -> list[Case]:
    return [
        Case(
            f"yarn(head_dim={D}, base={b}, factor={s}, original_max_position_embeddings={L0})",
            (D, b, s, L0),
        )
        for D, b, s, L0 in (
            (64, 150000.0, 32.0, 4096),
            (16, 10000.0, 4.0, 2048),
            (128, 1e6, 8.0, 8192),
        )
    ]


def _yarn_by_turns(D: int, base: float, factor: float, L0: int) -> Tensor:
    i = torch.arange(D // 2, dtype=torch.float64)
    theta = 1.0 / base ** (2 * i / D)
    low = D * math.log(L0 / (32 * 2 * math.pi)) / (2 * math.log(base))
    high = D * math.log(L0 / (1 * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(low, 0.0), min(high, D - 1.0)
    keep = 1 - torch.clamp((i - low) / (high - low), 0, 1)
    return theta * keep + theta / factor * (1 - keep)


_HINT_YARN = (
    "θ_i = base ** (-2i / D). Pair i turns L0·θ_i / (2π) times over the original context; the "
    "fractional pair index where that equals β is D·ln(L0 / (2π·β)) / (2·ln(base)). With "
    "low = that index for β = 32 (at least 0) and high = that for β = 1 (at most D - 1), "
    "r_i = clamp((i - low) / (high - low), 0, 1) and the speed is θ_i·(1 - r_i) + θ_i/factor·r_i."
)

_NO_YARN_FREQUENCIES = (
    "compute the speeds yourself, without mha.yarn_frequencies (or any function of mha.rope or "
    "of DeepSeek's module, whose rope_speeds does YaRN too)."
)


def _yarn_by_private_helper(D: int, base: float, factor: float, L0: int) -> Tensor:
    """θ from mha.rope's private helper, reached around the public functions; the ramp by hand."""
    theta = rope_library._rope_frequencies(D, base, torch.float64, None)  # (D/2,)
    return _yarn_speeds(D, base, factor, L0) / theta * theta


YARN_FREQUENCIES = Exercise(
    "check_yarn_frequencies",
    "YaRN's speeds: fast pairs kept, slow pairs interpolated, a ramp between",
    lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0),
    _yarn_cases,
    variants=(
        _yarn_by_turns,
        lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0).float(),
    ),
    mistakes=(
        (
            lambda D, base, factor, L0: mha.yarn_frequencies(
                D, base=base, factor=factor, original_max_position_embeddings=L0, truncate=False
            )[0],
            _NO_YARN_FREQUENCIES,
        ),
        (_yarn_by_private_helper, _NO_YARN_FREQUENCIES),
        (
            lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0, all=True),
            "This is position interpolation: every speed divided by factor. YaRN keeps the fast "
            "pairs, which turned many times in training, as they are. " + _HINT_YARN,
        ),
        (
            lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0, reversed=True),
            "The ramp is reversed: the first (fast) pairs keep their speed and the last (slow) "
            "ones are divided by factor. " + _HINT_YARN,
        ),
        (
            lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0, no_two_pi=True),
            "A turn is 2π radians: a pair makes L0·θ_i / (2π) turns. " + _HINT_YARN,
        ),
        (
            lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0, rounded=True),
            "gpt-oss sets truncate=False: keep low and high fractional, not floor/ceil. "
            + _HINT_YARN,
        ),
        (
            lambda D, base, factor, L0: _yarn_speeds(D, base, factor, L0, multiplied=True),
            "A longer context needs slower pairs: divide the speed by factor. " + _HINT_YARN,
        ),
    ),
    hint=_HINT_YARN,
    forbidden=(*defined_in(rope_library), *defined_in(deepseek_v3)),
    forbidden_hint=_NO_YARN_FREQUENCIES,
    rewrites=(mha.yarn_frequencies, deepseek_v3.rope_speeds),
    atol=1e-9,
    rtol=1e-5,
    params=("yarn",),
    doc="Check ``yarn(head_dim, base, factor, original_max_position_embeddings) -> (D/2,)``.",
)

EXERCISES = publish(globals())
