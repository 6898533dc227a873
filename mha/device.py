"""Which dtypes and attention kernels to use on a device: one decision, for the package and the book.

A Colab T4 (compute capability 7.5) has no bfloat16 units and no FlashAttention backend in torch's
SDPA; an A100 (8.0) and an H100 (9.0) have both; a CPU runs everything, slowly. Code that needs to
choose asks :func:`capabilities` instead of testing compute capabilities itself.

The Triton kernels of chapters 6 and 7 depend on the installed Triton as well as on the GPU:
Triton 3.3 dropped tensor-core ``tl.dot`` for compute capabilities below 8.0 (triton PR #5066,
"Deprecate MMAv1; fallback to FMA for computeCapability < 80", which also raised the supported
hardware in Triton's README to 8.0), so a T4 runs them natively only with Triton 3.2 or older.
The Triton version is read from the installed package's metadata, never by importing Triton:
``import triton`` fixes whether kernels are compiled or interpreted (``TRITON_INTERPRET``) for the
rest of the process, and a chapter must be able to ask first.

This module sits beside the attention code rather than in :mod:`mha.lab` because the core needs
it: :mod:`mha.triton_flash` asks it where its kernels can run. :mod:`mha.lab.hardware` reports on
the same device; the decision itself is made only here.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from dataclasses import dataclass

import torch

__all__ = ["Capabilities", "capabilities", "resolve_device", "triton_version"]


class _NoGpuNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." notice.

    A CUDA build of torch on a machine without a GPU (what Colab's CPU runtime installs, with
    the CUDA toolkit in /usr/local/cuda) logs it as a warning when ``torch.utils.cpp_extension``
    is first imported, which ``torch.utils.benchmark`` (the course's timer) and ``torch.compile``
    do. It says only that there is no GPU, which every chapter already prints in its setup cell;
    in a notebook it would be red text that is no lesson. Every other record of that logger passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_missing_gpu_notice() -> None:
    """Install :class:`_NoGpuNotice` on torch's ``cpp_extension`` logger (once; ``import mha``
    does it)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoGpuNotice) for f in logger.filters):
        logger.addFilter(_NoGpuNotice())


# The last Triton release whose tl.dot uses the tensor cores of a Turing GPU (compute capability
# 7.5, Colab's T4); from 3.3 on only 8.0 and newer are supported.
LAST_TRITON_FOR_TURING = (3, 2)
# The distributions that install the `triton` module: PyPI's, and PyTorch's own builds (nightly
# CUDA wheels, ROCm wheels).
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


def triton_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Triton, or ``None`` when it is not installed.

    Read from the package metadata, so that asking does not import Triton (see the module
    docstring for why that matters).
    """
    for name in _TRITON_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        match = re.match(r"(\d+)\.(\d+)", version)
        if match:
            return int(match[1]), int(match[2])
    return None


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
        triton_native: the Triton kernels of chapters 6 and 7 compile for this device and use its
            tensor cores: an NVIDIA GPU of compute capability 8.0 or newer, or 7.5 (a T4) with
            Triton 3.2 or older; an AMD GPU. Never on the CPU, where they run only in Triton's
            interpreter. Always False without Triton.
        triton: ``(major, minor)`` of the installed Triton, ``None`` if it is not installed.
    """

    device: str
    compute_capability: tuple[int, int] | None
    bfloat16: bool
    tf32: bool
    sdpa_flash: bool
    triton_bfloat16: bool
    triton_native: bool = False
    triton: tuple[int, int] | None = None

    @property
    def low_precision(self) -> tuple[torch.dtype, ...]:
        """The 16-bit dtypes worth running here: float16 always, bfloat16 where it is native."""
        return (torch.float16, torch.bfloat16) if self.bfloat16 else (torch.float16,)

    @property
    def half(self) -> torch.dtype:
        """The 16-bit dtype to train and serve in: bfloat16 where native (float32's range), else float16."""
        return torch.bfloat16 if self.bfloat16 else torch.float16

    @property
    def triton_note(self) -> str:
        """Where the course's Triton kernels can run on this device, and why, in words."""
        if self.triton is None:
            return "Triton is not installed: pip install triton (on Colab it comes with torch)."
        version = "Triton {}.{}".format(*self.triton)
        if self.triton_native:
            return f"{version} compiles the kernels for this GPU ({self.device})."
        if self.compute_capability is None:  # the CPU
            return f"No GPU: {version} runs the kernels in its interpreter, on the CPU."
        cc = "{}.{}".format(*self.compute_capability)
        if self.compute_capability >= (7, 5):  # a Turing GPU with a Triton that dropped it
            why = (
                f"{version} has no tensor-core tl.dot for compute capability {cc} (Turing, "
                "e.g. a T4): Triton 3.3 dropped it and supports 8.0 and newer (triton PR #5066)"
            )
        else:
            why = (
                f"the course runs its Triton kernels natively from compute capability 8.0 "
                f"(7.5 with Triton 3.2 or older), and this GPU is {cc}"
            )
        return (
            f"{why}. To run the kernels on this GPU, use Triton 3.2 or older (with a torch "
            "release built for it) or a GPU of compute capability 8.0 or newer; here they can "
            "run in Triton's interpreter, on CPU tensors (TRITON_INTERPRET=1 set before the "
            "first `import triton`)."
        )


def capabilities(device: str | torch.device | None = None) -> Capabilities:
    """Decide, from the device alone, which dtypes and attention kernels the course uses on it.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; defaults to the current CUDA device if
            there is one, else the CPU.
    """
    dev = resolve_device(device)
    triton = triton_version()
    if dev.type != "cuda" or torch.version.hip is not None:
        # The CPU runs every dtype and kernel (Triton's only in its interpreter); AMD GPUs have
        # bfloat16 and FlashAttention on the MI200/MI300 line, and Triton compiles for them.
        amd = dev.type == "cuda"
        return Capabilities(
            str(dev) if amd else dev.type,
            None,
            bfloat16=True,
            tf32=False,
            sdpa_flash=True,
            triton_bfloat16=True,
            triton_native=amd and triton is not None,
            triton=triton,
        )
    cc = tuple(torch.cuda.get_device_capability(dev))
    ampere = cc >= (8, 0)
    # Turing (7.5) has float16 tensor cores, but Triton's tl.dot uses them only up to 3.2.
    turing_ok = cc >= (7, 5) and triton is not None and triton <= LAST_TRITON_FOR_TURING
    return Capabilities(
        str(dev),
        (cc[0], cc[1]),
        bfloat16=ampere,
        tf32=ampere,
        sdpa_flash=ampere,
        triton_bfloat16=ampere,
        triton_native=triton is not None and (ampere or turing_ok),
        triton=triton,
    )
