"""Section 9.4, attention across processes: the exercises as data for :mod:`.._harness`.

References: the bytes one rank sends in ring attention, counted from the shapes; what a rank does
at each step of causal ring attention, from the shard it holds; ring attention simulated in one
process, written as a softmax over the whole sequence. Mistakes: ``world`` sends instead of
``world - 1``, keys only, the whole sequence sent, query heads for key/value heads, every rank's
bytes added up; the ring turned the wrong way, skip and compute swapped, the diagonal shard
attended in full; partials averaged, the diagonal shard without its causal mask, shards past the
diagonal attended, one softmax over the whole sequence or every partial kept to the end (caught
by the size of what a step makes); and the library's own functions (``mha.distributed``,
``mha.decoding``, ready-made attention), which the exercises ban.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

import mha
from mha import attention, decoding, distributed, flash

from .._harness import NO_SDPA, Case, Exercise, defined_in, publish, randn64, tr, whole
from ._guard import no_tensor_as_large

# --- the bytes one rank sends -----------------------------------------------------------------------


def _ring_bytes_reference(B: int, H: int, Hkv: int, L: int, D: int, world: int, nbytes: int) -> int:
    """``world - 1`` sends of this rank's key shard and value shard, ``(B, Hkv, L / world, D)``."""
    shard = B * Hkv * (L // world) * D * nbytes  # one key (or value) shard
    return (world - 1) * 2 * shard


def _ring_bytes_cases() -> list[Case]:
    """Every argument varied, GQA (Hkv < H) included, and one rank alone (nothing to send)."""
    calls = (
        (2, 24, 8, 4096, 128, 4, 2),
        (1, 8, 8, 1024, 64, 2, 4),
        (4, 16, 2, 96, 32, 3, 2),
        (1, 64, 8, 131072, 128, 8, 2),
        (3, 4, 1, 40, 16, 5, 1),
        (2, 8, 8, 64, 16, 1, 4),
    )
    return [Case(f"ring_bytes{args}", args) for args in calls]


_HINT_RING_BYTES = (
    "A rank's key and value shards are (B, Hkv, L / world, D) each, nbytes per number; it sends "
    "the shard it holds at every step but the last: (world - 1) · 2 · B · Hkv · (L / world) · D "
    "· nbytes."
)

RING_BYTES = Exercise(
    "check_ring_bytes",
    "the bytes one rank sends, GQA and one rank alone included",
    _ring_bytes_reference,
    _ring_bytes_cases,
    variants=(
        lambda B, H, Hkv, L, D, world, nbytes: 2 * (world - 1) * B * Hkv * L * D * nbytes // world,
        lambda B, H, Hkv, L, D, world, nbytes: (
            sum(2 * B * Hkv * (L // world) * D for _ in range(1, world)) * nbytes
        ),
    ),
    mistakes=(
        (
            lambda B, H, Hkv, L, D, world, nbytes: world * 2 * B * Hkv * (L // world) * D * nbytes,
            "The last step sends nothing: a rank already holds its own shard, so it passes "
            "world - 1 shards on, not world. " + _HINT_RING_BYTES,
        ),
        (
            lambda B, H, Hkv, L, D, world, nbytes: (
                (world - 1) * B * Hkv * (L // world) * D * nbytes
            ),
            "Keys and values both travel around the ring: two shards per step. " + _HINT_RING_BYTES,
        ),
        (
            lambda B, H, Hkv, L, D, world, nbytes: (
                (world - 1) * 2 * B * H * (L // world) * D * nbytes
            ),
            "Only key/value heads are sent: Hkv, not H (GQA sends fewer bytes). "
            + _HINT_RING_BYTES,
        ),
        (
            lambda B, H, Hkv, L, D, world, nbytes: (world - 1) * 2 * B * Hkv * L * D * nbytes,
            "A rank holds and sends shards of L / world tokens, not the whole sequence (the "
            "whole sequence, world - 1 times, is what all the ranks send together). "
            + _HINT_RING_BYTES,
        ),
    ),
    hint=_HINT_RING_BYTES,
    crash_hint="ring_bytes(B, H, Hkv, L, D, world, nbytes) takes ints and returns an int.",
    convert=whole,
    rewrites=(),  # arithmetic: mha counts a real ring's bytes (count_traffic), not a formula
    params=("ring_bytes",),
    doc="Check ``ring_bytes(B, H, Hkv, L, D, world, nbytes) -> int``: the bytes of keys and "
    "values one rank sends during ring attention over ``world`` ranks.",
)


# --- what a causal rank does at each step -------------------------------------------------------------


def _plan_reference(rank: int, world: int) -> list[str]:
    """At step t the rank holds the shard of rank (rank - t) mod world: its own is the diagonal,
    an earlier one is seen in full, a later one lies in the future."""
    plan = []
    for t in range(world):
        src = (rank - t) % world
        plan.append("diagonal" if src == rank else "full" if src < rank else "skip")
    return plan


def _plan_cases() -> list[Case]:
    return [
        Case(f"ring_plan(rank={r}, world={w})", (r, w))
        for r, w in ((1, 4), (0, 4), (3, 4), (2, 5), (4, 5), (1, 2), (0, 1))
    ]


_HINT_PLAN = (
    "At step t rank r holds the keys of rank (r - t) % world (each rank passes its shard to "
    "r + 1). Its own shard (t = 0) is the diagonal, attended causally; a shard of an earlier "
    "rank is attended in full; a later rank's keys are all in the future: skip."
)


def _plan_by_steps(rank: int, world: int) -> list[str]:
    """Counting: the rank's own shard first, then the ``rank`` earlier shards, then the rest."""
    return ["diagonal"] + ["full"] * rank + ["skip"] * (world - 1 - rank)


def _plan_slip(
    source: Callable[[int, int, int], int],
    *,
    diagonal: str = "diagonal",
    earlier: str = "full",
    later: str = "skip",
) -> Callable[[int, int], list[str]]:
    def plan(rank: int, world: int) -> list[str]:
        out = []
        for t in range(world):
            src = source(rank, t, world)
            out.append(diagonal if src == rank else earlier if src < rank else later)
        return out

    return plan


def _plan_by_schedule(rank: int, world: int) -> list[str]:
    """mha.ring_schedule's work per step: 0 skip, a half the diagonal, 1 a full shard."""
    work = distributed.ring_schedule(world)[rank].tolist()
    return ["skip" if w == 0 else "full" if w == 1 else "diagonal" for w in work]


def _plan_by_private_helper(rank: int, world: int) -> list[str]:
    """mha.distributed's private _process_group asked who is who, the plan then by hand."""
    distributed._process_group(None)
    return _plan_reference(rank, world)


#: Every function of mha.distributed (ring attention, its schedule and private helpers).
DISTRIBUTED_BANNED = tuple(defined_in(distributed))
_NO_SCHEDULE = "work the plan out yourself, without mha.ring_schedule (or mha.distributed)."

RING_PLAN = Exercise(
    "check_ring_plan",
    "every rank's steps, for 1, 2, 4 and 5 ranks",
    _plan_reference,
    _plan_cases,
    variants=(
        _plan_by_steps,
        lambda rank, world: [
            ("full", "diagonal", "skip")[
                1 + ((rank - t) % world > rank) - ((rank - t) % world < rank)
            ]
            for t in range(world)
        ],
    ),
    mistakes=(
        (
            _plan_slip(lambda r, t, w: (r + t) % w),
            "The ring turns the other way: each rank sends to r + 1, so it receives from r - 1, "
            "and at step t holds the shard of rank (r - t) % world. " + _HINT_PLAN,
        ),
        (
            _plan_slip(lambda r, t, w: (r - t) % w, earlier="skip", later="full"),
            "Skip and full are swapped: a query sees the keys before it, so an earlier rank's "
            "shard is attended in full and a later one skipped. " + _HINT_PLAN,
        ),
        (
            _plan_slip(lambda r, t, w: (r - t) % w, diagonal="full"),
            "A rank's own shard is not all visible: its queries see only the keys up to "
            "themselves, so it is attended causally ('diagonal'). " + _HINT_PLAN,
        ),
        (_plan_by_schedule, _NO_SCHEDULE),
        (_plan_by_private_helper, _NO_SCHEDULE),
    ),
    hint=_HINT_PLAN,
    crash_hint="ring_plan(rank, world) returns a list of world words, 'skip', 'full' or "
    "'diagonal', one per step.",
    forbidden=DISTRIBUTED_BANNED,
    forbidden_hint=_NO_SCHEDULE,
    rewrites=(distributed.ring_schedule,),
    params=("ring_plan",),
    doc="Check ``ring_plan(rank, world) -> list[str]``: for each step of causal ring attention, "
    "whether ``rank`` skips the key/value shard it holds, attends it in full, or attends it "
    "causally (its own shard, the diagonal).",
)


# --- ring attention in one process --------------------------------------------------------------------


def _ring_reference(q: Tensor, k: Tensor, v: Tensor, world: int) -> Tensor:
    """Causal attention over the whole sequence, as one softmax: what the ring must give."""
    L = q.shape[-2]
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (..., L, L)
    future = torch.ones(L, L, dtype=torch.bool).triu(1)  # (L, L), True above the diagonal
    return torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v  # (..., L, Dv)


#: The case in which no step may score more than one shard of keys: 8 ranks of 2 queries, D = 2,
#: so that one query's row over all 16 keys is already larger than any step's own tensors.
_SHARDED = "8 ranks of 2 tokens"


def _ring_cases() -> list[Case]:
    g = torch.Generator().manual_seed(94)
    cases = []
    for B, H, L, D, world in ((1, 2, 8, 4, 2), (2, 3, 12, 8, 4), (1, 1, 15, 6, 3), (2, 2, 6, 5, 1)):
        q, k, v = randn64(g, B, H, L, D), randn64(g, B, H, L, D), randn64(g, B, H, L, D)
        cases.append(Case(f"ring(q, k, v, world={world}) with q {(B, H, L, D)}", (q, k, v, world)))
    q, k, v = (randn64(g, 1, 2, 16, 2) for _ in range(3))
    cases.append(Case(f"ring(q, k, v, world=8) with q (1, 2, 16, 2): {_SHARDED}", (q, k, v, 8)))
    return cases


def _ring_run(answer: Callable[..., object], case: Case) -> object:
    """The answer's output; in the sharded case, no tensor larger than one step's own work (a
    shard's (l, l) scores, a shard of keys, a partial) may be made, views of q, k and v and the
    assembled (B, H, L, Dv) output aside."""
    q, k, v, world = case.args
    q, k, v = q.clone(), k.clone(), v.clone()
    if _SHARDED not in case.label:
        return answer(q, k, v, world)
    B, H, L, D = q.shape
    shard = L // world
    limit = B * H * shard * max(shard, D, v.shape[-1]) + 1
    message = tr(
        "made a tensor of {n} numbers or more: more than one step of a rank holds (its queries "
        "against one shard of keys)",
        n=limit,
    )
    with no_tensor_as_large(limit, (q, k, v), message, allowed=B * H * L * v.shape[-1]):
        return answer(q, k, v, world)


def _block(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """One block's partial output and logsumexp, by hand."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (..., l, l)
    if causal:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)  # (..., l, Dv), (..., l)


def _ring_by_steps(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    world: int,
    *,
    merge: str = "lse",
    diagonal: bool = True,
    future: bool = False,
) -> Tensor:
    """Rank by rank, step by step; ``merge``, ``diagonal`` and ``future`` make the usual slips."""
    qs, ks, vs = q.chunk(world, -2), k.chunk(world, -2), v.chunk(world, -2)
    outs = []
    for r in range(world):
        parts = []
        for t in range(world):
            src = (r - t) % world
            if src > r and not future:
                continue
            parts.append(_block(qs[r], ks[src], vs[src], diagonal and src == r))
        out, lse = parts[0]
        for o, l in parts[1:]:
            if merge == "mean":
                out = (out + o) / 2
                continue
            total = torch.logaddexp(lse, l)
            out = (lse - total).exp()[..., None] * out + (l - total).exp()[..., None] * o
            lse = total
        outs.append(out)
    return torch.cat(outs, -2)  # (..., L, Dv)


def _ring_online(q: Tensor, k: Tensor, v: Tensor, world: int) -> Tensor:
    """Each rank keeps a running max, sum and weighted sum (the online softmax), updated as each
    shard arrives: the same merge as logsumexp's, unnormalised."""
    qs, ks, vs = q.chunk(world, -2), k.chunk(world, -2), v.chunk(world, -2)
    outs = []
    for r in range(world):
        m = qs[r].new_full((*qs[r].shape[:-1], 1), float("-inf"))  # (B, H, l, 1)
        total, acc = torch.zeros_like(m), qs[r].new_zeros(*qs[r].shape[:-1], v.shape[-1])
        for t in range(world):
            src = (r - t) % world  # the shard this rank holds at step t
            if src > r:
                continue  # all in the future
            s = qs[r] @ ks[src].mT / q.shape[-1] ** 0.5  # (B, H, l, l)
            if src == r:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, alpha = (s - m_new).exp(), (m - m_new).exp()
            total, acc, m = (
                alpha * total + p.sum(-1, keepdim=True),
                alpha * acc + p @ vs[src],
                m_new,
            )
        outs.append(acc / total)
    return torch.cat(outs, -2)


def _ring_one_softmax(q: Tensor, k: Tensor, v: Tensor, world: int) -> Tensor:
    """The shortcut: no shard, no merge, one causal softmax over the whole sequence."""
    return _ring_reference(q, k, v, world)


def _ring_all_partials_kept(q: Tensor, k: Tensor, v: Tensor, world: int) -> Tensor:
    """Every visible shard's partial kept, merged at the end by a softmax over their lse."""
    qs, ks, vs = q.chunk(world, -2), k.chunk(world, -2), v.chunk(world, -2)
    outs = []
    for r in range(world):
        parts = [_block(qs[r], ks[s], vs[s], s == r) for s in range(r + 1)]
        o = torch.stack([p[0] for p in parts])  # (parts, ..., l, Dv)
        w = torch.softmax(torch.stack([p[1] for p in parts]), 0)[..., None]  # (parts, ..., l, 1)
        outs.append((w * o).sum(0))
    return torch.cat(outs, -2)


def _ring_by_private_helper(q: Tensor, k: Tensor, v: Tensor, world: int) -> Tensor:
    """mha.distributed's private _partials for each (rank, shard), merged by hand."""
    qs, ks, vs = q.chunk(world, -2), k.chunk(world, -2), v.chunk(world, -2)
    scale, outs = q.shape[-1] ** -0.5, []
    for r in range(world):
        parts = [
            p
            for src in range(r + 1)
            for p in distributed._partials(
                qs[r], ks[src], vs[src], r, src, True, scale, 1, "contiguous", world
            )
        ]
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
        outs.append(torch.stack([(p[1] - lse).exp()[..., None] * p[0] for p in parts]).sum(0))
    return torch.cat(outs, -2)


_HINT_RING = (
    "For rank r, every shard s <= r gives a partial (softmax(q_r k_sᵀ/√D) v_s, causal when "
    "s = r) and its logsumexp; merge them with weights exp(lse_s - logsumexp over s of lse_s); "
    "concatenate the ranks' outputs."
)
_RING_ONE_SHARD = (
    "A rank meets one shard of keys at a time: score its queries against that shard only "
    "((l, l) scores per step, masked causally on the diagonal) and fold the partial into a "
    "running out and lse by logsumexp before the next shard arrives. Never score the whole "
    "sequence, build an (L, L) mask, or keep every shard's partial for the end."
)
_NO_READY_MADE = (
    "write each block's attention and the merge yourself (torch.softmax, torch.logsumexp)."
)

RING_SIMULATION = Exercise(
    "check_ring_simulation",
    "causal ring attention over 1 to 8 simulated ranks equals one pass (float64); over 8 ranks, "
    "no tensor larger than one step's work (a shard's scores, keys or partial) was made",
    _ring_reference,
    _ring_cases,
    variants=(_ring_by_steps, _ring_online),
    mistakes=(
        (
            lambda q, k, v, world: _ring_by_steps(q, k, v, world, merge="mean"),
            "Averaging partials weighs every shard alike; each must count by its softmax mass, "
            "exp(lse). " + _HINT_RING,
        ),
        (
            lambda q, k, v, world: _ring_by_steps(q, k, v, world, diagonal=False),
            "A rank's own shard (the diagonal block) needs the causal mask: query i of the shard "
            "sees keys 0…i of it only. " + _HINT_RING,
        ),
        (
            lambda q, k, v, world: _ring_by_steps(q, k, v, world, future=True),
            "Shards of later ranks hold future keys only: skip them. " + _HINT_RING,
        ),
        (_ring_one_softmax, _RING_ONE_SHARD),
        (_ring_all_partials_kept, _RING_ONE_SHARD),
        (
            lambda q, k, v, world: mha.merge_partials(
                *(torch.stack(t) for t in zip(*[_block(q, k, v, True)], strict=True))
            )[0],
            _NO_READY_MADE,
        ),
        (_ring_by_private_helper, _NO_READY_MADE),
    ),
    hint=_HINT_RING,
    crash_hint="q, k, v are (B, H, L, D) with L divisible by world; rank r holds rows "
    "[r·L/world, (r+1)·L/world); return the (B, H, L, D) output.",
    atol=1e-10,
    rtol=1e-8,
    call=_ring_run,
    forbidden=(
        *NO_SDPA,
        *defined_in(distributed),
        *defined_in(decoding),
        *defined_in(attention),
        *defined_in(flash),
    ),
    forbidden_hint=_NO_READY_MADE,
    rewrites=(mha.ring_attention, mha.merge_partials),
    params=("ring",),
    doc="Check ``ring(q, k, v, world) -> out``: causal attention computed as ring attention "
    "over ``world`` simulated ranks in one process, equal to one pass; each step scores one "
    "shard of keys and merges its partial by logsumexp.",
)


EXERCISES = publish(globals())
