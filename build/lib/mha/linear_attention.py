"""Linear attention: a feature map instead of the softmax, so that no ``(L, S)`` matrix is formed.

Softmax attention weighs value ``j`` for query ``i`` by ``exp(q_i · k_j / √D)``, normalised over
``j``. Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs") replaces that
similarity by ``φ(q_i) · φ(k_j)`` for a feature map ``φ`` with positive outputs; here
``φ(x) = elu(x) + 1``. The sums over the keys then regroup:

    out_i = Σ_j (φ(q_i) · φ(k_j)) v_j / Σ_j φ(q_i) · φ(k_j)
          = φ(q_i) (Σ_j φ(k_j)ᵀ v_j) / φ(q_i) (Σ_j φ(k_j))

The ``(D, Dv)`` matrix ``Σ_j φ(k_j)ᵀ v_j`` is computed once and shared by every query, so the
cost is ``O((L + S) · D · Dv)`` time and ``O(D · Dv)`` extra memory instead of ``O(L · S · D)``
and ``O(L · S)``. The price: this is a *different function* from softmax attention, not an
approximation of it; a model must be trained with it.

* :func:`linear_attention` — the ``O(L)`` form (the one to use);
* :func:`linear_attention_weights` — the same weights written out as an ``(L, S)`` matrix, for
  checking and for pictures only (it costs ``O(L · S)`` like softmax attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import validation as validate

__all__ = ["elu_feature_map", "linear_attention", "linear_attention_weights"]


def elu_feature_map(x: Tensor) -> Tensor:
    """``φ(x) = elu(x) + 1``: positive for every input, close to ``x + 1`` for ``x ≥ 0``."""
    validate.tensor("x", x, floating=True)
    return _phi(x)


def _phi(x: Tensor) -> Tensor:
    """:func:`elu_feature_map` on an already checked tensor (linear attention's own calls)."""
    return F.elu(x) + 1.0  # (..., D)


def _features(query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
    """φ(query), φ(key) in float32 for 16-bit inputs (the sums are statistics, as in a softmax)."""
    if query.dtype in validate.LOW_PRECISION:
        query, key = query.float(), key.float()
    return _phi(query), _phi(key)


def linear_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Non-causal linear attention with the feature map ``φ(x) = elu(x) + 1``.

    Args:
        query: the queries.
        key: the keys, with the same head dim as ``query``.
        value: the values, one per key.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)``, value ``(..., S, Dv)`` with the same leading
        dims -> ``(..., L, Dv)``.

    Returns:
        ``out[..., i, :] = Σ_j w_ij v_j`` with ``w_ij = φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j')``;
        the weights of a row are positive and sum to 1, but they are not softmax's weights.
        float16/bfloat16 inputs are computed in float32 and the output is rounded once.
    """
    validate.qkv(query, key, value)
    dtype = value.dtype
    phi_q, phi_k = _features(query, key)  # (..., L, D), (..., S, D), all entries > 0
    v = value.to(phi_k.dtype)  # (..., S, Dv)
    kv = phi_k.transpose(-2, -1) @ v  # (..., D, Dv)  Σ_j φ(k_j)ᵀ v_j, shared by all queries
    z = phi_k.sum(dim=-2).unsqueeze(-1)  # (..., D, 1)  Σ_j φ(k_j)
    num = phi_q @ kv  # (..., L, Dv)
    den = phi_q @ z  # (..., L, 1)   > 0 unless every feature underflowed to 0
    # clamp: where den underflows to 0 so does num, and the row is 0 rather than NaN
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)  # (..., L, Dv)
    return out.to(dtype)


def linear_attention_weights(query: Tensor, key: Tensor) -> Tensor:
    """The ``(L, S)`` weights that :func:`linear_attention` applies without ever forming them.

    Shapes:
        query ``(..., L, D)``, key ``(..., S, D)`` -> ``(..., L, S)``, rows summing to 1.
    """
    validate.qkv(query, key, key)
    phi_q, phi_k = _features(query, key)  # (..., L, D), (..., S, D)
    sim = phi_q @ phi_k.transpose(-2, -1)  # (..., L, S)  φ(q_i)·φ(k_j) > 0
    weights = sim / sim.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(sim.dtype).tiny)
    return weights.to(query.dtype)  # (..., L, S)
