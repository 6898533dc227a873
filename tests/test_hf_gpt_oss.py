"""gpt-oss's attention (mha.from_hf) against Hugging Face's own module, through stored fixtures.

The fixtures come from ``tools/hf_fixtures.py`` (run in an environment with transformers); these
tests need only numpy and torch.
"""

import json

import pytest
import torch

import mha
from mha.models import load_fixture


def load(name):
    f = load_fixture(name)
    arrays = {"x": f.x, "positions": f.positions, "out": f.out}
    return f.config, f.state_dict, f.layer_idx, arrays


def test_other_settings_equal_hugging_face():
    """No biases, no GQA, YaRN with rounded boundaries: layer 2 of four, a sliding one."""
    f = load_fixture("gpt_oss_variant")
    assert not f.config["attention_bias"] and f.config["rope_parameters"]["truncate"]
    module = mha.from_hf("gpt_oss", f.config, f.state_dict, layer_idx=f.layer_idx)
    assert module.window == 3 and module.num_kv_heads == module.num_heads
    with torch.no_grad():
        torch.testing.assert_close(module(f.x, f.positions), f.out)


@pytest.mark.parametrize("case", ["sliding", "variant"])
def test_yarn_speeds_and_factor_equal_hugging_face(case):
    f = load_fixture(f"gpt_oss_{case}")
    module = mha.from_hf("gpt_oss", f.config, f.state_dict, layer_idx=f.layer_idx)
    torch.testing.assert_close(module.frequencies, f.rope_inv_freq, rtol=0, atol=0)
    assert module.attention_factor == pytest.approx(f.rope_attention_scaling, rel=1e-12)


@pytest.mark.parametrize("case", ["sliding", "full"])
def test_equals_hugging_face(case):
    config, state, layer_idx, a = load(f"gpt_oss_{case}")
    assert config["layer_types"][layer_idx] == f"{case}_attention"
    module = mha.from_hf("gpt_oss", config, state, layer_idx=layer_idx)
    with torch.no_grad():
        out = module(a["x"], a["positions"])
    torch.testing.assert_close(out, a["out"])
    # the second sequence starts at position 5000: YaRN's speeds matter there
    assert int(a["positions"][1, 0]) == 5000


def test_window_and_default_positions():
    config, state, _, a = load("gpt_oss_sliding")
    sliding = mha.from_hf("gpt_oss", config, state, layer_idx=0)
    full = mha.from_hf("gpt_oss", config, state, layer_idx=1)
    assert sliding.window == config["sliding_window"] and full.window is None
    x = a["x"][:1]
    with torch.no_grad():
        # positions (L,) and the default 0 … L-1 give HF's output for the first sequence
        torch.testing.assert_close(sliding(x), a["out"][:1])
        torch.testing.assert_close(sliding(x, torch.arange(x.shape[1])), a["out"][:1])
        # within the first W tokens a sliding layer and a full one with the same weights agree
        W = config["sliding_window"]
        torch.testing.assert_close(sliding(x)[:, :W], full(x)[:, :W])
        assert not torch.allclose(sliding(x)[:, W:], full(x)[:, W:])


def test_sinks_take_mass_and_give_no_value():
    config, state, _, a = load("gpt_oss_full")
    state = dict(state)
    state["sinks"] = torch.full_like(state["sinks"], -torch.inf)  # a sink nobody attends to
    module = mha.from_hf("gpt_oss", config, state, layer_idx=1)
    x = a["x"][:1]
    B, L, _ = x.shape
    with torch.no_grad():
        # without its sink the layer is torch's causal GQA attention on the rotated q and k
        q = module._rope(module.q_proj(x).view(B, L, 4, 16).transpose(1, 2), None)
        k = module._rope(module.k_proj(x).view(B, L, 2, 16).transpose(1, 2), None)
        v = module.v_proj(x).view(B, L, 2, 16).transpose(1, 2)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        ref = module.o_proj(ref.transpose(1, 2).reshape(B, L, 64))
        torch.testing.assert_close(module(x), ref)
        module.sinks.fill_(1e4)  # a sink that takes all the mass: only o_proj's bias is left
        torch.testing.assert_close(module(x), module.o_proj.bias.expand_as(ref), atol=1e-6, rtol=0)


def test_bad_family_config_and_weights():
    config, state, _, a = load("gpt_oss_sliding")
    with pytest.raises(ValueError, match="family must be one of"):
        mha.from_hf("gpt-oss", config, state)
    with pytest.raises(ValueError, match=r"missing keys \['sinks'\]"):
        mha.from_hf("gpt_oss", config, {k: v for k, v in state.items() if k != "sinks"})
    with pytest.raises(ValueError, match=r"unexpected keys \['q_norm.weight'\]"):
        mha.from_hf("gpt_oss", config, {**state, "q_norm.weight": torch.ones(16)})
    small = {**config, "num_attention_heads": 2}
    with pytest.raises(
        ValueError, match=r"state_dict\['sinks'\] has shape \(4,\), the config implies \(2,\)"
    ):
        mha.from_hf("gpt_oss", small, state)
    with pytest.raises(ValueError, match=r"config is missing \['sliding_window'\]"):
        mha.from_hf("gpt_oss", {**config, "sliding_window": None}, state)
    with pytest.raises(ValueError, match=r"config is missing \['num_key_value_heads'\]"):
        mha.from_hf(
            "gpt_oss", {k: v for k, v in config.items() if k != "num_key_value_heads"}, state
        )
    with pytest.raises(ValueError, match=r"layer_idx must be < 2"):
        mha.from_hf("gpt_oss", config, state, layer_idx=2)
    yarn = {**config["rope_parameters"], "original_max_position_embeddings": None}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        mha.from_hf("gpt_oss", {**config, "rope_parameters": yarn}, state)
    with pytest.raises(TypeError, match="config must be a dict"):
        mha.from_hf("gpt_oss", json.dumps(config), state)
    module = mha.from_hf("gpt_oss", config, state)
    with pytest.raises(ValueError, match=r"x must have E = hidden_size = 48, got x \(2, 11, 40\)"):
        module(a["x"][..., :40])
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\) = \(11,\)"):
        module(a["x"], torch.arange(10))


def test_unknown_fixture():
    with pytest.raises(ValueError, match=r"no fixture named 'gpt_oss_window'; there are \["):
        load_fixture("gpt_oss_window")


@pytest.mark.parametrize("case", ["sliding", "full", "variant"])
def test_cached_decoding_equals_hugging_face_with_its_cache(case):
    f = load_fixture(f"gpt_oss_{case}")
    module = mha.from_hf("gpt_oss", f.config, f.state_dict, layer_idx=f.layer_idx)
    cache, n = mha.KVCache(), f.prefill
    with torch.no_grad():
        outs = [module(f.x[:, :n], f.positions[:, :n], kv_cache=cache)]
        for t in range(n, f.x.shape[1]):
            outs.append(module(f.x[:, t : t + 1], f.positions[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), f.out_cached)
    assert len(cache) == f.x.shape[1]
    if case == "variant":
        return
    # positions left out continue after the cached tokens (the first sequence starts at 0)
    cache = mha.KVCache()
    with torch.no_grad():
        outs = [module(f.x[:1, :n], kv_cache=cache)]
        outs += [module(f.x[:1, t : t + 1], kv_cache=cache) for t in range(n, f.x.shape[1])]
    # against HF's full pass: a step sums its scores in another order (outputs reach ~14)
    torch.testing.assert_close(torch.cat(outs, dim=1), f.out[:1], atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError, match="kv_cache must be a cache whose update returns all"):
        module(f.x, kv_cache=[])
    with pytest.raises(TypeError, match="returns all its keys and values .* got PagedKVCache"):
        module(f.x, kv_cache=mha.PagedKVCache())  # its update returns the pools, not the keys
