"""Compile the course's Triton kernels for NVIDIA GPUs ahead of time, on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels without a GPU) runs a
kernel's Python source with NumPy: it never meets Triton's GPU compiler, which is where the
operand dtypes of ``tl.dot``, constexpr use, shared memory and layouts are checked. This helper
compiles the kernels with that compiler and NVIDIA's ``ptxas`` for compute capabilities 8.0
(Ampere) and 9.0 (Hopper), which needs no GPU.

What is compiled is what the course launches, not a configuration written again by hand: a
*launch function* (a plain function of a test module, run in a fresh process without
``TRITON_INTERPRET``) calls the course's own launchers on CPU tensors of the dtypes, head dims
and sizes the course uses. Every launch is caught before it reaches a GPU, and each distinct one
(kernel, argument types, Triton's specialisation of the integers and pointers, constexprs and
options, as a GPU launch would compile it) is compiled for every target::

    results = compile_launches(tmp_path, "test_triton_compile:launch_flash")
    assert_compiled(results, expected_kernels)

Several launch functions share one process (importing torch and Triton once), with a fresh
``TRITON_CACHE_DIR``: an earlier compile's cache proves nothing. On a machine with CUDA the GPU
tests compile and run the kernels for real, and a Triton without an NVIDIA backend cannot do
this: both skip.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: The compute capabilities compiled for: Ampere (A100; L4 and A10 are 8.9 and 8.6) and Hopper.
TARGETS = (80, 90)
#: The most shared memory one program may use, per target: 99 KiB on the 8.6 and 8.9 GPUs (the
#: A100 has 163 KiB), 227 KiB on Hopper. A kernel above it compiles but fails to launch.
SHARED_LIMIT = {80: 99 * 1024, 90: 227 * 1024}
_MARK = "TRITON-AOT-RESULTS "

# --- in the worker process ------------------------------------------------------------------

_label: list[str] = ["(unlabelled)"]


@contextlib.contextmanager
def label(text: str) -> Iterator[None]:
    """Name the launches made inside the ``with`` block (the failure messages quote it)."""
    _label.append(text)
    try:
        yield
    finally:
        _label.pop()


def allow_cpu_tensors(*modules: Any) -> None:
    """Let the course's launchers launch with CPU tensors although the kernels were built for a
    GPU: their ``_check_device`` (which would say "move the tensors to the GPU") does nothing.
    Only in the worker process, where no launch reaches a device."""
    for module in modules:
        module._check_device = lambda *args, **kwargs: None


def _worker(targets: list[int], launchers: list[str]) -> list[dict[str, Any]]:
    """Run the launch functions with every launch caught, then compile each distinct one."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    caught: list[tuple[str, Any, tuple, dict]] = []

    def catch(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        caught.append((_label[-1], self, args, kwargs))

    JITFunction.run = catch  # what `kernel[grid](...)` calls: nothing reaches a device
    # The test helpers the launch functions import may import the conftest, which sets
    # TRITON_INTERPRET=1 on a machine without a GPU: import it first, then take that back.
    import conftest  # noqa: F401

    os.environ.pop("TRITON_INTERPRET", None)
    for spec in launchers:
        module, name = spec.split(":")
        getattr(importlib.import_module(module), name)()

    results: list[dict[str, Any]] = []
    seen: set[str] = set()
    for cc in targets:
        target = GPUTarget("cuda", cc, 32)
        backend = make_backend(target)
        for where, fn, args, kwargs in caught:
            # What JITFunction.run does before it compiles: bind the arguments, specialise them
            # (dtypes, integers equal to 1, 16-divisible integers and pointers), parse options.
            # These are Triton's internals (3.9): a Triton that renames them fails here, loudly.
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(
                backend, kwargs, bound, specialization, options
            )
            declared = [p.name for p in fn.params if p.is_constexpr]  # not the specialised 1s
            constants = {fn.arg_names[k[0]]: v for k, v in constexprs.items() if len(k) == 1}
            key = repr((cc, id(fn), signature, constexprs, attrs, sorted(options.__dict__.items())))
            if key in seen:
                continue
            seen.add(key)
            result: dict[str, Any] = {
                "label": where,
                "kernel": fn.__name__,
                "target": cc,
                "constexprs": {k: v for k, v in constants.items() if k in declared},
                "dtypes": sorted({t for t in signature.values() if t.startswith("*")}),
                "num_warps": options.num_warps,
                "num_stages": options.num_stages,
            }
            start = time.perf_counter()
            try:
                src = ASTSource(fn, signature, constexprs, attrs)
                compiled = triton.compile(src, target=target, options=options.__dict__)
                result["cubin"] = len(compiled.asm.get("cubin") or b"")
                result["shared"] = int(compiled.metadata.shared)
            except Exception:  # noqa: BLE001 - reported, with the others, by the test
                result["error"] = traceback.format_exc()[-3000:]
            result["seconds"] = round(time.perf_counter() - start, 2)
            results.append(result)
    return results


# --- in the test process --------------------------------------------------------------------


def compile_launches(tmp_path: Path, *launchers: str, timeout: float = 600) -> list[dict]:
    """Compile for :data:`TARGETS` every launch the ``module:function`` launchers make.

    Returns one dict per distinct (launch, target): ``label``, ``kernel``, ``target``,
    ``constexprs`` (those the kernel declares), ``dtypes`` (of the pointers), ``num_warps``,
    ``num_stages``, and ``cubin`` (its size in bytes) and ``shared`` (bytes of shared memory per
    program), or ``error`` (the compiler's traceback). Skips where it cannot or need not run.
    """
    triton = pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the other tests compile and run the kernels")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a fresh compile, not a cached one
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    job = json.dumps({"targets": list(TARGETS), "launchers": list(launchers)})
    done = subprocess.run(
        [sys.executable, __file__],
        input=job,
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith(_MARK)]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len(_MARK) :])


def assert_compiled(results: list[dict], expected: dict[str, int]) -> None:
    """Every compile produced a cubin whose shared memory fits its target, and each kernel was
    compiled for each target from as many labelled launches as ``expected`` says (so a launcher
    that stopped launching a kernel, or a kernel left out, is noticed)."""
    failed = [f"{r['label']}: {r['kernel']} for sm_{r['target']}\n{r['error']}" for r in results
              if "error" in r]  # fmt: skip
    assert not failed, "\n\n".join(failed)
    for r in results:
        where = f"{r['label']}: {r['kernel']} {r['dtypes']} {r['constexprs']} for sm_{r['target']}"
        assert r["cubin"] > 0, f"{where}: no cubin"
        limit = SHARED_LIMIT[r["target"]]
        assert r["shared"] <= limit, f"{where}: {r['shared']} bytes of shared memory > {limit}"
    for target in TARGETS:
        labels: dict[str, set[str]] = {}
        for r in results:
            if r["target"] == target:
                labels.setdefault(r["kernel"], set()).add(r["label"])
        assert {k: len(v) for k, v in labels.items()} == expected, (target, labels)


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    import triton_aot  # the module the launch functions import, whose label() they use

    request = json.loads(sys.stdin.read())
    out = triton_aot._worker(request["targets"], request["launchers"])
    print(_MARK + json.dumps(out, default=str))
