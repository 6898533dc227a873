"""DeepSeek-V3.2's attention: V3's MLA whose keys a lightning indexer thins to the top k per query.

The **lightning indexer** scores every (query, key) pair cheaply: a few heads (64 in V3.2) of
small queries (128 numbers, from the query's low-rank ``q_resid``), one small key per token (from
``x``, LayerNorm'd, partly rotated), and per query token a weight for each indexer head:

    index_score(i, j) = Σ_h w_h(x_i) · ReLU(q_h,i · k_j) / sqrt(d) / sqrt(n_heads)

DeepSeek computes it in FP8 (with a Hadamard rotation first, which leaves dot products unchanged);
here it is float, as in Hugging Face's module. Each query then attends, with V3's MLA, to its
``index_topk`` (2048) best keys only: :func:`mha.topk_sparse_attention`. Parameter names follow
Hugging Face's ``DeepseekV32Attention`` (the indexer's are ``indexer.wq_b`` etc.).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import validation as validate
from ..sparse import _topk_sparse
from .deepseek_v3 import _REQUIRED, DeepSeekMLA, _mla_arguments, load_weights, rotate


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's indexer: ``index_scores`` ``(B, L, S)`` from ``x`` and the query's latent.

    Args:
        hidden_size: model width ``E``.
        q_lora_rank: width of the query's normed latent ``q_resid``.
        n_heads: indexer heads ``Hi`` (64 in V3.2).
        head_dim: ``Di`` (128); its first ``rope_dim`` numbers are rotated (rotate-half pairs).
        rope_dim: rotated numbers per head (the model's ``qk_rope_head_dim``).
    """

    def __init__(
        self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)  # one key per token
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)  # a weight per head

    def forward(self, x: Tensor, q_resid: Tensor, positions: Tensor, rope: DeepSeekMLA) -> Tensor:
        """Scores of every (query, key) pair of ``x``; the caller applies causality.

        Shapes:
            x ``(B, L, E)``, q_resid ``(B, L, Cq)``, positions ``(B, L)`` -> ``(B, L, L)``.
        """
        B, L, _ = x.shape
        Hi, Di, R = self.n_heads, self.head_dim, self.rope_dim
        q = self.wq_b(q_resid).view(B, L, Hi, Di).transpose(1, 2)  # (B, Hi, L, Di)
        k = self.k_norm(self.wk(x))  # (B, L, Di)
        speeds, factor = cast(Tensor, rope.rope_speeds), rope.rope_factor
        q = torch.cat(
            [rotate(q[..., :R], positions.unsqueeze(1), speeds, factor, False), q[..., R:]], -1
        )
        k = torch.cat([rotate(k[..., :R], positions, speeds, factor, False), k[..., R:]], -1)
        scores = torch.relu(q @ k.unsqueeze(1).transpose(-2, -1)) * Di**-0.5  # (B, Hi, L, L)
        w = self.weights_proj(x) * Hi**-0.5  # (B, L, Hi): how much each indexer head counts
        return torch.einsum("bhls,blh->bls", scores, w)  # (B, L, S): weighted sum over heads


class DeepSeekSparseMLA(DeepSeekMLA):
    """DeepSeek-V3.2's attention: :class:`DeepSeekMLA` attending to each query's top-k keys.

    Args:
        index_topk: keys kept per query (2048 in V3.2).
        index_n_heads, index_head_dim: the indexer's heads and their size.
        The rest as :class:`DeepSeekMLA`; ``q_lora_rank`` is required (the indexer reads the
        query's latent).

    Shapes:
        x ``(B, L, E)`` -> ``(B, L, E)``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        index_topk: int,
        index_n_heads: int,
        index_head_dim: int,
        **mla: Any,
    ) -> None:
        super().__init__(hidden_size, num_heads, **mla)
        if self.q_lora_rank is None:
            raise ValueError(
                "DeepSeek-V3.2's indexer needs q_lora_rank (it reads the query's latent)"
            )
        self.index_topk = validate.positive_int("index_topk", index_topk)
        self.indexer = LightningIndexer(
            hidden_size, self.q_lora_rank, index_n_heads, index_head_dim, self.qk_rope_head_dim
        )

    def forward(  # type: ignore[override]
        self, x: Tensor, positions: Tensor | None = None, *, return_index_scores: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Causal self-attention over ``x``, each query reading its ``index_topk`` best keys.

        Shapes:
            x ``(B, L, E)`` -> ``(B, L, E)`` [and index scores ``(B, L, L)``].
        """
        pos = self._check(x, positions, 0)  # (B, L)
        B, L, _ = x.shape
        H, Dn, R, Dv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # (B, L, Cq): what the indexer reads
        q = self.q_b_proj(q_resid).view(B, L, H, Dn + R).transpose(1, 2)  # (B, H, L, Dn + R)
        q_nope, q_rope = q.split([Dn, R], dim=-1)
        q = torch.cat([q_nope, self._rotate(q_rope, pos.unsqueeze(1))], dim=-1)  # (B, H, L, Dn + R)
        latent, k_rope = self.compress(x, pos)  # (B, L, C), (B, L, R)
        kv = self.kv_b_proj(latent).view(B, L, H, Dn + Dv).transpose(1, 2)  # (B, H, L, Dn + Dv)
        k_nope, v = kv.split([Dn, Dv], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(B, H, L, R)], dim=-1)  # (B, H, L, Dn + R)
        index_scores = self.indexer(x, q_resid, pos, self)  # (B, L, L)
        out = _topk_sparse(q, k, v, index_scores.unsqueeze(1), self.index_topk, True, self.scale)
        out = self.o_proj(out.transpose(1, 2).reshape(B, L, H * Dv))  # (B, L, E)
        return (out, index_scores) if return_index_scores else out


def from_hf(
    config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int = 0
) -> DeepSeekSparseMLA:
    """A :class:`DeepSeekSparseMLA` from a Hugging Face ``DeepseekV32Attention``'s config and
    weights (its own keys, the indexer's included)."""
    need = (*_REQUIRED, "q_lora_rank", "index_topk", "index_n_heads", "index_head_dim")
    mla = _mla_arguments(config, "deepseek_v32", need, layer_idx)
    mla["rope_interleave"] = True  # V3.2's main attention always pairs neighbours
    module = DeepSeekSparseMLA(
        config["hidden_size"],
        config["num_attention_heads"],
        index_topk=config["index_topk"],
        index_n_heads=config["index_n_heads"],
        index_head_dim=config["index_head_dim"],
        **mla,
    )
    load_weights(module, state_dict)
    return module
