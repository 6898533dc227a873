"""The dimension walk (mha.lab.shapes): every step's shape checked, and the walk is the layer."""

from __future__ import annotations

import pytest
import torch

import mha
from mha.lab.shapes import print_walk, walk_shapes


def _layer(*args: int, **kwargs: int) -> mha.MultiHeadAttention:
    torch.manual_seed(0)
    return mha.MultiHeadAttention(*args, **kwargs)


def test_self_attention_walk_is_the_layer():
    layer = _layer(6, 3)
    x = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(0))
    rows, out = walk_shapes(layer, x)
    torch.testing.assert_close(out, layer(x)[0])
    table = {code: (letters, shape) for code, letters, shape in rows}
    assert table["  .transpose(1, 2)"] == ("(B, H, L, D)", (1, 3, 3, 2))
    assert table["softmax(scores, dim=-1)"] == ("(B, H, L, S)", (1, 3, 3, 3))
    assert rows[-1] == ("out_proj(concat)", "(B, L, E)", (1, 3, 6))
    assert "key" not in table  # self-attention: no separate key row


def test_cross_attention_and_fewer_kv_heads():
    layer = _layer(8, 4, kdim=5, vdim=3, num_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 8, generator=g), torch.randn(2, 7, 5, generator=g)
    v = torch.randn(2, 7, 3, generator=g)
    rows, _ = walk_shapes(layer, q, k, v)
    table = {code: (letters, shape) for code, letters, shape in rows}
    assert table["key"] == ("(B, S, kdim)", (2, 7, 5))
    assert table["value"] == ("(B, S, vdim)", (2, 7, 3))
    assert table["k.repeat_interleave(H // Hkv, 1)"] == ("(B, H, S, D)", (2, 4, 7, 2))
    assert table["scores = q @ kᵀ / √D"] == ("(B, H, L, S)", (2, 4, 3, 7))


def test_a_wrong_layer_is_caught():
    layer = _layer(6, 3)
    layer.num_heads, layer.head_dim = 2, 3  # a layer whose forward no longer matches its walk
    with pytest.raises(AssertionError):
        walk_shapes(layer, torch.randn(1, 3, 6))


def test_print_walk(capsys):
    rows, _ = walk_shapes(_layer(6, 3), torch.randn(1, 3, 6))
    print_walk(rows[:2], {0: "3×6"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["code", "letters", "shape", "the", "post"]
    assert lines[1].split() == ["query", "(B,", "L,", "E)", "(1,", "3,", "6)", "3×6"]
    assert lines[2].endswith("(1, 3, 6)  —")
    print_walk(rows[:1])
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["code", "letters", "shape"] and row.startswith("query")
