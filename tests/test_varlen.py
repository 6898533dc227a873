"""Packed (varlen) attention, compared with torch's SDPA run over each sequence alone."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import mha
from mha.varlen import pack, unpack


def _sdpa_one(q, k, v, is_causal):
    """torch's SDPA over one sequence: (L, H, D), (S, Hkv, D), (S, Hkv, Dv) -> (L, H, Dv)."""
    L, S = q.shape[0], k.shape[0]
    if L == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    if S == 0:  # no key at all: the course's contract (and SDPA's for masked rows) is zeros
        return q.new_zeros(L, q.shape[1], v.shape[-1])
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, L, D) ...
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "NaNs when seq_len_q > seq_len_kv": we compare rows
        mask = causal_lower_right(L, S) if is_causal else None  # torch's bottom-right causal
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # (L, H, Dv)


def _case(lengths_q, lengths_k, H=4, Hkv=2, D=8, Dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, H, D, generator=g, dtype=dtype) for n in lengths_q]
    ks = [torch.randn(n, Hkv, D, generator=g, dtype=dtype) for n in lengths_k]
    vs = [torch.randn(n, Hkv, Dv, generator=g, dtype=dtype) for n in lengths_k]
    return qs, ks, vs


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "lengths_q, lengths_k",
    [
        ([5, 1, 7], [5, 1, 7]),  # self-attention, L = S
        ([2, 3, 1], [6, 3, 9]),  # L < S: new tokens after a cache
        ([6, 4], [2, 4]),  # L > S: the first L - S queries see no key (causal)
        ([3, 0, 4], [3, 0, 4]),  # an empty sequence in the middle
        ([0, 3], [2, 3]),  # a sequence with keys and no query
        ([3, 2], [0, 2]),  # a sequence with queries and no key: zeros
        ([1, 1, 1, 1], [17, 3, 9, 1]),  # decoding: one new token per sequence
    ],
)
def test_equals_sdpa_per_sequence(lengths_q, lengths_k, is_causal):
    qs, ks, vs = _case(lengths_q, lengths_k)
    q, cu_q = pack(qs)
    k, cu_k = pack(ks)
    v, _ = pack(vs)
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, is_causal=is_causal)
    expected = torch.cat([_sdpa_one(*t, is_causal) for t in zip(qs, ks, vs)])
    torch.testing.assert_close(out, expected)
    assert not out.isnan().any()


def test_scale_and_mha_heads():
    qs, ks, vs = _case([4, 6], [4, 6], H=3, Hkv=3, D=5, Dv=5, seed=3)
    q, cu = pack(qs)
    k, _ = pack(ks)
    v, _ = pack(vs)
    out = mha.varlen_attention(q, k, v, cu, cu, scale=0.3)
    for (a, b), qi, ki, vi in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), qs, ks, vs):
        ref = F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (qi, ki, vi)), scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref)


def test_no_token_crosses_a_boundary():
    """Changing every token of sequence 0 leaves sequence 1's outputs alone."""
    qs, ks, vs = _case([4, 5], [4, 5], seed=5)
    q, cu = pack(qs)
    k, _ = pack(ks)
    v, _ = pack(vs)
    out = mha.varlen_attention(q, k, v, cu, cu, is_causal=True)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:4] = 100.0
    out2 = mha.varlen_attention(q2, k2, v2, cu, cu, is_causal=True)
    torch.testing.assert_close(out[4:], out2[4:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_against_float64(dtype):
    qs, ks, vs = _case([7, 3], [9, 3], seed=7)
    q, cu_q = pack(qs)
    k, cu_k = pack(ks)
    v, _ = pack(vs)
    out = mha.varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, is_causal=True)
    assert out.dtype == dtype
    expected = torch.cat([_sdpa_one(*t, True) for t in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_pack_unpack_round_trip():
    qs, _, _ = _case([3, 0, 5], [1, 1, 1])
    packed, cu = pack(qs)
    assert packed.shape == (8, 4, 8) and cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8]
    for a, b in zip(unpack(packed, cu), qs):
        assert torch.equal(a, b)


def _packed():
    qs, ks, vs = _case([2, 3], [4, 3])
    q, cu_q = pack(qs)
    k, cu_k = pack(ks)
    v, _ = pack(vs)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize(
    "bad_q, bad_k, error, message",
    [
        ([1, 3, 5], None, ValueError, r"cu_seqlens_q must start at 0, got 1"),
        ([0, 4, 3, 5], None, ValueError, r"cu_seqlens_q must be non-decreasing.*4 then 3"),
        ([0, 2, 4], None, ValueError, r"cu_seqlens_q must end at the packed length of query \(5\)"),
        (None, [0, 4, 6], ValueError, r"cu_seqlens_k must end at the packed length of key \(7\)"),
        (None, [0, 7], ValueError, r"same number of sequences.*\(3,\) and \(2,\)"),
        ([0, 5], None, ValueError, r"same number of sequences.*\(2,\) and \(3,\)"),
        ([5], None, ValueError, r"cu_seqlens_q must hold B \+ 1 >= 2 offsets"),
    ],
)
def test_bad_cu_seqlens(bad_q, bad_k, error, message):
    q, k, v, cu_q, cu_k = _packed()
    if bad_q is not None:
        cu_q = torch.tensor(bad_q, dtype=torch.int32)
    if bad_k is not None:
        cu_k = torch.tensor(bad_k, dtype=torch.int32)
    with pytest.raises(error, match=message):
        mha.varlen_attention(q, k, v, cu_q, cu_k)


def test_bad_cu_seqlens_types():
    q, k, v, cu_q, cu_k = _packed()
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be an int32 tensor.*torch.int64"):
        mha.varlen_attention(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(TypeError, match=r"cu_seqlens_k must be a torch.Tensor, got list"):
        mha.varlen_attention(q, k, v, cu_q, [0, 4, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have 1 dims \(B \+ 1,\)"):
        mha.varlen_attention(q, k, v, cu_q[None], cu_k)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, is_causal=1)


def test_bad_packed_tensors():
    q, k, v, cu_q, cu_k = _packed()
    with pytest.raises(
        ValueError, match=r"query must have 3 dims \(total_q, H, D\), got shape \(1, 5, 4, 8\)"
    ):
        mha.varlen_attention(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match=r"query's heads \(4\) must be a multiple of key's \(3\)"):
        mha.varlen_attention(q, k.repeat(1, 2, 1)[:, :3], v.repeat(1, 2, 1)[:, :3], cu_q, cu_k)
    with pytest.raises(ValueError, match="query and key must have the same head dim"):
        mha.varlen_attention(q, k[..., :4], v, cu_q, cu_k)
    with pytest.raises(ValueError, match="key and value must have the same total_k and Hkv"):
        mha.varlen_attention(q, k, v[:6], cu_q, cu_k)
    with pytest.raises(TypeError, match="must share a dtype"):
        mha.varlen_attention(q.float(), k, v, cu_q, cu_k)


@pytest.mark.parametrize("is_causal", [False, True])
def test_flex_packed_documents_equals_sdpa_per_sequence(is_causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from mha import flex

    lengths_q, lengths_k = [3, 0, 5, 2], [6, 2, 5, 1]
    qs, ks, vs = _case(lengths_q, lengths_k, Dv=8)
    q, cu_q = pack(qs)
    k, cu_k = pack(ks)
    v, _ = pack(vs)
    mask_mod = flex.packed_documents(cu_q, cu_k, is_causal=is_causal)
    block_mask = create_block_mask(mask_mod, 1, None, q.shape[0], k.shape[0], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention: "without torch.compile"
        out = flex_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),  # (1, H, total, D)
            block_mask=block_mask,
            enable_gqa=True,
        )[0].transpose(0, 1)  # (total_q, H, D)
    expected = torch.cat([_sdpa_one(*t, is_causal) for t in zip(qs, ks, vs)])
    torch.testing.assert_close(out, expected)  # rows that see no key: zeros in both


def test_flex_packed_documents_errors():
    from mha import flex

    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        flex.packed_documents(torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="same number of sequences"):
        flex.packed_documents(
            torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
        )


def test_flex_packed_documents_type_errors():
    from mha import flex

    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor, got list"):
        flex.packed_documents([0, 3])
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 tensor"):
        flex.packed_documents(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3]))
