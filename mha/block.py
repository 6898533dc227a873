"""A pre-norm Transformer block: the course's attention where a model uses it.

A Transformer stacks one block many times. Each block has two sublayers, and each sublayer reads a
normalised copy of the running stream and *adds* its result back (a residual connection)::

    x = x + attention(norm1(x))        # tokens exchange information
    x = x + mlp(norm2(x))              # each token is transformed on its own

"Pre-norm" puts the normalisation at the entrance of each sublayer, as GPT-2 and Llama do; the
original Transformer normalised after the addition ("post-norm"). The stream itself is never
normalised inside the block, so the block can start out as (almost) the identity, which is what
lets deep stacks train.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import validation as validate
from .multihead import KVCacheProtocol, MultiHeadAttention

__all__ = ["TransformerBlock"]

ACTIVATIONS = ("gelu", "relu")


class TransformerBlock(nn.Module):
    """One pre-norm Transformer block: attention and an MLP, each inside a residual connection.

    Args:
        embed_dim: model width ``E``.
        num_heads: attention heads ``H`` (``E`` must be divisible by ``H``).
        ffn_dim: width of the MLP's hidden layer; ``4 * embed_dim`` by default, as in the
            original Transformer and GPT-2.
        dropout: dropout on the attention weights and after each sublayer, while training.
        activation: the MLP's nonlinearity, ``"gelu"`` (GPT-2) or ``"relu"`` (the original paper).
        norm_eps: the ``eps`` of both ``LayerNorm``s.
        bias: whether the linear layers and the norms have biases.
        num_kv_heads: key/value heads of the attention (grouped-query attention).
        backend: the attention's backend, as in :class:`mha.MultiHeadAttention`.

    Shapes:
        x ``(B, L, E)`` → out ``(B, L, E)``: a block never changes the shape, which is what lets
        a model stack it.

    ``forward``'s ``attn_mask`` and ``is_causal`` go to the attention unchanged (a keep-mask:
    ``True`` = may attend), and so does ``kv_cache`` for decoding token by token.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int | None = None,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        norm_eps: float = 1e-5,
        bias: bool = True,
        num_kv_heads: int | None = None,
        backend: str = "math",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        embed_dim = validate.positive_int("embed_dim", embed_dim)
        ffn_dim = 4 * embed_dim if ffn_dim is None else validate.positive_int("ffn_dim", ffn_dim)
        dropout = validate.probability("dropout", dropout)
        validate.one_of("activation", activation, ACTIVATIONS)
        eps = validate.positive_float("norm_eps", norm_eps)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(embed_dim, eps=eps, bias=bias, **factory)
        self.attn = MultiHeadAttention(
            embed_dim,
            num_heads,
            bias=bias,
            dropout=dropout,
            num_kv_heads=num_kv_heads,
            backend=backend,
            **factory,
        )
        self.norm2 = nn.LayerNorm(embed_dim, eps=eps, bias=bias, **factory)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, ffn_dim, bias=bias, **factory),  # up: E -> ffn_dim
            nn.GELU() if activation == "gelu" else nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(ffn_dim, embed_dim, bias=bias, **factory),  # down: ffn_dim -> E
        )
        self.drop = nn.Dropout(dropout)
        self.embed_dim, self.ffn_dim, self.activation = embed_dim, ffn_dim, activation

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, ffn_dim={self.ffn_dim}, activation={self.activation!r}"

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCacheProtocol | None = None,
    ) -> Tensor:
        """Apply the block to ``x`` of shape ``(B, L, E)``; returns ``(B, L, E)``."""
        validate.tensor("x", x, floating=True, ndim=3, layout="(B, L, E)")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have width embed_dim ({self.embed_dim}), got x {tuple(x.shape)}"
            )
        h = self.norm1(x)  # (B, L, E), normalised per token
        a, _ = self.attn(h, attn_mask=attn_mask, is_causal=is_causal, kv_cache=kv_cache)
        x = x + self.drop(a)  # residual: (B, L, E)
        return x + self.drop(self.mlp(self.norm2(x)))  # residual: (B, L, E)

    @classmethod
    def from_torch(
        cls, layer: nn.TransformerEncoderLayer, *, backend: str = "math"
    ) -> TransformerBlock:
        """Build a block with the weights of a ``nn.TransformerEncoderLayer``.

        The layer must be built with ``norm_first=True`` (pre-norm) and ``batch_first=True``, with
        a ReLU or GELU activation. Its bool masks mean "masked out"; pass ``~mask`` to ours.
        """
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(
                f"layer must be a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}"
            )
        if not (layer.norm_first and layer.self_attn.batch_first):
            raise ValueError(
                "layer must be built with norm_first=True and batch_first=True, got "
                f"norm_first={layer.norm_first}, batch_first={layer.self_attn.batch_first}"
            )
        act = layer.activation
        if act is nn.functional.gelu or isinstance(act, nn.GELU):
            activation = "gelu"
        elif act is nn.functional.relu or isinstance(act, nn.ReLU):
            activation = "relu"
        else:
            raise ValueError(f"layer's activation must be relu or gelu, got {act!r}")
        ref = layer.linear1.weight
        ours = cls(
            layer.self_attn.embed_dim,
            layer.self_attn.num_heads,
            layer.linear1.out_features,
            dropout=layer.dropout.p,
            activation=activation,
            norm_eps=layer.norm1.eps,
            bias=layer.linear1.bias is not None,
            backend=backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        ours.attn = MultiHeadAttention.from_torch(layer.self_attn, backend=backend)
        pairs = (
            (ours.norm1, layer.norm1),
            (ours.norm2, layer.norm2),
            (ours.mlp[0], layer.linear1),
            (ours.mlp[3], layer.linear2),
        )
        for mine, theirs in pairs:
            mine.load_state_dict(theirs.state_dict())  # weight and bias: the same keys
        return ours
