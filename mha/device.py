"""Which dtypes and attention kernels to use on a device: one decision, for the package and the book.

A Colab T4 (compute capability 7.5) has no bfloat16 units and no FlashAttention backend in torch's
SDPA; an A100 (8.0) and an H100 (9.0) have both; a CPU runs everything, slowly. Code that needs to
choose asks :func:`capabilities` instead of testing compute capabilities itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Capabilities", "capabilities", "resolve_device"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A ``torch.device`` with its index; ``None`` means the current CUDA device, else the CPU."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must name a torch device, got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device is {str(dev)!r} but CUDA is not available on this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass(frozen=True)
class Capabilities:
    """What the course may use on a device: the one place that decides dtypes and kernels.

    Chapters and ``mha`` ask this instead of testing compute capabilities themselves, so that a
    Colab T4 (7.5), an A100 (8.0), an H100 (9.0) and a CPU each get a choice that runs.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        compute_capability: ``(major, minor)`` of an NVIDIA GPU; ``None`` on the CPU or ROCm.
        bfloat16: bfloat16 runs natively (CPU; NVIDIA from 8.0 — a T4 only emulates it).
        tf32: float32 matmuls may run on TF32 tensor cores (NVIDIA from 8.0).
        sdpa_flash: torch's FlashAttention backend exists here (the CPU's fused kernel; on
            NVIDIA, FlashAttention-2 needs 8.0 and float16/bfloat16).
        triton_bfloat16: a Triton kernel may compute in bfloat16 (the CPU interpreter up-casts;
            NVIDIA needs 8.0).
    """

    device: str
    compute_capability: tuple[int, int] | None
    bfloat16: bool
    tf32: bool
    sdpa_flash: bool
    triton_bfloat16: bool

    @property
    def low_precision(self) -> tuple[torch.dtype, ...]:
        """The 16-bit dtypes worth running here: float16 always, bfloat16 where it is native."""
        return (torch.float16, torch.bfloat16) if self.bfloat16 else (torch.float16,)

    @property
    def half(self) -> torch.dtype:
        """The 16-bit dtype to train and serve in: bfloat16 where native (float32's range), else float16."""
        return torch.bfloat16 if self.bfloat16 else torch.float16


def capabilities(device: str | torch.device | None = None) -> Capabilities:
    """Decide, from the device alone, which dtypes and attention kernels the course uses on it.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; defaults to the current CUDA device if
            there is one, else the CPU.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return Capabilities(
            dev.type, None, bfloat16=True, tf32=False, sdpa_flash=True, triton_bfloat16=True
        )
    if torch.version.hip is not None:  # AMD: bfloat16 and FlashAttention on the MI200/MI300 line
        return Capabilities(
            str(dev), None, bfloat16=True, tf32=False, sdpa_flash=True, triton_bfloat16=True
        )
    cc = tuple(torch.cuda.get_device_capability(dev))
    ampere = cc >= (8, 0)
    return Capabilities(
        str(dev),
        (cc[0], cc[1]),
        bfloat16=ampere,
        tf32=ampere,
        sdpa_flash=ampere,
        triton_bfloat16=ampere,
    )
