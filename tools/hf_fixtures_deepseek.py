"""DeepSeek's families of tools/hf_fixtures.py (its entry point runs them too).

Run in a throwaway environment that has transformers (never the course's ``.venv``)::

    /tmp/hfenv/bin/python tools/hf_fixtures.py deepseek_v3 deepseek_v3_chapter deepseek_v32

Each family's function builds tiny random configurations, instantiates Hugging Face's own
attention module with eager attention, runs it on fixed inputs and saves
``tests/fixtures/hf/<family>_<case>.npz``: the config as a JSON string (``config``), the
module's own ``state_dict`` under its own keys (prefixed ``sd/``), the inputs, the positions and
the outputs. The tests read only these files (numpy and torch), so the course environment never
needs transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "hf"


def _save(name: str, config, module: torch.nn.Module, **arrays) -> None:
    """Write ``<name>.npz``: config JSON, ``sd/<key>`` weights and the given arrays."""
    OUT.mkdir(parents=True, exist_ok=True)
    # Any: a dict[str, ndarray] spread into savez_compressed could, for mypy, fill allow_pickle
    data: dict[str, Any] = {"config": np.array(json.dumps(config.to_dict(), default=str))}
    for key, value in module.state_dict().items():
        data[f"sd/{key}"] = value.detach().numpy()
    for key, value in arrays.items():
        data[key] = value.detach().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    path = OUT / f"{name}.npz"
    np.savez_compressed(path, **data)
    print(f"{path.relative_to(REPO)}: {path.stat().st_size / 1024:.1f} KiB")


def _save_json(path: Path, config, module: torch.nn.Module, **arrays) -> None:
    """The same content as :func:`_save` as JSON (float32 values, 9 significant digits: exact),
    for a case small enough to ship inside the package, where a chapter on Colab can read it."""

    def listed(t: torch.Tensor):
        return np.vectorize(lambda v: float(f"{v:.9g}"))(t.detach().numpy()).tolist()

    data = {
        "config": config.to_dict(),
        "state_dict": {k: listed(v) for k, v in module.state_dict().items()},
        **{k: listed(v) if isinstance(v, torch.Tensor) else v for k, v in arrays.items()},
    }
    path.write_text(json.dumps(data, default=str, separators=(",", ":")) + "\n")
    print(f"{path.relative_to(REPO)}: {path.stat().st_size / 1024:.1f} KiB")


def _additive_causal(B: int, L: int, S: int) -> torch.Tensor:
    """(B, 1, L, S) float mask, 0 where query i (the last L of S tokens) may see key j."""
    keep = torch.ones(L, S, dtype=torch.bool).tril(S - L)  # bottom-right aligned
    mask = torch.zeros(L, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    return mask.expand(B, 1, L, S)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 (MLA) and DeepSeek-V3.2 (MLA + lightning indexer)
# ---------------------------------------------------------------------------------------------

_DEEPSEEK_TINY = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    num_hidden_layers=2,
    vocab_size=64,
    intermediate_size=64,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
)

_DEEPSEEK_CASES: dict[str, dict[str, Any]] = {
    # q LoRA, DeepSeek's interleaved rope layout, YaRN with an mscale that changes the cos/sin
    # (mscale != mscale_all_dim) and the softmax scale (mscale_all_dim)
    "qlora_interleave_yarn": dict(
        q_lora_rank=12,
        rope_interleave=True,
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=8.0,
            mscale=1.0,
            mscale_all_dim=0.8,
            original_max_position_embeddings=32,
            beta_fast=32,
            beta_slow=1,
        ),
        offset=40,
    ),
    # no q LoRA (DeepSeek-V2-Lite's layout), rotate-half rope, plain RoPE, biases
    "noqlora_halfsplit": dict(
        q_lora_rank=None,
        rope_interleave=False,
        attention_bias=True,
        max_position_embeddings=64,
        rope_parameters=dict(rope_type="default", rope_theta=500.0),
        offset=3,
    ),
}


def _deepseek_config(cls, case: dict):
    kwargs = {k: v for k, v in case.items() if k != "offset"}
    config = cls(**_DEEPSEEK_TINY, **kwargs)
    config._attn_implementation = "eager"
    return config


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights everywhere, norms included (their ones would hide a missing norm)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            if "norm" in name and name.endswith("weight"):  # norm weights: around 1
                p.add_(1.0)


def make_deepseek_v3() -> None:
    from transformers import DeepseekV3Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    for name, case in _DEEPSEEK_CASES.items():
        gen = torch.Generator().manual_seed(26)
        config = _deepseek_config(DeepseekV3Config, case)
        attn = DeepseekV3Attention(config, layer_idx=1).eval()
        _randomise(attn, gen)
        rope = DeepseekV3RotaryEmbedding(config)
        B, L, prefill = 2, 9, 6
        x = torch.randn(B, L, config.hidden_size, generator=gen)
        positions = torch.arange(L) + case["offset"]  # (L,)
        pos_ids = positions.expand(B, L)
        with torch.no_grad():
            full, _ = attn(x, rope(x, pos_ids), _additive_causal(B, L, L))
            # cached decoding: a prefill of 6 tokens, then one token at a time
            cache = DynamicCache(config=config)
            steps = []
            for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]:
                xs, ps = x[:, start:stop], pos_ids[:, start:stop]
                out, _ = attn(
                    xs, rope(xs, ps), _additive_causal(B, stop - start, stop), cache=cache
                )
                steps.append(out)
            decoded = torch.cat(steps, dim=1)
        _save(
            f"deepseek_v3_{name}",
            config,
            attn,
            layer_idx=1,
            x=x,
            positions=positions,
            out=full,
            prefill=prefill,
            out_decoded=decoded,
        )


def make_deepseek_v3_chapter() -> None:
    """A smaller V3-style layer (q LoRA, interleaved rope, YaRN) shipped as package data,
    ``mha/models/deepseek_v3_hf.json``, for section 10.3 (which cannot read tests/ on Colab)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    gen = torch.Generator().manual_seed(103)
    case = dict(_DEEPSEEK_CASES["qlora_interleave_yarn"])
    tiny = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8)
    tiny |= dict(qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, q_lora_rank=8)
    config = DeepseekV3Config(
        **(_DEEPSEEK_TINY | tiny),
        **{k: v for k, v in case.items() if k not in ("offset", "q_lora_rank")},
    )
    config._attn_implementation = "eager"
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    _randomise(attn, gen)
    rope = DeepseekV3RotaryEmbedding(config)
    B, L = 1, 6
    x = torch.randn(B, L, config.hidden_size, generator=gen)
    positions = torch.arange(L) + case["offset"]
    with torch.no_grad():
        out, _ = attn(x, rope(x, positions.expand(B, L)), _additive_causal(B, L, L))
    _save_json(
        REPO / "mha" / "models" / "deepseek_v3_hf.json",
        config,
        attn,
        x=x,
        positions=positions.tolist(),
        out=out,
    )


def make_deepseek_v32() -> None:
    """DeepSeek-V3.2's attention: MLA whose keys the lightning indexer thins to the top k."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Attention,
        DeepseekV32RotaryEmbedding,
    )

    gen = torch.Generator().manual_seed(32)
    case = dict(_DEEPSEEK_CASES["qlora_interleave_yarn"])
    config = _deepseek_config(DeepseekV32Config, case)
    config.index_topk, config.index_n_heads, config.index_head_dim = 5, 3, 8
    attn = DeepseekV32Attention(config, layer_idx=0).eval()
    _randomise(attn, gen)
    rope = DeepseekV32RotaryEmbedding(config)
    B, L = 2, 12
    x = torch.randn(B, L, config.hidden_size, generator=gen)
    positions = torch.arange(L) + case["offset"]
    pos_ids = positions.expand(B, L)
    mask = _additive_causal(B, L, L)
    with torch.no_grad():
        cos_sin = rope(x, pos_ids)
        out, _ = attn(x, cos_sin, mask, position_ids=pos_ids)
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        topk = attn.indexer(x, q_resid, cos_sin, mask[:, 0], pos_ids)
    _save(
        "deepseek_v32_indexer",
        config,
        attn,
        x=x,
        positions=positions,
        out=out,
        topk_indices=topk.sort(dim=-1).values,
    )


FAMILIES: dict[str, Callable[[], None]] = {
    "deepseek_v3": make_deepseek_v3,
    "deepseek_v3_chapter": make_deepseek_v3_chapter,
    "deepseek_v32": make_deepseek_v32,
}
