"""The small framework every checker is built on."""

from __future__ import annotations

import torch
from torch import Tensor


class ExerciseError(AssertionError):
    """A learner's answer is wrong; the message says how and hints at why."""


def passed(name: str, detail: str = "") -> None:
    """Print the one success line of a checker."""
    print(f"✅ {name}: correct{' — ' + detail if detail else ''}")


def check_close(
    actual: object,
    expected: Tensor,
    *,
    what: str,
    hint: str,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Raise ``ExerciseError`` unless ``actual`` is a tensor equal to ``expected``.

    Args:
        actual: what the learner's code returned.
        expected: the reference result.
        what: names the result in the message, e.g. ``"my_softmax(x)"``.
        hint: the targeted hint shown when the values (not the shape) are wrong.
    """
    if not isinstance(actual, Tensor):
        raise ExerciseError(f"{what} should return a torch.Tensor, got {type(actual).__name__}.")
    if actual.shape != expected.shape:
        raise ExerciseError(
            f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}. "
            "Check which dimensions you reduce, transpose or reshape."
        )
    actual = actual.detach().to(expected.dtype)
    if torch.isnan(actual).any() and not torch.isnan(expected).any():
        raise ExerciseError(f"{what} contains NaN. {hint}")
    try:
        torch.testing.assert_close(actual, expected.detach(), atol=atol, rtol=rtol)
    except AssertionError as err:
        detail = str(err).splitlines()
        summary = "; ".join(line.strip() for line in detail[1:4] if line.strip())
        raise ExerciseError(f"{what} has the right shape but wrong values ({summary}). {hint}") from None
