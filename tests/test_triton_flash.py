"""The Triton FlashAttention kernel (mha.triton_flash) against torch's own attention.

Without a GPU the kernel runs in Triton's interpreter. ``TRITON_INTERPRET=1`` must be set before
the first ``import triton`` of the process: ``@triton.jit`` reads it when it decorates a function,
and Triton decorates its own ``triton.language`` helpers when it is imported. This module sets it
when it is collected, before any test imports Triton. Sizes stay small because the interpreter
runs every program of the grid one after the other in NumPy. Select these tests with
``pytest -m triton``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mha.device import capabilities

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: Triton can only interpret (see above)
CAPS = capabilities(DEVICE)  # reads Triton's version without importing it

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tf(tf):
    """The conftest's ``tf``, skipped on a GPU the installed Triton cannot compile the kernels
    for (a T4 with Triton >= 3.3), with the reason; the interpreter runs them in CI."""
    if DEVICE == "cuda" and not CAPS.triton_native:
        pytest.skip(CAPS.triton_note)
    return tf


def qkv(B, H, L, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g)  # (B, H, L, D)
    k = torch.randn(B, H, S, D, generator=g)  # (B, H, S, D)
    v = torch.randn(B, H, S, D, generator=g)  # (B, H, S, D)
    return (t.to(DEVICE, dtype) for t in (q, k, v))


# --------------------------------------------------------------------------- float32 correctness

CASES = [
    # B, H, L,  S,  D,   causal, block_m, block_n
    (2, 3, 37, 53, 16, False, 16, 16),  # ragged L and S, several programs and key tiles
    (2, 3, 37, 53, 16, True, 16, 16),  # causal with L < S
    (1, 2, 70, 33, 32, True, 32, 16),  # causal with L > S: rows past S see every key
    (1, 2, 64, 64, 64, True, 32, 32),  # lengths that are multiples of the tiles
    (1, 1, 29, 41, 48, False, 16, 32),  # head dim 48, padded to 64 lanes
    (1, 1, 29, 41, 48, True, 32, 16),
    (1, 1, 33, 47, 128, False, None, None),  # head dim 128, default tiles
    (1, 1, 47, 47, 128, True, None, None),
    (1, 2, 21, 19, 8, False, 16, 16),  # head dim below 16, padded to 16 lanes
    (1, 1, 1, 1, 16, True, 16, 16),  # one query, one key
]


@pytest.mark.triton
@pytest.mark.parametrize("B, H, L, S, D, causal, block_m, block_n", CASES)
def test_float32_matches_sdpa(tf, B, H, L, S, D, causal, block_m, block_n):
    q, k, v = qkv(B, H, L, S, D)
    out = tf.triton_attention(q, k, v, is_causal=causal, block_m=block_m, block_n=block_n)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, L, D)
    assert out.shape == (B, H, L, D) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
@settings(max_examples=12, deadline=None)
@given(
    L=st.integers(1, 40),
    S=st.integers(1, 40),
    D=st.sampled_from([16, 24, 32]),
    causal=st.booleans(),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
)
def test_float32_matches_sdpa_property(tf, L, S, D, causal, block_m, block_n):
    q, k, v = qkv(1, 1, L, S, D, seed=L * 1000 + S)
    out = tf.triton_attention(q, k, v, is_causal=causal, block_m=block_m, block_n=block_n)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
def test_custom_scale(tf):
    q, k, v = qkv(1, 2, 24, 40, 32)
    out = tf.triton_attention(q, k, v, is_causal=True, scale=0.3, block_m=16, block_n=16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
def test_strided_inputs_need_no_copy(tf):
    # Multi-head attention produces q, k, v as transposed views (B, L, H, D) -> (B, H, L, D);
    # the kernel reads them through their strides.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 30, 3, 32, generator=g).to(DEVICE).transpose(1, 2)  # (B, H, L, D) view
    kv = torch.randn(2, 45, 2, 3, 32, generator=g).to(DEVICE)  # (B, S, 2, H, D) packed K and V
    k = kv[:, :, 0].transpose(1, 2)  # (B, H, S, D) view
    v = kv[:, :, 1].transpose(1, 2)  # (B, H, S, D) view
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = tf.triton_attention(q, k, v, is_causal=True, block_m=16, block_n=16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the last call
def test_tiles_past_the_diagonal_are_never_read(tf):
    # One query tile of 32 rows, causal: the kernel's loop must stop after key 31. Keys and values
    # from 32 on are NaN; if any of those tiles were loaded, 0 * NaN would poison the output.
    q, k, v = qkv(1, 2, 32, 96, 16)
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    out = tf.triton_attention(q, k, v, is_causal=True, block_m=32, block_n=16)
    assert torch.isfinite(out).all()
    expected = F.scaled_dot_product_attention(q, k[:, :, :32], v[:, :, :32], is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # Ragged last query tile: rows 0..19 only, so the loop stops after the tile holding key 19.
    q, k, v = qkv(1, 1, 20, 96, 16)
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    out = tf.triton_attention(q, k, v, is_causal=True, block_m=32, block_n=16)
    assert torch.isfinite(out).all()
    # Without is_causal every tile is read, and the poison shows: the test can fail.
    assert torch.isnan(tf.triton_attention(q, k, v, block_m=32, block_n=16)).any()


@pytest.mark.triton
def test_empty_inputs(tf):
    q, k, v = qkv(1, 2, 0, 5, 16)
    assert tf.triton_attention(q, k, v).shape == (1, 2, 0, 16)
    # No keys at all: SDPA returns zeros, and so does the kernel (never NaN).
    q, k, v = qkv(1, 2, 5, 0, 16)
    out = tf.triton_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert not out.isnan().any()


# ------------------------------------------------------------------------- low precision

LOW_CASES = [
    (torch.float16, 1, 2, 37, 45, 16, True, 16, 16),
    (torch.float16, 1, 1, 33, 30, 64, False, None, None),
    (torch.float16, 1, 1, 24, 24, 128, True, None, None),
    (torch.bfloat16, 1, 2, 37, 45, 16, True, 16, 16),
    (torch.bfloat16, 1, 1, 33, 30, 64, False, None, None),
    (torch.bfloat16, 1, 1, 24, 24, 48, True, 16, 16),
]


@pytest.mark.triton
@pytest.mark.parametrize("dtype, B, H, L, S, D, causal, block_m, block_n", LOW_CASES)
def test_low_precision_error_like_sdpa(tf, dtype, B, H, L, S, D, causal, block_m, block_n):
    # As in PyTorch's own attention tests: measure both implementations against a float64 run
    # on the same (rounded) inputs and require our error to be of the same size as SDPA's.
    # The allowance of one unit in the last place (eps * |out|) covers the final rounding: the
    # interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest.
    q, k, v = qkv(B, H, L, S, D, dtype=dtype)
    out = tf.triton_attention(q, k, v, is_causal=causal, block_m=block_m, block_n=block_n)
    assert out.dtype == dtype and out.shape == (B, H, L, D)
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    ours = (out.double() - golden).abs().max().item()
    sdpa = (
        (F.scaled_dot_product_attention(q, k, v, is_causal=causal).double() - golden)
        .abs()
        .max()
        .item()
    )
    eps = torch.finfo(dtype).eps
    assert ours <= 2 * sdpa + eps * golden.abs().max().item(), (
        f"max error {ours:.2e}, SDPA's {sdpa:.2e}"
    )
    torch.testing.assert_close(out.double(), golden, atol=4 * eps, rtol=4 * eps)


# ----------------------------------------------------------------------------- the module API


@pytest.mark.triton
@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_backend_triton(tf, causal, num_kv_heads):
    from mha import MultiHeadAttention

    torch.manual_seed(0)
    ref = MultiHeadAttention(64, 4, num_kv_heads=num_kv_heads).to(DEVICE)
    ours = MultiHeadAttention(64, 4, num_kv_heads=num_kv_heads, backend="triton").to(DEVICE)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 19, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        expected, _ = ref(x, is_causal=causal)
        out, _ = ours(x, is_causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
def test_launch_grid_and_loop_bound(tf):
    assert tf.launch_grid(2, 3, 100, 32) == (4, 6)
    assert tf.launch_grid(1, 1, 64, 64) == (1, 1)
    # The causal bound covers every key a row of the tile may see, and no whole tile beyond.
    for L, S, bm, bn in [(100, 100, 32, 16), (37, 90, 16, 32), (90, 37, 32, 32)]:
        keep = torch.ones(L, S, dtype=torch.bool).tril()  # (L, S) causal keep-mask
        for start_m in range(tf.launch_grid(1, 1, L, bm)[0]):
            end = tf.causal_kv_end(start_m, bm, L, S)
            rows = keep[start_m * bm : (start_m + 1) * bm]  # (<= bm, S)
            seen = rows.any(0).nonzero()
            assert int(seen.max()) < end  # nothing visible is skipped
            assert int(seen.max()) >= (end - 1) // bn * bn  # the last visited tile is needed


@pytest.mark.triton
@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda q, k, v: (q[0], k, v),
            ValueError,
            r"query must have 4 dims \(B, H, L\|S, D\), got shape \(2, 5, 16\)",
        ),
        (lambda q, k, v: ([[1.0]], k, v), TypeError, r"query must be a torch.Tensor, got list"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, r"head dim"),
        (
            lambda q, k, v: (q, k, v[:, :, :3]),
            ValueError,
            r"key and value must have the same length S",
        ),
        (
            lambda q, k, v: (q, k, v[..., :8]),
            ValueError,
            r"key and value must have the same shape \(B, H, S, D\)",
        ),
        (
            lambda q, k, v: (q, k[:, :1], v[:, :1]),
            ValueError,
            r"same leading \(batch\) dims, got query \(1, 2, 5, 16\), key \(1, 1, 7, 16\)",
        ),
        (lambda q, k, v: (q, k, v.double()), TypeError, r"float16, bfloat16 or float32"),
        (lambda q, k, v: (q.half(), k, v), TypeError, r"share a dtype"),
        (lambda q, k, v: (q.int(), k, v), TypeError, r"query must be float16"),
    ],
)
def test_bad_input(tf, change, error, match):
    q, k, v = qkv(1, 2, 5, 7, 16)
    with pytest.raises(error, match=match):
        tf.triton_attention(*change(q, k, v))


@pytest.mark.triton
def test_bad_options(tf):
    q, k, v = qkv(1, 1, 5, 7, 16)
    with pytest.raises(ValueError, match=r"block_m must be a power of two >= 16 .*got 24"):
        tf.triton_attention(q, k, v, block_m=24)
    with pytest.raises(ValueError, match=r"block_n must be a power of two >= 16 .*got 8"):
        tf.triton_attention(q, k, v, block_n=8)
    with pytest.raises(TypeError, match=r"block_m must be an int, got float \(16.0\)"):
        tf.triton_attention(q, k, v, block_m=16.0)
    with pytest.raises(ValueError, match=r"block_n must be positive, got 0"):
        tf.triton_attention(q, k, v, block_n=0)
    with pytest.raises(ValueError, match=r"scale must be finite, got nan"):
        tf.triton_attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match=r"scale must be a float or None, got str"):
        tf.triton_attention(q, k, v, scale="big")
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got NoneType"):
        tf.triton_attention(q, k, v, is_causal=None)
    q, k, v = qkv(1, 1, 5, 7, 256)
    with pytest.raises(ValueError, match=r"head dim D must be in \[1, 128\], got D=256"):
        tf.triton_attention(q, k, v)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.triton
@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU without the interpreter")
def test_cpu_tensors_without_interpreter_say_what_to_do():
    pytest.importorskip("triton")
    result = _run(
        "import torch, mha.triton_flash as tf\n"
        "assert not tf.is_interpreted()\n"
        "q = torch.randn(1, 1, 4, 16)\n"
        "try:\n"
        "    tf.triton_attention(q, q, q)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    assert result.returncode == 0, result.stderr
    assert (
        "TRITON_INTERPRET" in result.stdout and "before the first `import triton`" in result.stdout
    )


def test_mha_imports_and_explains_without_triton():
    # Make `import triton` fail, as on a machine without it: mha still imports and works, and
    # the triton backend says what to install.
    result = _run(
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch, mha, mha.exercises\n"
        "import mha.triton_flash as tf\n"
        "assert not tf.HAS_TRITON and not tf.is_interpreted()\n"
        "q = torch.randn(1, 1, 4, 16)\n"
        "for call in (lambda: tf.triton_attention(q, q, q),\n"
        "             lambda: mha.MultiHeadAttention(16, 1, backend='triton')(torch.randn(1, 4, 16))):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("pip install triton" in line for line in lines), result.stdout
