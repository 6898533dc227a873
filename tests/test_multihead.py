"""mha.MultiHeadAttention against torch.nn.MultiheadAttention, across backends, GQA and KV cache."""

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch import nn
from torch.testing import assert_close

import mha

BACKENDS = ["math", "sdpa", "flash"]


def torch_mha(E=32, H=4, **kwargs):
    torch.manual_seed(0)
    return nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **kwargs).eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_attention_matches_torch(backend):
    ref = torch_mha()
    ours = mha.MultiHeadAttention.from_torch(ref, backend=backend)
    x = randn(3, 10, 32)
    out, weights = ours(x)
    assert weights is None
    assert_close(out, ref(x, x, x, need_weights=False)[0])


def test_per_head_weights_match_torch():
    ref = torch_mha()
    ours = mha.MultiHeadAttention.from_torch(ref)
    x = randn(3, 10, 32)
    out, weights = ours(x, need_weights=True)
    ref_out, ref_weights = ref(x, x, x, average_attn_weights=False)
    assert weights.shape == (3, 4, 10, 10)
    assert_close(out, ref_out)
    assert_close(weights, ref_weights)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_with_other_widths_matches_torch(backend):
    ref = torch_mha(kdim=12, vdim=20)
    ours = mha.MultiHeadAttention.from_torch(ref, backend=backend)
    q, k, v = randn(2, 5, 32, seed=1), randn(2, 9, 12, seed=2), randn(2, 9, 20, seed=3)
    assert_close(ours(q, k, v)[0], ref(q, k, v, need_weights=False)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_mask_converted_with_not(backend):
    ref = torch_mha()
    ours = mha.MultiHeadAttention.from_torch(ref, backend=backend)
    x = randn(2, 8, 32)
    lengths = torch.tensor([8, 5])
    keep = mha.padding_mask(lengths, 8)  # (B, 1, 1, S), True = real token
    key_padding_mask = ~keep[:, 0, 0, :]  # torch's convention: True = ignore
    ref_out = ref(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]
    assert_close(ours(x, attn_mask=keep)[0], ref_out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_matches_torch(backend):
    ref = torch_mha()
    ours = mha.MultiHeadAttention.from_torch(ref, backend=backend)
    x = randn(2, 8, 32)
    torch_mask = ~mha.causal_mask(8)  # torch's bool attn_mask: True = masked out
    ref_out = ref(x, x, x, attn_mask=torch_mask, need_weights=False)[0]
    assert_close(ours(x, is_causal=True)[0], ref_out)


def test_no_bias_and_separate_projection_weights():
    ref = torch_mha(bias=False, kdim=16, vdim=16)
    assert not ref._qkv_same_embed_dim
    ours = mha.MultiHeadAttention.from_torch(ref)
    assert ours.q_proj.bias is None and ours.out_proj.bias is None
    q, kv = randn(2, 4, 32), randn(2, 6, 16)
    assert_close(ours(q, kv)[0], ref(q, kv, kv, need_weights=False)[0])


def test_backends_agree_with_masks_and_gqa():
    torch.manual_seed(0)
    base = mha.MultiHeadAttention(48, 6, num_kv_heads=2, dtype=torch.float64)
    x = randn(2, 11, 48)
    mask = mha.padding_mask(torch.tensor([11, 7]), 11) & mha.sliding_window_mask(11, window=4)
    outs = []
    for backend in BACKENDS:
        base.backend = backend
        outs.append(base(x, attn_mask=mask, is_causal=True)[0])
    for out in outs[1:]:
        assert_close(out, outs[0])


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
def test_gqa_equals_mha_with_explicitly_repeated_heads(num_kv_heads):
    torch.manual_seed(0)
    H, D = 6, 4
    gqa = mha.MultiHeadAttention(H * D, H, num_kv_heads=num_kv_heads, dtype=torch.float64)
    assert gqa.k_proj.out_features == num_kv_heads * D
    full = mha.MultiHeadAttention(H * D, H, dtype=torch.float64)
    group = H // num_kv_heads
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for src, dst in ((gqa.k_proj, full.k_proj), (gqa.v_proj, full.v_proj)):
            # query head i reads key/value head i // group: repeat each kv head's rows `group` times
            dst.weight.copy_(
                src.weight.view(num_kv_heads, D, -1).repeat_interleave(group, 0).reshape(H * D, -1)
            )
            dst.bias.copy_(
                src.bias.view(num_kv_heads, D).repeat_interleave(group, 0).reshape(H * D)
            )
    x = randn(2, 7, H * D)
    out_gqa, w_gqa = gqa(x, need_weights=True, is_causal=True)
    out_full, w_full = full(x, need_weights=True, is_causal=True)
    assert_close(out_gqa, out_full)
    assert_close(w_gqa, w_full)
    # and torch's own GQA path agrees
    B, L, E = x.shape
    q = gqa.q_proj(x).view(B, L, H, D).transpose(1, 2)
    k = gqa.k_proj(x).view(B, L, num_kv_heads, D).transpose(1, 2)
    v = gqa.v_proj(x).view(B, L, num_kv_heads, D).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(out_gqa, gqa.out_proj(ref.transpose(1, 2).reshape(B, L, E)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, 10])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_kv_cache_decoding_equals_one_causal_pass(backend, chunk, num_kv_heads):
    torch.manual_seed(0)
    model = mha.MultiHeadAttention(
        32, 4, num_kv_heads=num_kv_heads, backend=backend, dtype=torch.float64
    ).eval()
    x = randn(2, 10, 32)
    full = model(x, is_causal=True)[0]
    cache = mha.KVCache()
    steps = [
        model(x[:, i : i + chunk], is_causal=True, kv_cache=cache)[0] for i in range(0, 10, chunk)
    ]
    assert_close(torch.cat(steps, dim=1), full)
    assert len(cache) == 10
    D = 8
    assert cache.key.shape == (2, num_kv_heads, 10, D)
    assert cache.nbytes == 2 * (2 * num_kv_heads * 10 * D) * 8  # keys + values, float64


def test_kv_cache_with_padding_mask():
    torch.manual_seed(0)
    model = mha.MultiHeadAttention(16, 2, dtype=torch.float64)
    x = randn(2, 6, 16)
    keep = mha.padding_mask(torch.tensor([6, 6]), 6)
    keep = keep.clone()
    keep[1, ..., 1] = False  # sequence 1 hides token 1 from everyone
    full = model(x, attn_mask=keep, is_causal=True)[0]
    cache = mha.KVCache()
    steps = [
        model(x[:, i : i + 1], attn_mask=keep[..., : i + 1], is_causal=True, kv_cache=cache)[0]
        for i in range(6)
    ]
    assert_close(torch.cat(steps, 1), full)


def test_dropout_only_while_training():
    torch.manual_seed(0)
    model = mha.MultiHeadAttention(16, 2, dropout=0.5, dtype=torch.float64)
    x = randn(1, 20, 16)
    model.eval()
    a, b = model(x)[0], model(x)[0]
    assert torch.equal(a, b)
    model.train()
    c = model(x)[0]
    assert not torch.allclose(a, c)


def test_gradients_flow_through_every_backend():
    for backend in BACKENDS:
        torch.manual_seed(0)
        model = mha.MultiHeadAttention(16, 2, backend=backend, dtype=torch.float64)
        model(randn(2, 5, 16), is_causal=True)[0].sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# --- the step hook ----------------------------------------------------------------------------


def _watch(layer):
    """Register a step hook that keeps (step, tensor) pairs; returns the list and the handle."""
    seen = []
    handle = layer.register_step_hook(lambda step, tensor: seen.append((step, tensor)))
    return seen, handle


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_hook_sees_every_step_in_order(backend):
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(24, 6, num_kv_heads=2, kdim=5, vdim=5, backend=backend)
    seen, _ = _watch(layer)
    q, k = randn(2, 4, 24, dtype=torch.float32), randn(2, 7, 5, dtype=torch.float32)
    out, weights = layer(q, k, need_weights=True)
    shapes = {step: tuple(t.shape) for step, t in seen}
    assert [step for step, _ in seen] == list(mha.multihead.STEPS)
    assert shapes == {
        "q": (2, 6, 4, 4),  # (B, H, L, D)
        "k": (2, 2, 7, 4),  # (B, Hkv, S, D)
        "v": (2, 2, 7, 4),
        "weights": (2, 6, 4, 7),  # (B, H, L, S)
        "heads": (2, 6, 4, 4),  # (B, H, L, D)
        "concat": (2, 4, 24),  # (B, L, E)
        "out": (2, 4, 24),
    }
    steps = dict(seen)
    assert steps["out"] is out and steps["weights"] is weights
    # the concatenation is what out_proj receives
    assert_close(layer.out_proj(steps["concat"]), out)


def test_step_hook_without_weights_and_with_a_cache():
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(16, 2, rope=True).eval()
    seen, _ = _watch(layer)
    cache = mha.KVCache()
    x = randn(1, 5, 16, dtype=torch.float32)
    with torch.no_grad():
        layer(x[:, :4], is_causal=True, kv_cache=cache)
        seen.clear()
        layer(x[:, 4:], is_causal=True, kv_cache=cache)  # one new token after 4 cached
    assert [step for step, _ in seen] == ["q", "k", "v", "heads", "concat", "out"]
    k = dict(seen)["k"]
    assert k.shape == (1, 2, 1, 8)  # after the split: this step's key only, before the cache


def test_step_hook_handles_remove_and_change_nothing():
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(16, 2)
    x = randn(2, 3, 16, dtype=torch.float32)
    expected = layer(x)[0]
    first, handle_1 = _watch(layer)
    second, handle_2 = _watch(layer)
    assert torch.equal(layer(x)[0], expected)
    assert len(first) == len(second) == 6  # q, k, v, heads, concat, out
    handle_1.remove()
    layer(x)
    assert len(first) == 6 and len(second) == 12
    handle_2.remove()
    layer(x)
    assert len(second) == 12 and not layer._step_hooks


def test_step_hook_must_be_callable():
    with pytest.raises(TypeError, match="hook must be callable, got int"):
        mha.MultiHeadAttention(16, 2).register_step_hook(3)


# --- what a backend cannot do is refused at forward's entry, before any work ----------------


@pytest.mark.parametrize(
    "backend,kwargs,error,message",
    [
        (
            "flash",
            {"attn_mask": torch.zeros(3, 3, requires_grad=True)},
            ValueError,
            r"backend 'flash' does not compute a gradient for attn_mask; pass "
            r"attn_mask.detach\(\) \(attn_mask \(3, 3\) requires grad\)",
        ),
        (
            "triton",
            {"attn_mask": torch.ones(3, 3, dtype=torch.bool)},
            ValueError,
            "backend 'triton' supports is_causal but no attn_mask",
        ),
        (
            "triton",
            {"is_causal": True, "kv_cache": mha.KVCache()},
            ValueError,
            r"backend 'triton' supports is_causal but no attn_mask \(with a kv_cache, "
            "is_causal is a bottom-right mask\\)",
        ),
    ],
)
def test_backend_limits_are_checked_at_the_entry(backend, kwargs, error, message):
    layer = mha.MultiHeadAttention(16, 2, backend=backend)
    seen, _ = _watch(layer)
    with pytest.raises(error, match=message):
        layer(torch.zeros(2, 3, 16), **kwargs)
    assert seen == []  # not even the projection ran
    # with need_weights the math path runs instead, which can do all of it
    layer(torch.zeros(2, 3, 16), need_weights=True, **kwargs)


def test_triton_dtype_and_head_dim_are_checked_at_the_entry():
    layer = mha.MultiHeadAttention(16, 2, backend="triton", dtype=torch.float64)
    seen, _ = _watch(layer)
    with pytest.raises(TypeError, match="query must be float16, bfloat16 or float32, got torch.f"):
        layer(torch.zeros(2, 3, 16, dtype=torch.float64))
    wide = mha.MultiHeadAttention(512, 2, backend="triton")
    wide.register_step_hook(lambda step, tensor: seen.append(step))
    with pytest.raises(
        ValueError,
        match=r"head dim D must be in \[1, 128\], got D=256 \(embed_dim \(512\) / num_heads \(2\)\)",
    ):
        wide(torch.zeros(1, 2, 512))
    assert seen == []


# --- the layer knows no cache type ---------------------------------------------------------------


def test_the_layer_imports_no_cache_module():
    """Chapter 3's layer asks a cache to attend over itself: it imports none of the serving
    caches' modules (paged, decoding, quantised, latent), nor names their classes."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(mha.__file__).parent / "multihead.py").read_text())
    imported, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[-1])
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[-1] for alias in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    assert not imported & {"paged", "decoding", "kv_quant", "mla"}, imported
    caches = {"PagedKVCache", "PreallocatedKVCache", "QuantizedKVCache", "LatentCache"}
    assert not (imported | names) & caches  # (its docstrings may name them)


def test_a_cache_of_ones_own_needs_attend_and_contiguous_cache_provides_it():
    class OnlyUpdate:  # the old interface: no attend
        def __init__(self):
            self.inner = mha.KVCache()

        def __len__(self):
            return len(self.inner)

        nbytes = 0

        def reset(self):
            self.inner.reset()

        def update(self, key, value):
            return self.inner.update(key, value)

    class Mine(OnlyUpdate, mha.multihead.ContiguousCache):  # attend from ContiguousCache
        pass

    layer = mha.MultiHeadAttention(16, 2, num_kv_heads=1, dtype=torch.float64).eval()
    x = randn(2, 5, 16)
    with pytest.raises(TypeError, match=r"and attend, as mha.KVCache has\), got OnlyUpdate"):
        layer(x, kv_cache=OnlyUpdate())
    cache = Mine()
    steps = [layer(x[:, i : i + 1], is_causal=True, kv_cache=cache)[0] for i in range(5)]
    assert_close(torch.cat(steps, 1), layer(x, is_causal=True)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_through_a_cache_are_the_bottom_right_causal_ones(backend):
    torch.manual_seed(0)
    layer = mha.MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend, dtype=torch.float64)
    layer = layer.eval()
    x = randn(2, 7, 16)
    full, full_weights = layer(x, is_causal=True, need_weights=True)
    for make in (mha.KVCache, lambda: mha.PreallocatedKVCache(7)):
        cache = make()
        head, _ = layer(x[:, :4], is_causal=True, kv_cache=cache)
        tail, weights = layer(x[:, 4:], is_causal=True, need_weights=True, kv_cache=cache)
        assert weights.shape == (2, 4, 3, 7)
        assert_close(weights, full_weights[:, :, 4:])  # rows 4..6 of the full causal weights
        assert_close(torch.cat([head, tail], 1), full)
