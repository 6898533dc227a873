"""mha.from_hf("deepseek_v3", ...) against Hugging Face's DeepseekV3Attention (stored fixtures).

The fixtures come from ``tools/hf_fixtures.py`` (run in a throwaway environment with
transformers); these tests need only numpy and torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import mha
from mha.models import from_hf
from mha.models.deepseek_v3 import (
    MLACache,
    YaRN,
    absorbed_decode_cost,
    hf_reference,
    rope_speeds,
    yarn_mscale,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CASES = ["deepseek_v3_qlora_interleave_yarn", "deepseek_v3_noqlora_halfsplit"]


def load(name: str) -> tuple[dict, dict, dict]:
    data = np.load(FIXTURES / f"{name}.npz")
    config = json.loads(str(data["config"]))
    state = {k[3:]: torch.from_numpy(data[k]) for k in data.files if k.startswith("sd/")}
    arrays = {
        k: torch.from_numpy(np.asarray(data[k]))
        for k in data.files
        if "/" not in k and k != "config"
    }
    return config, state, arrays


@pytest.fixture(params=CASES)
def case(request):
    return load(request.param)


def test_full_pass_equals_hugging_face(case):
    config, state, a = case
    module = mha.from_hf("deepseek_v3", config, state, layer_idx=int(a["layer_idx"]))
    with torch.no_grad():
        out = module(a["x"], a["positions"])
    assert_close(out, a["out"], atol=2e-5, rtol=1e-4)


def test_absorbed_equals_expanded_and_hugging_face(case):
    config, state, a = case
    module = from_hf(config=config, state_dict=state, family="deepseek_v3")
    with torch.no_grad():
        out = module(a["x"], a["positions"], absorbed=True)
    assert_close(out, a["out"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decoding_equals_hugging_face_cache(case, absorbed):
    config, state, a = case
    module = from_hf("deepseek_v3", config, state)
    x, pos, p = a["x"], a["positions"], int(a["prefill"])
    cache = MLACache()
    with torch.no_grad():
        outs = [module(x[:, :p], pos[:p], cache=cache)]
        for t in range(p, x.shape[1]):
            outs.append(module(x[:, t : t + 1], pos[t : t + 1], cache=cache, absorbed=absorbed))
    assert_close(torch.cat(outs, dim=1), a["out_decoded"], atol=2e-5, rtol=1e-4)
    B, S = x.shape[:2]
    C, R = config["kv_lora_rank"], config["qk_rope_head_dim"]
    assert cache.nbytes == B * S * (C + R) * 4  # float32: latent and one rope key per token


def test_default_positions_continue_the_cache():
    config, state, a = load(CASES[1])
    module = from_hf("deepseek_v3", config, state)
    x = a["x"]
    cache = MLACache()
    with torch.no_grad():
        whole = module(x)  # positions 0 … L-1
        parts = [module(x[:, :4], cache=cache), module(x[:, 4:], cache=cache)]
    assert_close(torch.cat(parts, dim=1), whole, atol=2e-5, rtol=1e-4)


def test_batch_positions_are_per_sequence():
    config, state, a = load(CASES[0])
    module = from_hf("deepseek_v3", config, state)
    x, pos = a["x"], a["positions"]
    with torch.no_grad():
        shared = module(x, pos)
        per_row = module(x, torch.stack([pos, pos + 5]))
        shifted = module(x[1:], pos + 5)
    assert_close(per_row[0], shared[0])
    assert_close(per_row[1:], shifted, atol=2e-5, rtol=1e-4)


def test_yarn_speeds_and_temperature():
    # Fast pairs keep their speed, slow pairs are slowed by the factor; no YaRN: plain RoPE.
    plain, one = rope_speeds(64, 10000.0)
    assert one == 1.0
    assert_close(plain, 10000.0 ** (-torch.arange(0, 64, 2) / 64))
    yarn = YaRN(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    speeds, factor = rope_speeds(64, 10000.0, yarn)
    assert_close(speeds[:4], plain[:4])
    assert_close(speeds[-4:], plain[-4:] / 40.0)
    assert factor == 1.0  # mscale == mscale_all_dim: V3's cos and sin are not scaled ...
    assert yarn_mscale(40.0, 1.0) == pytest.approx(1 + 0.1 * np.log(40.0))  # ... its scores are


def test_absorbed_decode_intensity_of_v3():
    flops, nbytes = absorbed_decode_cost(128, 512, 64, bytes_per_element=2)
    assert nbytes == 576 * 2
    assert flops == 128 * (2 * 576 + 2 * 512)
    assert flops / nbytes == pytest.approx(241.78, abs=0.01)


def test_checkpoint_style_config_is_read():
    # config.json of the released checkpoints: rope_theta and rope_scaling at the top level.
    config, state, a = load(CASES[0])
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    params = dict(config["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    old["rope_scaling"] = params
    module = from_hf("deepseek_v3", old, state)
    with torch.no_grad():
        assert_close(module(a["x"], a["positions"]), a["out"], atol=2e-5, rtol=1e-4)


def test_bad_family_config_and_weights_raise_naming_what_is_wrong():
    config, state, a = load(CASES[0])
    with pytest.raises(ValueError, match="unknown family 'deepseek_v9'"):
        from_hf("deepseek_v9", config, state)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        from_hf("deepseek_v3", {k: v for k, v in config.items() if k != "kv_lora_rank"}, state)
    with pytest.raises(ValueError, match=r"missing keys \['kv_a_layernorm.weight'\]"):
        from_hf(
            "deepseek_v3", config, {k: v for k, v in state.items() if "kv_a_layernorm" not in k}
        )
    with pytest.raises(ValueError, match=r"unexpected keys \['q_proj.weight'\]"):
        from_hf("deepseek_v3", config, {**state, "q_proj.weight": state["q_b_proj.weight"]})
    wider = {**config, "v_head_dim": config["v_head_dim"] + 2}
    with pytest.raises(ValueError, match="kv_b_proj.weight: expected"):
        from_hf("deepseek_v3", wider, state)
    no_lora = {**config, "q_lora_rank": None}  # weights of a q-LoRA layer, config without it
    with pytest.raises(ValueError, match="missing keys \\['q_proj.weight'\\]"):
        from_hf("deepseek_v3", no_lora, state)
    with pytest.raises(ValueError, match="layer_idx"):
        from_hf("deepseek_v3", config, state, layer_idx=config["num_hidden_layers"])
    linear = {**config, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(ValueError, match="rope type 'linear'"):
        from_hf("deepseek_v3", linear, state)


def test_bad_inputs_raise():
    config, state, a = load(CASES[1])
    module = from_hf("deepseek_v3", config, state)
    x = a["x"]
    with pytest.raises(ValueError, match="width 32"):
        module(x[..., :16])
    with pytest.raises(ValueError, match="positions must have shape"):
        module(x, torch.arange(3))
    with pytest.raises(TypeError, match="positions"):
        module(x, torch.arange(x.shape[1]).float())
    with pytest.raises(TypeError, match="MLACache"):
        module(x, cache=mha.KVCache())


def test_package_data_reference_equals_hugging_face():
    # the small layer section 10.3 loads (package data: Colab has no tests/ folder)
    ref = hf_reference()
    module = from_hf("deepseek_v3", ref["config"], ref["state_dict"])
    assert ref["config"]["q_lora_rank"] and ref["config"]["rope_interleave"]
    assert ref["config"]["rope_parameters"]["rope_type"] == "yarn"
    with torch.no_grad():
        assert_close(module(ref["x"], ref["positions"]), ref["out"], atol=2e-5, rtol=1e-4)
        assert_close(
            module(ref["x"], ref["positions"], absorbed=True), ref["out"], atol=2e-5, rtol=1e-4
        )
