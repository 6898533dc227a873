"""Bad input raises ValueError/TypeError naming the argument and the shapes, never NaN or assert."""

import pytest
import torch
from torch import nn

import mha


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


ATTENTION_CASES = [
    (
        (t(2, 4, 8), t(2, 4, 9), t(2, 4, 9)),
        {},
        ValueError,
        r"query and key must have the same head dim, got query \(2, 4, 8\) and key \(2, 4, 9\)",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 6, 8)),
        {},
        ValueError,
        r"key and value must have the same length S, got key \(2, 5, 8\) and value \(2, 6, 8\)",
    ),
    (
        (t(2, 4, 8), t(3, 4, 8), t(3, 4, 8)),
        {},
        ValueError,
        r"same leading \(batch\) dims, got query \(2, 4, 8\), key \(3, 4, 8\) and value \(3, 4, 8\)",
    ),
    (
        (t(8), t(4, 8), t(4, 8)),
        {},
        ValueError,
        r"query must have at least 2 dims .* got shape \(8,\)",
    ),
    (
        (t(2, 4, 8), t(2, 4, 8, dtype=torch.float64), t(2, 4, 8)),
        {},
        TypeError,
        "query, key and value must share a dtype, got torch.float32, torch.float64 and torch.float32",
    ),
    (
        (t(2, 4, 8, dtype=torch.int64), t(2, 4, 8), t(2, 4, 8)),
        {},
        TypeError,
        "query must have a floating dtype, got torch.int64",
    ),
    (([[1.0]], t(4, 8), t(4, 8)), {}, TypeError, "query must be a torch.Tensor, got list"),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"attn_mask": torch.ones(4, 4, dtype=torch.bool)},
        ValueError,
        r"attn_mask of shape \(4, 4\) is not broadcastable to the scores \(2, 4, 5\)",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"attn_mask": torch.ones(3, 4, 5, dtype=torch.bool)},
        ValueError,
        r"attn_mask of shape \(3, 4, 5\) is not broadcastable to the scores \(2, 4, 5\)",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"attn_mask": torch.ones(4, 5, dtype=torch.int64)},
        TypeError,
        "attn_mask must be bool .* or floating .*, got dtype torch.int64",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"scale": "big"},
        TypeError,
        "scale must be a float or None, got str",
    ),
]


@pytest.mark.parametrize("fn", [mha.scaled_dot_product_attention, mha.flash_attention])
@pytest.mark.parametrize("args,kwargs,error,message", ATTENTION_CASES)
def test_attention_errors(fn, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        fn(*args, **kwargs)


def test_dropout_and_block_size_errors():
    q = t(2, 4, 8)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        mha.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        mha.flash_attention(q, q, q, block_size=0)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            {"embed_dim": 10, "num_heads": 3},
            ValueError,
            r"embed_dim \(10\) must be divisible by num_heads \(3\)",
        ),
        (
            {"embed_dim": 12, "num_heads": 6, "num_kv_heads": 4},
            ValueError,
            r"num_heads \(6\) must be divisible by num_kv_heads \(4\)",
        ),
        ({"embed_dim": 12, "num_heads": 0}, ValueError, "num_heads must be positive, got 0"),
        ({"embed_dim": 12.0, "num_heads": 3}, TypeError, "embed_dim must be an int, got float"),
        (
            {"embed_dim": 12, "num_heads": 3, "backend": "cuda"},
            ValueError,
            "unknown backend 'cuda'; choose one of math, sdpa, flash, triton",
        ),
        (
            {"embed_dim": 12, "num_heads": 3, "dropout": 1.0},
            ValueError,
            r"dropout must be in \[0, 1\), got 1.0",
        ),
        (
            {"embed_dim": 12, "num_heads": 3, "dropout": 0.1, "backend": "flash"},
            ValueError,
            "backend 'flash' has no attention dropout",
        ),
        (
            {"embed_dim": 9, "num_heads": 3, "rope": True},
            ValueError,
            r"rope rotates pairs and needs an even head dim, got embed_dim \(9\) / num_heads \(3\) = 3",
        ),
    ],
)
def test_module_construction_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        mha.MultiHeadAttention(**kwargs)


def test_forward_errors():
    model = mha.MultiHeadAttention(12, 3, kdim=5)
    x = t(2, 4, 12)
    with pytest.raises(
        ValueError, match=r"query must be batch-first \(B, length, width\), got shape \(4, 12\)"
    ):
        model(t(4, 12), t(2, 4, 5), t(2, 4, 12))
    with pytest.raises(
        ValueError, match=r"query must have width 12 \(embed_dim\), got shape \(2, 4, 10\)"
    ):
        model(t(2, 4, 10), t(2, 4, 5), t(2, 4, 12))
    with pytest.raises(ValueError, match=r"key must have width 5 \(kdim\), got shape \(2, 4, 12\)"):
        model(x)
    with pytest.raises(
        ValueError, match=r"same batch size, got query \(2, 4, 12\), key \(3, 4, 5\)"
    ):
        model(x, t(3, 4, 5), t(3, 4, 12))
    with pytest.raises(
        ValueError,
        match=r"attn_mask of shape \(3, 1, 1, 4\) is not broadcastable to the scores \(2, 3, 4, 4\)",
    ):
        model(x, t(2, 4, 5), t(2, 4, 12), attn_mask=torch.ones(3, 1, 1, 4, dtype=torch.bool))


def test_kv_cache_rejects_mismatched_steps():
    cache = mha.KVCache()
    cache.update(t(2, 4, 3, 8), t(2, 4, 3, 8))
    with pytest.raises(
        ValueError, match=r"new keys \(2, 2, 1, 8\) do not match the cached keys \(2, 4, 3, 8\)"
    ):
        cache.update(t(2, 2, 1, 8), t(2, 2, 1, 8))


def test_from_torch_errors():
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention, got Linear"):
        mha.MultiHeadAttention.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="batch_first=True"):
        mha.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2))
