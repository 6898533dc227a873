"""Mask helpers: keep-masks (True = may attend) with the documented shapes."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.testing import assert_close

import mha


def test_causal_mask_matches_torch_is_causal():
    q, k, v = (
        torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(i))
        for i, n in enumerate((5, 8, 8))
    )
    assert mha.causal_mask(5, 8).shape == (5, 8)
    assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mha.causal_mask(5, 8)),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


def test_causal_mask_values():
    assert mha.causal_mask(3).tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
    assert mha.causal_mask(2, 3).tolist() == [[True, False, False], [True, True, False]]


def test_bottom_right_matches_torch_causal_lower_right():
    for L, S in ((3, 3), (2, 5), (1, 4)):
        expected = causal_lower_right(L, S)._materialize()
        assert torch.equal(mha.causal_mask_bottom_right(L, S), expected)
    assert mha.causal_mask_bottom_right(1, 4).all()  # one new token sees the whole cache


def test_sliding_window():
    causal = mha.sliding_window_mask(5, window=2)
    assert causal.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, True, True, False, False],
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]
    both = mha.sliding_window_mask(5, window=2, causal=False)
    assert both.tolist()[2] == [False, True, True, True, False]
    assert torch.equal(mha.sliding_window_mask(6, window=6), mha.causal_mask(6))


def test_padding_mask_shape_and_values():
    mask = mha.padding_mask(torch.tensor([3, 1, 0]), 4)
    assert mask.shape == (3, 1, 1, 4) and mask.dtype == torch.bool
    assert mask[:, 0, 0].tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [False] * 4,
    ]
    assert torch.equal(mha.padding_mask([3, 1, 0], 4), mask)


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: mha.causal_mask(0), ValueError, "L must be positive, got 0"),
        (lambda: mha.causal_mask(3.0), TypeError, "L must be an int, got float"),
        (lambda: mha.causal_mask_bottom_right(4, 2), ValueError, "needs S >= L, got L=4 and S=2"),
        (
            lambda: mha.sliding_window_mask(4, window=0),
            ValueError,
            "window must be positive, got 0",
        ),
        (
            lambda: mha.padding_mask(torch.tensor([1.0]), 4),
            TypeError,
            "lengths must hold integers, got dtype torch.float32",
        ),
        (
            lambda: mha.padding_mask(torch.tensor([[1]]), 4),
            ValueError,
            r"lengths must be 1-D \(B,\), got shape \(1, 1\)",
        ),
        (
            lambda: mha.padding_mask(torch.tensor([5, 2]), 4),
            ValueError,
            r"lengths must lie in \[0, S=4\], got min 2 and max 5",
        ),
    ],
)
def test_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
