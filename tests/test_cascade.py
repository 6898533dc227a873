"""cascade_attention: a shared prefix attended once for the whole batch, each sequence's own keys
packed, the two merged by logsumexp; equal to SDPA over prefix + own keys per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

import mha


def case(Ls, Ss, P, H=4, Hkv=2, D=8, Dv=6, seed=0, dtype=torch.float64):
    """Packed queries, a prefix, packed own keys and values, and both cu_seqlens."""
    query = randn(sum(Ls), H, D, seed=seed, dtype=dtype)  # (total_q, H, D)
    prefix_key = randn(P, Hkv, D, seed=seed + 1, dtype=dtype)  # (P, Hkv, D)
    prefix_value = randn(P, Hkv, Dv, seed=seed + 2, dtype=dtype)
    key = randn(sum(Ss), Hkv, D, seed=seed + 3, dtype=dtype)  # (total_k, Hkv, D)
    value = randn(sum(Ss), Hkv, Dv, seed=seed + 4, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(Ls).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(Ss).cumsum(0).tolist()], dtype=torch.int32)
    return query, prefix_key, prefix_value, key, value, cu_q, cu_k


def reference(query, prefix_key, prefix_value, key, value, Ls, Ss, scale=None):
    """Per sequence: torch's SDPA over prefix + own keys, causal aligned bottom-right over that
    whole length; a query that sees no key gives zeros (the course's contract)."""
    outs, q0, k0 = [], 0, 0
    for L, S in zip(Ls, Ss):
        q = query[q0 : q0 + L].transpose(0, 1)  # (H, L, D)
        k = torch.cat([prefix_key, key[k0 : k0 + S]]).transpose(0, 1)  # (Hkv, P + S, D)
        v = torch.cat([prefix_value, value[k0 : k0 + S]]).transpose(0, 1)
        q0, k0 = q0 + L, k0 + S
        total = k.shape[1]
        keep = torch.arange(total)[None, :] <= torch.arange(L)[:, None] + total - L  # (L, P + S)
        if L and total:
            out = F.scaled_dot_product_attention(q, k, v, keep, scale=scale, enable_gqa=True)
            out = torch.where(keep.any(-1)[:, None], out, 0.0)  # (H, L, Dv)
        else:
            out = q.new_zeros(q.shape[0], L, v.shape[-1])
        outs.append(out.transpose(0, 1))  # (L, H, Dv)
    return torch.cat(outs)


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=5
    ),  # (L_b, S_b): queries and own keys; L_b > S_b reaches into the prefix
    P=st.integers(0, 12),
    groups=st.sampled_from([1, 2, 4]),
    Hkv=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_cascade_equals_sdpa_over_prefix_and_own_keys(seqs, P, groups, Hkv, seed):
    Ls, Ss = [L for L, _ in seqs], [S for _, S in seqs]
    args = case(Ls, Ss, P, H=Hkv * groups, Hkv=Hkv, seed=seed)
    out = mha.cascade_attention(*args)
    assert out.shape == (sum(Ls), Hkv * groups, 6)
    assert_close(out, reference(*args[:5], Ls, Ss))


def test_decode_steps_after_a_long_shared_prompt_with_a_scale_in_float32():
    Ls, Ss = [1, 1, 1, 4, 1], [7, 1, 30, 4, 12]
    args = case(Ls, Ss, P=300, H=8, Hkv=2, D=16, Dv=16, seed=3, dtype=torch.float32)
    out = mha.cascade_attention(*args, scale=0.2)
    assert out.dtype == torch.float32
    assert_close(out, reference(*args[:5], Ls, Ss, scale=0.2), atol=1e-5, rtol=1e-4)


class _PrefixReads(TorchFunctionMode):
    """Counts the matrix products that read the prefix keys (through any view of them)."""

    def __init__(self, prefix: torch.Tensor) -> None:
        super().__init__()
        self.storage, self.calls = prefix.untyped_storage().data_ptr(), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls += any(a.untyped_storage().data_ptr() == self.storage for a in operands)
        return func(*args, **(kwargs or {}))


def test_the_prefix_is_read_once_for_the_whole_batch():
    """One sequence or six: the prefix keys enter the same number of matrix products."""

    def reads(B):
        args = case([1] * B, [5] * B, P=64)
        with _PrefixReads(args[1]) as mode:
            mha.cascade_attention(*args)
        return mode.calls

    assert reads(1) == reads(6) >= 1


def _args():
    return list(case([2, 1], [3, 4], P=5))


def replace(i, value):
    args = _args()
    args[i] = value
    return args


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (replace(0, torch.randn(3, 4, 8)), TypeError, "must share a dtype"),
        (replace(1, randn(5, 1, 8)), ValueError, r"key's .*prefix_key \(5, 1, 8\)"),
        (replace(1, randn(5, 2, 9)), ValueError, r"key's .*prefix_key \(5, 2, 9\)"),
        (replace(2, randn(5, 2, 7)), ValueError, r"prefix_value \(5, 2, 7\)"),
        (replace(2, randn(4, 2, 6)), ValueError, r"one P.*prefix_value \(4, 2, 6\)"),
        (
            replace(1, randn(5, 2, 8).float()),
            TypeError,
            "prefix_key and prefix_value must have key's dtype",
        ),
        (replace(1, randn(2, 5, 2, 8)), ValueError, r"prefix_key must have 3 dims \(P, Hkv, D\)"),
        (replace(3, randn(7, 2, 9)), ValueError, "query and key must have the same head dim"),
        (replace(5, torch.tensor([0, 3], dtype=torch.int32)), ValueError, "same number of seq"),
        (replace(6, torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError, r"key \(7\)"),
        (replace(5, torch.tensor([0, 2, 3])), TypeError, "cu_seqlens_q must be an int32"),
    ],
)
def test_bad_inputs(arguments, error, message):
    with pytest.raises(error, match=message):
        mha.cascade_attention(*arguments)


def test_bad_scale():
    with pytest.raises(TypeError, match="scale must be a float or None"):
        mha.cascade_attention(*_args(), scale="0.5")
