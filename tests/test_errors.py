"""Bad input raises ValueError/TypeError naming the argument and the shapes, never NaN or assert."""

import pytest
import torch
from torch import nn

import mha
from mha.linear_attention import elu_feature_map


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


ATTENTION_CASES = [
    (
        (t(2, 4, 8), t(2, 4, 9), t(2, 4, 9)),
        {},
        ValueError,
        r"query and key must have the same head dim, got query \(2, 4, 8\) and key \(2, 4, 9\)",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 6, 8)),
        {},
        ValueError,
        r"key and value must have the same length S, got key \(2, 5, 8\) and value \(2, 6, 8\)",
    ),
    (
        (t(2, 4, 8), t(3, 4, 8), t(3, 4, 8)),
        {},
        ValueError,
        r"same leading \(batch\) dims, got query \(2, 4, 8\), key \(3, 4, 8\) and value \(3, 4, 8\)",
    ),
    (
        (t(8), t(4, 8), t(4, 8)),
        {},
        ValueError,
        r"query must have at least 2 dims .* got shape \(8,\)",
    ),
    (
        (t(2, 4, 8), t(2, 4, 8, dtype=torch.float64), t(2, 4, 8)),
        {},
        TypeError,
        "query, key and value must share a dtype, got torch.float32, torch.float64 and torch.float32",
    ),
    (
        (t(2, 4, 8, dtype=torch.int64), t(2, 4, 8), t(2, 4, 8)),
        {},
        TypeError,
        "query must have a floating dtype, got torch.int64",
    ),
    (([[1.0]], t(4, 8), t(4, 8)), {}, TypeError, "query must be a torch.Tensor, got list"),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"attn_mask": torch.ones(4, 4, dtype=torch.bool)},
        ValueError,
        r"attn_mask of shape \(4, 4\) is not broadcastable to the scores \(2, 4, 5\)",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"attn_mask": torch.ones(3, 4, 5, dtype=torch.bool)},
        ValueError,
        r"attn_mask of shape \(3, 4, 5\) is not broadcastable to the scores \(2, 4, 5\)",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"attn_mask": torch.ones(4, 5, dtype=torch.int64)},
        TypeError,
        "attn_mask must be bool .* or floating .*, got dtype torch.int64",
    ),
    (
        (t(2, 4, 8), t(2, 5, 8), t(2, 5, 8)),
        {"scale": "big"},
        TypeError,
        "scale must be a float or None, got str",
    ),
]


@pytest.mark.parametrize("fn", [mha.scaled_dot_product_attention, mha.flash_attention])
@pytest.mark.parametrize("args,kwargs,error,message", ATTENTION_CASES)
def test_attention_errors(fn, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        fn(*args, **kwargs)


def test_dropout_and_block_size_errors():
    q = t(2, 4, 8)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        mha.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        mha.flash_attention(q, q, q, block_size=0)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            {"embed_dim": 10, "num_heads": 3},
            ValueError,
            r"embed_dim \(10\) must be divisible by num_heads \(3\)",
        ),
        (
            {"embed_dim": 12, "num_heads": 6, "num_kv_heads": 4},
            ValueError,
            r"num_heads \(6\) must be divisible by num_kv_heads \(4\)",
        ),
        ({"embed_dim": 12, "num_heads": 0}, ValueError, "num_heads must be positive, got 0"),
        ({"embed_dim": 12.0, "num_heads": 3}, TypeError, "embed_dim must be an int, got float"),
        (
            {"embed_dim": 12, "num_heads": 3, "backend": "cuda"},
            ValueError,
            "unknown backend 'cuda'; choose one of math, sdpa, flash, triton",
        ),
        (
            {"embed_dim": 12, "num_heads": 3, "dropout": 1.0},
            ValueError,
            r"dropout must be in \[0, 1\), got 1.0",
        ),
        (
            {"embed_dim": 12, "num_heads": 3, "dropout": 0.1, "backend": "flash"},
            ValueError,
            "backend 'flash' has no attention dropout",
        ),
        (
            {"embed_dim": 9, "num_heads": 3, "rope": True},
            ValueError,
            r"rope rotates pairs and needs an even head dim, got embed_dim \(9\) / num_heads \(3\) = 3",
        ),
    ],
)
def test_module_construction_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        mha.MultiHeadAttention(**kwargs)


def test_forward_errors():
    model = mha.MultiHeadAttention(12, 3, kdim=5)
    x = t(2, 4, 12)
    with pytest.raises(
        ValueError, match=r"query must be batch-first \(B, length, width\), got shape \(4, 12\)"
    ):
        model(t(4, 12), t(2, 4, 5), t(2, 4, 12))
    with pytest.raises(
        ValueError, match=r"query must have width 12 \(embed_dim\), got shape \(2, 4, 10\)"
    ):
        model(t(2, 4, 10), t(2, 4, 5), t(2, 4, 12))
    with pytest.raises(ValueError, match=r"key must have width 5 \(kdim\), got shape \(2, 4, 12\)"):
        model(x)
    with pytest.raises(
        ValueError, match=r"same batch size, got query \(2, 4, 12\), key \(3, 4, 5\)"
    ):
        model(x, t(3, 4, 5), t(3, 4, 12))
    with pytest.raises(
        ValueError,
        match=r"attn_mask of shape \(3, 1, 1, 4\) is not broadcastable to the scores \(2, 3, 4, 4\)",
    ):
        model(x, t(2, 4, 5), t(2, 4, 12), attn_mask=torch.ones(3, 1, 1, 4, dtype=torch.bool))


def test_kv_cache_rejects_mismatched_steps():
    cache = mha.KVCache()
    cache.update(t(2, 4, 3, 8), t(2, 4, 3, 8))
    with pytest.raises(
        ValueError,
        match=r"new keys \(2, 2, 1, 8\) and values \(2, 2, 1, 8\) do not match the cached keys "
        r"\(2, 4, 3, 8\) and values \(2, 4, 3, 8\)",
    ):
        cache.update(t(2, 2, 1, 8), t(2, 2, 1, 8))


def test_from_torch_errors():
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention, got Linear"):
        mha.MultiHeadAttention.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="batch_first=True"):
        mha.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2))


# --- the APIs of chapters 7 and 8 -------------------------------------------------------------


def paged(B=2, S=5):
    """A paged cache holding ``B`` sequences of ``S`` positions."""
    cache = mha.PagedKVCache(block_size=4)
    cache.update(t(B, 1, S, 8), t(B, 1, S, 8))
    return cache


def kv_cache(dtype=torch.float32):
    cache = mha.KVCache()
    cache.update(t(2, 4, 3, 8, dtype=dtype), t(2, 4, 3, 8, dtype=dtype))
    return cache


def latent_cache():
    cache = mha.LatentCache()
    cache.update(t(2, 3, 16))
    return cache


def mla(**kwargs):
    return mha.MultiHeadLatentAttention(32, 4, 16, **kwargs)


x8 = t(2, 3, 5, 8)  # (B, H, L, D)
f64 = torch.float64

CHAPTER_7_8_CASES = [
    # 1. cache lookups past the end, or negative (Python would count from the end)
    pytest.param(
        lambda: paged().slot(2, 0),
        ValueError,
        r"sequence must be in \[0, 2\), got 2 \(the cache holds 2 sequences\)",
        id="slot-sequence-past-end",
    ),
    pytest.param(
        lambda: paged().slot(-1, 0),
        ValueError,
        r"sequence must be in \[0, 2\), got -1 \(the cache holds 2 sequences\)",
        id="slot-sequence-negative",
    ),
    pytest.param(
        lambda: paged().slot(0, -1),
        ValueError,
        r"position must be in \[0, 5\), got -1 \(5 positions are stored\)",
        id="slot-position-negative",
    ),
    pytest.param(
        lambda: paged().slot(1, 5),
        ValueError,
        r"position must be in \[0, 5\), got 5",
        id="slot-position-past-end",
    ),
    pytest.param(
        lambda: paged().slot(0, 1.0),
        TypeError,
        r"position must be an int, got float \(1.0\)",
        id="slot-position-float",
    ),
    pytest.param(
        lambda: paged().slot(True, 0),
        TypeError,
        r"sequence must be an int, got bool \(True\)",
        id="slot-sequence-bool",
    ),
    pytest.param(
        lambda: mha.PagedKVCache().slot(0, 0),
        ValueError,
        r"sequence must be in \[0, 0\), got 0 \(the cache holds 0 sequences\)",
        id="slot-empty-cache",
    ),
    # 2. a float where an integer position is meant
    pytest.param(
        lambda: mha.apply_rope(x8, 1.5),
        TypeError,
        r"positions must be an int offset or an integer tensor, got float \(1.5\)",
        id="rope-float-offset",
    ),
    pytest.param(
        lambda: mha.apply_rope(x8, torch.arange(5.0)),
        TypeError,
        "positions must be an integer tensor, got dtype torch.float32",
        id="rope-float-positions",
    ),
    pytest.param(
        lambda: mha.apply_rope(x8, True),
        TypeError,
        r"positions must be an int offset or an integer tensor, got bool \(True\)",
        id="rope-bool-offset",
    ),
    pytest.param(
        lambda: mha.apply_rope(x8, torch.arange(5) - 2),
        ValueError,
        "positions must be >= 0, got a minimum of -2",
        id="rope-negative-positions",
    ),
    pytest.param(
        lambda: mha.rope_frequencies(8.0),
        TypeError,
        r"head_dim must be an int, got float \(8.0\)",
        id="rope-frequencies-float-head-dim",
    ),
    pytest.param(
        lambda: mha.rope_frequencies(8, dtype=torch.int64),
        TypeError,
        "dtype must be a floating dtype, got torch.int64",
        id="rope-frequencies-int-dtype",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2.0, rope=True),
        TypeError,
        r"num_heads must be an int, got float \(2.0\)",
        id="rope-module-float-heads",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2, rope=True, rope_base="1e4"),
        TypeError,
        r"rope_base must be a number, got str \('1e4'\)",
        id="rope-module-str-base",
    ),
    pytest.param(
        lambda: mha.MultiHeadLatentAttention(32, 4, 16.0),
        TypeError,
        r"kv_latent_dim must be an int, got float \(16.0\)",
        id="mla-float-latent-dim",
    ),
    pytest.param(
        lambda: mha.MultiHeadLatentAttention(32, 4, 16, head_dim=8.0),
        TypeError,
        r"head_dim must be an int, got float \(8.0\)",
        id="mla-float-head-dim",
    ),
    # 3. merge_partials: lse of the wrong shape (a silent broadcast before), splits or dtype
    pytest.param(
        lambda: mha.merge_partials(t(4, 2, 3, 8), t(4, 2, 1)),
        ValueError,
        r"lse must have out's shape without its last dim \(splits, \.\.\., L\) = \(4, 2, 3\), "
        r"got out \(4, 2, 3, 8\) and lse \(4, 2, 1\)",
        id="merge-lse-broadcasts",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 2, 3, 8), t(1, 2, 3)),
        ValueError,
        r"same number of splits \(dim 0\), got out \(4, 2, 3, 8\) and lse \(1, 2, 3\)",
        id="merge-lse-one-split",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 2, 3, 8), t(3, 2, 3)),
        ValueError,
        r"same number of splits \(dim 0\), got out \(4, 2, 3, 8\) and lse \(3, 2, 3\)",
        id="merge-lse-other-splits",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 3, 8), t(4, 3, 8)),
        ValueError,
        r"lse must have out's shape .* got out \(4, 3, 8\) and lse \(4, 3, 8\)",
        id="merge-lse-as-out",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(3, 8), t(3)),
        ValueError,
        r"out must have at least 3 dims \(splits, \.\.\., L, Dv\), got shape \(3, 8\)",
        id="merge-out-too-few-dims",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 3, 8), t(4, 3, dtype=torch.int64)),
        TypeError,
        "lse must have a floating dtype, got torch.int64",
        id="merge-lse-int",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 3, 8, dtype=torch.int64), t(4, 3)),
        TypeError,
        "out must have a floating dtype, got torch.int64",
        id="merge-out-int",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 3, 8), t(4, 3, dtype=torch.float16)),
        TypeError,
        "lse must have dtype torch.float32 for out of dtype torch.float32, got torch.float16",
        id="merge-lse-float16",
    ),
    pytest.param(
        lambda: mha.merge_partials(t(4, 3, 8, dtype=f64), t(4, 3)),
        TypeError,
        "lse must have dtype torch.float64 for out of dtype torch.float64, got torch.float32",
        id="merge-lse-less-precise",
    ),
    # 5. an input of another dtype than the module's parameters
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2)(t(2, 3, 16, dtype=f64)),
        TypeError,
        r"query has dtype torch.float64 but the module's parameters are torch.float32",
        id="module-float64-input",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2, rope=True)(t(2, 3, 16, dtype=f64)),
        TypeError,
        r"query has dtype torch.float64 but the module's parameters are torch.float32",
        id="rope-module-float64-input",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2)(t(2, 3, 16), t(2, 4, 16, dtype=f64)),
        TypeError,
        r"key has dtype torch.float64 but the module's parameters are torch.float32",
        id="module-float64-key",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2, dtype=f64)(t(2, 3, 16)),
        TypeError,
        r"query has dtype torch.float32 but the module's parameters are torch.float64",
        id="float64-module-float32-input",
    ),
    pytest.param(
        lambda: mla()(t(2, 3, 32, dtype=f64)),
        TypeError,
        r"x has dtype torch.float64 but the module's parameters are torch.float32",
        id="mla-float64-input",
    ),
    pytest.param(
        lambda: mla().compress(t(2, 3, 32, dtype=f64)),
        TypeError,
        r"x has dtype torch.float64 but the module's parameters are torch.float32",
        id="mla-compress-float64-input",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2, dtype=torch.int64),
        TypeError,
        "dtype must be a floating dtype, got torch.int64",
        id="module-int-dtype",
    ),
    pytest.param(
        lambda: mla(dtype=torch.int64),
        TypeError,
        "dtype must be a floating dtype, got torch.int64",
        id="mla-int-dtype",
    ),
    # caches: each update checks its tensors against what is stored
    pytest.param(
        lambda: kv_cache().update(t(2, 4, 1, 8, dtype=f64), t(2, 4, 1, 8, dtype=f64)),
        TypeError,
        "new keys and values must have the cache's dtype torch.float32 and torch.float32, "
        "got torch.float64 and torch.float64",
        id="kv-cache-other-dtype",
    ),
    pytest.param(
        lambda: kv_cache().update(t(2, 4, 1, 8), t(2, 4, 2, 8)),
        ValueError,
        r"key and value must agree in \(B, Hkv, S_new\), got key \(2, 4, 1, 8\) "
        r"and value \(2, 4, 2, 8\)",
        id="kv-cache-key-value-lengths",
    ),
    pytest.param(
        lambda: kv_cache().update(t(2, 4, 1, 8), t(2, 4, 1, 5)),
        ValueError,
        r"new keys \(2, 4, 1, 8\) and values \(2, 4, 1, 5\) do not match the cached keys "
        r"\(2, 4, 3, 8\) and values \(2, 4, 3, 8\)",
        id="kv-cache-value-dim",
    ),
    pytest.param(
        lambda: mha.KVCache().update(t(4, 1, 8), t(4, 1, 8)),
        ValueError,
        r"key must have 4 dims \(B, Hkv, S_new, D\), got shape \(4, 1, 8\)",
        id="kv-cache-three-dims",
    ),
    pytest.param(
        lambda: mha.PagedKVCache().update(t(0, 2, 1, 8), t(0, 2, 1, 8)),
        ValueError,
        r"key must hold at least one sequence, got key \(0, 2, 1, 8\)",
        id="paged-cache-no-sequence",
    ),
    pytest.param(
        lambda: paged().update(t(2, 1, 1, 8, dtype=f64), t(2, 1, 1, 8, dtype=f64)),
        TypeError,
        "new keys and values must have the cache's dtype torch.float32",
        id="paged-cache-other-dtype",
    ),
    pytest.param(
        lambda: latent_cache().update(t(2, 16)),
        ValueError,
        r"c must have 3 dims \(B, S_new, C\), got shape \(2, 16\)",
        id="latent-cache-two-dims",
    ),
    pytest.param(
        lambda: latent_cache().update(t(2, 1, 16, dtype=f64)),
        TypeError,
        "new latents must have the cached latents' dtype torch.float32, got torch.float64",
        id="latent-cache-other-dtype",
    ),
    pytest.param(
        lambda: latent_cache().update(t(2, 1, 8)),
        ValueError,
        r"new latents \(2, 1, 8\) do not match the cached latents \(2, 3, 16\)",
        id="latent-cache-other-width",
    ),
    # the rest of the chapter 7 and 8 arguments
    pytest.param(
        lambda: mha.flash_attention(x8, x8, x8, block_size=4.0),
        TypeError,
        r"block_size must be an int, got float \(4.0\)",
        id="flash-float-block-size",
    ),
    pytest.param(
        lambda: mha.tile_schedule(8, -1),
        ValueError,
        "S must be zero or positive, got -1",
        id="tile-schedule-negative-S",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2)(t(2, 3, 16), kv_cache=[]),
        TypeError,
        "kv_cache must be a cache with update, __len__, nbytes and reset .* got list",
        id="module-kv-cache-list",
    ),
    pytest.param(
        lambda: mha.MultiHeadAttention(16, 2)(
            t(2, 3, 16), kv_cache=kv_cache(), attn_mask=torch.ones(3, 3, dtype=torch.bool)
        ),
        ValueError,
        r"attn_mask of shape \(3, 3\) is not broadcastable to the scores \(2, 2, 3, 6\)",
        id="module-mask-without-the-cached-keys",
    ),
    pytest.param(
        lambda: mha.flex.sliding_window(torch.tensor(0)),
        ValueError,
        "window must be positive, got 0",
        id="flex-window-tensor-zero",
    ),
    pytest.param(
        lambda: mha.flex.padding(torch.tensor([3, -1])),
        ValueError,
        "lengths must be >= 0, got a minimum of -1",
        id="flex-negative-length",
    ),
    pytest.param(
        lambda: mha.flex.alibi_slopes(0),
        ValueError,
        "num_heads must be positive, got 0",
        id="alibi-zero-heads",
    ),
    pytest.param(
        lambda: mha.flex.alibi_slopes(12.0),
        TypeError,
        r"num_heads must be an int, got float \(12.0\)",
        id="alibi-float-heads",
    ),
    pytest.param(
        lambda: elu_feature_map([1.0]),
        TypeError,
        "x must be a torch.Tensor, got list",
        id="elu-feature-map-list",
    ),
    pytest.param(
        lambda: mha.AttentionConfig(None, 2, 4, 4, 8),
        TypeError,
        "name must be a str, got NoneType",
        id="attention-config-name",
    ),
]


@pytest.mark.parametrize("call,error,message", CHAPTER_7_8_CASES)
def test_chapter_7_8_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _flag_calls():
    """Every bool flag of every public function, given the int 1 instead of True."""
    layer, latent = mha.MultiHeadAttention(16, 2), mla()
    x, e = x8, t(2, 3, 16)
    return {
        "sdpa is_causal": (
            "is_causal",
            lambda: mha.scaled_dot_product_attention(x, x, x, None, 0.0, 1),
        ),
        "sdpa enable_gqa": (
            "enable_gqa",
            lambda: mha.scaled_dot_product_attention(x, x, x, enable_gqa=1),
        ),
        "sdpa return_weights": (
            "return_weights",
            lambda: mha.scaled_dot_product_attention(x, x, x, return_weights=1),
        ),
        "flash is_causal": ("is_causal", lambda: mha.flash_attention(x, x, x, is_causal=1)),
        "flash enable_gqa": ("enable_gqa", lambda: mha.flash_attention(x, x, x, enable_gqa=1)),
        "flash return_lse": ("return_lse", lambda: mha.flash_attention(x, x, x, return_lse=1)),
        "flash_decoding enable_gqa": (
            "enable_gqa",
            lambda: mha.flash_decoding(x, x, x, enable_gqa=1),
        ),
        "tile_schedule is_causal": ("is_causal", lambda: mha.tile_schedule(8, 8, is_causal=1)),
        "module bias": ("bias", lambda: mha.MultiHeadAttention(16, 2, bias=1)),
        "module rope": ("rope", lambda: mha.MultiHeadAttention(16, 2, rope=1)),
        "module is_causal": ("is_causal", lambda: layer(e, is_causal=1)),
        "module need_weights": ("need_weights", lambda: layer(e, need_weights=1)),
        "mla bias": ("bias", lambda: mla(bias=1)),
        "mla is_causal": ("is_causal", lambda: latent(t(2, 3, 32), is_causal=1)),
        "mla absorbed": ("absorbed", lambda: latent(t(2, 3, 32), absorbed=1)),
    }


@pytest.mark.parametrize("case", list(_flag_calls()))
def test_every_flag_must_be_a_bool(case):
    name, call = _flag_calls()[case]
    with pytest.raises(TypeError, match=rf"{name} must be a bool, got int \(1\)"):
        call()
