"""mha.gated_delta_rule against Hugging Face's torch reference for Qwen3-Next, and against itself.

The fixtures (``tests/fixtures/hf/gated_delta_*.npz``, written by ``tools/hf_fixtures.py``) hold
what HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` were called
with, in HF's layout (B, L, H, D) and with q and k *not yet* L2-normalised (HF normalised them,
``use_qk_l2norm_in_kernel=True``), and what they returned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mha

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "hf").glob("gated_delta_*.npz"))


def _load(path: Path) -> dict:
    with np.load(path) as data:
        return {n: torch.from_numpy(data[n]) for n in data.files if data[n].dtype.kind == "f"}


def _ours_layout(x: dict) -> tuple:
    """HF's (B, L, H, D) inputs as ours, (B, H, L, D), with q and k normalised as HF did; fewer
    q/k heads than value heads are repeated, each serving consecutive value heads (HF's order)."""
    q, k = (F.normalize(x[n], dim=-1).transpose(1, 2) for n in ("query", "key"))  # (B, Hk, L, Dk)
    v = x["value"].transpose(1, 2)  # (B, H, L, Dv)
    group = v.shape[1] // k.shape[1]
    q, k = (t.repeat_interleave(group, dim=1) for t in (q, k))  # (B, H, L, Dk)
    g, beta = (x[n].transpose(1, 2) for n in ("g", "beta"))  # (B, H, L)
    return q, k, v, g, beta


def test_fixtures_exist():
    assert len(FIXTURES) == 5, FIXTURES


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk_size", [None, 16, 64, 7])
def test_equals_hf(path, chunk_size):
    x = _load(path)
    q, k, v, g, beta = _ours_layout(x)
    out, state = mha.gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk_size, initial_state=x.get("initial_state"),
        output_final_state=True,
    )  # fmt: skip
    assert_close(out, x["out"].transpose(1, 2), atol=2e-5, rtol=1e-4)  # HF's out (B, L, H, Dv)
    assert_close(state, x["final_state"], atol=2e-5, rtol=1e-4)


def _random(B=2, H=3, L=50, Dk=8, Dv=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, L, Dk, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, L, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, L, Dv, generator=gen, dtype=dtype)
    g = -torch.rand(B, H, L, generator=gen, dtype=dtype)  # log-decays in (-1, 0]
    beta = torch.rand(B, H, L, generator=gen, dtype=dtype)
    state = torch.randn(B, H, Dk, Dv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 50, 64])
def test_chunked_equals_recurrence_float64(chunk_size):
    q, k, v, g, beta, s0 = _random()
    ref, ref_state = mha.gated_delta_rule(
        q, k, v, g, beta, chunk_size=None, initial_state=s0, output_final_state=True
    )
    out, state = mha.gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk_size, initial_state=s0, output_final_state=True
    )
    assert out.dtype == state.dtype == torch.float64
    assert_close(out, ref, atol=1e-12, rtol=1e-10)
    assert_close(state, ref_state, atol=1e-12, rtol=1e-10)


def test_recurrence_is_the_definition():
    """One token by hand: fade, read, correct, then read with q / sqrt(Dk)."""
    q, k, v, g, beta, s0 = _random(B=1, H=1, L=1, Dk=4, Dv=3)
    s = s0[0, 0] * g[0, 0, 0].exp()  # (Dk, Dv)
    k0, v0 = k[0, 0, 0], v[0, 0, 0]
    s = s + torch.outer(k0, beta[0, 0, 0] * (v0 - k0 @ s))  # (Dk, Dv)
    out, state = mha.gated_delta_rule(
        q, k, v, g, beta, chunk_size=None, initial_state=s0, output_final_state=True
    )
    assert_close(state[0, 0], s)
    assert_close(out[0, 0, 0], q[0, 0, 0] @ s / 2.0)


def test_without_gate_and_with_zero_beta():
    """g = 0 and beta = 0 write nothing and forget nothing: the state stays the initial one."""
    q, k, v, g, beta, s0 = _random()
    for chunk_size in (None, 16):
        out, state = mha.gated_delta_rule(
            q, k, v, torch.zeros_like(g), torch.zeros_like(beta), chunk_size=chunk_size,
            initial_state=s0, output_final_state=True,
        )  # fmt: skip
        assert_close(state, s0)
        assert_close(out, q @ s0 / q.shape[-1] ** 0.5)


def test_state_size_is_constant_in_length():
    sizes = set()
    for L in (1, 10, 100, 1000):
        q, k, v, g, beta, _ = _random(B=1, H=2, L=L, dtype=torch.float32)
        _, state = mha.gated_delta_rule(q, k, v, g, beta, chunk_size=64, output_final_state=True)
        sizes.add(tuple(state.shape))
    assert sizes == {(1, 2, 8, 5)}


def test_prompt_in_pieces_equals_whole():
    """Carrying the final state as the next initial_state splits a sequence anywhere (decoding)."""
    q, k, v, g, beta, _ = _random(L=30)
    whole, whole_state = mha.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    outs, state = [], None
    for lo, hi in ((0, 13), (13, 14), (14, 30)):
        out, state = mha.gated_delta_rule(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi], beta[:, :, lo:hi],
            chunk_size=None if hi - lo == 1 else 8, initial_state=state, output_final_state=True,
        )  # fmt: skip
        outs.append(out)
    assert_close(torch.cat(outs, dim=2), whole)
    assert_close(state, whole_state)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_computed_in_float32(dtype):
    q, k, v, g, beta, _ = _random(dtype=torch.float32)
    ref = mha.gated_delta_rule(*(t.to(dtype).float() for t in (q, k, v, g, beta)))
    out, state = mha.gated_delta_rule(
        *(t.to(dtype) for t in (q, k, v, g, beta)), output_final_state=True
    )
    assert out.dtype == dtype and state.dtype == torch.float32
    assert_close(out, ref.to(dtype))


def test_returns_out_only_by_default():
    q, k, v, g, beta, _ = _random(L=5)
    assert isinstance(mha.gated_delta_rule(q, k, v, g, beta), torch.Tensor)


def test_bad_arguments():
    q, k, v, g, beta, s0 = _random(B=2, H=3, L=6, Dk=8, Dv=5)
    with pytest.raises(ValueError, match=r"query must have 4 dims \(B, H, L, D\), got shape"):
        mha.gated_delta_rule(q[0], k, v, g, beta)
    with pytest.raises(ValueError, match=r"query and key must have the same shape.*\(2, 3, 6, 7\)"):
        mha.gated_delta_rule(q, k[..., :7], v, g, beta)
    with pytest.raises(ValueError, match=r"value must have key's \(B, H, L\).*\(2, 3, 5, 5\)"):
        mha.gated_delta_rule(q, k, v[:, :, :5], g, beta)
    with pytest.raises(ValueError, match=r"beta must have shape \(B, H, L\) = \(2, 3, 6\)"):
        mha.gated_delta_rule(q, k, v, g, beta[:, :, :4])
    with pytest.raises(ValueError, match=r"g must have 3 dims"):
        mha.gated_delta_rule(q, k, v, g[..., None], beta)
    with pytest.raises(ValueError, match=r"initial_state must have shape .* = \(2, 3, 8, 5\)"):
        mha.gated_delta_rule(q, k, v, g, beta, initial_state=s0.transpose(-1, -2))
    with pytest.raises(ValueError, match="chunk_size"):
        mha.gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(TypeError, match="value must have a floating dtype"):
        mha.gated_delta_rule(q, k, v.long(), g, beta)
    with pytest.raises(TypeError, match="output_final_state"):
        mha.gated_delta_rule(q, k, v, g, beta, output_final_state=1)
