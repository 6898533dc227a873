"""Attention across processes (mha/distributed.py), run in real gloo process groups on 127.0.0.1.

Each world size is started once (spawning processes that import torch is the slow part) and runs
every job; the gathered outputs are compared with torch's own operators over the full sequence:
``F.scaled_dot_product_attention`` for ring attention, ``nn.MultiheadAttention`` (or torch's
linear + SDPA) for the tensor-parallel heads. Every launch is bounded in time, and a failing or
hanging process is killed, never waited for.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mha
from mha import distributed
from mha.lab import processes

# Each launch is bounded in time, and up to four processes share the cores: none runs beside
# another test (make test-unit runs these in a pytest without -n).
pytestmark = pytest.mark.serial

B, H, HKV, L, D = 2, 4, 2, 24, 8
E = H * D
CASES = [  # (name, ring options, GQA)
    ("full", {}, False),
    ("causal", {"is_causal": True}, False),
    ("gqa causal", {"is_causal": True, "enable_gqa": True}, True),
    ("scaled", {"scale": 0.3}, False),
    ("zigzag causal", {"is_causal": True, "layout": "zigzag"}, False),
]


def _inputs(gqa: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hkv = HKV if gqa else H
    return (
        torch.randn(B, H, L, D, generator=g),
        torch.randn(B, hkv, L, D, generator=g),
        torch.randn(B, hkv, L, D, generator=g),
    )


def _torch_mha() -> tuple[nn.MultiheadAttention, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(1))
    return module, x


def _gqa_module(rope: bool = False) -> tuple[dict, dict]:
    config = {"embed_dim": E, "num_heads": H, "num_kv_heads": HKV, "rope": rope}
    torch.manual_seed(2)
    return config, mha.MultiHeadAttention(**config).state_dict()


def _jobs(world: int) -> list:
    jobs = [(processes.ring_job, (*_inputs(gqa), options)) for _, options, gqa in CASES]
    torch_module, x = _torch_mha()
    ours = mha.MultiHeadAttention.from_torch(torch_module)
    config = {"embed_dim": E, "num_heads": H}
    jobs += [
        (processes.tensor_parallel_job, (ours.state_dict(), config, x, c)) for c in (False, True)
    ]
    gqa_config, gqa_state = _gqa_module()
    jobs.append((processes.tensor_parallel_job, (gqa_state, gqa_config, x, True)))
    rope_config, rope_state = _gqa_module(rope=True)
    jobs.append((processes.tensor_parallel_job, (rope_state, rope_config, x, True)))
    q, k, v = (t[..., : L // world, :] for t in _inputs(False))
    jobs.append(
        (processes.error_job, (mha.ring_attention, (q, k[..., :-1, :], v[..., :-1, :]), {}))
    )
    odd = {"embed_dim": 4 * (world + 1), "num_heads": world + 1}  # heads do not split evenly
    jobs.append((_tp_from_config, (odd,)))
    return jobs


def _tp_from_config(rank: int, world: int, config: dict) -> str:
    """TensorParallelAttention over a module whose heads do not split evenly: the error."""
    return processes.error_job(
        rank, world, distributed.TensorParallelAttention, (mha.MultiHeadAttention(**config),), {}
    )


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def run(request):
    world = request.param
    start = time.monotonic()
    results = processes.launch(_jobs(world), world, timeout=90)
    assert time.monotonic() - start < 90
    return world, results


def test_ring_attention_equals_sdpa_over_the_whole_sequence(run):
    world, results = run
    for (name, options, gqa), per_rank in zip(CASES, results, strict=False):
        q, k, v = _inputs(gqa)
        shards = [out for out, _ in per_rank]
        assert all(s.shape == (B, H, L // world, D) for s in shards), name
        layout = options.get("layout", "contiguous")
        out = distributed.unshard_sequence(shards, layout=layout)
        expected = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=options.get("is_causal", False),
            scale=options.get("scale"),
            enable_gqa=gqa,
        )
        torch.testing.assert_close(out, expected, msg=f"{name}, world {world}")


def test_ring_sends_world_minus_one_key_and_value_shards(run):
    world, results = run
    for (name, _, gqa), per_rank in zip(CASES, results, strict=False):
        _, k, v = _inputs(gqa)
        shard_bytes = (k.nbytes + v.nbytes) // world
        for _, traffic in per_rank:
            assert traffic.sent_bytes == (world - 1) * shard_bytes, name
            assert traffic.messages == 2 * (world - 1) and traffic.reduced_bytes == 0, name


def test_tensor_parallel_heads_equal_torch_multihead_attention(run):
    world, results = run
    torch_module, x = _torch_mha()
    full_params = sum(p.numel() for p in torch_module.parameters())
    for offset, is_causal in enumerate((False, True)):
        mask = torch.ones(L, L, dtype=torch.bool).triu(1) if is_causal else None  # True = hidden
        with torch.no_grad():
            expected, _ = torch_module(x, x, x, attn_mask=mask, need_weights=False)
        for out, traffic, params in results[len(CASES) + offset]:
            torch.testing.assert_close(out, expected)
            assert traffic.reduced_bytes == x.nbytes and traffic.sent_bytes == 0
            # each rank holds 1/world of the projection weights (W_O's bias is kept whole)
            assert params == (full_params - E) // world + E
    for _, _, params in results[len(CASES) + 2]:  # GQA: H/world query heads on each rank
        kv_heads = max(1, HKV // world)  # copied when there are fewer than ranks
        assert params == (E + 1) * D * (H // world + 2 * kv_heads) + E * E // world + E


def _rotate_half(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Llama's RoPE written with torch operators: pairs (i, i + D/2) rotated by position · θ_i."""
    L, D = x.shape[-2:]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)  # (D/2,)
    angle = torch.arange(L, dtype=torch.float32)[:, None] * theta  # (L, D/2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # (L, D)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("rope", [False, True], ids=["gqa", "gqa-rope"])
def test_tensor_parallel_grouped_heads_equal_torch_linear_and_sdpa(run, rope):
    world, results = run
    _, x = _torch_mha()
    config, state = _gqa_module(rope=rope)
    q = F.linear(x, state["q_proj.weight"], state["q_proj.bias"]).view(B, L, H, D).transpose(1, 2)
    k = F.linear(x, state["k_proj.weight"], state["k_proj.bias"]).view(B, L, HKV, D).transpose(1, 2)
    v = F.linear(x, state["v_proj.weight"], state["v_proj.bias"]).view(B, L, HKV, D).transpose(1, 2)
    if rope:
        q, k = _rotate_half(q), _rotate_half(k)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, L, D)
    expected = F.linear(
        heads.transpose(1, 2).reshape(B, L, E), state["out_proj.weight"], state["out_proj.bias"]
    )
    for out, _, _ in results[len(CASES) + 2 + rope]:
        torch.testing.assert_close(out, expected)


def test_bad_shards_and_head_counts_are_clear_errors(run):
    world, results = run
    for message in results[len(CASES) + 4]:
        assert message.startswith("ValueError: query and key shards must hold the same tokens"), (
            message
        )
    for message in results[len(CASES) + 5]:
        assert message.startswith(
            f"ValueError: num_heads ({world + 1}) must be divisible by the world size ({world})"
        )


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no process group is initialised"):
        mha.ring_attention(q, q, q)
    with pytest.raises(ValueError, match="no process group is initialised"):
        mha.TensorParallelAttention(mha.MultiHeadAttention(16, 4))
    with pytest.raises(TypeError, match="module must be an mha.MultiHeadAttention"):
        mha.TensorParallelAttention(nn.Linear(4, 4))


def test_a_sequence_that_does_not_split_evenly_is_a_clear_error():
    x = torch.randn(1, 2, 10, 8)
    with pytest.raises(
        ValueError,
        match=r"sequence length L \(10\) of x \(1, 2, 10, 8\) must be divisible by world_size \(4\)",
    ):
        distributed.shard_sequence(x, 4)
    with pytest.raises(ValueError, match=r"divisible by 2 \* world_size \(4\)"):
        distributed.shard_sequence(torch.randn(1, 2, 6, 8), 2, layout="zigzag")


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_shards_put_back_in_order(layout):
    x = torch.arange(16.0).view(1, 16, 1)
    shards = distributed.shard_sequence(x, 4, layout=layout)
    torch.testing.assert_close(distributed.unshard_sequence(shards, layout=layout), x)


def test_ring_schedule_counts_causal_work():
    contiguous = distributed.ring_schedule(4)
    assert contiguous.sum(1).tolist() == [0.5, 1.5, 2.5, 3.5]  # rank r: r full shards + a half
    assert contiguous[0, 1:].tolist() == [0.0, 0.0, 0.0]  # rank 0 skips every other shard
    zigzag = distributed.ring_schedule(4, layout="zigzag")
    assert zigzag.sum(1).tolist() == [8.0] * 4  # the same work on every rank
    assert contiguous.sum() * 4 == zigzag.sum()  # the same total, in chunks 4x smaller
    assert distributed.ring_schedule(3, is_causal=False).tolist() == [[1.0] * 3] * 3


def _fail_on_last_rank(rank: int, world: int) -> None:
    if rank == world - 1:
        raise ValueError("deliberate failure")
    dist.barrier()  # waits for the rank that failed: only killing it ends this


def _sleep(rank: int, world: int) -> None:
    time.sleep(600)


def test_a_failing_process_stops_the_others_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="deliberate failure"):
        processes.launch([(_fail_on_last_rank, ())], 2, timeout=60)
    assert time.monotonic() - start < 30


def test_a_hanging_process_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 4 s"):
        processes.launch([(_sleep, ())], 1, timeout=4)
    assert time.monotonic() - start < 20
