"""Start a few local processes in a gloo process group, run jobs in them, bring the results back.

:func:`launch` is how the course's chapter and tests run :mod:`mha.distributed`: ``world_size``
processes on this machine, joined in a ``torch.distributed`` gloo group on ``127.0.0.1`` (a free
port, no other address), each running the same list of jobs with its own rank::

    results = launch([(ring_job, (q, k, v, {"is_causal": True}))], world_size=2)
    results[0]  # job 0's return value on rank 0, rank 1, ...

A job is ``(function, args)``; the function must be importable (a notebook's own functions are
not: the processes are *spawned*, and a spawned process finds a function by its module's name),
and it is called as ``function(rank, world_size, *args)``. The run is bounded in time: past
``timeout`` seconds every process is killed and :func:`launch` raises ``TimeoutError``. Whatever
the processes print (gloo's own warnings included) goes to a log, not to the notebook: it is
returned with a failure's message, and on success is available as ``launch(...).log``.

The jobs the chapter runs (:func:`ring_job`, :func:`tensor_parallel_job`, :func:`error_job`,
:func:`context_parallel_job`) are here too, for the same reason.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from .. import distributed as _distributed
from ..multihead import MultiHeadAttention
from . import demo as _demo

Job = tuple[Callable[..., Any], tuple[Any, ...]]


class Results(list):
    """One entry per job: the list of its return values, rank by rank; ``log`` holds what the
    processes printed."""

    log: str = ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_interface() -> str | None:
    """The name of the loopback interface ("lo" on Linux), for gloo's GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), None)


def _worker(rank: int, world_size: int, port: int, folder: str, jobs: Sequence[Job]) -> None:
    """One process: send its output to a log, join the group, run the jobs, save the results."""
    log = os.open(os.path.join(folder, f"log{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)  # everything this process prints, C++ included, goes to its log
    os.dup2(log, 2)
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    interface = _loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    result: dict[str, Any] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        result["values"] = [fn(rank, world_size, *args) for fn, args in jobs]
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    if "error" in result:  # exit at once: the parent sees it and stops the other ranks
        os._exit(1)
    dist.destroy_process_group()


def launch(jobs: Sequence[Job], world_size: int, *, timeout: float = 60.0) -> Results:
    """Run ``jobs`` in ``world_size`` spawned processes joined in a gloo group on 127.0.0.1.

    Args:
        jobs: ``(function, args)`` pairs, run in order by every process as
            ``function(rank, world_size, *args)``; functions must be importable.
        world_size: how many processes.
        timeout: seconds before every process is killed and ``TimeoutError`` raised.

    Returns:
        One list per job of its return values on ranks ``0 … world_size - 1``; ``.log`` is what
        the processes printed.

    Raises:
        RuntimeError: a process failed (the message holds its traceback and log).
        TimeoutError: the processes did not finish within ``timeout`` seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _worker,
            args=(world_size, free_port(), folder, list(jobs)),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not _joined(context):  # a process that fails ends the wait at once
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world_size} processes did not finish in {timeout:g} s; killed\n"
                        + _logs(folder, world_size)
                    )
        finally:  # never leave a process behind: the others may wait for a failed one forever
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        return _collect(folder, world_size, len(jobs))


def _joined(context: Any) -> bool:
    """Wait up to a second: ``True`` when every process has finished, ``True`` as soon as one
    has failed (its result says why), ``False`` while they run."""
    try:
        return bool(context.join(timeout=1.0))
    except mp.ProcessExitedException:
        return True


def _logs(folder: str, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = Path(folder) / f"log{rank}.txt"
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            parts.append(f"[rank {rank}]\n{text}")
    return "\n".join(parts)


def _collect(folder: str, world_size: int, n_jobs: int) -> Results:
    """Read every rank's results; raise the failures' tracebacks, the first one first (a rank
    that fails can make the others fail in turn; ranks stopped by the launcher have no result)."""
    paths = [Path(folder) / f"rank{rank}.pt" for rank in range(world_size)]
    loaded = [torch.load(p, weights_only=False) if p.exists() else None for p in paths]
    errors = {r: result["error"] for r, result in enumerate(loaded) if result and "error" in result}
    if errors:
        order = sorted(errors, key=lambda r: paths[r].stat().st_mtime_ns)  # as they failed
        report = "\n".join(f"rank {r} failed:\n{errors[r]}" for r in order)
        raise RuntimeError(f"{report}\n{_logs(folder, world_size)}")
    if any(result is None for result in loaded):
        raise RuntimeError(f"a process ended without a result\n{_logs(folder, world_size)}")
    per_rank = [result["values"] for result in loaded if result is not None]
    results = Results([rank_values[j] for rank_values in per_rank] for j in range(n_jobs))
    results.log = _logs(folder, world_size)
    return results


def ring_job(
    rank: int, world_size: int, query: Tensor, key: Tensor, value: Tensor, options: dict[str, Any]
) -> tuple[Tensor, _distributed.Traffic]:
    """Shard the full ``query, key, value`` (``layout`` in ``options``), run
    :func:`mha.distributed.ring_attention` on this rank's shard; return its output shard and
    what it sent."""
    layout = options.get("layout", "contiguous")
    q, k, v = (
        _distributed.shard_sequence(t, world_size, layout=layout)[rank] for t in (query, key, value)
    )
    with _distributed.count_traffic() as traffic:
        out = _distributed.ring_attention(q, k, v, **options)
    return out, traffic


def tensor_parallel_job(
    rank: int,
    world_size: int,
    state: dict[str, Tensor],
    config: dict[str, Any],
    x: Tensor,
    is_causal: bool,
) -> tuple[Tensor, _distributed.Traffic, int]:
    """Build the module from ``config`` and ``state``, keep this rank's heads, attend over ``x``;
    return the output, what was sent, and the number of parameters this rank holds."""
    module = MultiHeadAttention(**config)
    module.load_state_dict(state)
    shard = _distributed.TensorParallelAttention(module)
    with _distributed.count_traffic() as traffic:
        out = shard(x, is_causal=is_causal)
    return out.detach(), traffic, sum(p.numel() for p in shard.parameters())


def error_job(rank: int, world_size: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> str:
    """Call ``fn(*args, **kwargs)`` where it must raise ``ValueError`` or ``TypeError`` before
    any communication; return the error as ``"TypeName: message"``."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as error:
        return _demo.format_error(error)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised nothing on rank {rank}")


def context_parallel_job(
    rank: int, world_size: int, query: Tensor, key: Tensor, value: Tensor
) -> Tensor | str:
    """Causal SDPA under torch's own context parallelism
    (``torch.distributed.tensor.experimental.context_parallel``), sharding the full tensors
    across a CPU device mesh; return the gathered output, or the error it raised as
    ``"TypeName: message"`` (the first line)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh("cpu", (world_size,))
    q, k, v = query.clone(), key.clone(), value.clone()  # sharded in place by context_parallel
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out,) = context_parallel_unshard(mesh, [out], [2])
    except (NotImplementedError, RuntimeError) as error:
        return _demo.format_error(error).splitlines()[0]
    return out
