"""Chapter 7's checkers: correct answers written unlike the reference pass, typical wrong answers
fail with their hint, and the autograd shortcut trips without leaving the library patched."""

from __future__ import annotations

import math

import pytest
import torch

import mha
import mha.exercises
from mha import flash
from mha.exercises import ExerciseError, ch07


def _jacobian_softmax_backward(p, dp):
    """The explicit Jacobian, J = diag(p) - p pᵀ per row, times dP (J is symmetric)."""
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)  # (..., L, S, S)
    return (jac @ dp.unsqueeze(-1)).squeeze(-1)  # (..., L, S)


def _einsum_attention_backward(q, k, v, d_out):
    scale = q.shape[-1] ** -0.5
    p = torch.einsum("...ld,...sd->...ls", q, k).mul(scale).softmax(-1)  # (B, H, L, S)
    out = p @ v  # (B, H, L, Dv)
    dp = torch.einsum("...le,...se->...ls", d_out, v)  # (B, H, L, S)
    ds = p * (dp - (d_out * out).sum(-1, keepdim=True))  # D = rowsum(dO * O)
    dq = torch.einsum("...ls,...sd->...ld", ds, k) * scale
    dk = torch.einsum("...ls,...ld->...sd", ds, q) * scale
    dv = torch.einsum("...ls,...le->...se", p, d_out)
    return dq, dk, dv


def _tile_by_division(q, k, lse, scale):
    return (q @ k.mT * scale).exp() / lse.exp()[..., None]


VARIANTS = {
    "check_softmax_backward": [_jacobian_softmax_backward, ch07._softmax_backward_reference],
    "check_attention_backward": [_einsum_attention_backward],
    "check_weights_tile": [_tile_by_division],
}


@pytest.mark.parametrize(
    ("name", "answer"),
    [(name, answer) for name, answers in VARIANTS.items() for answer in answers],
)
def test_correct_variant_passes(name, answer, capsys):
    getattr(mha.exercises, name)(answer)
    assert capsys.readouterr().out.startswith(f"✓ {name}: correct — ")


@pytest.mark.parametrize(
    "answer", [(8192, 4, 2), (8192.0, 3.9, 2.0), (torch.tensor(8192.0).item(), 4.2, 2)]
)
def test_memory_prediction_accepts_rounded_predictions(answer, capsys):
    mha.exercises.check_memory_prediction(*answer)
    assert capsys.readouterr().out.startswith("✓ check_memory_prediction: correct — 8192 MiB")


@pytest.mark.parametrize(
    ("name", "answer", "hint"),
    [
        ("check_softmax_backward", lambda p, dp: p * dp, "rowsum term is missing"),
        (
            "check_softmax_backward",
            lambda p, dp: p * (dp - (p * dp).sum(-2, keepdim=True)),
            r"Sum over the keys \(dim -1\)",
        ),
        (
            "check_softmax_backward",
            lambda p, dp: p * (dp - (p * dp).sum(-1)),
            r"raised RuntimeError.*keepdim=True",
        ),
        (
            "check_softmax_backward",
            lambda p, dp: p * (dp - (p * dp).sum(-1, keepdim=True)).sum(-1, keepdim=True),
            r"J_i = diag\(p_i\) - p_i p_iᵀ",
        ),
        (
            "check_attention_backward",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out, no_delta=True),
            "the -D term",
        ),
        (
            "check_attention_backward",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out, scale_twice=True),
            "applied twice",
        ),
        (
            "check_attention_backward",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out, ds_not_transposed=True),
            r"dK = dSᵀ·Q·scale: transpose dS",
        ),
        (
            "check_attention_backward",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out)[::-1],
            r"dq has shape .*dQ = dS·K·scale",
        ),
        (
            "check_attention_backward",
            lambda q, k, v, d_out: ch07._backward(q, k, v, d_out)[:2],
            r"should return a tuple \(dq, dk, dv\)",
        ),
        (
            "check_weights_tile",
            lambda q, k, lse, scale: torch.softmax(q @ k.mT * scale, -1),
            "divides by this tile's sum",
        ),
        (
            "check_weights_tile",
            lambda q, k, lse, scale: torch.exp(q @ k.mT * scale - lse),
            "must broadcast over the keys",
        ),
        (
            "check_weights_tile",
            lambda q, k, lse, scale: torch.exp(
                q @ k.mT / math.sqrt(q.shape[-1] * 2) - lse[..., None]
            ),
            "P_tile = exp",
        ),
    ],
)
def test_typical_mistakes_fail_with_their_hint(name, answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(answer)


@pytest.mark.parametrize(
    ("answer", "hint"),
    [
        ((2048, 4, 2), "divide the bytes by 2\\*\\*20|4 bytes|32 heads|B·H·L·S"),
        ((8192, 2, 2), "multiplies them by 4"),
        ((8192, 4, 4), "doubling L doubles them"),
        ((8192, 4, 1), "doubling L doubles them"),
        (("8 GiB", 4, 2), "mib should be a number"),
    ],
)
def test_memory_prediction_rejects(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        mha.exercises.check_memory_prediction(*answer)


def _by_autograd(q, k, v, d_out):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), -1) @ v
    return torch.autograd.grad(out, (q, k, v), d_out)


def _by_backward(q, k, v, d_out):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    (torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), -1) @ v).backward(d_out)
    return q.grad, k.grad, v.grad


def _by_flash_backward(q, k, v, d_out):
    out, lse = mha.flash_attention(q, k, v, return_lse=True)
    scale = 1 / math.sqrt(q.shape[-1])
    return flash.flash_attention_backward(
        d_out, q, k, v, out, lse, None, False, scale=scale, block_size=4
    )


@pytest.mark.parametrize("answer", [_by_autograd, _by_backward, _by_flash_backward])
def test_attention_backward_refuses_autograd_and_restores_it(answer):
    originals = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)
    originals += (flash.flash_attention_backward,)
    with pytest.raises(ExerciseError, match="without autograd"):
        mha.exercises.check_attention_backward(answer)
    assert (
        torch.autograd.grad,
        torch.autograd.backward,
        torch.Tensor.backward,
        flash.flash_attention_backward,
    ) == originals
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()
    assert x.grad.tolist() == [3.0, 3.0]
