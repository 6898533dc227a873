"""The backward pass of the Triton kernel (mha.triton_flash) against autograd through torch's SDPA.

Without a GPU the kernels run in Triton's interpreter, which must be chosen before the first
``import triton`` of the process (see tests/test_triton_flash.py, whose pattern this follows).
Sizes stay small: the interpreter runs every program of a grid one after the other in NumPy.
Select these tests with ``pytest -m triton``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mha.device import capabilities

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: Triton can only interpret
# A GPU the installed Triton cannot compile the kernels for (a T4 with Triton >= 3.3) skips
# them, saying why; the interpreter runs them in CI.
CAPS = capabilities(DEVICE)

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(DEVICE == "cuda" and not CAPS.triton_native, reason=CAPS.triton_note),
]


def inputs(B, H, L, S, D, dtype=torch.float32, seed=0):
    """q, k, v and an upstream gradient dO, drawn on the CPU, then moved to DEVICE."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L, D), (B, H, S, D), (B, H, S, D), (B, H, L, D)]  # q, k, v, dO
    return [torch.randn(shape, generator=g).to(DEVICE, dtype) for shape in shapes]


def grads(fn, q, k, v, d_out, **kwargs):
    """``(out, dq, dk, dv)`` of ``fn(q, k, v, **kwargs)`` for the upstream gradient ``d_out``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kwargs)
    return (out, *torch.autograd.grad(out, leaves, d_out))


def sdpa_grads(q, k, v, d_out, is_causal=False, scale=None):
    return grads(F.scaled_dot_product_attention, q, k, v, d_out, is_causal=is_causal, scale=scale)


# --------------------------------------------------------------------------- float32 correctness

CASES = [
    # B, H, L,  S,  D,   causal, block_m, block_n
    (2, 1, 37, 53, 24, False, 16, 16),  # ragged L and S, D not a power of two, several tiles
    (1, 2, 37, 53, 24, True, 16, 16),  # causal with L < S: keys past L get zero gradients
    (1, 2, 70, 33, 32, True, 32, 16),  # causal with L > S: rows past S see every key
    (1, 1, 64, 64, 64, True, 16, 32),  # lengths that are multiples of the tiles, BLOCK_M < N
    (1, 1, 33, 47, 128, True, None, None),  # head dim 128, default tiles
    (1, 2, 21, 19, 8, False, 16, 16),  # head dim below 16, padded to 16 lanes
    (1, 1, 1, 1, 16, True, 16, 16),  # one query, one key
]


@pytest.mark.parametrize("B, H, L, S, D, causal, block_m, block_n", CASES)
def test_float32_gradients_match_sdpa(tf, B, H, L, S, D, causal, block_m, block_n):
    q, k, v, d_out = inputs(B, H, L, S, D)
    tiles = {"block_m": block_m, "block_n": block_n}
    ours = grads(tf.triton_attention, q, k, v, d_out, is_causal=causal, **tiles)
    theirs = sdpa_grads(q, k, v, d_out, is_causal=causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=8, deadline=None)
@given(
    L=st.integers(1, 40),
    S=st.integers(1, 40),
    D=st.sampled_from([16, 24]),
    causal=st.booleans(),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
)
def test_float32_gradients_property(tf, L, S, D, causal, block_m, block_n):
    q, k, v, d_out = inputs(1, 1, L, S, D, seed=L * 1000 + S)
    tiles = {"block_m": block_m, "block_n": block_n}
    ours = grads(tf.triton_attention, q, k, v, d_out, is_causal=causal, **tiles)
    for a, b in zip(ours, sdpa_grads(q, k, v, d_out, is_causal=causal)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_custom_scale_and_strided_inputs(tf):
    # Head-split views (B, L, H, D) -> (B, H, L, D) and an expanded upstream gradient (stride 0,
    # what `out.sum().backward()` sends): the kernels read everything through its strides.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 30, 2, 24, generator=g).to(DEVICE).transpose(1, 2)  # (B, H, L, D) view
    kv = torch.randn(1, 45, 2, 2, 24, generator=g).to(DEVICE)  # (B, S, 2, H, D) packed K and V
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, H, S, D) views
    d_out = torch.ones(1, 1, 1, 1, device=DEVICE).expand(1, 2, 30, 24)  # (B, H, L, D), stride 0
    assert not any(t.is_contiguous() for t in (q, k, v, d_out))
    tiles = {"block_m": 16, "block_n": 16}
    ours = grads(tf.triton_attention, q, k, v, d_out, is_causal=True, scale=0.3, **tiles)
    theirs = sdpa_grads(q, k, v, d_out, is_causal=True, scale=0.3)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(37, 53), (70, 33)])
def test_forward_saves_the_logsumexp(tf, L, S, causal):
    # Natural-log units, like mha.flash_attention(return_lse=True): logsumexp of the scaled,
    # causally masked scores of each row.
    q, k, v, _ = inputs(1, 2, L, S, 24)
    out, lse, tiles = tf._forward(q, k, v, causal, 0.2, 16, 16, False)
    scores = q @ k.transpose(-2, -1) * 0.2  # (B, H, L, S)
    if causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=DEVICE).tril()  # (L, S)
        scores = scores.masked_fill(~keep, float("-inf"))
    assert lse.shape == (1, 2, L) and lse.dtype == torch.float32 and tiles == (16, 16)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)
    no_key = tf._forward(q, k[:, :, :0], v[:, :, :0], causal, 0.2, 16, 16, False)[1]
    assert torch.isneginf(no_key).all()  # S = 0: a row that sees no key has lse = -inf


# ------------------------------------------------------------------------- low precision

LOW_CASES = [
    (torch.float16, 1, 2, 37, 45, 24, True, 16, 16),
    (torch.float16, 1, 1, 33, 30, 64, False, None, None),
    (torch.bfloat16, 1, 2, 37, 45, 24, True, 16, 16),
    (torch.bfloat16, 1, 1, 24, 24, 48, True, 16, 16),
]


@pytest.mark.parametrize("dtype, B, H, L, S, D, causal, block_m, block_n", LOW_CASES)
def test_low_precision_gradients_error_like_sdpa(
    tf, dtype, B, H, L, S, D, causal, block_m, block_n
):
    # As the forward tests: both implementations against a float64 run on the same rounded
    # inputs; our error must be of the size of SDPA's own (plus one unit in the last place of
    # the largest gradient, for the final rounding, which the interpreter truncates).
    q, k, v, d_out = inputs(B, H, L, S, D, dtype=dtype)
    tiles = {"block_m": block_m, "block_n": block_n}
    ours = grads(tf.triton_attention, q, k, v, d_out, is_causal=causal, **tiles)
    theirs = sdpa_grads(q, k, v, d_out, is_causal=causal)
    golden = sdpa_grads(*(t.double() for t in (q, k, v, d_out)), is_causal=causal)
    eps = torch.finfo(dtype).eps
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, theirs, golden):
        assert a.dtype == dtype and a.shape == c.shape, name
        err, err_sdpa = ((t.double() - c).abs().max().item() for t in (a, b))
        allowed = 2 * err_sdpa + eps * c.abs().max().item()
        assert err <= allowed, f"{name}: max error {err:.2e}, SDPA's {err_sdpa:.2e}"


# ---------------------------------------------------------------------- tiles the backward skips


def test_causal_loop_start_of_the_dkdv_kernel(tf):
    # Key tile j's loop visits the query tiles from causal_q_start on: every row that sees one
    # of its keys is visited, and the first visited query tile is needed.
    for L, S, bm, bn in [(100, 100, 32, 16), (37, 90, 16, 32), (90, 37, 32, 32), (64, 64, 16, 16)]:
        keep = torch.ones(L, S, dtype=torch.bool).tril()  # (L, S) causal keep-mask
        for start_n in range(tf.launch_grid(1, 1, S, bn)[0]):
            start = tf.causal_q_start(start_n, bn, bm)
            assert start % bm == 0  # a whole query tile
            rows = keep[:, start_n * bn : (start_n + 1) * bn].any(1).nonzero()  # rows that see it
            if len(rows) == 0:
                assert start >= L  # keys past L: the loop is empty, dK = dV = 0
                continue
            assert int(rows.min()) >= start  # nothing visible is skipped
            assert int(rows.min()) < start + bm  # the first visited tile is needed
    # Loop trips, L = S = 64 in tiles of 16: the causal dK/dV kernel visits the 10 (query tile,
    # key tile) pairs on and below the diagonal of 4 x 4, as the forward and dQ kernels do.
    trips = sum(len(range(tf.causal_q_start(j, 16, 16), 64, 16)) for j in range(4))
    forward = sum(len(range(0, tf.causal_kv_end(i, 16, 64, 64), 16)) for i in range(4))
    assert trips == forward == 10


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy, on the NaN the tests plant
def test_backward_never_reads_tiles_above_the_diagonal(tf):
    # dK/dV pass: query rows 0..31 are NaN. Key tiles from 32 on start their loop at query row
    # 32, so their dK and dV stay finite; so do dQ of rows 32.. (their own rows and finite keys).
    q, k, v, d_out = inputs(1, 1, 64, 64, 16)
    q[:, :, :32] = float("nan")
    tiles = {"block_m": 32, "block_n": 32}
    _, dq, dk, dv = grads(tf.triton_attention, q, k, v, d_out, is_causal=True, **tiles)
    assert all(torch.isfinite(t[:, :, 32:]).all() for t in (dq, dk, dv))
    assert torch.isnan(dk[:, :, :32]).any()  # the poison is real where it is read
    # Without is_causal every key tile reads every query tile: the test can fail.
    _, _, dk_full, _ = grads(tf.triton_attention, q, k, v, d_out, **tiles)
    assert torch.isnan(dk_full[:, :, 32:]).any()

    # dQ pass: 32 queries, keys and values from 32 on are NaN. The dQ kernel stops at key 31;
    # the dK/dV programs of keys 32.. have no query to visit and return exact zeros.
    q, k, v, d_out = inputs(1, 1, 32, 96, 16)
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    _, dq, dk, dv = grads(tf.triton_attention, q, k, v, d_out, is_causal=True, **tiles)
    assert torch.isfinite(dq).all()
    assert (dk[:, :, 32:] == 0).all() and (dv[:, :, 32:] == 0).all()
    ref = sdpa_grads(q, k[:, :, :32], v[:, :, :32], d_out, is_causal=True)
    for a, b in zip((dq, dk[:, :, :32], dv[:, :, :32]), ref[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- the autograd API


def test_autograd_function(tf):
    q, k, v, d_out = inputs(1, 1, 20, 20, 16)
    assert tf.triton_attention(q, k, v).grad_fn is None  # nothing requires grad: plain forward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        assert tf.triton_attention(*leaves).grad_fn is None
    out = tf.triton_attention(*leaves, is_causal=True)
    assert type(out.grad_fn).__name__ == "_TritonAttentionBackward"
    # Only the query needs a gradient: the others come back as None from autograd.
    q_only = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(tf.triton_attention(q_only, k, v), q_only, d_out)
    torch.testing.assert_close(dq, sdpa_grads(q, k, v, d_out)[1], atol=1e-5, rtol=1e-4)
    # The backward is not itself differentiable, and says so.
    out = tf.triton_attention(*leaves)
    d_out = d_out.clone().requires_grad_()  # a gradient that itself needs a gradient
    dq, *_ = torch.autograd.grad(out, leaves, d_out, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_empty_inputs_give_zero_gradients(tf):
    for L, S in [(0, 5), (5, 0)]:
        q, k, v, d_out = inputs(1, 2, L, S, 16)
        out, dq, dk, dv = grads(tf.triton_attention, q, k, v, d_out)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert not any(t.isnan().any() or t.abs().sum() != 0 for t in (dq, dk, dv))


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_backend_triton_trains(tf, causal):
    from mha import MultiHeadAttention

    torch.manual_seed(0)
    ref = MultiHeadAttention(32, 4, num_kv_heads=2).to(DEVICE)
    ours = MultiHeadAttention(32, 4, num_kv_heads=2, backend="triton").to(DEVICE)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for layer in (ref, ours):
        out, _ = layer(x, is_causal=causal)
        out.square().mean().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------------------ GPU only


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (the kernels compiled natively)")
@pytest.mark.parametrize("causal", [False, True])
def test_float16_gradients_on_gpu(tf, causal):
    q, k, v, d_out = inputs(2, 4, 1000, 1000, 64, dtype=torch.float16)
    ours = grads(tf.triton_attention, q, k, v, d_out, is_causal=causal)
    theirs = sdpa_grads(q, k, v, d_out, is_causal=causal)
    golden = sdpa_grads(*(t.double() for t in (q, k, v, d_out)), is_causal=causal)
    eps = torch.finfo(torch.float16).eps
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, theirs, golden):
        err, err_sdpa = ((t.double() - c).abs().max().item() for t in (a, b))
        allowed = 2 * err_sdpa + eps * c.abs().max().item()
        assert err <= allowed, f"{name}: max error {err:.2e}, SDPA's {err_sdpa:.2e}"
