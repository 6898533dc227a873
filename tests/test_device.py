"""mha.device.capabilities: the one decision of dtypes and kernels, for a T4, an A100, an H100 and
the CPU. CI has no GPU, so the device queries are replaced by what those GPUs answer."""

from __future__ import annotations

import pytest
import torch

from mha import device, hardware


def fake_gpu(monkeypatch, capability: tuple[int, int], hip: str | None = None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize(
    "capability,native",
    [((7, 5), False), ((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True)],
    ids=["T4 sm75", "A100 sm80", "A10 sm86", "L4 sm89", "H100 sm90"],
)
def test_nvidia_decisions(monkeypatch, capability, native):
    fake_gpu(monkeypatch, capability)
    caps = device.capabilities("cuda")
    assert caps.device == "cuda:0" and caps.compute_capability == capability
    assert caps.bfloat16 is caps.tf32 is caps.sdpa_flash is caps.triton_bfloat16 is native
    assert caps.half == (torch.bfloat16 if native else torch.float16)
    assert caps.low_precision == ((torch.float16, torch.bfloat16) if native else (torch.float16,))


def test_t4_report_says_bfloat16_is_emulated(monkeypatch):
    fake_gpu(monkeypatch, (7, 5))
    fp16, bf16, tf32 = hardware._dtype_support(torch.device("cuda", 0))
    assert fp16.supported and not bf16.supported and not tf32.supported
    assert "emulated only" in bf16.note


def test_amd_rocm(monkeypatch):
    fake_gpu(monkeypatch, (9, 4), hip="6.2")
    caps = device.capabilities("cuda")
    assert caps.bfloat16 and caps.sdpa_flash and caps.compute_capability is None


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

    fake_gpu(monkeypatch, (7, 5))
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(
        TypeError, match=r"compute capability 8.0 or newer .* this one is 7.5; use float16"
    ):
        triton_flash._check_device(_on_cuda(q), False)
    triton_flash._check_device(_on_cuda(q.half()), False)  # float16 is fine on a T4


def _on_cuda(t: torch.Tensor) -> torch.Tensor:
    """A stand-in whose .device says cuda (the check only reads device and dtype)."""

    class Fake:
        device = torch.device("cuda", 0)
        dtype = t.dtype
        shape = t.shape

    return Fake()  # type: ignore[return-value]  # duck-typed: no CUDA tensor exists in CI
