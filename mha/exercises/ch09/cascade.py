"""Section 9.6, cascade attention: the exercise as data for :mod:`.._harness`.

Reference: attention of each packed sequence over the shared prefix followed by its own keys, one
softmax, causal aligned bottom-right (what the cascade must equal). The method is checked too, on
a batch of 4 sequences: no tensor has an axis of ``P + S_b`` positions (the prefix's keys joined to
a sequence's own), and the operations that read the prefix are as many as for 1 sequence (the
prefix attended once for the batch). Mistakes: prefix and own keys joined into one softmax, the
prefix attended sequence by sequence, partials averaged, merged without subtracting the max, or
weighted by ``exp(lse)`` without dividing by the sum, the logsumexp over the query axis, the own
keys' causal mask aligned top-left, the prefix masked causally; and the library's own functions
(``mha.cascade``, ``mha.decoding``, ready-made attention), which the exercise bans.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

import mha
from mha import attention, cascade, decoding, flash, varlen

from .._harness import NO_SDPA, Case, Exercise, defined_in, publish, randn64, tr


def _spans(cu: list[int]) -> list[tuple[int, int]]:
    return list(zip(cu[:-1], cu[1:]))


def _cascade_reference(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    """Each sequence alone: one softmax over the prefix followed by its own keys, its L_b queries
    the last L_b of those P + S_b positions (causal, aligned bottom-right)."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # (total_q, H, Dv)
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        keys = torch.cat([prefix_k, k[k0:k1]]).transpose(0, 1)  # (H, P + S_b, D)
        values = torch.cat([prefix_v, v[k0:k1]]).transpose(0, 1)  # (H, P + S_b, Dv)
        L, S = q1 - q0, keys.shape[1]
        scores = q[q0:q1].transpose(0, 1) @ keys.mT / math.sqrt(q.shape[-1])  # (H, L, S)
        future = torch.ones(L, S, dtype=torch.bool).triu(S - L + 1)  # bottom-right causal
        weights = torch.softmax(scores.masked_fill(future, -math.inf), -1)
        out[q0:q1] = (weights @ values).transpose(0, 1)  # (L, H, Dv)
    return out


#: The case whose method is checked: 4 sequences, and the first alone (B = 1) to compare with.
_WATCHED = "4 sequences, the method watched"


def _cascade_cases() -> list[Case]:
    g = torch.Generator().manual_seed(96)
    cases = []
    for P, S, L, H, D, scale, what in (
        (6, (4, 7, 2), (1, 1, 1), 2, 4, 1, "a decode step"),
        (5, (6, 3, 8), (3, 3, 2), 2, 4, 1, "chunks of different lengths"),
        (4, (5, 0, 4), (2, 0, 0), 3, 2, 1, "a sequence without own keys, two without queries"),
        (3, (3, 4), (0, 0), 2, 4, 1, "no query at all"),
        (6, (5, 3), (2, 3), 2, 4, 40, "scores in the thousands: exp overflows"),
        (38, (5, 9, 3, 8), (2, 4, 1, 2), 2, 4, 1, _WATCHED),
    ):
        cu_q, cu_k = [0, *itertools.accumulate(L)], [0, *itertools.accumulate(S)]
        q = randn64(g, cu_q[-1], H, D) * scale
        prefix_k, prefix_v = randn64(g, P, H, D) * scale, randn64(g, P, H, D)
        k, v = randn64(g, cu_k[-1], H, D) * scale, randn64(g, cu_k[-1], H, D)
        label = f"cascade(...) with P = {P}, own keys {list(S)}, queries {list(L)} ({what})"
        cases.append(Case(label, (q, prefix_k, prefix_v, k, v, cu_q, cu_k)))
    return cases


class WrongMethod(Exception):
    """The answer's values may be right, but it does not compute them as a cascade."""


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in an argument (lists and tuples searched, one level deep)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, Tensor)]
    return []


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class _Cascade(TorchFunctionMode):
    """Watches an answer: no tensor of 2 or more dimensions with an axis of one of ``joined``
    sizes (P + S_b), and counts the operations that read the prefix (its keys or values, or a
    tensor made from them alone: a transpose, a copy)."""

    def __init__(self, prefix: tuple[Tensor, Tensor], joined: set[int]) -> None:
        super().__init__()
        self.joined = joined
        self.kept = list(prefix)  # keeps what it watches alive, so no storage is reused
        self.prefix = {_storage(t) for t in prefix} - {0}
        self.reads = 0
        self.tripped = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        results = [t for t in (out if isinstance(out, (tuple, list)) else (out,))]
        results = [t for t in results if isinstance(t, Tensor)]
        if not results:
            return out  # a shape, a dtype, a number: nothing read
        inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
        from_prefix = [_storage(t) in self.prefix for t in inputs]
        if any(from_prefix):
            self.reads += 1
            if all(from_prefix):  # made from the prefix alone: a view or copy of it
                self.kept += results
                self.prefix |= {_storage(t) for t in results} - {0}
        if any(t.dim() >= 2 and self.joined & set(t.shape) for t in results):
            self.tripped = True
            raise _joined()
        return out


def _joined() -> WrongMethod:
    return WrongMethod(
        tr(
            "made a tensor with an axis of P + S_b positions: the prefix's keys were joined to a "
            "sequence's own keys (or its scores to theirs) for one softmax"
        )
    )


def _per_sequence() -> WrongMethod:
    return WrongMethod(
        tr(
            "read the prefix in more operations for 4 sequences than for 1 sequence: the prefix "
            "was attended sequence by sequence"
        )
    )


def _watched(answer: Callable[..., Any], args: tuple) -> tuple[Tensor, int]:
    """The answer's output on ``args`` and the number of operations that read the prefix."""
    q, prefix_k, prefix_v, k, v, cu_q, cu_k = args
    P = prefix_k.shape[0]
    joined = {P + b - a for a, b in _spans(cu_k) if b > a}
    mode = _Cascade((prefix_k, prefix_v), joined)
    with mode:
        out = answer(q, prefix_k, prefix_v, k, v, list(cu_q), list(cu_k))
    if mode.tripped:  # an answer that caught the error is still rejected
        raise _joined()
    return out, mode.reads


def _cascade_run(answer: Callable[..., Any], case: Case) -> object:
    """The answer's output; in the watched case, the answer runs on sequence 1 alone, then on all
    4, and must read the prefix in no more operations for 4 than for 1."""
    q, prefix_k, prefix_v, k, v = (t.clone() for t in case.args[:5])
    cu_q, cu_k = list(case.args[5]), list(case.args[6])
    args = (q, prefix_k, prefix_v, k, v, cu_q, cu_k)
    if _WATCHED not in case.label:
        return answer(*args)
    (q0, q1), (k0, k1) = _spans(cu_q)[1], _spans(cu_k)[1]
    one = (q[q0:q1].clone(), prefix_k, prefix_v, k[k0:k1].clone(), v[k0:k1].clone())
    _, reads_one = _watched(answer, (*one, [0, q1 - q0], [0, k1 - k0]))
    out, reads_all = _watched(answer, args)
    if reads_all > reads_one:
        raise _per_sequence()
    return out


# --- answers: the cascade written out, and its slips -----------------------------------------------


def _partial(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, lse_dim: int = -1):
    """Attention of ``q`` (H, L, D) over ``k``, ``v`` (H, S, D) by hand: the output (H, L, Dv)
    and the logsumexp of the scores over the keys (H, L)."""
    scores = q @ k.mT / math.sqrt(q.shape[-1])  # (H, L, S)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, lse_dim)


def _cascade_by_parts(
    q: Tensor,
    prefix_k: Tensor,
    prefix_v: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: list,
    cu_k: list,
    *,
    merge: str = "lse",
    own_mask: str = "bottom-right",
    causal_prefix: bool = False,
    lse_dim: int = -1,
) -> Tensor:
    """The three steps; ``merge``, ``own_mask``, ``causal_prefix``, ``lse_dim`` make the slips."""
    qh = q.transpose(0, 1)  # (H, total_q, D): every query of the batch
    keep = None
    if causal_prefix:
        keep = torch.ones(q.shape[0], prefix_k.shape[0], dtype=torch.bool).tril()
    o1, l1 = _partial(qh, prefix_k.transpose(0, 1), prefix_v.transpose(0, 1), keep, lse_dim)
    o2 = qh.new_zeros(qh.shape[0], qh.shape[1], v.shape[-1])  # (H, total_q, Dv)
    l2 = torch.full_like(o2[..., 0], -math.inf)  # (H, total_q)
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        if q1 == q0:
            continue
        L, S = q1 - q0, k1 - k0
        own = torch.ones(L, S, dtype=torch.bool).tril(S - L if own_mask == "bottom-right" else 0)
        o2[:, q0:q1], l2[:, q0:q1] = _partial(
            qh[:, q0:q1], k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1), own, lse_dim
        )
    if merge == "mean":
        out = (o1 + o2) / 2
    elif merge == "exp":  # exp(lse) as weights, not divided by their sum
        out = l1.exp()[..., None] * o1 + l2.exp()[..., None] * o2
    elif merge == "no-max":  # the right weights, computed without subtracting the max
        e1, e2 = l1.exp()[..., None], l2.exp()[..., None]
        out = (e1 * o1 + e2 * o2) / (e1 + e2)
    else:
        total = torch.logaddexp(l1, l2)  # (H, total_q)
        out = (l1 - total).exp()[..., None] * o1 + (l2 - total).exp()[..., None] * o2
    return out.transpose(0, 1)  # (total_q, H, Dv)


def _cascade_padded(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    """No loop at all: each query gathers its sequence's own keys padded to the longest, and the
    two partials merge by a softmax over their logsumexps."""
    total_q, H, _ = q.shape
    if total_q == 0:
        return q.new_zeros(0, H, v.shape[-1])
    lengths_q = torch.tensor([b - a for a, b in _spans(cu_q)])
    lengths_k = torch.tensor([b - a for a, b in _spans(cu_k)])
    seq = torch.repeat_interleave(torch.arange(len(lengths_q)), lengths_q)  # (total_q,)
    i = torch.arange(total_q) - torch.tensor(cu_q[:-1])[seq]  # index inside its sequence
    j = torch.arange(int(lengths_k.max()))  # (S_max,)
    sees = j <= (i + lengths_k[seq] - lengths_q[seq])[:, None]  # (total_q, S_max) bottom-right
    index = (torch.tensor(cu_k[:-1])[seq][:, None] + j).clamp(max=k.shape[0] - 1)
    scale = q.shape[-1] ** -0.5
    s_own = torch.einsum("qhd,qshd->hqs", q, k[index]) * scale  # (H, total_q, S_max)
    s_own = s_own.masked_fill(~sees, -math.inf)
    s_pre = torch.einsum("qhd,phd->hqp", q, prefix_k) * scale  # (H, total_q, P)
    o_own = torch.einsum("hqs,qshd->hqd", s_own.softmax(-1), v[index])
    o_pre = torch.einsum("hqp,phd->hqd", s_pre.softmax(-1), prefix_v)
    w = torch.stack([s_pre.logsumexp(-1), s_own.logsumexp(-1)]).softmax(0)  # (2, H, total_q)
    return (w[0, ..., None] * o_pre + w[1, ..., None] * o_own).transpose(0, 1)


def _cascade_joined(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    """Right values, not a cascade: the prefix joined to each sequence's own keys."""
    return _cascade_reference(q, prefix_k, prefix_v, k, v, cu_q, cu_k)


def _cascade_prefix_per_sequence(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    """Right values, the prefix read again for every sequence."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        out[q0:q1] = _cascade_by_parts(
            q[q0:q1], prefix_k, prefix_v, k[k0:k1], v[k0:k1], [0, q1 - q0], [0, k1 - k0]
        )
    return out


def _cascade_by_library(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    cu = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    return mha.cascade_attention(q, prefix_k, prefix_v, k, v, *cu)


def _cascade_by_private_helper(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    """mha.cascade's private function, reached around cascade_attention's checks."""
    scale = q.shape[-1] ** -0.5
    return cascade._cascade_attention(q, prefix_k, prefix_v, k, v, cu_q, cu_k, scale, 1)


def _cascade_merged_by_library(
    q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor, cu_q: list, cu_k: list
) -> Tensor:
    """Both partials by hand, merged by mha.decoding's private merge."""
    qh = q.transpose(0, 1)
    o1, l1 = _partial(qh, prefix_k.transpose(0, 1), prefix_v.transpose(0, 1), None)
    o2, l2 = _partial(qh, k.transpose(0, 1), v.transpose(0, 1), None)
    return decoding._merge_partials(torch.stack([o1, o2]), torch.stack([l1, l2]))[0].transpose(0, 1)


def _slip(**slip: Any) -> Callable[..., Tensor]:
    def answer(*args: Any) -> Tensor:
        return _cascade_by_parts(*args, **slip)

    return answer


_HINT_CASCADE = (
    "(1) Every query of the batch against the prefix at once: scores (H, total_q, P), their "
    "softmax @ prefix values and their logsumexp over the keys; (2) each sequence's queries "
    "against its own keys, keeping key j for query i when j <= i + S_b - L_b; (3) merge: with "
    "l = logaddexp(l1, l2), out = exp(l1 - l) o1 + exp(l2 - l) o2."
)
_ONE_PASS = (
    "Right values, but not a cascade. Attend to the two key sets apart, the prefix in one "
    "pass for every query of the batch (never joined to a sequence's own keys, never read "
    "once per sequence), and merge the two partials by logsumexp. " + _HINT_CASCADE
)
_NO_READY_MADE = (
    "write the two attentions and the merge yourself (torch.softmax, torch.logsumexp), without "
    "mha.cascade_attention, mha.merge_partials or ready-made attention."
)

CASCADE_ATTENTION = Exercise(
    "check_cascade_attention",
    "equal to one softmax over prefix and own keys per sequence (float64, 6 batches, scores up "
    "to thousands); on 4 sequences, no tensor had an axis of P + S_b and no more operations read the "
    "prefix than for 1 sequence",
    _cascade_reference,
    _cascade_cases,
    variants=(_cascade_by_parts, _cascade_padded),
    mistakes=(
        (_cascade_joined, _ONE_PASS),
        (_cascade_prefix_per_sequence, _ONE_PASS),
        (
            _slip(merge="mean"),
            "Averaging the partials weighs the prefix and the own keys alike; each counts by its "
            "mass, exp(lse). " + _HINT_CASCADE,
        ),
        (
            _slip(merge="no-max"),
            "exp(lse) overflows when the scores are large (inf / inf = NaN): weigh by exp(l1 - l) "
            "and exp(l2 - l), with l = logaddexp(l1, l2). " + _HINT_CASCADE,
        ),
        (
            _slip(merge="exp"),
            "The weights exp(l1) and exp(l2) must be divided by their sum, exp(l1) + exp(l2): "
            "each partial is already normalised over its own keys. " + _HINT_CASCADE,
        ),
        (
            _slip(lse_dim=-2),
            "The logsumexp runs over the keys (the last axis of the scores), one per query, not "
            "over the queries. " + _HINT_CASCADE,
        ),
        (
            _slip(own_mask="top-left"),
            "A sequence's L_b queries are its last L_b positions: the causal mask over its own "
            "keys is aligned bottom-right (tril(S_b - L_b)), not top-left. " + _HINT_CASCADE,
        ),
        (
            _slip(causal_prefix=True),
            "The prefix comes before every query of the sequence: each query sees all P prefix "
            "keys, no causal mask there. " + _HINT_CASCADE,
        ),
        (_cascade_by_library, _NO_READY_MADE),
        (_cascade_by_private_helper, _NO_READY_MADE),
        (_cascade_merged_by_library, _NO_READY_MADE),
    ),
    hint=_HINT_CASCADE,
    crash_hint="q is (total_q, H, D), prefix_k and prefix_v (P, H, D), k and v (total_k, H, D); "
    "cu_q and cu_k are lists of ints; return the (total_q, H, D) output.",
    atol=1e-10,
    rtol=1e-8,
    call=_cascade_run,
    forbidden=(
        *NO_SDPA,
        *defined_in(cascade),
        *defined_in(decoding),
        *defined_in(attention),
        *defined_in(flash),
        *defined_in(varlen),
    ),
    forbidden_hint=_NO_READY_MADE,
    rewrites=(mha.cascade_attention, mha.merge_partials),
    params=("cascade",),
    doc="Check ``cascade(q, prefix_k, prefix_v, k, v, cu_q, cu_k) -> out``: attention of packed "
    "sequences over a shared prefix and their own keys (causal, bottom-right), the prefix "
    "attended once for the batch and merged with the own keys' partial by logsumexp.",
)


EXERCISES = publish(globals())
