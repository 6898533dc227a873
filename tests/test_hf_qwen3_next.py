"""Qwen3-Next's full-attention layer (mha.from_hf) against Hugging Face's module, via fixtures."""

import pytest
import torch

import mha
from mha.models import load_fixture
from mha.models.gated_deltanet import GatedDeltaNet, RecurrentState


def load(name):
    f = load_fixture(name)
    arrays = {"x": f.x, "positions": f.positions, "out": f.out}
    return f.config, f.state_dict, f.layer_idx, arrays


@pytest.mark.parametrize("case", ["full", "full_bias", "yarn"])
def test_equals_hugging_face(case):
    config, state, layer_idx, a = load(f"qwen3_next_{case}")
    module = mha.from_hf("qwen3_next", config, state, layer_idx=layer_idx)
    factor = config["rope_parameters"]["partial_rotary_factor"]  # a quarter, or half with yarn
    assert module.rotary_dim == int(config["head_dim"] * factor)
    with torch.no_grad():
        torch.testing.assert_close(module(a["x"], a["positions"]), a["out"])


def test_gate_closed_gives_only_the_bias():
    config, state, layer_idx, a = load("qwen3_next_full_bias")
    module = mha.from_hf("qwen3_next", config, state, layer_idx=layer_idx)
    H, D = config["num_attention_heads"], config["head_dim"]
    with torch.no_grad():
        # q_proj's rows hold, per head, D query rows then D gate rows: shut every gate
        rows = module.q_proj.bias.view(H, 2, D)  # (H, 2, D)
        rows[:, 1] = -1e4
        out = module(a["x"])
    torch.testing.assert_close(out, module.o_proj.bias.expand_as(out), atol=1e-6, rtol=0)


def test_bad_layer_and_weights():
    config, state, layer_idx, _ = load("qwen3_next_full")
    with pytest.raises(ValueError, match=r"missing keys \['A_log', 'conv1d.weight'"):
        mha.from_hf("qwen3_next", config, state, layer_idx=0)  # layer 0 is a linear layer
    with pytest.raises(ValueError, match=r"missing keys \['k_norm.weight'\]"):
        mha.from_hf(
            "qwen3_next",
            config,
            {k: v for k, v in state.items() if k != "k_norm.weight"},
            layer_idx=layer_idx,
        )
    with pytest.raises(
        ValueError,
        match=r"state_dict\['q_proj.weight'\] has shape \(128, 48\), the config implies \(64, 48\)",
    ):
        mha.from_hf("qwen3_next", {**config, "head_dim": 8}, state, layer_idx=layer_idx)
    with pytest.raises(ValueError, match=r"config is missing \['rope_theta'\]"):
        mha.from_hf("qwen3_next", {**config, "rope_parameters": {}}, state, layer_idx=layer_idx)
    with pytest.raises(ValueError, match="layer_idx must be zero or positive"):
        mha.from_hf("qwen3_next", config, state, layer_idx=-1)


@pytest.mark.parametrize("case", ["full", "yarn"])
def test_rope_speeds_equal_hugging_face(case):
    f = load_fixture(f"qwen3_next_{case}")
    module = mha.from_hf("qwen3_next", f.config, f.state_dict, layer_idx=f.layer_idx)
    torch.testing.assert_close(module.frequencies, f.rope_inv_freq, rtol=1e-6, atol=0)
    assert module.attention_factor == pytest.approx(f.rope_attention_scaling, rel=1e-12)


@pytest.mark.parametrize("case", ["full", "yarn"])
def test_cached_decoding_equals_hugging_face_with_its_cache(case):
    f = load_fixture(f"qwen3_next_{case}")
    module = mha.from_hf("qwen3_next", f.config, f.state_dict, layer_idx=f.layer_idx)
    cache, n = mha.KVCache(), f.prefill
    with torch.no_grad():
        outs = [module(f.x[:, :n], f.positions[:, :n], kv_cache=cache)]
        for t in range(n, f.x.shape[1]):
            outs.append(module(f.x[:, t : t + 1], f.positions[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), f.out_cached)


# --- the linear-attention layer: Gated DeltaNet with its projections, convolution and gates ----

LINEAR = ["linear", "linear_long"]  # grouped heads (Hk 2, Hv 4); two chunks of 64, no grouping


def assert_close_to_hf(actual, expected):
    """torch's float32 tolerances (atol 1e-5, rtol 1.3e-6) with atol scaled by the output's
    largest magnitude (~5.6 in linear_long). Our layer and Hugging Face's sum the same float32
    terms in different orders, and which order a matrix product uses depends on the CPU: on one
    machine the largest difference was 1.2e-5, on others below 1e-5, against outputs up to 5.6."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=1.3e-6, atol=1e-5 * scale)


@pytest.mark.parametrize("case", LINEAR)
def test_linear_layer_equals_hugging_face(case):
    f = load_fixture(f"qwen3_next_{case}")
    assert f.config["layer_types"][f.layer_idx] == "linear_attention"
    module = mha.from_hf("qwen3_next", f.config, f.state_dict, layer_idx=f.layer_idx)
    assert isinstance(module, GatedDeltaNet)
    with torch.no_grad():
        assert_close_to_hf(module(f.x), f.out)


@pytest.mark.parametrize("case", LINEAR)
def test_linear_layer_decodes_with_a_fixed_size_state_as_hugging_face_does(case):
    f = load_fixture(f"qwen3_next_{case}")
    module = mha.from_hf("qwen3_next", f.config, f.state_dict, layer_idx=f.layer_idx)
    state, n = RecurrentState(), f.prefill
    with torch.no_grad():
        outs = [module(f.x[:, :n], kv_cache=state)]
        after_prompt = state.nbytes()
        outs += [module(f.x[:, t : t + 1], kv_cache=state) for t in range(n, f.x.shape[1])]
    assert_close_to_hf(torch.cat(outs, dim=1), f.out_cached)  # HF's cached run
    assert_close_to_hf(torch.cat(outs, dim=1), f.out)  # and the full pass
    assert len(state) == f.x.shape[1]
    assert state.nbytes() == after_prompt  # the state does not grow with the text


def test_linear_layer_in_uneven_chunks_equals_one_pass():
    f = load_fixture("qwen3_next_linear_long")
    module = mha.from_hf("qwen3_next", f.config, f.state_dict, layer_idx=f.layer_idx)
    state, bounds = RecurrentState(), [0, 1, 3, 40, 41, 70]  # shorter than the kernel, then longer
    with torch.no_grad():
        outs = [module(f.x[:, a:b], kv_cache=state) for a, b in zip(bounds, bounds[1:])]
    assert_close_to_hf(torch.cat(outs, dim=1), f.out)


def test_linear_layer_bad_input():
    f = load_fixture("qwen3_next_linear")
    module = mha.from_hf("qwen3_next", f.config, f.state_dict, layer_idx=f.layer_idx)
    with pytest.raises(TypeError, match="must be a RecurrentState .* got KVCache"):
        module(f.x, kv_cache=mha.KVCache())
    with pytest.raises(ValueError, match=r"x must have E = hidden_size = 48, got x \(2, 13, 40\)"):
        module(f.x[..., :40])
    with pytest.raises(ValueError, match=r"config is missing \['linear_conv_kernel_dim'\]"):
        config = {k: v for k, v in f.config.items() if k != "linear_conv_kernel_dim"}
        mha.from_hf("qwen3_next", config, f.state_dict, layer_idx=f.layer_idx)
    with pytest.raises(ValueError, match=r"state_dict\['dt_bias'\] has shape \(4,\), the config"):
        mha.from_hf("qwen3_next", {**f.config, "linear_num_value_heads": 2}, f.state_dict,
                    layer_idx=f.layer_idx)  # fmt: skip
    with pytest.raises(ValueError, match=r"num_value_heads \(4\) must be divisible by"):
        mha.from_hf("qwen3_next", {**f.config, "linear_num_key_heads": 3}, f.state_dict,
                    layer_idx=f.layer_idx)  # fmt: skip
