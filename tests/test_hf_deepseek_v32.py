"""mha.from_hf("deepseek_v32", ...) against Hugging Face's DeepseekV32Attention (a stored fixture):
V3's MLA whose keys the lightning indexer thins to the top k per query."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import mha

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v32_indexer.npz"


@pytest.fixture(scope="module")
def case():
    data = np.load(FIXTURE)
    config = json.loads(str(data["config"]))
    state = {k[3:]: torch.from_numpy(data[k]) for k in data.files if k.startswith("sd/")}
    arrays = {k: torch.from_numpy(data[k]) for k in data.files if "/" not in k and k != "config"}
    return config, state, arrays


def test_sparse_attention_equals_hugging_face(case):
    config, state, a = case
    module = mha.from_hf("deepseek_v32", config, state)
    assert config["index_topk"] < a["x"].shape[1]  # the selection really drops keys
    with torch.no_grad():
        out = module(a["x"], a["positions"])
    assert_close(out, a["out"], atol=2e-5, rtol=1e-4)


def test_indexer_selects_the_keys_hugging_face_selects(case):
    config, state, a = case
    module = mha.from_hf("deepseek_v32", config, state)
    with torch.no_grad():
        _, index_scores = module(a["x"], a["positions"], return_index_scores=True)
    keep = mha.topk_keep_mask(index_scores, config["index_topk"])  # (B, L, L)
    B, L = a["x"].shape[:2]
    hf = torch.zeros(B, L, L, dtype=torch.bool).scatter(-1, a["topk_indices"].long(), True)
    visible = torch.ones(L, L, dtype=torch.bool).tril()  # HF fills short rows with hidden keys
    assert torch.equal(keep, hf & visible)


def test_sparse_differs_from_dense_mla(case):
    # the same weights without the indexer (V3's layer): the selection changes the output
    config, state, a = case
    dense_state = {k: v for k, v in state.items() if not k.startswith("indexer.")}
    dense = mha.from_hf("deepseek_v3", config, dense_state)
    with torch.no_grad():
        gap = (dense(a["x"], a["positions"]) - a["out"]).abs().max()
    assert gap > 1e-2


def test_missing_config_and_weights_raise(case):
    config, state, a = case
    with pytest.raises(ValueError, match="index_topk"):
        mha.from_hf("deepseek_v32", {k: v for k, v in config.items() if k != "index_topk"}, state)
    with pytest.raises(ValueError, match=r"missing keys \['indexer.k_norm.bias'\]"):
        mha.from_hf(
            "deepseek_v32", config, {k: v for k, v in state.items() if k != "indexer.k_norm.bias"}
        )
    with pytest.raises(ValueError, match="q_lora_rank"):
        mha.from_hf("deepseek_v32", {**config, "q_lora_rank": None}, state)


def test_bad_inputs_raise(case):
    config, state, a = case
    module = mha.from_hf("deepseek_v32", config, state)
    with pytest.raises(ValueError, match="positions must have shape"):
        module(a["x"], torch.arange(3))
    with pytest.raises(ValueError, match="hidden_size"):
        module(a["x"][..., :8])
