"""Section 8.2, FlexAttention: the exercise as data for :mod:`.._harness`.

Reference: a prefix-LM ``mask_mod`` against the dense mask built by broadcasting (the learner's
evaluated by FlexAttention's ``create_mask``); mistakes: ``and``/``or`` on tensors, the prefix not
read at ``b``, causal only, prefix only, ``&`` for ``|``, the prefix off by one or tested on the
query, the diagonal missing, causality backwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import mha
from mha.flex import MaskMod

from .._harness import Case, Exercise, ExerciseError, publish, tr

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
    rewrites=(),  # neither mha nor torch has a prefix-LM mask_mod
    params=("prefix_lm",),
    doc="Check ``prefix_lm(prefix_lengths) -> mask_mod``: a FlexAttention ``mask_mod(b, h, q_idx, "
    "kv_idx)`` for a prefix LM, bidirectional among the first ``prefix_lengths[b]`` tokens of "
    "sequence ``b`` and causal after them; ``prefix_lengths`` an integer tensor ``(B,)``. The "
    "checker evaluates it with ``torch.nn.attention.flex_attention.create_mask``.",
)


EXERCISES = publish(globals())
