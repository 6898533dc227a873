"""What this machine can do: the device, its low-precision formats, and torch's SDPA backends.

``torch.nn.functional.scaled_dot_product_attention`` is one function with several kernels behind
it — the math reference, FlashAttention, memory-efficient attention, cuDNN — and it picks one per
call from the inputs (device, dtype, shapes, mask, dropout) and the hardware. This module finds out
which of them *can* run for given inputs by forcing each one in turn with
``torch.nn.attention.sdpa_kernel`` and recording either success or the reason torch gives.

* :func:`device_report` — device name, compute capability, torch/CUDA versions, fp16/bf16/TF32.
* :func:`sdpa_backends` — which backends run for one set of SDPA arguments, and which torch picks.
* :func:`hardware_report` — both, over a few typical inputs, as one table.

Which dtypes and kernels the course *uses* on a device is decided in one place, by
:func:`mha.device.capabilities` (the Triton kernels need that decision too); the reports here
describe what the device and torch offer.

Every report has a fixed-format ``str()``. On the CPU it shows only what does not depend on the
particular processor (its instruction set and thread count are attributes of
:class:`DeviceReport`, not printed), so a notebook that prints a report gives the same output on
every CPU machine.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import validation as validate
from ..device import capabilities as _capabilities
from ..device import resolve_device as _resolve_device

__all__ = [
    "BackendReport",
    "BackendStatus",
    "DeviceReport",
    "DtypeSupport",
    "HardwareReport",
    "default_cases",
    "device_report",
    "hardware_report",
    "sdpa_backends",
]

# Short column titles for the backends, in torch's enum order.
_SHORT = {
    "MATH": "math",
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "OVERRIDEABLE": "overrideable",
}


def _backends() -> list[Any]:
    """torch's SDPA backends (``SDPBackend`` members), without the ``ERROR`` sentinel."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.2 has no per-call backend selection
        return []
    return [b for name, b in SDPBackend.__members__.items() if name != "ERROR"]


# --------------------------------------------------------------------------------------- device


@dataclass(frozen=True)
class DtypeSupport:
    """Whether a number format is usable on the device.

    Attributes:
        name: ``"float16"``, ``"bfloat16"`` or ``"tf32"``.
        supported: ``True`` if it runs natively (``False`` when only emulated or not at all).
        note: what that means in practice.
    """

    name: str
    supported: bool
    note: str


@dataclass(frozen=True)
class DeviceReport:
    """The device and the software stack.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        name: ``"CPU"`` or the GPU's name.
        compute_capability: ``(major, minor)`` of a CUDA GPU, ``None`` on the CPU.
        total_memory_gib: the GPU's memory, ``None`` on the CPU.
        torch_version: ``torch.__version__``.
        cuda_version: the CUDA toolkit torch was built with, ``None`` for a CPU build.
        cudnn_version: cuDNN's version number, ``None`` without cuDNN.
        dtypes: float16, bfloat16 and TF32 support.
        cpu_capability: the SIMD instruction set torch's CPU kernels use (``"AVX2"`` ...).
        num_threads: ``torch.get_num_threads()``.
    """

    device: str
    name: str
    compute_capability: tuple[int, int] | None
    total_memory_gib: float | None
    torch_version: str
    cuda_version: str | None
    cudnn_version: int | None
    dtypes: tuple[DtypeSupport, ...]
    cpu_capability: str
    num_threads: int

    def _items(self) -> list[tuple[str, str]]:
        # Only what is the same on every CPU machine: printed notebooks must not change.
        cc = self.compute_capability
        items = [("device", f"{self.device} ({self.name})")]
        if cc is not None:
            items.append(("compute capability", f"{cc[0]}.{cc[1]}"))
        if self.total_memory_gib is not None:
            items.append(("memory", f"{self.total_memory_gib:.1f} GiB"))
        items += [
            ("torch", self.torch_version),
            ("CUDA (torch build)", self.cuda_version or "none"),
            ("cuDNN", str(self.cudnn_version) if self.cudnn_version else "none"),
        ]
        items += [(d.name, f"{'yes' if d.supported else 'no'} ({d.note})") for d in self.dtypes]
        return items

    def to_text(self) -> str:
        """Fixed-format text, one ``name: value`` per line."""
        items = self._items()
        width = max(len(k) for k, _ in items)
        return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in items)

    def __str__(self) -> str:
        return self.to_text()


def _runs_in(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a small matmul and softmax run in ``dtype`` on ``device``."""
    try:
        x = torch.ones(4, 4, dtype=dtype, device=device)
        torch.softmax(x @ x, dim=-1)
        return True
    except (RuntimeError, TypeError):
        return False


def _dtype_support(device: torch.device) -> tuple[DtypeSupport, ...]:
    if device.type != "cuda":
        cpu_note = "runs; speed depends on the CPU's instruction set"
        return (
            DtypeSupport("float16", _runs_in(torch.float16, device), cpu_note),
            DtypeSupport("bfloat16", _runs_in(torch.bfloat16, device), cpu_note),
            DtypeSupport("tf32", False, "a CUDA tensor-core format, compute capability >= 8.0"),
        )
    major, _ = torch.cuda.get_device_capability(device)
    tensor_cores = major >= 7
    fp16 = DtypeSupport(
        "float16",
        True,
        "tensor cores" if tensor_cores else "no tensor cores before compute capability 7.0",
    )
    caps = _capabilities(device)  # the one decision of what is native here
    if caps.bfloat16:
        bf16 = DtypeSupport("bfloat16", True, "tensor cores")
    else:
        # Pre-Ampere GPUs (e.g. the T4, 7.5) have no bfloat16 units; torch emulates it slowly.
        bf16 = DtypeSupport(
            "bfloat16", False, "emulated only: no bfloat16 units before compute capability 8.0"
        )
    if caps.tf32:
        # "highest" keeps float32 matmuls in full float32; "high"/"medium" allow TF32.
        on = torch.get_float32_matmul_precision() != "highest"
        tf32 = DtypeSupport(
            "tf32",
            True,
            f"float32 matmuls use it: {'yes' if on else 'no'} (torch.set_float32_matmul_precision)",
        )
    else:
        tf32 = DtypeSupport("tf32", False, "needs compute capability >= 8.0")
    return fp16, bf16, tf32


def device_report(device: str | torch.device | None = None) -> DeviceReport:
    """Describe a device and the torch build.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; defaults to the current CUDA device if
            there is one, else the CPU.

    Returns:
        A :class:`DeviceReport`.
    """
    dev = _resolve_device(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    common: dict[str, Any] = {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": cudnn,
        "dtypes": _dtype_support(dev),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_threads": torch.get_num_threads(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return DeviceReport(
            device=str(dev),
            name=props.name,
            compute_capability=(props.major, props.minor),
            total_memory_gib=props.total_memory / 2**30,
            **common,
        )
    return DeviceReport(
        device=dev.type,
        name=dev.type.upper(),
        compute_capability=None,
        total_memory_gib=None,
        **common,
    )


# ------------------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class BackendStatus:
    """Whether one SDPA backend runs for the given inputs.

    Attributes:
        backend: the ``torch.nn.attention.SDPBackend`` name, e.g. ``"FLASH_ATTENTION"``.
        runs: ``True`` if the call succeeded with only this backend allowed.
        reason: why it cannot run (torch's own explanation, cleaned up); ``""`` when it runs.
    """

    backend: str
    runs: bool
    reason: str = ""


def _describe(t: Tensor | None) -> str:
    if t is None:
        return "None"
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class BackendReport:
    """Which SDPA backends run for one set of arguments.

    Attributes:
        inputs: the arguments, described (shapes, dtypes, mask, dropout, causal, device).
        default: the backend torch picks when all are allowed; ``None`` if torch cannot say.
        backends: one :class:`BackendStatus` per backend, in torch's enum order.
    """

    inputs: str
    default: str | None
    backends: tuple[BackendStatus, ...]

    def status(self, backend: str) -> BackendStatus:
        """The status of one backend, by ``SDPBackend`` name (e.g. ``"FLASH_ATTENTION"``)."""
        for s in self.backends:
            if s.backend == backend:
                return s
        raise ValueError(
            f"unknown backend {backend!r}; known: {[s.backend for s in self.backends]}"
        )

    @property
    def runnable(self) -> list[str]:
        """The names of the backends that run."""
        return [s.backend for s in self.backends if s.runs]

    def __str__(self) -> str:
        width = max((len(s.backend) for s in self.backends), default=0)
        lines = [f"SDPA backends for {self.inputs}", f"torch picks: {self.default or 'unknown'}"]
        lines += [
            f"{s.backend:<{width}}  {'runs' if s.runs else 'no: ' + s.reason}"
            for s in self.backends
        ]
        return "\n".join(lines)


_TRIGGERED = re.compile(r"\s*\(Triggered internally at .*?\)\s*$", re.DOTALL)
_HEADER = re.compile(r"kernel not used because:?$")
_NO_VIABLE = "No viable backend"


def _clean(message: str) -> str:
    """torch's warning text without the C++ source location, on one line."""
    message = _TRIGGERED.sub("", message)
    return " ".join(message.split())


def _try_backend(backend: Any, args: tuple, kwargs: dict, device: torch.device) -> BackendStatus:
    from torch.nn.attention import sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        # Record every warning (not only the first of its kind), without printing any of them.
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*args, **kwargs)
            return BackendStatus(backend.name, True)
        except (
            RuntimeError,
            ValueError,
            TypeError,
            NotImplementedError,
        ) as err:  # the answer we want
            error = _clean(str(err)) or type(err).__name__
    reasons: list[str] = []
    for w in caught:
        text = _clean(str(w.message))
        if text and not _HEADER.search(text) and text not in reasons:
            reasons.append(text)
    if not reasons:
        if error.startswith(_NO_VIABLE):
            # torch only says that nothing was left to run: this backend has no kernel here.
            reasons = [
                f"no {_SHORT.get(backend.name, backend.name)} kernel for {device.type} tensors in this torch build"
            ]
        else:
            reasons = [error]
    return BackendStatus(backend.name, False, "; ".join(reasons))


def sdpa_backends(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> BackendReport:
    """Find which of torch's SDPA backends can run these arguments on this machine.

    Each backend is forced in turn with ``torch.nn.attention.sdpa_kernel`` and
    ``torch.nn.functional.scaled_dot_product_attention`` is called once (a forward pass; when
    gradients are enabled and an input requires them, the backends are checked for that too).
    The warnings torch emits to explain a refusal are recorded as the reason and never printed.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale: exactly as for
            ``torch.nn.functional.scaled_dot_product_attention``.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``; attn_mask broadcasts to
        ``(..., L, S)``. Use small sizes: every backend runs the full computation.

    Returns:
        A :class:`BackendReport`.
    """
    _check_sdpa_args(query, key, value, attn_mask, dropout_p, is_causal, scale)
    backends = _backends()
    if not backends:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs torch >= 2.2)"
        )
    args = (query, key, value)
    kwargs = {
        "attn_mask": attn_mask,
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
    }
    statuses = tuple(_try_backend(b, args, kwargs, query.device) for b in backends)
    return BackendReport(_describe_inputs(args, kwargs), _torch_choice(args, kwargs), statuses)


def _check_sdpa_args(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
) -> None:
    """Reject arguments of the wrong type or range before any backend runs.

    Only what is wrong whatever the backend: whether shapes, dtypes or a mask suit a backend is
    exactly what the report finds out, so those mismatches are recorded, not raised.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        validate.tensor(name, t)
    if attn_mask is not None:
        validate.tensor("attn_mask", attn_mask)
    validate.probability("dropout_p", dropout_p)
    validate.flag("is_causal", is_causal)
    validate.scale(scale)


def _describe_inputs(args: tuple[Tensor, Tensor, Tensor], kwargs: Mapping[str, Any]) -> str:
    """One line naming the shapes, dtypes and options, e.g. ``query (1, 2, 128, 64) float32, ...``."""
    query, key, value = args
    scale = kwargs["scale"]
    return (
        f"query {_describe(query)}, key {_describe(key)}, value {_describe(value)}, "
        f"attn_mask {_describe(kwargs['attn_mask'])}, "
        f"dropout_p {kwargs['dropout_p']}, is_causal {kwargs['is_causal']}"
        + ("" if scale is None else f", scale {scale}")
        + f" on {query.device.type}"
    )


def _torch_choice(args: tuple, kwargs: Mapping[str, Any]) -> str | None:
    """The backend torch's dispatcher picks with every backend allowed; ``None`` if it cannot say.

    ``torch._fused_sdp_choice`` is an internal API: a torch without it, or one that refuses the
    inputs, leaves the answer unknown rather than failing the report.
    """
    from torch.nn.attention import SDPBackend

    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    try:
        return SDPBackend(choose(*args, **kwargs)).name
    except (RuntimeError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------- cases


def default_cases(device: str | torch.device | None = None) -> dict[str, dict[str, Any]]:
    """Typical SDPA arguments, small enough to check every backend in well under a second.

    Args:
        device: where to put the tensors (default as in :func:`device_report`).

    Returns:
        case name -> keyword arguments for :func:`sdpa_backends`: float32 without a mask, causal,
        with a bool mask; float16 causal; bfloat16; dropout; head dim 128 vs 64 for the value.
    """
    dev = _resolve_device(device)
    g = torch.Generator().manual_seed(0)

    def qkv(dtype: torch.dtype = torch.float32, dv: int = 64) -> dict[str, Tensor]:
        shape = (1, 2, 128, 64)  # (B, H, L, D)
        q, k = (torch.randn(shape, generator=g).to(dev, dtype) for _ in range(2))
        v = torch.randn((1, 2, 128, dv), generator=g).to(dev, dtype)
        return {"query": q, "key": k, "value": v}

    keep = torch.ones(128, 128, dtype=torch.bool).tril().to(dev)  # (L, S)
    return {
        "float32": qkv(),
        "float32, causal": {**qkv(), "is_causal": True},
        "float32, bool mask": {**qkv(), "attn_mask": keep},
        "float16, causal": {**qkv(torch.float16), "is_causal": True},
        "bfloat16": qkv(torch.bfloat16),
        "float32, dropout 0.1": {**qkv(), "dropout_p": 0.1},
        "float32, value dim 128": qkv(dv=128),
    }


@dataclass(frozen=True)
class HardwareReport:
    """A :class:`DeviceReport` plus a :class:`BackendReport` per named case.

    ``str()`` prints the device, then a matrix (case × backend: ``yes``/``no``, and the backend
    torch picks), then each distinct reason a backend refused, with the cases it applies to.
    """

    device: DeviceReport
    cases: dict[str, BackendReport] = field(default_factory=dict)

    def _matrix(self) -> tuple[list[str], list[list[str]]]:
        names = [s.backend for s in next(iter(self.cases.values())).backends] if self.cases else []
        header = ["case", "torch picks", *(_SHORT.get(n, n) for n in names)]
        rows = [
            [
                case,
                _SHORT.get(r.default or "", r.default or "unknown"),
                *("yes" if s.runs else "no" for s in r.backends),
            ]
            for case, r in self.cases.items()
        ]
        return header, rows

    def _reasons(self) -> list[str]:
        grouped: dict[tuple[str, str], list[str]] = {}
        for case, r in self.cases.items():
            for s in r.backends:
                if not s.runs:
                    grouped.setdefault((s.backend, s.reason), []).append(case)
        out = []
        for (backend, reason), cases in grouped.items():
            which = "all cases" if len(cases) == len(self.cases) else "; ".join(cases)
            out.append(f"{_SHORT.get(backend, backend)} ({which}): {reason}")
        return out

    def to_text(self) -> str:
        """Fixed-format text: the device, the backend matrix, the reasons."""
        parts = [self.device.to_text()]
        if self.cases:
            header, rows = self._matrix()
            widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
            fmt = "  ".join(f"{{:<{w}}}" for w in widths)
            table = [fmt.format(*header).rstrip()] + [fmt.format(*row).rstrip() for row in rows]
            parts.append("\n".join(["SDPA backends that run:", *table]))
            reasons = self._reasons()
            if reasons:
                parts.append("\n".join(["Why not:", *(f"- {r}" for r in reasons)]))
        return "\n\n".join(parts)

    def __str__(self) -> str:
        return self.to_text()


def hardware_report(
    device: str | torch.device | None = None,
    cases: Mapping[str, Mapping[str, Any]] | Sequence[Any] | None = None,
) -> HardwareReport:
    """Describe the device and check torch's SDPA backends over several inputs.

    Args:
        device: as in :func:`device_report`.
        cases: case name -> keyword arguments of :func:`sdpa_backends`; defaults to
            :func:`default_cases` on ``device``.

    Returns:
        A :class:`HardwareReport`; ``print(report)`` shows it as text.
    """
    dev = _resolve_device(device)
    if cases is None:
        cases = default_cases(dev)
    if not isinstance(cases, Mapping):
        raise TypeError(
            f"cases must be a mapping of name -> sdpa_backends keyword arguments, got {type(cases).__name__}"
        )
    reports = {}
    for name, kwargs in cases.items():
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"cases[{name!r}] must be a mapping of keyword arguments, got {type(kwargs).__name__}"
            )
        reports[str(name)] = sdpa_backends(**kwargs)
    return HardwareReport(device_report(dev), reports)
