"""Timing: how long a call takes, on ``torch.utils.benchmark``, and ratios a noisy machine allows.

* :func:`time_fn` times one call pattern with ``torch.utils.benchmark.Timer``, which warms up,
  picks a block size that hides the timer's own overhead and synchronises CUDA around each block.
* :func:`compare_times` times several functions in interleaved rounds, so that a burst of load on
  the machine hits all of them alike and their *ratio* stays meaningful.
* :func:`paired_ratio` times two functions in alternating pairs and returns the median of the
  per-pair ratios, the most robust ratio a shared, noisy machine allows.

Peak memory is measured by :mod:`mha.lab.memory`; :mod:`mha.lab.bench` runs both over a grid of
sizes. Printed measurements carry a leading ``~`` (``time ~1.234 ms``): they change from run to
run, and the notebooks' sanitiser rewrites ``~<number>`` so that stored outputs stay comparable.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import benchmark

from .. import validation as validate

__all__ = ["Timing", "compare_times", "paired_ratio", "time_fn"]


@dataclass(frozen=True)
class Timing:
    """The run time of one call, summarised over many measured runs.

    Attributes:
        median: median seconds per call.
        iqr: interquartile range of the per-call times, in seconds (0 with a single block).
        runs: how many calls were measured (warm-up calls not included).
        times: seconds per call of each measured block (a block is ``runs / len(times)`` calls).
    """

    median: float
    iqr: float
    runs: int
    times: tuple[float, ...]

    @property
    def ms(self) -> float:
        """The median in milliseconds."""
        return self.median * 1e3

    def __str__(self) -> str:
        return f"~{self.ms:.3f} ms (IQR ~{self.iqr * 1e3:.3f} ms, ~{self.runs} runs)"


def _summarise(times: Sequence[float], number: int) -> Timing:
    """Median and IQR of per-call block times."""
    if len(times) >= 2:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        iqr = q3 - q1
    else:
        iqr = 0.0
    return Timing(statistics.median(times), iqr, len(times) * number, tuple(times))


class _Runner:
    """A ``Timer`` for one call pattern plus the block size it settled on."""

    def __init__(self, fn: Callable[..., object], args: tuple, kwargs: dict, num_threads: int):
        validate.function("fn", fn)
        self.timer = benchmark.Timer(
            stmt="fn(*args, **kwargs)",
            globals={"fn": fn, "args": args, "kwargs": kwargs},
            num_threads=num_threads,
        )
        self.number: int | None = None

    def measure(self, min_run_time: float) -> list[float]:
        """Seconds per call of each block run in about ``min_run_time`` seconds."""
        if self.number is None:
            # blocked_autorange warms up and chooses the block size; keep it for later rounds
            # so that every round measures the same thing.
            m = self.timer.blocked_autorange(min_run_time=min_run_time)
            self.number = m.number_per_run
            return list(m.times)
        times: list[float] = []
        while not times or sum(times) * self.number < min_run_time:
            times.extend(self.timer.timeit(self.number).times)
        return times


def _threads(num_threads: int | None) -> int:
    # torch.utils.benchmark defaults to ONE thread; the course compares what a reader would see,
    # so use every thread torch would use anyway.
    return (
        torch.get_num_threads()
        if num_threads is None
        else validate.positive_int("num_threads", num_threads)
    )


def time_fn(
    fn: Callable[..., object],
    *args: Any,
    min_run_time: float = 0.2,
    min_blocks: int = 3,
    num_threads: int | None = None,
    **kwargs: Any,
) -> Timing:
    """Time ``fn(*args, **kwargs)`` with ``torch.utils.benchmark``.

    The timer warms up, chooses how many calls make one block (so that the timer's overhead is
    negligible) and, on CUDA, synchronises the device around every block, so asynchronous kernel
    launches are not mistaken for finished work.

    Args:
        fn: the function to time; it is called with ``*args`` and ``**kwargs``.
        min_run_time: seconds of measurement to collect at least.
        min_blocks: measure at least this many blocks, so that slow calls (one call per block)
            still get a median of several runs.
        num_threads: torch threads during the measurement; defaults to ``torch.get_num_threads()``
            (``Timer`` itself would use one thread).

    Returns:
        A :class:`Timing` with the median seconds per call, the IQR and the number of runs.

    To time inference, pass a function decorated with ``@torch.no_grad()``: otherwise autograd's
    bookkeeping (for inputs that require grad) is part of what is measured.
    """
    min_run_time = validate.positive_float("min_run_time", min_run_time)
    min_blocks = validate.positive_int("min_blocks", min_blocks)
    runner = _Runner(fn, args, kwargs, _threads(num_threads))
    times = runner.measure(min_run_time)
    while len(times) < min_blocks:
        times.extend(runner.measure(0.0))  # one more block
    return _summarise(times, runner.number or 1)


def check_fns(fns: object) -> Mapping[str, Callable[..., object]]:
    """``fns``, checked to be a non-empty mapping of name -> callable.

    What :func:`compare_times` and :func:`mha.lab.bench.sweep` measure.
    """
    if not isinstance(fns, Mapping) or not fns:
        raise ValueError(f"fns must be a non-empty mapping of name -> function, got {fns!r}")
    for name, fn in fns.items():
        validate.function(f"fns[{name!r}]", fn)
    return fns


def compare_times(
    fns: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 3,
    min_run_time: float = 0.2,
    num_threads: int | None = None,
) -> dict[str, Timing]:
    """Time several zero-argument functions in interleaved rounds, for ratios between them.

    Each round measures every function for about ``min_run_time`` seconds, in order; the blocks of
    all rounds are pooled per function. When other work slows the machine down for a while, the
    interleaving spreads the slowdown over all functions instead of penalising one of them.

    Args:
        fns: name -> function called without arguments (bind inputs with a lambda).
        rounds: how many rounds to interleave.
        min_run_time: seconds of measurement per function and round.
        num_threads: as in :func:`time_fn`.

    Returns:
        name -> :class:`Timing`, in the order of ``fns``.
    """
    fns = check_fns(fns)
    rounds = validate.positive_int("rounds", rounds)
    min_run_time = validate.positive_float("min_run_time", min_run_time)
    threads = _threads(num_threads)
    runners = {name: _Runner(fn, (), {}, threads) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, runner in runners.items():
            times[name].extend(runner.measure(min_run_time))
    return {name: _summarise(times[name], runners[name].number or 1) for name in fns}


def paired_ratio(
    numerator: Callable[[], object],
    denominator: Callable[[], object],
    *,
    pairs: int = 7,
    min_run_time: float = 0.05,
    num_threads: int | None = None,
) -> tuple[float, Timing, Timing]:
    """The median over alternating pairs of ``time(numerator) / time(denominator)``.

    Both are timed one block after the other, ``pairs`` times, taking turns at going first; each
    pair gives one ratio. A burst
    of load on a shared machine then spoils a pair or two, not the median, which is why the
    course's timing claims are medians of pairs.

    Returns:
        ``(median ratio, numerator's Timing, denominator's Timing)``.
    """
    pairs = validate.positive_int("pairs", pairs)
    min_run_time = validate.positive_float("min_run_time", min_run_time)
    threads = _threads(num_threads)
    a, b = _Runner(numerator, (), {}, threads), _Runner(denominator, (), {}, threads)
    a_times: list[float] = []
    b_times: list[float] = []
    ratios = []
    for i in range(pairs):
        # Swap which one goes first every other pair: whatever the first of two calls pays
        # (cold caches, a timer tick) then falls on both sides alike.
        if i % 2:
            tb, ta = b.measure(min_run_time), a.measure(min_run_time)
        else:
            ta, tb = a.measure(min_run_time), b.measure(min_run_time)
        a_times.extend(ta)
        b_times.extend(tb)
        ratios.append(statistics.median(ta) / statistics.median(tb))
    return (
        statistics.median(ratios),
        _summarise(a_times, a.number or 1),
        _summarise(b_times, b.number or 1),
    )
