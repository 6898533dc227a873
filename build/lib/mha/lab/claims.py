"""One way to assert a measured claim: print it, check it against its bound, record its margin.

A chapter that measures something (a time ratio, a memory ratio, a growth factor) and states a
claim about it calls :func:`claim`::

    claim("math / fused SDPA time, L = 2048", t_math / t_sdpa, above=1.5)

which prints ``math / fused SDPA time, L = 2048: ~2.31  (claim > 1.5, margin ~1.54)``, raises
``AssertionError`` when the claim does not hold, and records the claim. The **margin** says how close
the claim came to failing: ``value / above`` for a lower bound, ``below / value`` for an upper
bound, the smaller of the two for an interval; it is ≥ 1 exactly when the claim holds. Bounds are
therefore positive numbers, and so are the values (ratios, times, growth factors).

The printed value and margin carry a leading ``~`` so that the notebooks' sanitiser masks them; the
bound is printed as it is, so a changed bound shows up as a changed output.

Two environment variables serve ``make test-robust`` (``tools/robustness.py``), which runs every
chapter under several load conditions and reports each claim's worst margin:

* ``MHA_CLAIMS_FILE``: append every claim as one JSON line to this file;
* ``MHA_CLAIMS_CONTINUE=1``: print a failed claim as ``FAILED`` and go on instead of raising, so
  that one run measures every claim of a chapter (the robustness run then fails on its own).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

__all__ = ["Claim", "claim", "claims_made", "summary"]


@dataclass(frozen=True)
class Claim:
    """One measured claim: its value, its bounds and how far it is from failing."""

    name: str
    value: float
    above: float | None
    below: float | None

    @property
    def margin(self) -> float:
        """``value / above`` or ``below / value`` (the smaller of both); ≥ 1 when the claim holds."""
        margins = []
        if self.above is not None:
            margins.append(self.value / self.above)
        if self.below is not None:
            margins.append(self.below / self.value if self.value > 0 else math.inf)
        return min(margins)

    @property
    def holds(self) -> bool:
        return self.margin >= 1

    @property
    def bound(self) -> str:
        """The claim's bound as text: ``> 1.5``, ``< 0.25`` or ``in (1.5, 2.5)``."""
        if self.above is not None and self.below is not None:
            return f"in ({self.above:g}, {self.below:g})"
        return f"> {self.above:g}" if self.above is not None else f"< {self.below:g}"


# The claims made in this process, by name: running a notebook cell again replaces its claims.
_MADE: dict[str, Claim] = {}


def _positive(name: str, value: object, what: str) -> float:
    # a Python number, a numpy scalar or a 0-d tensor; not a bool, a string or a vector
    if isinstance(value, (bool, str)) or not hasattr(value, "__float__"):
        raise TypeError(
            f"{what} must be a real number, got {type(value).__name__} (claim {name!r})"
        )
    shape = tuple(getattr(value, "shape", ()))
    if shape:
        raise TypeError(f"{what} must be a single number, got shape {shape} (claim {name!r})")
    number = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {number!r} (claim {name!r})")
    return number


def claim(
    name: str,
    value: float,
    *,
    above: float | None = None,
    below: float | None = None,
    digits: int = 3,
) -> None:
    """Print a measured claim, assert it and record it.

    Args:
        name: what was measured, e.g. ``"math / fused SDPA time, L = 2048"``.
        value: the measurement (> 0): a ratio, a time, a growth factor.
        above: the claim is ``value > above`` (a lower bound, > 0).
        below: the claim is ``value < below`` (an upper bound, > 0); give both for an interval.
        digits: significant digits printed for the value.

    Returns nothing, so that a cell ending with a claim shows only the printed line.

    Raises:
        AssertionError: the claim does not hold (unless ``MHA_CLAIMS_CONTINUE=1``).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if above is None and below is None:
        raise ValueError(f"claim {name!r} needs a bound: give above=, below= or both")
    lo = None if above is None else _positive(name, above, "above")
    hi = None if below is None else _positive(name, below, "below")
    if lo is not None and hi is not None and not lo < hi:
        raise ValueError(f"claim {name!r}: above ({lo:g}) must be smaller than below ({hi:g})")
    made = Claim(name, _positive(name, value, "value"), lo, hi)
    _MADE[name] = made
    verdict = "" if made.holds else "  FAILED"
    print(
        f"{name}: ~{made.value:.{digits}g}  (claim {made.bound}, margin ~{made.margin:.2f}){verdict}"
    )
    path = os.environ.get("MHA_CLAIMS_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({**asdict(made), "margin": made.margin}) + "\n")
    if not made.holds and os.environ.get("MHA_CLAIMS_CONTINUE") != "1":
        raise AssertionError(
            f"claim failed: {name} = {made.value:.4g}, expected {made.bound}"
            f" (margin {made.margin:.2f})"
        )


def claims_made() -> list[Claim]:
    """The claims made so far in this process (a notebook's kernel), in the order first made."""
    return list(_MADE.values())


def summary() -> str:
    """Every claim made so far, one line each: name, bound, value and margin, in the order made."""
    made = list(_MADE.values())
    width = max((len(c.name) for c in made), default=0)
    bound_width = max((len(c.bound) for c in made), default=0)
    return "\n".join(
        f"{c.name:<{width}}  {c.bound:<{bound_width}}  ~{c.value:.3g}  (margin ~{c.margin:.2f})"
        for c in made
    )
