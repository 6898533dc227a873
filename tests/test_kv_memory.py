"""The KV-memory calculator: hand-computed values per kind, and the bytes of real caches."""

from __future__ import annotations

import pytest
import torch
from conftest import randn

import mha
from mha.kv_memory import CONFIGS, AttentionConfig, kv_cache_bytes


def test_mha_formula() -> None:
    # 2 (k and v) · layers · H · D · bytes · tokens
    cfg = CONFIGS["Llama-2-7B"]
    for seq_len in (1, 100, 4096):
        assert kv_cache_bytes(cfg, seq_len) == 2 * 32 * 32 * 128 * 2 * seq_len
    assert kv_cache_bytes(cfg, 4096) == 2 * 2**30  # 2 GiB, as chapter 5 computes
    assert kv_cache_bytes(cfg, 10, batch=3, bytes_per_element=4) == 3 * 2 * kv_cache_bytes(cfg, 10)


@pytest.mark.parametrize(
    ("name", "kind", "per_token"),
    [
        ("Llama-2-7B", "MHA", 32 * 2 * 32 * 128 * 2),  # 512 KiB per token
        ("Llama-3-8B", "GQA", 32 * 2 * 8 * 128 * 2),  # 128 KiB
        ("Llama-3-70B", "GQA", 80 * 2 * 8 * 128 * 2),  # 320 KiB
        ("Falcon-7B", "MQA", 32 * 2 * 1 * 64 * 2),  # 8 KiB
        ("DeepSeek-V2", "MLA", 60 * (512 + 64) * 2),  # 67.5 KiB
        ("DeepSeek-V3", "MLA", 61 * (512 + 64) * 2),
    ],
)
def test_bytes_per_token_by_hand(name: str, kind: str, per_token: int) -> None:
    cfg = CONFIGS[name]
    assert cfg.kind == kind
    assert kv_cache_bytes(cfg, 1) == per_token
    assert kv_cache_bytes(cfg, 1000, batch=2) == 2000 * per_token  # linear without a window


def test_sliding_window_every_layer() -> None:
    cfg = CONFIGS["Mistral-7B-v0.1"]
    per_token = 32 * 2 * 8 * 128 * 2
    assert kv_cache_bytes(cfg, 1000) == 1000 * per_token
    assert kv_cache_bytes(cfg, 4096) == 4096 * per_token
    # beyond the window the rolling buffer stays at 4096 tokens
    assert kv_cache_bytes(cfg, 4097) == kv_cache_bytes(cfg, 32768) == 4096 * per_token


def test_sliding_window_some_layers() -> None:
    cfg = CONFIGS["Gemma-2-9B"]
    layer = 2 * 8 * 256 * 2  # bytes per token per layer
    assert cfg.window_layers is not None and len(cfg.window_layers) == 21
    assert kv_cache_bytes(cfg, 4096) == 42 * 4096 * layer
    # 21 global layers keep every token, 21 local ones 4096
    assert kv_cache_bytes(cfg, 8192) == (21 * 8192 + 21 * 4096) * layer
    small = AttentionConfig("toy", 3, 2, 2, 4, sliding_window=5, window_layers=(1,))
    assert kv_cache_bytes(small, 9, bytes_per_element=1) == (9 + 5 + 9) * 2 * 2 * 4
    assert [small.uses_window(i) for i in range(3)] == [False, True, False]


def test_kinds_order_at_equal_shape() -> None:
    shapes = {k: AttentionConfig(k, 4, 8, h, 16) for k, h in (("MHA", 8), ("GQA", 2), ("MQA", 1))}
    b = {k: kv_cache_bytes(c, 100) for k, c in shapes.items()}
    assert b["MQA"] < b["GQA"] < b["MHA"]
    assert b["MHA"] == 8 * b["MQA"] == 4 * b["GQA"]


def _decode_stack(layers: list[mha.MultiHeadAttention], x: torch.Tensor) -> list[mha.KVCache]:
    """Decode ``x`` token by token through a stack of layers; return each layer's cache."""
    caches = [mha.KVCache() for _ in layers]
    with torch.no_grad():
        for t in range(x.shape[1]):
            h = x[:, t : t + 1]  # (B, 1, E)
            for layer, cache in zip(layers, caches):
                h = h + layer(h, is_causal=True, kv_cache=cache)[0]
    return caches


@pytest.mark.parametrize(
    ("num_kv_heads", "dtype"), [(4, torch.float32), (2, torch.float64), (1, torch.float32)]
)
def test_matches_real_caches(num_kv_heads: int, dtype: torch.dtype) -> None:
    # A 3-layer stack of the course's MultiHeadAttention: the calculator's bytes are the bytes
    # its KVCaches hold after decoding T tokens of a batch of 2.
    E, H, T, B = 32, 4, 7, 2
    torch.manual_seed(0)
    layers = [
        mha.MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, dtype=dtype) for _ in range(3)
    ]
    caches = _decode_stack(layers, randn(B, T, E, dtype=dtype))
    cfg = AttentionConfig("small", 3, H, num_kv_heads, E // H)
    nbytes = dtype.itemsize
    assert all(len(c) == T for c in caches)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(
        cfg, T, batch=B, bytes_per_element=nbytes
    )


def test_matches_real_latent_cache() -> None:
    E, H, C, T, B = 32, 4, 6, 5, 2
    torch.manual_seed(0)
    layers = [mha.MultiHeadLatentAttention(E, H, C) for _ in range(2)]
    caches = [mha.LatentCache() for _ in layers]
    x = randn(B, T, E, dtype=torch.float32)
    with torch.no_grad():
        for t in range(T):
            h = x[:, t : t + 1]
            for layer, cache in zip(layers, caches):
                h = h + layer(h, is_causal=True, absorbed=True, cache=cache)
    cfg = AttentionConfig("latent", 2, H, H, E // H, kv_lora_rank=C)
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(cfg, T, batch=B, bytes_per_element=4)


def test_mla_smaller_than_gqa_of_larger_models() -> None:
    # per token: DeepSeek-V3 (671B parameters) caches less than Llama-3-8B, let alone 405B
    v3 = kv_cache_bytes(CONFIGS["DeepSeek-V3"], 1)
    assert (
        v3 < kv_cache_bytes(CONFIGS["Llama-3-8B"], 1) < kv_cache_bytes(CONFIGS["Llama-3.1-405B"], 1)
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_layers=0), ValueError, "num_layers must be positive, got 0"),
        (
            dict(num_kv_heads=3),
            ValueError,
            r"num_heads \(8\) must be divisible by num_kv_heads \(3\)",
        ),
        (dict(head_dim=2.0), TypeError, r"head_dim must be an int, got float \(2.0\)"),
        (dict(window_layers=(0,)), ValueError, "window_layers needs a sliding_window"),
        (dict(sliding_window=4, window_layers=[0]), TypeError, "window_layers must be a tuple"),
        (
            dict(sliding_window=4, window_layers=(2,)),
            ValueError,
            "window_layers has layer 2, but num_layers is 2",
        ),
        (dict(qk_rope_head_dim=64), ValueError, "it needs kv_lora_rank"),
        (dict(kv_lora_rank=-1), ValueError, "kv_lora_rank must be positive, got -1"),
    ],
)
def test_config_errors(kwargs: dict, error: type[Exception], message: str) -> None:
    args = dict(name="bad", num_layers=2, num_heads=8, num_kv_heads=8, head_dim=4) | kwargs
    with pytest.raises(error, match=message):
        AttentionConfig(**args)


def test_calculator_errors() -> None:
    cfg = CONFIGS["Llama-3-8B"]
    with pytest.raises(TypeError, match="config must be an AttentionConfig, got dict"):
        kv_cache_bytes({}, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len must be positive, got 0"):
        kv_cache_bytes(cfg, 0)
    with pytest.raises(TypeError, match=r"bytes_per_element must be an int, got float \(0.5\)"):
        kv_cache_bytes(cfg, 10, bytes_per_element=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch must be positive, got -2"):
        kv_cache_bytes(cfg, 10, batch=-2)
