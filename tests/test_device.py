"""mha.device.capabilities: the one decision of dtypes and kernels, for a T4, an A100, an H100 and
the CPU. CI has no GPU, so the device queries are replaced by what those GPUs answer."""

from __future__ import annotations

import logging

import pytest
import torch

from mha import device
from mha.lab import hardware


def fake_gpu(
    monkeypatch,
    capability: tuple[int, int],
    hip: str | None = None,
    triton: tuple[int, int] | None = (3, 9),
) -> None:
    """Make torch report one GPU of this compute capability, and Triton this version."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(device, "triton_version", lambda: triton)


@pytest.mark.parametrize(
    "capability,native",
    [((7, 5), False), ((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True)],
    ids=["T4 sm75", "A100 sm80", "A10 sm86", "L4 sm89", "H100 sm90"],
)
def test_nvidia_decisions(monkeypatch, capability, native):
    fake_gpu(monkeypatch, capability)  # with a current Triton (3.9)
    caps = device.capabilities("cuda")
    assert caps.device == "cuda:0" and caps.compute_capability == capability
    assert caps.bfloat16 is caps.tf32 is caps.sdpa_flash is caps.triton_bfloat16 is native
    assert caps.triton_native is native and caps.triton == (3, 9)
    assert caps.half == (torch.bfloat16 if native else torch.float16)
    assert caps.low_precision == ((torch.float16, torch.bfloat16) if native else (torch.float16,))


@pytest.mark.parametrize(
    "capability,triton,native",
    [
        ((7, 5), (3, 2), True),  # the last Triton with Turing's tensor-core tl.dot
        ((7, 5), (3, 3), False),  # triton PR #5066: 8.0 and newer only
        ((7, 5), (4, 0), False),
        ((7, 5), None, False),  # no Triton at all
        ((7, 0), (3, 2), False),  # Volta: not a GPU the course runs its kernels on
        ((8, 0), (3, 0), True),
        ((8, 0), None, False),
        ((9, 0), (3, 3), True),
    ],
)
def test_triton_native_depends_on_the_gpu_and_the_installed_triton(
    monkeypatch, capability, triton, native
):
    fake_gpu(monkeypatch, capability, triton=triton)
    caps = device.capabilities("cuda")
    assert caps.triton_native is native and caps.triton == triton
    assert caps.sdpa_flash is (capability >= (8, 0))  # torch's kernels do not depend on Triton


def test_a_t4_with_a_new_triton_is_told_why_and_what_to_do(monkeypatch):
    fake_gpu(monkeypatch, (7, 5), triton=(3, 5))
    note = device.capabilities("cuda").triton_note
    assert "Triton 3.5 has no tensor-core tl.dot for compute capability 7.5" in note
    assert "Triton 3.3 dropped it" in note and "#5066" in note
    assert "Triton 3.2 or older" in note and "TRITON_INTERPRET=1" in note
    fake_gpu(monkeypatch, (7, 5), triton=(3, 2))
    assert device.capabilities("cuda").triton_note.startswith("Triton 3.2 compiles the kernels")
    fake_gpu(monkeypatch, (6, 1), triton=(3, 5))
    assert "this GPU is 6.1" in device.capabilities("cuda").triton_note
    fake_gpu(monkeypatch, (9, 0), triton=None)
    assert device.capabilities("cuda").triton_note.startswith("Triton is not installed")


def test_cpu_runs_triton_only_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(device, "triton_version", lambda: (3, 9))
    caps = device.capabilities("cpu")
    assert not caps.triton_native and caps.triton == (3, 9)
    assert caps.triton_note == "No GPU: Triton 3.9 runs the kernels in its interpreter, on the CPU."


@pytest.mark.parametrize(
    "installed,expected",
    [
        ({"triton": "3.3.1"}, (3, 3)),
        ({"triton": "3.2.0+git4b3bb1f8"}, (3, 2)),
        ({"pytorch-triton": "3.4.0+gitabcdef"}, (3, 4)),  # PyTorch's nightly wheels
        ({"pytorch-triton-rocm": "3.1.0"}, (3, 1)),  # PyTorch's ROCm wheels
        ({}, None),
    ],
)
def test_triton_version_from_package_metadata(monkeypatch, installed, expected):
    import importlib.metadata

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert device.triton_version() == expected


def test_triton_version_of_this_environment_without_importing_triton():
    import subprocess
    import sys

    # A fresh interpreter: asking must not import triton, which would fix TRITON_INTERPRET.
    code = (
        "import sys, mha.device as d; v = d.triton_version(); "
        "print(v is None or isinstance(v, tuple), 'triton' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.split() == ["True", "False"]


def test_t4_report_says_bfloat16_is_emulated(monkeypatch):
    fake_gpu(monkeypatch, (7, 5))
    fp16, bf16, tf32 = hardware._dtype_support(torch.device("cuda", 0))
    assert fp16.supported and not bf16.supported and not tf32.supported
    assert "emulated only" in bf16.note


def test_amd_rocm(monkeypatch):
    fake_gpu(monkeypatch, (9, 4), hip="6.2")
    caps = device.capabilities("cuda")
    assert caps.bfloat16 and caps.sdpa_flash and caps.compute_capability is None
    assert caps.triton_native  # Triton supports ROCm


def test_cpu():
    caps = device.capabilities("cpu")
    assert caps.device == "cpu" and caps.compute_capability is None
    assert caps.bfloat16 and not caps.tf32 and caps.sdpa_flash  # torch's fused C++ kernel
    assert caps.low_precision == (torch.float16, torch.bfloat16)


def test_bad_device():
    with pytest.raises(ValueError, match="device must name a torch device, got 'gpu0'"):
        device.capabilities("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            device.capabilities("cuda")


def test_triton_refuses_bfloat16_on_a_t4_with_the_fix_in_the_message(monkeypatch):
    pytest.importorskip("triton")
    from mha import triton_flash

    fake_gpu(monkeypatch, (7, 5), triton=(3, 2))  # a Triton that still compiles for a T4
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(
        TypeError, match=r"compute capability 8.0 or newer .* this one is 7.5; use float16"
    ):
        triton_flash._check_device(_on_cuda(q), False)
    triton_flash._check_device(_on_cuda(q.half()), False)  # float16 is fine on a T4


def test_triton_refuses_a_t4_with_triton_3_3_or_newer_and_says_what_to_do(monkeypatch):
    pytest.importorskip("triton")
    from mha import triton_flash

    fake_gpu(monkeypatch, (7, 5), triton=(3, 3))
    q = _on_cuda(torch.zeros(1, 1, 16, 16, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"cannot run natively on this GPU: Triton 3.3 has no"):
        triton_flash._check_device(q, False)
    triton_flash._check_device(q, True)  # the interpreter is always possible
    fake_gpu(monkeypatch, (8, 0), triton=(3, 3))
    triton_flash._check_device(q, False)  # an A100 compiles them


def test_chapters_6_and_7_fall_back_to_the_interpreter_on_a_t4(monkeypatch):
    """The decision chapters 6 and 7 take before importing Triton, on a mocked Colab T4."""
    fake_gpu(monkeypatch, (7, 5), triton=(3, 4))
    caps = device.capabilities("cuda")
    kernels_on = "cuda" if caps.triton_native else "cpu"  # the chapters' own expression
    assert kernels_on == "cpu" and "interpreter" in caps.triton_note
    fake_gpu(monkeypatch, (9, 0), triton=(3, 4))
    caps = device.capabilities("cuda")
    assert ("cuda" if caps.triton_native else "cpu") == "cuda"


def _on_cuda(t: torch.Tensor) -> torch.Tensor:
    """A stand-in whose .device says cuda (the check only reads device and dtype)."""

    class Fake:
        device = torch.device("cuda", 0)
        dtype = t.dtype
        shape = t.shape

    return Fake()  # type: ignore[return-value]  # duck-typed: no CUDA tensor exists in CI


def test_the_no_cuda_runtime_notice_is_dropped_and_nothing_else(caplog):
    """`import mha` quiets one record of torch's cpp_extension logger: the notice a CUDA build
    without a GPU (Colab's CPU runtime) logs when torch's timer or compiler is first imported."""
    import mha  # noqa: F401 - installs the filter

    logger = logging.getLogger("torch.utils.cpp_extension")
    device.quiet_missing_gpu_notice()  # a second call adds no second filter
    assert sum(isinstance(f, device._NoGpuNotice) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        logger.warning("Error checking compiler version for %s", "c++")
    assert [r.getMessage() for r in caplog.records] == ["Error checking compiler version for c++"]
