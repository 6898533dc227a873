"""Measuring attention: time on ``torch.utils.benchmark``, peak memory for real, sweeps, slopes.

* :func:`time_fn` times one call pattern with ``torch.utils.benchmark.Timer``, which warms up,
  picks a block size that hides the timer's own overhead and synchronises CUDA around each block.
* :func:`compare_times` times several functions in interleaved rounds, so that a burst of load on
  the machine hits all of them alike and their *ratio* stays meaningful.
* :func:`peak_memory` measures the extra bytes a call allocates at its peak: on CUDA with the
  caching allocator's peak counter, on the CPU by replaying the allocation events that
  ``torch.profiler`` records with ``profile_memory=True``.
* :func:`sweep` runs several implementations over a grid of sizes and returns a :class:`Table`;
  :func:`loglog_fit` (from :mod:`mha.fit`, importable from here too) fits ``y ≈ c · x**slope`` to
  such a curve (slope 2 for memory that grows like ``L²``, slope 1 for ``L``).

* :func:`paired_ratio` times two functions in alternating pairs and returns the median of the
  per-pair ratios, the most robust ratio a shared, noisy machine allows.

``make bench`` (``tools/bench_report.py``) prints the course's performance targets with these
tools, each a ratio against PyTorch measured in one run.

Printed measurements carry a leading ``~`` (``time ~1.234 ms``): they change from run to run, and
the notebooks' sanitiser rewrites ``~<number>`` so that stored outputs stay comparable.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import benchmark

from . import validation as validate
from .fit import LogLogFit, loglog_fit

__all__ = [
    "LogLogFit",
    "Table",
    "Timing",
    "compare_times",
    "loglog_fit",
    "paired_ratio",
    "peak_memory",
    "sweep",
    "time_fn",
]

MiB = 2**20


# --------------------------------------------------------------------------------------- timing


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


def _check_fns(fns: object) -> Mapping[str, Callable[..., object]]:
    """A non-empty mapping of name -> callable (what :func:`sweep` and friends measure)."""
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
    fns = _check_fns(fns)
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


# --------------------------------------------------------------------------------------- memory


def _find_device(args: Sequence[object], kwargs: Mapping[str, object]) -> torch.device:
    """The device of the first tensor among the arguments (searching one level into lists)."""
    for obj in (*args, *kwargs.values()):
        items = obj if isinstance(obj, (list, tuple)) else (obj,)
        for item in items:
            if isinstance(item, torch.Tensor):
                return item.device
            if isinstance(item, torch.nn.Module):
                for p in item.parameters():
                    return p.device
    return torch.device("cpu")


# Lines that the profiler's native layer (Kineto, the CPU allocator) writes straight to file
# descriptor 2, past Python's sys.stderr: status lines on start and stop, and a one-time notice
# when the measured call frees a tensor that existed before the profiler started.
_PROFILER_NOISE = re.compile(
    r"profiler_start|profiler_stop|Completed Stage|ActivityProfiler|libkineto|Trace (?:start|duration)"
    r"|Log file: .*libkineto|allocated before the profiling started"
)


@contextlib.contextmanager
def _filter_native_stderr() -> Iterator[None]:
    """Capture file descriptor 2, drop the profiler's own lines, re-emit everything else.

    In a notebook anything written to file descriptor 2 becomes stderr output of the cell; the
    profiler's status lines would land there. Whatever else the measured call writes (its
    warnings) is passed on to ``sys.stderr`` unchanged.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable fd 2 (embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
    kept = "".join(
        line for line in text.splitlines(keepends=True) if not _PROFILER_NOISE.search(line)
    )
    if kept:
        sys.stderr.write(kept)


def _cpu_peak_bytes(call: Callable[[], object]) -> int:
    """Peak of the running sum of CPU allocations (minus frees) recorded during ``call()``."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    # Free unreachable cycles now, so that the collector does not free older tensors mid-call.
    gc.collect()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _filter_native_stderr():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the profiler's own notices, not the measured call's
            prof.start()
        try:
            result = call()
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof.stop()
    del result

    # Every allocation and free through torch's CPU allocator is one event carrying its address
    # and size (negative for a free). Replaying them in time order gives the bytes the call holds
    # at each moment. Frees of blocks the call did not allocate (older tensors it drops) are
    # ignored: the profiler knows the size of some of them and not of others, and counting only
    # the call's own blocks keeps the result independent of what ran before.
    def walk(nodes: Sequence[Any]) -> Iterator[Any]:
        for node in nodes:
            yield node
            yield from walk(node.children)

    profiler = prof.profiler  # set by start(), its results by stop()
    assert profiler is not None and profiler.kineto_results is not None
    tree = profiler.kineto_results.experimental_event_tree()
    events = sorted(
        (node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size)
        for node in walk(tree)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu"
    )
    owned: dict[int, int] = {}  # address -> size of the blocks the call holds
    live = peak = 0
    for _, ptr, size in events:
        if size > 0:
            owned[ptr] = owned.get(ptr, 0) + size
            live += size
            peak = max(peak, live)
        elif ptr in owned:
            live -= owned.pop(ptr)
    return peak


def peak_memory(
    fn: Callable[..., object],
    *args: Any,
    device: str | torch.device | None = None,
    warmup: bool = True,
    **kwargs: Any,
) -> int:
    """Measure the peak number of bytes ``fn(*args, **kwargs)`` allocates on top of what exists.

    What is counted: the blocks allocated through PyTorch's allocator during the call — its
    intermediates and its result — as the maximum over time of the bytes the call has allocated
    and not yet freed. Memory that existed before the call (the inputs, the model's weights) is
    not counted; a chain of operations that frees its intermediates as it goes reports less than
    the sum of their sizes.

    * CUDA: ``torch.cuda.reset_peak_memory_stats``, then ``max_memory_allocated`` minus the bytes
      allocated before the call. These are the caching allocator's global counters: blocks it
      keeps cached but free are not counted, and older tensors the call frees make room.
    * CPU: the call runs under ``torch.profiler.profile(profile_memory=True)``; the recorded
      allocation and free events of the blocks the call allocates are replayed in time order and
      the peak of the bytes they hold is returned (freeing older tensors does not make room here).
      Allocations made outside torch (NumPy, a BLAS library's private buffers) are not seen.

    Args:
        fn: the function to measure; called with ``*args`` and ``**kwargs``.
        device: ``"cpu"`` or a CUDA device; defaults to the device of the first tensor (or module)
            among the arguments, else the CPU.
        warmup: call ``fn`` once before measuring, so that one-time allocations (lazy
            initialisation, cuBLAS workspaces) are not charged to the call.

    Returns:
        Peak extra bytes, an ``int`` ``>= 0``.
    """
    validate.function("fn", fn)
    validate.flag("warmup", warmup)
    dev = _find_device(args, kwargs) if device is None else torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a cpu or cuda device, got {str(dev)!r}")

    def call() -> object:
        return fn(*args, **kwargs)

    if warmup:
        call()
    if dev.type == "cpu":
        return _cpu_peak_bytes(call)
    if not torch.cuda.is_available():
        raise ValueError(f"device is {str(dev)!r} but CUDA is not available")
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    result = call()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del result
    return max(peak, 0)


# ---------------------------------------------------------------------------------------- table


def _format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _format_mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.2f} MiB"


# The measurement columns that sweep() produces: header and formatter.
_COLUMN_SPECS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "time_s": ("time", _format_ms),
    "iqr_s": ("iqr", _format_ms),
    "runs": ("runs", str),
    "peak_bytes": ("peak", _format_mib),
}


class Table:
    """Rows of measurements (a list of dicts) with a stable text and a Markdown rendering.

    ``str(table)`` prints one line per row: the fixed columns (implementation, size) padded into
    columns, then the measured ones as ``name ~value unit``. Measured cells are deliberately not
    padded: their width changes from run to run and padding would make the printed text change
    even after the ``~<number>`` values are normalised.

    Args:
        rows: one dict per row; every row has the same keys, in the same order.
        columns: the column names; taken from the first row by default (needed for no rows).
        measured: column names whose values are measurements (printed with ``~``). Defaults to
            the measurement columns :func:`sweep` produces (``time_s``, ``iqr_s``, ``runs``,
            ``peak_bytes``).
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        columns: Sequence[str] | None = None,
        measured: Sequence[str] | None = None,
    ):
        copies = [dict(r) for r in rows]
        columns = list(columns) if columns is not None else (list(copies[0]) if copies else [])
        for i, row in enumerate(copies):
            if list(row) != columns:
                raise ValueError(
                    f"rows must all have the columns {columns}, row {i} has {list(row)}"
                )
        self.rows: list[dict[str, Any]] = copies
        self.columns: list[str] = columns
        self.measured: tuple[str, ...] = tuple(
            c for c in columns if (c in _COLUMN_SPECS if measured is None else c in measured)
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def where(self, **equal: Any) -> Table:
        """The rows whose columns equal the given values, e.g. ``table.where(impl="flash")``."""
        for name in equal:
            if name not in self.columns:
                raise ValueError(f"unknown column {name!r}; the table has {self.columns}")
        rows = [r for r in self.rows if all(r[k] == v for k, v in equal.items())]
        return Table(rows, columns=self.columns, measured=self.measured)

    def column(self, name: str, **equal: Any) -> list[Any]:
        """The values of one column, optionally of the rows selected as in :meth:`where`."""
        if name not in self.columns:
            raise ValueError(f"unknown column {name!r}; the table has {self.columns}")
        return [r[name] for r in self.where(**equal).rows]

    def _cell(self, name: str, value: Any) -> str:
        if value is None:
            return "-"
        if name in _COLUMN_SPECS:
            text = _COLUMN_SPECS[name][1](value)
        else:
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return f"~{text}" if name in self.measured else text

    @staticmethod
    def _header(name: str) -> str:
        return _COLUMN_SPECS[name][0] if name in _COLUMN_SPECS else name

    def __str__(self) -> str:
        fixed = [c for c in self.columns if c not in self.measured]
        cells = [[f"{c}={self._cell(c, r[c])}" for c in fixed] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(fixed))] if cells else []
        lines = []
        for row, cell in zip(self.rows, cells):
            parts = [text.ljust(w) for text, w in zip(cell, widths)]
            parts += [f"{self._header(c)} {self._cell(c, row[c])}" for c in self.measured]
            lines.append("  ".join(parts).rstrip())
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """A Markdown table (measured cells with ``~``), e.g. for ``IPython.display.Markdown``."""
        headers = [self._header(c) for c in self.columns]
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for row in self.rows:
            lines.append("| " + " | ".join(self._cell(c, row[c]) for c in self.columns) + " |")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Table({len(self.rows)} rows, columns={self.columns})"


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    sizes = list(sizes)
    if not sizes:
        raise ValueError("sizes must not be empty")
    for s in sizes:
        validate.positive_int("each of sizes", s)
    return sizes


def _check_size_name(size_name: object) -> str:
    # The size becomes a column next to "impl" and the measurements: it must not overwrite one.
    if not isinstance(size_name, str):
        raise TypeError(f"size_name must be a str, got {type(size_name).__name__} ({size_name!r})")
    if size_name in ("impl", *_COLUMN_SPECS):
        raise ValueError(
            f"size_name must be a str other than the table's own columns, got {size_name!r}"
        )
    return size_name


def _check_max_size(
    max_size: Mapping[str, int] | None, fns: Mapping[str, object]
) -> dict[str, int]:
    max_size = dict(max_size or {})
    for name, largest in max_size.items():
        if name not in fns:
            raise ValueError(f"max_size names {name!r}, which is not in fns {list(fns)}")
        validate.positive_int(f"max_size[{name!r}]", largest)
    return max_size


def _split_inputs(inputs: object) -> tuple[tuple, dict[str, Any]]:
    """``make_inputs``' result as ``(args, kwargs)``: a tuple is positional, a mapping keywords."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    raise TypeError(
        f"make_inputs must return a tuple of arguments or a dict of keyword arguments, "
        f"got {type(inputs).__name__}"
    )


def _measure(
    fn: Callable[..., object],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    time: bool,
    memory: bool,
    min_run_time: float,
) -> dict[str, Any]:
    """The measurement columns of one row of :func:`sweep`."""
    row: dict[str, Any] = {}
    if time:
        t = time_fn(fn, *args, min_run_time=min_run_time, **kwargs)
        row.update(time_s=t.median, iqr_s=t.iqr, runs=t.runs)
    if memory:
        # timing already warmed the function up
        row["peak_bytes"] = peak_memory(fn, *args, warmup=not time, **kwargs)
    return row


def sweep(
    fns: Mapping[str, Callable[..., object]],
    sizes: Sequence[int],
    make_inputs: Callable[[int], tuple | Mapping[str, Any]],
    *,
    size_name: str = "L",
    time: bool = True,
    memory: bool = True,
    min_run_time: float = 0.1,
    max_size: Mapping[str, int] | None = None,
    progress: bool = False,
) -> Table:
    """Measure several implementations over a grid of sizes.

    For each size, ``make_inputs(size)`` builds the inputs once (a tuple of positional arguments
    or a dict of keyword arguments); every implementation is then timed with :func:`time_fn`
    and/or measured with :func:`peak_memory` on them.

    Args:
        fns: implementation name -> function.
        sizes: the sizes to sweep, e.g. sequence lengths.
        make_inputs: size -> the arguments of every function in ``fns``.
        size_name: the name of the size column (``"L"`` for a sequence length).
        time: measure the run time (``time_s``, ``iqr_s``, ``runs`` columns).
        memory: measure the peak memory (``peak_bytes`` column).
        min_run_time: seconds of timing per implementation and size.
        max_size: implementation name -> largest size to run it at (e.g. keep the naive O(L²)
            version away from sizes that would exhaust memory); larger sizes are left out.
        progress: print a one-line progress message (on stdout) before each measurement.

    Returns:
        A :class:`Table` with columns ``impl``, ``size_name``, then the measurements, ordered by
        size, then by the order of ``fns``.
    """
    fns, sizes = _check_fns(fns), _check_sizes(sizes)
    validate.function("make_inputs", make_inputs)
    time, memory = validate.flag("time", time), validate.flag("memory", memory)
    if not (time or memory):
        raise ValueError("at least one of time and memory must be True")
    size_name = _check_size_name(size_name)
    min_run_time = validate.positive_float("min_run_time", min_run_time)
    max_size = _check_max_size(max_size, fns)
    validate.flag("progress", progress)

    plan = [(s, name) for s in sizes for name in fns if s <= max_size.get(name, s)]
    rows = []
    for step, (size, name) in enumerate(plan, 1):
        if progress:
            print(f"\rsweep {step}/{len(plan)}: {name} {size_name}={size}", end="", flush=True)
        if step == 1 or plan[step - 2][0] != size:  # built once per size, shared by every fn
            args, kwargs = _split_inputs(make_inputs(size))
        measured = _measure(
            fns[name], args, kwargs, time=time, memory=memory, min_run_time=min_run_time
        )
        rows.append({"impl": name, size_name: size, **measured})
    if progress:
        print(f"\rsweep done: {len(plan)} measurements" + " " * 20, flush=True)
    return Table(rows)
