"""Checkers for chapter 4, masking.

Every checker builds the right answer from PyTorch's own operators (``torch.tril``,
``torch.arange``, ``torch.nn.functional.scaled_dot_product_attention``), runs the learner's code on
the same inputs and, when the two differ, recognises the usual mistakes (an inverted mask, an
off-by-one diagonal, a shape that broadcasts the wrong way, a fill value that overflows float16)
to say which one it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._check import ExerciseError, check_close, passed

_INVERTED = (
    "The mask is inverted. In this course (and in F.scaled_dot_product_attention) True means "
    "'may attend'; True = 'masked out' is nn.MultiheadAttention's convention. Flip it with ~."
)
_NOT_BOOL = (
    "Return a bool tensor. A float mask is *added* to the scores, so a 1/0 float mask masks "
    "nothing (real keys get +1, padding +0), and an integer mask is rejected by SDPA."
)


def _require_tensor(what: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise ExerciseError(f"{what} should return a torch.Tensor, got {type(value).__name__}.")
    return value


def _require_bool(what: str, value: Tensor) -> None:
    if value.dtype != torch.bool:
        raise ExerciseError(f"{what} has dtype {value.dtype}. {_NOT_BOOL}")


def _reference_padding_mask(lengths: Tensor, S: int) -> Tensor:
    keep = torch.arange(S)[None, :] < lengths[:, None]  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


def check_padding_mask(fn: Callable[[Tensor, int], Tensor]) -> None:
    """Check ``fn(lengths, S)``: the ``(B, 1, 1, S)`` keep-mask of right-padded sequences.

    Rejects an inverted mask, an off-by-one length, a non-bool mask and shapes such as ``(B, S)``
    that would broadcast against the scores ``(B, H, L, S)`` the wrong way.
    """
    name = "check_padding_mask"
    cases = [(torch.tensor([3, 5, 0, 1]), 5), (torch.tensor([2, 7]), 7), (torch.tensor([4]), 6)]
    for lengths, S in cases:
        what = f"padding_mask(lengths={lengths.tolist()}, S={S})"
        expected = _reference_padding_mask(lengths, S)
        B = lengths.numel()
        actual = _require_tensor(what, fn(lengths.clone(), S))
        if actual.shape != expected.shape:
            got = tuple(actual.shape)
            if got == (B, S):
                hint = (
                    "Against scores of shape (B, H, L, S), broadcasting aligns the *last* dims, so a "
                    "(B, S) mask is read as (L, S): batch element b would mask query row b. "
                    "Add the head and query dims: (B, 1, 1, S)."
                )
            elif got in ((B, 1, S, 1), (B, S, 1)):
                hint = (
                    "This shape masks queries (rows of the scores), not keys (columns). Padding "
                    "hides *keys*: (B, 1, 1, S)."
                )
            else:
                hint = "It must broadcast over heads and queries: (B, 1, 1, S)."
            raise ExerciseError(f"{what} has shape {got}, expected {tuple(expected.shape)}. {hint}")
        _require_bool(what, actual)
        if torch.equal(actual, expected):
            continue
        if torch.equal(actual, ~expected):
            raise ExerciseError(f"{what} is wrong. {_INVERTED}")
        off_by_one = {
            "one too many": _reference_padding_mask(lengths + 1, S),
            "one too few": _reference_padding_mask(lengths - 1, S),
        }
        for how, wrong in off_by_one.items():
            if torch.equal(actual, wrong):
                raise ExerciseError(
                    f"{what} keeps {how} token per sequence. A sequence of length n has its real "
                    "tokens at positions 0..n-1: keep position j when j < n."
                )
        raise ExerciseError(
            f"{what} is wrong: got {actual.flatten(1).int().tolist()}, expected "
            f"{expected.flatten(1).int().tolist()}. Position j of sequence b is real when j < lengths[b]."
        )
    passed(name, "(B, 1, 1, S) bool, True for real tokens")


def check_causal_mask(fn: Callable[..., Tensor]) -> None:
    """Check ``fn(L, S=None)``: the ``(L, S)`` causal keep-mask aligned top-left (torch's ``is_causal``).

    Rejects an inverted mask, a diagonal shifted by one either way, the upper triangle, bottom-right
    alignment and a non-bool or wrongly shaped result.
    """
    name = "check_causal_mask"
    for L, S in [(4, None), (1, None), (3, 5), (5, 3)]:
        cols = L if S is None else S
        what = f"causal_mask({L})" if S is None else f"causal_mask({L}, {S})"
        expected = torch.ones(L, cols, dtype=torch.bool).tril()
        actual = _require_tensor(what, fn(L) if S is None else fn(L, S))
        if actual.shape != expected.shape:
            hint = "Use S (the number of keys) for the columns: scores are (L, S)." if S else ""
            raise ExerciseError(
                f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)} (L queries "
                f"by S keys). {hint}".rstrip()
            )
        _require_bool(what, actual)
        if torch.equal(actual, expected):
            continue
        ones = torch.ones(L, cols, dtype=torch.bool)
        known = [
            (~expected, _INVERTED + " (torch.triu(..., diagonal=1) is the 'masked out' version.)"),
            (
                ones.tril(-1),
                (
                    "The diagonal must be True: a token may attend to itself. Without it the "
                    "first query sees no key at all."
                ),
            ),
            (ones.tril(1), "Each query sees one future token: the diagonal is shifted by one."),
            (ones.triu(), "That is the upper triangle: each query sees itself and the *future*."),
            (
                ones.tril(cols - L),
                (
                    "That is the bottom-right alignment (the last query sees every key), which "
                    "decoding with a cache needs. Here we want torch's is_causal alignment, "
                    "top-left: query i sees keys 0..i."
                ),
            ),
        ]
        for wrong, hint in known:
            if torch.equal(actual, wrong):
                raise ExerciseError(f"{what} is wrong. {hint}")
        raise ExerciseError(
            f"{what} is wrong: got {actual.int().tolist()}, expected {expected.int().tolist()}. "
            "Query i may attend to keys j <= i."
        )
    passed(name, "(L, S) bool, True on and below the diagonal")


def _left_padded_example() -> tuple[Tensor, Tensor]:
    """The chapter's prediction exercise: a left-padded batch under a causal mask."""
    real = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)  # (B, S), 1 = real token
    keep = real[:, None, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()  # (B, 1, L, S)
    return real, keep


def check_mask_prediction(
    shape: Sequence[int], mask: Sequence[Sequence[int]], empty_rows: Sequence[int]
) -> None:
    """Check predictions about ``padding & causal`` for a left-padded batch.

    The batch is ``real = [[1, 1, 1, 1], [0, 0, 1, 1]]`` (sequence 1 is padded on the *left*, as
    batched generation does); ``keep = real[:, None, None, :] & causal_mask(4)``.

    Args:
        shape: predicted ``keep.shape``.
        mask: predicted ``keep[1, 0]`` as 0/1 rows (one row per query).
        empty_rows: predicted query rows of sequence 1 that may attend to no key at all.
    """
    name = "check_mask_prediction"
    _, keep = _left_padded_example()
    if tuple(shape) != tuple(keep.shape):
        raise ExerciseError(
            f"keep.shape is {tuple(keep.shape)}, not {tuple(shape)}. Broadcasting aligns trailing "
            "dims: (B, 1, 1, S) & (L, S) -> (B, 1, L, S); the head dim stays 1 until the scores "
            "(B, H, L, S) meet the mask."
        )
    try:
        predicted = torch.tensor([[bool(x) for x in row] for row in mask])
    except (TypeError, ValueError) as err:
        raise ExerciseError(f"mask should be a list of 4 rows of 4 zeros/ones ({err}).") from None
    truth = keep[1, 0]
    if predicted.shape != truth.shape:
        raise ExerciseError(
            f"mask should have {truth.shape[0]} rows of {truth.shape[1]} entries (L queries by S "
            f"keys), got shape {tuple(predicted.shape)}."
        )
    for i in range(truth.shape[0]):
        if not torch.equal(predicted[i], truth[i]):
            raise ExerciseError(
                f"Row {i} (query {i}) of keep[1, 0] should be {truth[i].int().tolist()}, you predicted "
                f"{predicted[i].int().tolist()}. Query {i} may see key j only if j <= {i} (causal) "
                "AND key j is a real token (keys 0 and 1 of sequence 1 are padding)."
            )
    truth_empty = [i for i in range(truth.shape[0]) if not truth[i].any()]
    if sorted(int(i) for i in empty_rows) != truth_empty:
        raise ExerciseError(
            f"The query rows of sequence 1 with no key at all are {truth_empty}, not "
            f"{sorted(empty_rows)}: a row is empty when every key it could see causally is padding. "
            "Those rows are the ones a naive softmax turns into NaN."
        )
    passed(name, f"shape {tuple(keep.shape)}, empty rows {truth_empty}")


def _attention_cases() -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(4)
    B, H, L, S, D = 2, 2, 5, 6, 8
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    lengths = torch.tensor([6, 3])
    keep = torch.arange(S)[None, :] < lengths[:, None]  # (B, S)
    keep = keep[:, None, None, :] & torch.ones(L, S, dtype=torch.bool).tril()  # (B, 1, L, S)
    keep_full = keep.clone()
    keep_full[1, :, 1] = False  # query 1 of sequence 1 sees no key
    keep_full[0, :, 4] = False
    return [(q, k, v, keep), (q, k, v, keep_full)]


def check_masked_attention(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> None:
    """Check ``fn(q, k, v, keep)``: masked attention that survives float16 and empty rows.

    ``keep`` is a bool keep-mask broadcastable to ``(B, H, L, S)``. The result must match
    ``F.scaled_dot_product_attention`` in float32, float16 and bfloat16, give zeros for a query whose
    keys are all masked, and have finite gradients equal to SDPA's.
    """
    name = "check_masked_attention"
    for index, (q, k, v, keep) in enumerate(_attention_cases()):
        has_empty = bool((~keep.any(-1)).any())
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            what = f"masked_attention(q, k, v, keep) in {str(dtype).replace('torch.', '')}"
            if has_empty:
                what += " with a fully masked query row"
            qd, kd, vd = (t.to(dtype).requires_grad_() for t in (q, k, v))
            try:
                out = fn(qd, kd, vd, keep)
            except RuntimeError as err:
                if "overflow" in str(err):
                    raise ExerciseError(
                        f"{what} raised RuntimeError: {err}. -1e9 does not fit in float16 (its largest "
                        "magnitude is 65504): fill with float('-inf') or "
                        "torch.finfo(scores.dtype).min instead."
                    ) from None
                raise
            out = _require_tensor(what, out)
            # The reference: torch's own SDPA on float32 copies. Rows with no key get every key
            # unmasked and are then zeroed, so the reference never depends on how a given torch
            # version treats empty rows.
            q32, k32, v32 = (t.detach().float().requires_grad_() for t in (qd, kd, vd))
            has_key = keep.any(-1, keepdim=True)  # (B, 1, L, 1)
            ref = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=keep | ~has_key)
            ref = ref * has_key  # (B, H, L, D)
            empty = ~has_key.expand(ref.shape[:-1] + (1,))  # (B, H, L, 1)
            if has_empty and out.shape == ref.shape:
                rows = out.detach().float().masked_select(empty)
                if torch.isnan(rows).any():
                    raise ExerciseError(
                        f"{what} gives NaN for the query that may attend to no key: with a -inf fill "
                        "its softmax is 0/0. Give such rows zero weights (e.g. find them with "
                        "keep.any(-1) and torch.where), as torch's SDPA does."
                    )
                if rows.abs().max() > 0:
                    raise ExerciseError(
                        f"{what} gives a non-zero output for the query that may attend to no key. A "
                        "finite fill such as -1e9 or finfo.min makes all its scores equal, so softmax "
                        "spreads the weight uniformly over keys that should be hidden (silently "
                        "averaging padding). Zero the weights of rows with no key."
                    )
            low = dtype != torch.float32
            check_close(
                out.float(),
                ref,
                what=what,
                hint="Compare your scores, mask and softmax with F.scaled_dot_product_attention; "
                "keep means True = may attend, and the scale is 1/sqrt(D).",
                atol=3e-2 if low else 1e-5,
                rtol=3e-2 if low else 1e-4,
            )
            if out.grad_fn is None:
                raise ExerciseError(
                    f"{what} is not differentiable: build it from torch operations."
                )
            grads = torch.autograd.grad(out.float().sum(), (qd, kd, vd), allow_unused=True)
            ref_grads = torch.autograd.grad(ref.sum(), (q32, k32, v32))
            for label, grad, ref_grad in zip("qkv", grads, ref_grads):
                if grad is None:
                    grad = torch.zeros_like(ref_grad)
                if torch.isnan(grad).any():
                    raise ExerciseError(
                        f"The gradient of {what} with respect to {label} contains NaN, although the "
                        "output looks right. A NaN in the forward pass (e.g. softmax of an all -inf "
                        "row), even one you replaced afterwards with nan_to_num or multiplied by 0, "
                        "still flows back as NaN. Keep the softmax from ever seeing an all -inf row."
                    )
                check_close(
                    grad.float(),
                    ref_grad,
                    what=f"the gradient of {what} with respect to {label}",
                    hint="The forward pass is right but the gradient is not: is the mask applied "
                    "with torch operations autograd can follow?",
                    atol=5e-2 if low else 1e-4,
                    rtol=5e-2 if low else 1e-3,
                )
    passed(name, "float32/float16/bfloat16, empty rows give zeros forward and backward")


def check_mask_conversion(fn: Callable[[Tensor], tuple[Tensor, Tensor]]) -> None:
    """Check ``fn(attention_mask) -> (key_padding_mask, sdpa_mask)``.

    ``attention_mask`` is a Hugging Face-style ``(B, S)`` integer tensor, 1 = attend, 0 = padding.
    ``key_padding_mask`` is for ``nn.MultiheadAttention`` (``(B, S)`` bool, True = ignore this key);
    ``sdpa_mask`` is for ``F.scaled_dot_product_attention`` with scores ``(B, H, L, S)``
    (``(B, 1, 1, S)`` bool, True = attend).
    """
    name = "check_mask_conversion"
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    B, S = attention_mask.shape
    result = fn(attention_mask.clone())
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ExerciseError(
            "convert(attention_mask) should return a tuple (key_padding_mask, sdpa_mask), got "
            f"{type(result).__name__}."
        )
    kpm, sdpa_mask = result
    what = "key_padding_mask"
    kpm = _require_tensor(what, kpm)
    expected_kpm = attention_mask == 0
    if kpm.shape != expected_kpm.shape:
        raise ExerciseError(
            f"{what} has shape {tuple(kpm.shape)}; nn.MultiheadAttention wants (B, S) = {(B, S)}."
        )
    _require_bool(what, kpm)
    if torch.equal(kpm, ~expected_kpm):
        raise ExerciseError(
            f"{what} is inverted: nn.MultiheadAttention's key_padding_mask marks the keys to *ignore* "
            "(True = padding), the opposite of attention_mask (1 = attend). Use attention_mask == 0."
        )
    if not torch.equal(kpm, expected_kpm):
        raise ExerciseError(f"{what} is wrong: True exactly where attention_mask is 0.")
    what = "sdpa_mask"
    sdpa_mask = _require_tensor(what, sdpa_mask)
    expected = (attention_mask == 1)[:, None, None, :]
    if sdpa_mask.shape != expected.shape:
        got = tuple(sdpa_mask.shape)
        hint = (
            "A (B, S) mask against scores (B, H, L, S) is read as (L, S): with B == L it runs without "
            "an error and masks the wrong rows. Reshape to (B, 1, 1, S)."
            if got == (B, S)
            else "It must broadcast over heads and queries: (B, 1, 1, S)."
        )
        raise ExerciseError(f"{what} has shape {got}, expected {tuple(expected.shape)}. {hint}")
    _require_bool(what, sdpa_mask)
    if torch.equal(sdpa_mask, ~expected):
        raise ExerciseError(
            f"{what} is inverted: SDPA's bool mask means True = attend, like attention_mask's 1. "
            "Did you reuse key_padding_mask? Flip it with ~."
        )
    if not torch.equal(sdpa_mask, expected):
        raise ExerciseError(f"{what} is wrong: True exactly where attention_mask is 1.")
    passed(name, "key_padding_mask True = ignore, sdpa_mask True = attend")


def _alibi_slopes(H: int) -> Tensor:
    return 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)  # (H,)


def _alibi_reference(H: int, L: int, slopes: Tensor | None = None) -> Tensor:
    slopes = _alibi_slopes(H) if slopes is None else slopes
    i = torch.arange(L)[:, None]  # (L, 1)
    j = torch.arange(L)[None, :]  # (1, L)
    bias = -slopes[:, None, None] * (i - j)  # (H, L, L)
    return bias.masked_fill(j > i, float("-inf")).float()


def check_alibi_bias(fn: Callable[[int, int], Tensor]) -> None:
    """Check ``fn(H, L)``: the causal ALiBi bias ``(H, L, L)`` as a float mask.

    ``bias[h, i, j] = -m_h * (i - j)`` for ``j <= i`` and ``-inf`` for ``j > i``, with the slopes
    ``m_h = 2 ** (-8 * h / H)`` for ``h = 1..H`` (Press et al., 2022).
    """
    name = "check_alibi_bias"
    for H, L in [(8, 5), (4, 6), (2, 3)]:
        what = f"alibi_bias(H={H}, L={L})"
        expected = _alibi_reference(H, L)
        actual = _require_tensor(what, fn(H, L))
        if actual.shape != expected.shape:
            raise ExerciseError(
                f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}: one "
                "(L, L) bias per head, so it broadcasts against scores (B, H, L, L)."
            )
        if not actual.dtype.is_floating_point:
            raise ExerciseError(
                f"{what} has dtype {actual.dtype}: a bias is a float mask, added to the scores."
            )
        actual = actual.detach().float()
        future = torch.ones(L, L, dtype=torch.bool).triu(1)
        if not torch.isneginf(actual[:, future]).all():
            raise ExerciseError(
                f"{what} must be -inf above the diagonal: ALiBi in a decoder is added to a causal "
                "mask, so future keys stay hidden."
            )
        past = ~future
        if (actual[:, past] > 0).any():
            raise ExerciseError(
                f"{what} has positive entries: the bias must *penalise* distance, -m_h * (i - j) <= 0."
            )
        candidates = {
            "h running from 0 to H-1 (the first head's slope must be 2**(-8/H), not 1)": 2.0
            ** (-8.0 * torch.arange(0, H, dtype=torch.float64) / H),
            "the slopes in reverse order (head 1 has the largest slope, 2**(-8/H))": _alibi_slopes(
                H
            ).flip(0),
        }
        for how, slopes in candidates.items():
            if torch.allclose(actual[:, past], _alibi_reference(H, L, slopes)[:, past]):
                raise ExerciseError(f"{what} uses {how}.")
        check_close(
            actual.masked_fill(future, 0.0),
            expected.masked_fill(future, 0.0),
            what=f"{what} on and below the diagonal",
            hint="bias[h, i, j] = -m_h * (i - j) with m_h = 2 ** (-8 * h / H), h = 1..H.",
        )
    passed(name, "slopes 2^(-8h/H), linear distance penalty, causal")
