"""mha.TransformerBlock against torch.nn.TransformerEncoderLayer(norm_first=True) with its weights."""

import pytest
import torch
from conftest import randn
from torch import nn
from torch.testing import assert_close

import mha


def torch_layer(E=32, H=4, ffn=48, activation="gelu", **kwargs):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        E,
        H,
        dim_feedforward=ffn,
        dropout=0.0,
        activation=activation,
        norm_first=True,
        batch_first=True,
        dtype=torch.float64,
        **kwargs,
    )
    with torch.no_grad():  # non-trivial norms, so that a swapped or skipped norm shows
        for norm in (layer.norm1, layer.norm2):
            norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
            if norm.bias is not None:
                norm.bias.copy_(0.5 * torch.randn_like(norm.bias))
    return layer.eval()


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
def test_block_matches_torch_encoder_layer(activation, backend):
    ref = torch_layer(activation=activation)
    ours = mha.TransformerBlock.from_torch(ref, backend=backend)
    assert ours.activation == activation and ours.ffn_dim == 48
    x = randn(3, 10, 32)
    assert_close(ours(x), ref(x))


def test_block_causal_matches_torch():
    ref = torch_layer()
    ours = mha.TransformerBlock.from_torch(ref)
    x = randn(2, 9, 32)
    future = nn.Transformer.generate_square_subsequent_mask(9, dtype=torch.float64)  # -inf above
    assert_close(ours(x, is_causal=True), ref(x, src_mask=future, is_causal=True))
    keep = mha.causal_mask(9)
    assert_close(ours(x, attn_mask=keep), ref(x, src_mask=~keep))  # torch: True = masked out


def test_block_without_bias_matches_torch():
    ref = torch_layer(bias=False)
    ours = mha.TransformerBlock.from_torch(ref)
    assert ours.norm1.bias is None and ours.mlp[0].bias is None
    x = randn(2, 7, 32)
    assert_close(ours(x), ref(x))


def test_block_is_residual_pre_norm():
    """Zero output projections make both sublayers add nothing: the block is the identity."""
    block = mha.TransformerBlock(16, 4, dtype=torch.float64)
    with torch.no_grad():
        for lin in (block.attn.out_proj, block.mlp[3]):
            lin.weight.zero_()
            lin.bias.zero_()
    x = randn(2, 5, 16) * 100  # a pre-norm block never normalises the stream itself
    assert_close(block(x), x)


def test_block_decodes_with_a_cache():
    block = mha.TransformerBlock(16, 4, num_kv_heads=2, dtype=torch.float64).eval()
    x = randn(1, 6, 16)
    full = block(x, is_causal=True)
    cache = mha.KVCache()
    steps = [block(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(6)]
    assert_close(torch.cat(steps, dim=1), full)


def test_block_parameters_match_torch():
    ref = torch_layer(E=64, H=8, ffn=256)
    ours = mha.TransformerBlock(64, 8)
    count = sum(p.numel() for p in ours.parameters())
    assert (
        count
        == sum(p.numel() for p in ref.parameters())
        == 4 * 64 * 65 + 2 * 64 * 256 + 256 + 64 + 4 * 64
    )


def test_block_bad_arguments():
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        mha.TransformerBlock(10, 3)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        mha.TransformerBlock(8, 2, activation="tanh")
    block = mha.TransformerBlock(8, 2)
    with pytest.raises(ValueError, match=r"x must have width embed_dim \(8\), got x \(1, 3, 6\)"):
        block(torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match=r"x must have 3 dims \(B, L, E\), got shape \(3, 8\)"):
        block(torch.randn(3, 8))
    with pytest.raises(ValueError, match="norm_first=True"):
        mha.TransformerBlock.from_torch(nn.TransformerEncoderLayer(8, 2, batch_first=True))
    with pytest.raises(TypeError, match="TransformerEncoderLayer, got Linear"):
        mha.TransformerBlock.from_torch(nn.Linear(8, 8))
