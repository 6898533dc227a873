"""Speculative decoding's verification step: a tree of draft tokens checked in one pass.

Decoding one token per step reads the whole cache for one query: the step is bound by memory,
and the arithmetic units wait. Speculative decoding lets a cheap *draft* (a small model, extra
heads, or DeepSeek-V3's multi-token prediction) propose ``T`` tokens, and the large *target*
model checks them all in **one** pass: ``T + 1`` queries read the cache once, so the step does
``T + 1`` times the work for nearly the same bytes.

The drafts may form a chain or a tree (several candidates per position, as in Medusa or
EAGLE). In the verification pass every draft token must see exactly what it would see if it
had been decoded: the cached prefix, its ancestors in the tree, and itself, never a sibling
branch. :func:`tree_attention_mask` is that mask; for a chain it is the bottom-right causal
mask.

:func:`verify_greedy` then walks the tree with the target's logits: from the last accepted
token it follows the child the target would have chosen greedily, as long as there is one,
and adds the target's own next token (the *bonus* token) at the end. The tokens emitted are
exactly those of plain greedy decoding; the cache entries of the rejected drafts are dropped
(:meth:`mha.PagedKVCache.truncate` for a chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import validation as validate


def tree_attention_mask(
    parents: Sequence[int] | Tensor,
    prefix_len: int = 0,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """The keep-mask of a verification pass over a tree of ``T`` draft tokens.

    Token ``i`` sees every prefix position, its ancestors in the tree and itself. A chain,
    ``parents = [-1, 0, 1, …, T - 2]``, gives the bottom-right causal mask.

    Args:
        parents: ``parents[i] < i`` is draft token ``i``'s parent; ``-1`` means its parent is
            the last token of the prefix.
        prefix_len: positions before the drafts (the cache), seen by every draft token.
        device: where to create the mask.

    Shapes:
        parents ``(T,)``; returns ``(T, prefix_len + T)`` bool, prefix columns first.
    """
    links = _parents(parents)
    prefix_len = validate.non_negative_int("prefix_len", prefix_len)
    T = len(links)
    keep = torch.zeros(T, prefix_len + T, dtype=torch.bool, device=device)  # (T, prefix + T)
    keep[:, :prefix_len] = True  # the prefix is everyone's past
    tree = keep[:, prefix_len:]  # (T, T) a view: token i's ancestors and itself
    for i, p in enumerate(links):  # a parent comes before its children: its row is complete
        if p >= 0:
            tree[i] = tree[p]
        tree[i, i] = True
    return keep


def _parents(parents: Any) -> list[int]:
    """``parents`` as a list of ints, each ``-1 <= parents[i] < i``."""
    if isinstance(parents, Tensor):
        links = validate.integer_tensor("parents", parents, ndim=1).tolist()
    elif isinstance(parents, Sequence) and not isinstance(parents, str):
        links = list(parents)
        for i, p in enumerate(links):
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(
                    f"parents must hold ints, got {type(p).__name__} ({p!r}) at index {i}"
                )
    else:
        raise TypeError(
            f"parents must be a list of ints or a 1-D integer tensor, got {type(parents).__name__}"
        )
    bad = [i for i, p in enumerate(links) if not -1 <= p < i]
    if bad:
        i = bad[0]
        raise ValueError(
            f"parents[{i}] must be -1 (the prefix's last token) or an earlier draft in "
            f"[0, {i}), got {links[i]} (in {links})"
        )
    return links


@dataclass(frozen=True)
class Verification:
    """What a verification step decided.

    Attributes:
        tokens: the accepted draft tokens, root to leaf, then the bonus token: what the target
            model emits this step (always at least one token).
        accepted: the indices of the accepted drafts, root to leaf (``[0, 1, …, k - 1]`` in a
            chain).
        rejected: how many drafts were not accepted: the cache entries to remove once the
            accepted ones are in place.
    """

    tokens: list[int]
    accepted: list[int]
    rejected: int

    @property
    def kept(self) -> list[int]:
        """The entries of the verification pass to keep, counted from its first input (the
        last accepted token, entry 0; draft ``i`` is entry ``1 + i``). In a chain they are
        the first ``len(kept)``, so truncating the cache removes the rest; in a tree an
        accepted draft of a later branch moves to entry ``1 + j`` first."""
        return [0] + [1 + i for i in self.accepted]


def verify_greedy(
    draft: Sequence[int] | Tensor, parents: Sequence[int] | Tensor, logits: Tensor
) -> Verification:
    """Accept the longest path of draft tokens that greedy decoding would have produced.

    The verification pass runs the target model once on ``[last, *draft]`` (the last accepted
    token, not yet in the cache, then the ``T`` drafts), with the mask
    ``tree_attention_mask([-1] + [p + 1 for p in parents], prefix_len=cached)``. Row 0 of its
    logits predicts the token after ``last``, row ``1 + i`` the token after draft ``i``.
    Starting at ``last``, the walk takes the target's greedy token; if a child of the current
    node drafted that token it is accepted and the walk moves to it, otherwise the target's
    token is the bonus token and the step ends.

    Args:
        draft: the draft tokens (token ids).
        parents: ``parents[i] < i`` is draft ``i``'s parent; ``-1`` is ``last``.
        logits: the target model's logits at ``last`` and at each draft.

    Shapes:
        draft ``(T,)``, parents ``(T,)``, logits ``(T + 1, V)``.

    Returns:
        A :class:`Verification`: the tokens emitted (accepted drafts, then the bonus token),
        the accepted drafts' indices, and how many drafts were rejected.
    """
    links = _parents(parents)
    tokens = _tokens(draft)
    validate.tensor("logits", logits, floating=True, ndim=2, layout="(T + 1, V)")
    if len(tokens) != len(links) or logits.shape[0] != len(links) + 1:
        raise ValueError(
            f"draft (T,), parents (T,) and logits (T + 1, V) must agree in T, got "
            f"{len(tokens)} draft tokens, {len(links)} parents and logits "
            f"{validate.shape(logits)}"
        )
    greedy = logits.argmax(-1).tolist()  # (T + 1,) the target's choice after each input
    children: dict[int, list[int]] = {}
    for i, p in enumerate(links):
        children.setdefault(p, []).append(i)
    node, accepted = -1, []
    while True:
        want = greedy[node + 1]  # what greedy decoding emits after this node
        match = [i for i in children.get(node, []) if tokens[i] == want]
        if not match:
            break  # `want` is the bonus token
        node = match[0]
        accepted.append(node)
    emitted = [tokens[i] for i in accepted] + [greedy[node + 1]]
    return Verification(emitted, accepted, len(tokens) - len(accepted))


def _tokens(draft: Any) -> list[int]:
    """Draft token ids as a list of ints."""
    if isinstance(draft, Tensor):
        return validate.integer_tensor("draft", draft, ndim=1).tolist()
    if isinstance(draft, Sequence) and not isinstance(draft, str):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in draft):
            return list(draft)
    raise TypeError(
        f"draft must be a list of token ids (ints) or a 1-D integer tensor, got {draft!r:.60}"
    )
