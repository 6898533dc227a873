"""Benchmarks: several implementations measured over a grid of sizes, in one tidy table.

* :func:`sweep` runs several implementations over a grid of sizes, timing each with
  :func:`mha.lab.timing.time_fn` and/or measuring its peak memory with
  :func:`mha.lab.memory.peak_memory`, and returns a :class:`Table`;
  :func:`mha.lab.fit.loglog_fit` then fits ``y ≈ c · x**slope`` to a column of it (slope 2 for
  memory that grows like ``L²``, slope 1 for ``L``).
* :class:`Table` holds rows of measurements with a stable text form (measured cells carry a leading
  ``~``, which the notebooks' sanitiser masks) and a Markdown form.

``make bench`` (``tools/bench_report.py``) prints the course's performance targets with these
instruments, each a ratio against PyTorch measured in one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .. import validation as validate
from . import memory as _memory
from . import timing as _timing

__all__ = ["Table", "sweep"]


def _format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _format_mib(nbytes: float) -> str:
    return f"{nbytes / _memory.MiB:.2f} MiB"


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
        t = _timing.time_fn(fn, *args, min_run_time=min_run_time, **kwargs)
        row.update(time_s=t.median, iqr_s=t.iqr, runs=t.runs)
    if memory:
        # timing already warmed the function up
        row["peak_bytes"] = _memory.peak_memory(fn, *args, warmup=not time, **kwargs)
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
    or a dict of keyword arguments); every implementation is then timed with
    :func:`mha.lab.timing.time_fn` and/or measured with :func:`mha.lab.memory.peak_memory` on them.

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
    fns, sizes = _timing.check_fns(fns), _check_sizes(sizes)
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
