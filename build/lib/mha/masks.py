"""Attention masks as keep-masks: ``True`` means "this query may attend to this key".

This is the convention of ``torch.nn.functional.scaled_dot_product_attention``. It is the
*opposite* of ``nn.MultiheadAttention``'s ``key_padding_mask``/bool ``attn_mask`` (``True`` =
masked out); convert between the two with ``~``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import validation as validate


def causal_mask(
    L: int, S: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Keep-mask of causal attention, aligned top-left like PyTorch's ``is_causal=True``.

    Query ``i`` may attend to keys ``0..i``. With ``S > L`` the extra keys at the end are never
    seen; for decoding with a cache (new queries at the *end* of the sequence) use
    :func:`causal_mask_bottom_right`.

    Args:
        L: number of queries.
        S: number of keys; defaults to ``L``.
        device: where to create the mask.

    Shapes:
        returns ``(L, S)`` bool, ``True`` on and below the diagonal.
    """
    L = validate.positive_int("L", L)
    S = L if S is None else validate.positive_int("S", S)
    return _causal_mask(L, S, device=device)


def causal_mask_bottom_right(
    L: int, S: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Keep-mask of causal attention aligned bottom-right (the last query sees every key).

    The ``L`` queries are the *last* ``L`` positions of a sequence of ``S`` keys: query ``i`` sits
    at position ``i + S - L`` and may attend to keys ``0..i + S - L``. This is the alignment a
    key/value cache needs; it equals :func:`causal_mask` when ``L == S``.

    Shapes:
        returns ``(L, S)`` bool.
    """
    L = validate.positive_int("L", L)
    S = L if S is None else validate.positive_int("S", S)
    if S < L:
        raise ValueError(f"bottom-right causal alignment needs S >= L, got L={L} and S={S}")
    return _causal_mask(L, S, diagonal=S - L, device=device)


def _causal_mask(
    L: int, S: int, *, diagonal: int = 0, device: torch.device | str | None = None
) -> Tensor:
    """The causal keep-mask of :func:`causal_mask` (``diagonal=0``, top-left) and of
    :func:`causal_mask_bottom_right` (``diagonal=S - L``), on checked ``L`` and ``S``.

    Query ``i`` may attend to keys ``0..i + diagonal``: the lower triangle of an ``(L, S)``
    matrix of ones, from the diagonal that starts at key ``diagonal``.

    Shapes:
        returns ``(L, S)`` bool.
    """
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal)


def sliding_window_mask(
    L: int,
    S: int | None = None,
    *,
    window: int,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """Keep-mask of local (sliding-window) attention, the idea behind Longformer and BigBird.

    With ``causal=True`` query ``i`` sees the ``window`` most recent keys ``i-window+1..i``;
    with ``causal=False`` it sees every key ``j`` with ``|i - j| < window``.

    Args:
        L: number of queries.
        S: number of keys; defaults to ``L``.
        window: how many keys back (and, if not causal, forward) a query sees, itself included.
        causal: whether future keys are hidden too.
        device: where to create the mask.

    Shapes:
        returns ``(L, S)`` bool.
    """
    L = validate.positive_int("L", L)
    S = L if S is None else validate.positive_int("S", S)
    window = validate.positive_int("window", window)
    i = torch.arange(L, device=device)[:, None]  # (L, 1)
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = i - j  # (L, S): how far key j lies behind query i
    keep = distance < window
    return keep & (distance >= 0) if causal else keep & (distance > -window)


def padding_mask(lengths: Tensor | Sequence[int], S: int) -> Tensor:
    """Keep-mask that hides the padding at the end of each sequence in a batch.

    Args:
        lengths: the number of real tokens of each sequence, ``0 <= length <= S``.
        S: the padded length (number of keys).

    Shapes:
        lengths: ``(B,)``; returns ``(B, 1, 1, S)`` bool, ``True`` for real tokens, which
        broadcasts over heads and queries to ``(B, H, L, S)``.
    """
    S = validate.positive_int("S", S)
    if not isinstance(lengths, Tensor):
        lengths = torch.as_tensor(list(lengths))
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.is_complex():
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if lengths.numel() and (lengths.min() < 0 or lengths.max() > S):
        raise ValueError(
            f"lengths must lie in [0, S={S}], got min {int(lengths.min())} and max {int(lengths.max())}"
        )
    positions = torch.arange(S, device=lengths.device)  # (S,)
    keep = positions[None, :] < lengths[:, None]  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)
