"""mha.expect_error: shows a deliberate error and lets the notebook go on, but only that error."""

from __future__ import annotations

import pytest

import mha
from mha.lab.demo import format_error


def test_prints_type_and_message_and_goes_on(capsys):
    animals = {"cat": 1}
    with mha.expect_error(KeyError) as caught:
        animals["kitten"]
    assert capsys.readouterr().out == "KeyError: 'kitten'\n"
    assert isinstance(caught.value, KeyError)
    assert caught.message == "KeyError: 'kitten'"


def test_accepts_subclasses_and_tuples(capsys):
    with mha.expect_error(LookupError):
        [].pop()
    with mha.expect_error((TypeError, ValueError)):
        int("seven")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "IndexError: pop from empty list",
        "ValueError: invalid literal for int() with base 10: 'seven'",
    ]


def test_no_error_fails_loudly(capsys):
    nothing = "expected KeyError, but the block raised nothing"
    with pytest.raises(AssertionError, match=nothing), mha.expect_error(KeyError):
        {"kitten": 1}["kitten"]
    assert capsys.readouterr().out == ""


def test_another_error_fails_and_keeps_the_cause(capsys):
    other = "expected KeyError, but the block raised ValueError: no"
    with pytest.raises(AssertionError, match=other) as info, mha.expect_error(KeyError):
        raise ValueError("no")
    assert isinstance(info.value.__cause__, ValueError)
    assert capsys.readouterr().out == ""


def test_match_checks_the_message(capsys):
    with mha.expect_error(ValueError, match=r"head dim"):
        raise ValueError("query and key must have the same head dim")
    assert capsys.readouterr().out == "ValueError: query and key must have the same head dim\n"
    with (
        pytest.raises(AssertionError, match="matching 'mask'"),
        mha.expect_error(ValueError, match="mask"),
    ):
        raise ValueError("wrong head dim")


def test_keyboard_interrupt_is_not_swallowed():
    with pytest.raises(KeyboardInterrupt), mha.expect_error(ValueError):
        raise KeyboardInterrupt


def test_a_real_mha_error_is_shown():
    import torch

    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 6, 9)
    with mha.expect_error(ValueError, match="same head dim") as caught:
        mha.scaled_dot_product_attention(q, k, k)
    assert caught.message.startswith("ValueError: query and key must have the same head dim")


def test_format_error_without_a_message():
    assert format_error(StopIteration()) == "StopIteration"
