"""Power-law fits on log-log axes: how fast a measured curve grows.

:func:`loglog_fit` fits ``y ≈ c · x**slope``; the slope is what the course reads off its curves
(slope 2 for memory that grows like ``L²``, slope 1 for ``L``). It lives in a module of its own:
chapters fit the columns of a :mod:`mha.lab.bench` table with it, and :mod:`mha.lab.charts`
draws the fitted lines, without either importing the other.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LogLogFit", "loglog_fit"]


@dataclass(frozen=True)
class LogLogFit:
    """``y ≈ coefficient · x**slope``, fitted by least squares on ``log x``, ``log y``.

    Attributes:
        slope: the exponent (1 for linear growth, 2 for quadratic).
        coefficient: the prefactor ``c``.
    """

    slope: float
    coefficient: float

    def __call__(self, x: float | Sequence[float]) -> float | list[float]:
        """The fitted curve at ``x`` (a number or a sequence of numbers)."""
        if isinstance(x, (int, float)):
            return self.coefficient * x**self.slope
        return [self.coefficient * xi**self.slope for xi in x]


def _positive_values(name: str, values: Sequence[float] | torch.Tensor) -> list[float]:
    """The values as floats; each must be positive and finite, since its logarithm is taken."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a sequence of numbers, got {type(values).__name__}"
        ) from None
    for v in out:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(
                f"{name} must hold positive finite numbers for a log-log fit, got {v!r}"
            )
    return out


def loglog_fit(x: Sequence[float], y: Sequence[float]) -> LogLogFit:
    """Fit ``y ≈ c · x**slope`` by least squares on ``(log x, log y)``.

    The slope is how fast ``y`` grows: doubling ``x`` multiplies ``y`` by ``2**slope``. Peak memory
    of the naive attention has slope ≈ 2 in the sequence length, the tiled one slope ≈ 1.

    Args:
        x: positive sizes, at least two distinct values.
        y: positive measurements, one per size.

    Returns:
        A :class:`LogLogFit` (``slope``, ``coefficient``; call it to evaluate the fitted curve).
    """
    xs, ys = _positive_values("x", x), _positive_values("y", y)
    if len(xs) != len(ys):
        raise ValueError(f"x and y must have the same length, got {len(xs)} and {len(ys)}")
    if len(set(xs)) < 2:
        raise ValueError(f"x must hold at least two distinct values for a fit, got {xs}")
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    return LogLogFit(slope, math.exp(my - slope * mx))
