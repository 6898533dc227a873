"""Memory: the peak number of bytes a call allocates, measured for real on the CPU and on CUDA.

:func:`peak_memory` measures the extra bytes a call allocates at its peak: on CUDA with the caching
allocator's peak counter, on the CPU by replaying the allocation events that ``torch.profiler``
records with ``profile_memory=True``. It is the course's only user of torch's private profiler
API (``torch._C._profiler``), which is why it has a module of its own: when a torch release moves
that API, this is the one file to change.

Run time is measured by :mod:`mha.lab.timing`; :mod:`mha.lab.bench` runs both over a grid of sizes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import validation as validate

__all__ = ["MiB", "peak_memory"]

MiB = 2**20


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
# descriptor 2, past Python's sys.stderr: status lines on start and stop, a one-time notice
# when the measured call frees a tensor that existed before the profiler started, and, with a
# CUDA build of torch on a machine without a GPU (Colab's CPU runtime), Kineto's report that it
# found no GPU to count ("gpuGetDeviceCount failed with code 35").
_PROFILER_NOISE = re.compile(
    r"profiler_start|profiler_stop|Completed Stage|ActivityProfiler|libkineto|Trace (?:start|duration)"
    r"|Log file: .*libkineto|allocated before the profiling started"
    r"|DeviceProperties\.cpp.*gpuGetDeviceCount failed"
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
