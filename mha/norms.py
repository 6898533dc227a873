"""RMSNorm, the normalisation 2026's models put on each head's queries and keys ("QK-norm").

``rms_norm(x) = x / sqrt(mean(x²) + eps) · weight`` over the last dim. On queries and keys of one
head (``D`` numbers) it bounds the length of every query and key, so a score ``q·k`` can no longer
grow without limit as training pushes the projections up: the logits stay in a range where the
softmax neither saturates nor spikes (Qwen3, Qwen3-Next, OLMo 2, Gemma 3 use it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import validation as validate


def rms_norm(x: Tensor, weight: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """Divide each row by its root mean square, then scale it coordinate-wise by ``weight``.

    Args:
        x: the rows to normalise (e.g. queries ``(B, L, H, D)``: one norm per head and token).
        weight: ``(D,)`` gain per coordinate; ``None`` for the parameter-free norm.
        eps: added to the mean square, so that a zero row stays zero rather than NaN.

    Shapes:
        x ``(..., D)``, weight ``(D,)`` -> ``(..., D)`` in x's dtype (computed in float32 for
        float16/bfloat16, as the models do).
    """
    validate.tensor("x", x, floating=True)
    if weight is not None:
        validate.tensor("weight", weight, floating=True)
        if validate.shape(weight) != validate.shape(x)[-1:]:
            raise ValueError(
                f"weight must have shape (D,) with D = x's last dim, got weight "
                f"{validate.shape(weight)} and x {validate.shape(x)}"
            )
    eps = validate.positive_float("eps", eps)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """:func:`rms_norm` on checked arguments."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    out = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)  # (..., D), RMS 1 per row
    if weight is not None:
        out = out * weight.to(compute)  # (..., D)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned gain ``weight`` (``(D,)``).

    Args:
        dim: ``D``, the normalised (last) dim.
        eps: see :func:`rms_norm`.
        zero_centered: store ``gain - 1`` instead of the gain (Qwen3-Next's and Gemma's
            convention: weight decay then pulls the gain towards 1, not towards 0).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        dim = validate.positive_int("dim", dim)
        self.eps = validate.positive_float("eps", eps)
        self.zero_centered = validate.flag("zero_centered", zero_centered)
        init = torch.zeros(dim) if self.zero_centered else torch.ones(dim)
        self.weight = nn.Parameter(init)

    def forward(self, x: Tensor) -> Tensor:
        gain = self.weight + 1 if self.zero_centered else self.weight  # (D,)
        return rms_norm(x, gain, eps=self.eps)
