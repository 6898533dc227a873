"""What one line of the performance report is, and the small pieces every section of it uses:
``tools/bench_report.py`` and ``tools/bench_serving.py`` both build their lines from here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha.lab.timing import Timing


@dataclass(frozen=True)
class Check:
    """One line of the performance report.

    Attributes:
        name: what is compared, with the sizes.
        value: the measured ratio.
        target: the bound the ratio must respect.
        at_most: ``True`` when ``value <= target`` passes, ``False`` when ``value >= target`` does.
        detail: the measurements the ratio comes from.
    """

    name: str
    value: float
    target: float
    at_most: bool
    detail: str

    @property
    def passed(self) -> bool:
        """Whether the target is met."""
        return self.value <= self.target if self.at_most else self.value >= self.target

    def __str__(self) -> str:
        op = "<=" if self.at_most else ">="
        status = "PASS" if self.passed else "FAIL"
        return f"[{status}] {self.name}: ~{self.value:.3f} (target {op} {self.target:g}); {self.detail}"


def randn(shape: tuple[int, ...], device: torch.device, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(device)  # drawn on the CPU: same numbers everywhere


def times(a: str, ta: Timing, b: str, tb: Timing) -> str:
    return f"{a} ~{ta.ms:.3f} ms, {b} ~{tb.ms:.3f} ms"
