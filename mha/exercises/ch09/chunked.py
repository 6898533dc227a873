"""Section 9.5, chunked prefill and speculative verification: the exercises as data for
:mod:`.._harness`.

References: a mixed batch's ``cu_seqlens_q`` (prefix sums of the query counts, int32) and the
position of every packed query row (sequence ``b``'s rows are its last ``n_b`` positions), and
the tree-attention mask of a verification pass (the prefix, the ancestors and the token itself);
mistakes: the queries taken as the first positions, the lengths for the counts, int64 offsets,
only the parent instead of every ancestor, the causal triangle (siblings seen), no diagonal, the
prefix hidden, and the library's own functions, which the exercises ban.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

import mha
from mha import masks, speculative, varlen

from .._harness import Case, Exercise, ExerciseError, as_int, defined_in, publish, tr, whole
from .varlen import VARLEN_BANNED

# --- a mixed batch by hand ----------------------------------------------------------------------


def _mixed_reference(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    counts = torch.tensor(new_tokens, dtype=torch.int64)  # (B,)
    cu = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)  # (B + 1,)
    first = torch.tensor(seq_lens, dtype=torch.int64) - counts  # (B,) first new position
    seq = torch.arange(len(new_tokens)).repeat_interleave(counts)  # (total_q,) its sequence
    rank = torch.arange(int(counts.sum())) - cu[:-1].long()[seq]  # (total_q,) row within it
    return cu, first[seq] + rank  # (B + 1,) int32, (total_q,) int64


def _mixed_cases() -> list[Case]:
    return [
        Case(
            f"mixed_batch({n}, {s}){what}",
            (n, s),
        )
        for n, s, what in (
            ([4, 1, 1], [4, 9, 17], " (a whole prompt, two decode steps)"),
            ([3, 1, 0, 2], [10, 6, 5, 2], " (a later chunk, a decode step, one sitting out)"),
            ([1], [1], " (one decode step on an empty cache)"),
            ([5, 1, 5], [15, 40, 5], ""),
        )
    ]


def _mixed_by_loop(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    offsets: list[int] = [0]
    positions: list[int] = []
    for n, S in zip(new_tokens, seq_lens):
        offsets.append(offsets[-1] + n)
        positions += range(S - n, S)  # the last n of its S positions
    return torch.tensor(offsets, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64)


def _mixed_by_accumulate(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    cu = torch.tensor([0, *itertools.accumulate(new_tokens)], dtype=torch.int32)
    parts = [torch.arange(S - n, S) for n, S in zip(new_tokens, seq_lens)]
    return cu, torch.cat([torch.zeros(0, dtype=torch.int64), *parts])


def _mixed_first_positions(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    cu, _ = _mixed_reference(new_tokens, seq_lens)
    return cu, torch.cat([torch.arange(n) for n in [0, *new_tokens]])


def _mixed_lengths_as_counts(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    return _mixed_reference(seq_lens, seq_lens)


def _mixed_by_library(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    cu = varlen.pack([torch.zeros(n, 1) for n in new_tokens])[1]
    return cu, _mixed_reference(new_tokens, seq_lens)[1]


def _mixed_by_private_helper(new_tokens: list[int], seq_lens: list[int]) -> tuple[Tensor, Tensor]:
    """The counts read off mha.varlen's private per-sequence helper."""
    empty = torch.zeros(0, 1, 1)
    sizes = [
        varlen._attend_one(empty, empty, empty, 1, False, 1.0).shape[0] + n for n in new_tokens
    ]
    return _mixed_reference(sizes, seq_lens)


_HINT_MIXED = (
    "cu_seqlens_q holds the B + 1 int32 prefix sums of the query counts n_b, starting at 0; "
    "sequence b's n_b packed rows are its LAST n_b positions, seq_lens[b] - n_b ... "
    "seq_lens[b] - 1 (the step's keys are already in the cache)."
)
_NO_PACK = "write it yourself, without mha.varlen (pack ...) or mha.chunked_prefill."

MIXED_BATCH = Exercise(
    "check_mixed_batch",
    "cu_seqlens_q and each query row's position: the last n_b of every sequence's seq_lens",
    _mixed_reference,
    _mixed_cases,
    variants=(_mixed_by_loop, _mixed_by_accumulate),
    mistakes=(
        (
            _mixed_first_positions,
            "These are the first n_b positions: the queries of a chunk or a decode step come "
            "after what is cached, so they are the last ones. " + _HINT_MIXED,
        ),
        (
            _mixed_lengths_as_counts,
            "cu_seqlens_q counts this step's queries n_b, not the tokens stored: a decode step "
            "adds one row, whatever the length of its sequence. " + _HINT_MIXED,
        ),
        (
            lambda n, s: (_mixed_reference(n, s)[0].long(), _mixed_reference(n, s)[1]),
            "The values are right, the dtype is not: FlashAttention's kernels read cu_seqlens_q "
            "as int32 (.to(torch.int32)).",
        ),
        (_mixed_by_library, _NO_PACK),
        (_mixed_by_private_helper, _NO_PACK),
    ),
    hint=_HINT_MIXED,
    crash_hint=_HINT_MIXED,
    exact_dtype=True,
    outputs=("cu_seqlens_q", "positions"),
    forbidden=VARLEN_BANNED,
    forbidden_hint=_NO_PACK,
    rewrites=(varlen.pack,),  # pack returns the packed tensor and its cu_seqlens
    params=("mixed_batch",),
    doc="Check ``mixed_batch(new_tokens, seq_lens) -> (cu_seqlens_q, positions)``: the packed "
    "layout of a mixed batch, ``(B + 1,)`` int32 offsets and the ``(total_q,)`` int64 position "
    "of every query row in its sequence.",
)


# --- a tree mask --------------------------------------------------------------------------------


def _tree_reference(parents: list[int], prefix_len: int) -> Tensor:
    T = len(parents)
    keep = torch.zeros(T, prefix_len + T, dtype=torch.bool)  # (T, prefix + T)
    keep[:, :prefix_len] = True
    for i, p in enumerate(parents):
        if p >= 0:
            keep[i, prefix_len:] = keep[p, prefix_len:]  # the parent's ancestors
        keep[i, prefix_len + i] = True
    return keep


def _tree_cases() -> list[Case]:
    return [
        Case(f"tree_mask({p}, {n}){what}", (p, n))
        for p, n, what in (
            ([-1, 0, 1, 2], 3, " (a chain)"),
            ([-1, -1, 0, 1, 1], 2, " (two branches)"),
            ([-1, 0, 0, 1, 2, 4], 0, " (a tree, no prefix)"),
            ([-1, -1, -1], 4, " (three candidates for one position)"),
            ([-1, 0, -1, 2, 1, 3, 5], 1, ""),
        )
    ]


def _tree_by_walking_up(parents: list[int], prefix_len: int) -> Tensor:
    T = len(parents)
    rows = []
    for i in range(T):
        seen, node = [False] * T, i
        while node >= 0:  # up to the root
            seen[node] = True
            node = parents[node]
        rows.append([True] * prefix_len + seen)
    return torch.tensor(rows, dtype=torch.bool).view(T, prefix_len + T)


def _tree_by_closure(parents: list[int], prefix_len: int) -> Tensor:
    """Reachability: itself, then T times one more step up the tree."""
    T = len(parents)
    up = torch.zeros(T, T)  # up[i, p] = 1: p is i's parent
    for i, p in enumerate(parents):
        if p >= 0:
            up[i, p] = 1.0
    reach = torch.eye(T)
    for _ in range(T):
        reach = ((reach + reach @ up) > 0).float()
    return torch.cat([torch.ones(T, prefix_len), reach], dim=1).bool()


def _tree_parent_only(parents: list[int], prefix_len: int) -> Tensor:
    keep = torch.zeros(len(parents), prefix_len + len(parents), dtype=torch.bool)
    keep[:, :prefix_len] = True
    for i, p in enumerate(parents):
        if p >= 0:
            keep[i, prefix_len + p] = True
        keep[i, prefix_len + i] = True
    return keep


def _tree_causal(parents: list[int], prefix_len: int) -> Tensor:
    T = len(parents)
    return torch.ones(T, prefix_len + T, dtype=torch.bool).tril(diagonal=prefix_len)


def _tree_no_self(parents: list[int], prefix_len: int) -> Tensor:
    keep = _tree_reference(parents, prefix_len)
    keep[:, prefix_len:].fill_diagonal_(False)
    return keep


def _tree_no_prefix(parents: list[int], prefix_len: int) -> Tensor:
    keep = _tree_reference(parents, prefix_len)
    keep[:, :prefix_len] = False
    return keep


def _tree_by_private_helper(parents: list[int], prefix_len: int) -> Tensor:
    """mha.speculative's private check of the parents, reached around the public function."""
    return _tree_reference(speculative._parents(parents), prefix_len)


_HINT_TREE = (
    "Row i is draft token i: True on every prefix column, on itself and on each ancestor (its "
    "parent, the parent's parent ..., up to -1), and False on every other draft, a sibling "
    "branch above all."
)
_NO_TREE = "write it yourself, without mha.tree_attention_mask (or anything from mha.speculative)."

TREE_MASK = Exercise(
    "check_tree_mask",
    "each draft sees the prefix, its ancestors and itself, in chains and in trees",
    _tree_reference,
    _tree_cases,
    variants=(_tree_by_walking_up, _tree_by_closure),
    mistakes=(
        (
            _tree_parent_only,
            "Only the parent is not enough: a draft must see its whole path back to the prefix, "
            "the parent's parent too, as if those tokens had been decoded before it. " + _HINT_TREE,
        ),
        (
            _tree_causal,
            "This is the causal triangle: right for a chain, but in a tree it lets a draft see "
            "the drafts of other branches that come before it in the list. " + _HINT_TREE,
        ),
        (
            _tree_no_self,
            "A draft token sees itself, as every causal query does (the diagonal). " + _HINT_TREE,
        ),
        (
            _tree_no_prefix,
            "The prefix (the cache) is every draft's past: its columns are all True. " + _HINT_TREE,
        ),
        (
            lambda parents, prefix_len: _tree_reference(parents, prefix_len).int(),
            "The pattern is right; return a bool keep-mask (dtype=torch.bool).",
        ),
        (lambda parents, prefix_len: mha.tree_attention_mask(parents, prefix_len), _NO_TREE),
        (_tree_by_private_helper, _NO_TREE),
    ),
    hint=_HINT_TREE,
    crash_hint=_HINT_TREE,
    exact_dtype=True,
    forbidden=(*defined_in(speculative), mha.causal_mask_bottom_right, masks._causal_mask),
    forbidden_hint=_NO_TREE,
    rewrites=(mha.tree_attention_mask,),
    params=("tree_mask",),
    doc="Check ``tree_mask(parents, prefix_len) -> (T, prefix_len + T) bool``: the keep-mask of "
    "a verification pass over draft tokens whose parents are given (``-1``: the prefix).",
)


# --- predict a verification step ----------------------------------------------------------------

#: The prediction's tree (drafts 0 … 5: token and parent) and the target's greedy token after
#: each input of the pass (the last accepted token, then drafts 0 … 5).
PREDICT_DRAFT, PREDICT_PARENTS = [5, 3, 7, 4, 8, 2], [-1, -1, 0, 1, 1, 4]
PREDICT_GREEDY = [3, 1, 8, 9, 6, 2, 6]


def _verification_truth() -> tuple[list[int], int]:
    logits = F.one_hot(torch.tensor(PREDICT_GREEDY), 10).double()  # (T + 1, V)
    step = speculative.verify_greedy(PREDICT_DRAFT, PREDICT_PARENTS, logits)
    return step.tokens, step.rejected


def _as_verification(answer: tuple[object, object]) -> tuple[list[int], int]:
    tokens, rejected = answer
    if not isinstance(tokens, (list, tuple)):
        kind = type(tokens).__name__
        raise ExerciseError(tr("tokens should be a list of token ids, got {kind}.", kind=kind))
    return [as_int(t, "a token") for t in tokens], as_int(whole(rejected), "rejected")


_HINT_WALK = (
    "Start at the last accepted token: the target's token after it is 3, and draft 1 (a child of "
    "-1) is 3, so draft 1 is accepted; go on from draft 1 (row 2 of the logits) to its children, "
    "and stop at the first node none of whose children match: the target's token there is the "
    "bonus token."
)

VERIFICATION_PREDICTION = Exercise(
    "check_verification_prediction",
    lambda want: tr("emits {0}, {1} drafts rejected", want[0], want[1]),
    _verification_truth,
    prediction=True,
    variants=(lambda t: ([3, 8, 2, 6], 3), lambda t: ((3, 8, 2, 6), 3.0)),
    mistakes=(
        (
            lambda t: ([3, 8, 2], 3),
            "The step also emits the bonus token, the target's own choice after the last "
            "accepted draft: it comes for free from the same pass.",
        ),
        (
            lambda t: ([3], 6),
            "Draft 0 is not the only candidate: draft 1 is also a child of the last token, and "
            "it matches the target's 3. " + _HINT_WALK,
        ),
        (
            lambda t: ([3, 8, 2, 6], 2),
            "The bonus token is no draft: the drafts rejected are the 6 drafts minus the 3 "
            "accepted ones.",
        ),
        (
            lambda t: ([3, 1], 5),
            "Row i + 1 of the logits follows draft i (row 0 follows the last accepted token): "
            "after draft 1 read row 2. " + _HINT_WALK,
        ),
    ),
    hint={"tokens": _HINT_WALK, "rejected": "Rejected = the 6 drafts minus the accepted ones."},
    outputs=("tokens", "rejected"),
    convert=_as_verification,
    doc="Check a prediction of the tokens a verification step emits and how many drafts it "
    "rejects, for the tree and the target's greedy tokens given in section 9.5.",
)


EXERCISES = publish(globals())
