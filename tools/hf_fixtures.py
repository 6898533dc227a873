"""Build the small fixtures that test ``mha.from_hf`` against Hugging Face's own attention code.

Run it in a throwaway environment that has ``transformers`` (the course's environment does not)::

    /tmp/hfenv/bin/python tools/hf_fixtures.py            # every family
    /tmp/hfenv/bin/python tools/hf_fixtures.py gpt_oss    # some of them

(DeepSeek's families live in ``tools/hf_fixtures_deepseek.py``; this entry point runs them too.)

For each family a tiny random configuration is built, HF's attention module for one layer is
instantiated (eager attention), its weights are drawn from a seeded generator, and it runs on fixed
inputs. Each case is saved as ``mha/models/fixtures/<family>_<case>.npz`` (package data, so that a
chapter on Colab, where ``mha`` is installed with pip, can load it too) holding:

* ``config``: the HF config as a JSON string (``config.to_dict()``), ``layer_idx``;
* ``state_dict/<key>``: the module's own ``state_dict``, under its own keys;
* ``x`` (B, L, E), ``positions`` (B, L) and ``out`` (B, L, E), HF's output;
* ``prefill`` and ``out_cached`` (B, L, E): HF's output when the first ``prefill`` tokens run as
  one chunk and the others one at a time, with HF's own ``DynamicCache`` (a sliding layer's cache
  keeps only the last ``sliding_window - 1`` tokens);
* ``transformers_version``.

The tests (``tests/test_hf_<family>.py``) and the chapters read them with
``mha.models.load_fixture`` (numpy and torch only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_fixtures_deepseek  # noqa: E402 (tools/ is not a package)

OUT_DIR = Path(__file__).resolve().parent.parent / "mha" / "models" / "fixtures"


def _fill(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Draw every parameter of ``module`` from a seeded normal (HF leaves some uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _causal_float_mask(L: int, window: int | None) -> torch.Tensor:
    """HF's eager mask for one sequence: 0 where key j may be seen by query i, else finfo.min.

    Causal: j <= i; HF's sliding-window overlay adds j > i - window.
    """
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    keep = j <= i
    if window is not None:
        keep &= j > i - window
    mask = torch.zeros(L, L)
    mask[~keep] = torch.finfo(torch.float32).min
    return mask[None, None]  # (1, 1, L, L)


def _cached(config, attn, rotary, x, positions, window: int | None, prefill: int):
    """HF's module on a prefill chunk, then token by token, with HF's DynamicCache."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    outs = []
    with torch.no_grad():
        chunk = slice(0, prefill)
        cos_sin = rotary(x[:, chunk], positions[:, chunk])
        out, _ = attn(x[:, chunk], cos_sin, _causal_float_mask(prefill, window), cache=cache)
        outs.append(out)
        for t in range(prefill, x.shape[1]):
            step = slice(t, t + 1)
            cos_sin = rotary(x[:, step], positions[:, step])
            # no mask: a decode step sees every key the cache returns (a sliding layer's cache
            # returns only the window)
            out, _ = attn(x[:, step], cos_sin, None, cache=cache)
            outs.append(out)
    return torch.cat(outs, dim=1)


def _save(
    family: str,
    case: str,
    config,
    layer_idx: int,
    module,
    x,
    positions,
    out,
    prefill,
    out_cached,
    rotary,
) -> None:
    # HF's cached decoding must equal its own full pass, or the masks above are wrong.
    torch.testing.assert_close(out_cached, out, atol=1e-5, rtol=1e-5)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    arrays = {
        "prefill": np.array(prefill),
        "rope_inv_freq": rotary.inv_freq.numpy(),  # HF's RoPE speeds (YaRN's, if set)
        "rope_attention_scaling": np.array(float(rotary.attention_scaling)),
        "out_cached": out_cached.detach().numpy(),
        "config": np.array(json.dumps(config.to_dict(), default=str, sort_keys=True)),
        "layer_idx": np.array(layer_idx),
        "x": x.numpy(),
        "positions": positions.numpy(),
        "out": out.detach().numpy(),
        "transformers_version": np.array(transformers.__version__),
    }
    for key, value in module.state_dict().items():
        arrays[f"state_dict/{key}"] = value.detach().numpy()
    path = OUT_DIR / f"{family}_{case}.npz"
    np.savez_compressed(path, **arrays)
    print(f"{path.relative_to(OUT_DIR.parent.parent.parent)}: {path.stat().st_size} bytes")


def _inputs(seed: int, B: int, L: int, E: int, offsets: list[int]) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, E, generator=gen)
    positions = torch.stack([torch.arange(L) + o for o in offsets])  # (B, L)
    return x, positions


# --- gpt-oss: learned sinks, sliding/full alternation, YaRN -------------------------------------


def make_gpt_oss() -> None:
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    config = m.GptOssConfig(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,  # layer_types: sliding, full (gpt-oss's alternation)
        sliding_window=4,
        max_position_embeddings=131072,
        rope_parameters={  # gpt-oss's own YaRN settings, on a smaller head
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        attention_bias=True,
    )
    config._attn_implementation = "eager"
    rotary = m.GptOssRotaryEmbedding(config)
    B, L = 2, 11
    for layer_idx, case in [(0, "sliding"), (1, "full")]:
        assert config.layer_types[layer_idx] == f"{case}_attention"
        attn = m.GptOssAttention(config, layer_idx).eval()
        _fill(attn, seed=10 + layer_idx)
        with torch.no_grad():
            attn.sinks.mul_(4.0)  # sinks of a few units, as trained ones are
        x, positions = _inputs(20 + layer_idx, B, L, config.hidden_size, [0, 5000])
        window = config.sliding_window if case == "sliding" else None
        with torch.no_grad():
            cos_sin = rotary(x, positions)
            out, _ = attn(x, cos_sin, _causal_float_mask(L, window))
        cached = _cached(config, attn, rotary, x, positions, window, prefill=6)
        _save("gpt_oss", case, config, layer_idx, attn, x, positions, out, 6, cached, rotary)


def make_gpt_oss_variant() -> None:
    """Other settings HF's class accepts: no biases, no GQA, a wider model, YaRN with
    rounded boundaries and a smaller factor."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    config = m.GptOssConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_hidden_layers=4,
        sliding_window=3,
        max_position_embeddings=4096,  # 8 × 512
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "truncate": True,
            "original_max_position_embeddings": 512,
        },
        attention_bias=False,
    )
    config._attn_implementation = "eager"
    rotary = m.GptOssRotaryEmbedding(config)
    layer_idx, B, L = 2, 2, 9
    assert config.layer_types[layer_idx] == "sliding_attention"
    attn = m.GptOssAttention(config, layer_idx).eval()
    _fill(attn, seed=50)
    with torch.no_grad():
        attn.sinks.mul_(4.0)
    x, positions = _inputs(60, B, L, config.hidden_size, [0, 900])
    with torch.no_grad():
        out, _ = attn(x, rotary(x, positions), _causal_float_mask(L, config.sliding_window))
    cached = _cached(config, attn, rotary, x, positions, config.sliding_window, prefill=4)
    _save("gpt_oss", "variant", config, layer_idx, attn, x, positions, out, 4, cached, rotary)


# --- Qwen3-Next: the full-attention layer (output gate, QK-norm, partial RoPE) ------------------


def make_qwen3_next() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    max_positions = {"full": 32768, "full_bias": 32768, "yarn": 256}  # yarn: 4 × 64
    default = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    for case, bias, rope in [
        ("full", False, default),
        ("full_bias", True, default),
        ("yarn", False, yarn),
    ]:
        config = m.Qwen3NextConfig(
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=4,  # three Gated DeltaNet layers, then one full-attention layer
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=rope,
            max_position_embeddings=max_positions[case],
            attention_bias=bias,
        )
        config._attn_implementation = "eager"
        rotary = m.Qwen3NextRotaryEmbedding(config)
        layer_idx = 3
        attn = m.Qwen3NextAttention(config, layer_idx).eval()
        _fill(attn, seed=30 + bias)
        B, L = 2, 9
        x, positions = _inputs(40 + bias, B, L, config.hidden_size, [0, 37])
        with torch.no_grad():
            cos_sin = rotary(x, positions)
            out, _ = attn(x, cos_sin, _causal_float_mask(L, None))
        cached = _cached(config, attn, rotary, x, positions, None, prefill=5)
        _save("qwen3_next", case, config, layer_idx, attn, x, positions, out, 5, cached, rotary)


def make_qwen3_next_linear() -> None:
    """Qwen3-Next's linear-attention layer (Gated DeltaNet): its projections, short convolution,
    gates and gated RMSNorm around the rule. HF's cached run keeps a convolution state and a
    recurrent state per request (its DynamicCache's linear-attention layer), no keys or values."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    cases = {  # name: (q/k heads, value heads, Dk, Dv, conv kernel, L, prefill)
        "linear": (2, 4, 8, 6, 4, 13, 5),  # two value heads per q/k head, as Qwen3-Next (16, 32)
        "linear_long": (2, 2, 8, 8, 3, 70, 66),  # two chunks of 64; no grouping
    }
    for seed, (case, (Hk, Hv, Dk, Dv, K, L, prefill)) in enumerate(cases.items()):
        config = m.Qwen3NextConfig(
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=Hk,
            linear_num_value_heads=Hv,
            linear_key_head_dim=Dk,
            linear_value_head_dim=Dv,
            linear_conv_kernel_dim=K,
        )
        config._attn_implementation = "eager"
        layer_idx, B = 1, 2
        layer = m.Qwen3NextGatedDeltaNet(config, layer_idx).eval()
        _fill(layer, seed=70 + seed)
        x, positions = _inputs(80 + seed, B, L, config.hidden_size, [0, 0])
        with torch.no_grad():
            out = layer(x)
            cache = DynamicCache(config=config)
            outs = [layer(x[:, :prefill], cache=cache)]
            outs += [layer(x[:, t : t + 1], cache=cache) for t in range(prefill, L)]
        out_cached = torch.cat(outs, dim=1)
        torch.testing.assert_close(out_cached, out, atol=1e-5, rtol=1e-5)
        arrays = {
            "prefill": np.array(prefill),
            "rope_inv_freq": np.zeros(0, dtype=np.float32),  # a linear layer has no RoPE
            "rope_attention_scaling": np.array(1.0),
            "out_cached": out_cached.numpy(),
            "config": np.array(json.dumps(config.to_dict(), default=str, sort_keys=True)),
            "layer_idx": np.array(layer_idx),
            "x": x.numpy(),
            "positions": positions.numpy(),
            "out": out.numpy(),
            "transformers_version": np.array(transformers.__version__),
        }
        for key, value in layer.state_dict().items():
            arrays[f"state_dict/{key}"] = value.detach().numpy()
        path = OUT_DIR / f"qwen3_next_{case}.npz"
        np.savez_compressed(path, **arrays)
        print(f"{path.relative_to(OUT_DIR.parent.parent.parent)}: {path.stat().st_size} bytes")


def make_gpt_oss_and_variant() -> None:
    """gpt-oss's fixtures: its own settings, and the variant."""
    make_gpt_oss()
    make_gpt_oss_variant()


FAMILIES = {
    "gpt_oss": make_gpt_oss_and_variant,
    "qwen3_next": make_qwen3_next,
    "qwen3_next_linear": make_qwen3_next_linear,
    # DeepSeek V3 and V3.2 (MLA, the lightning indexer): tools/hf_fixtures_deepseek.py, whose
    # fixtures go to tests/fixtures/hf/ (section 10.3 reads mha/models/deepseek_v3_hf.json).
    **hf_fixtures_deepseek.FAMILIES,
}


# --- gated_delta: Qwen3-Next's gated delta rule (section 10.5, mha.gated_delta_rule) -----------
# (a block of its own: at a merge it goes after the FAMILIES dict, before main)
#
# HF's torch reference takes (B, L, H, D) tensors, L2-normalises q and k itself when
# use_qk_l2norm_in_kernel=True, scales q by 1/sqrt(Dk), and returns (out (B, L, H, Dv), state
# (B, H, Dk, Dv)). The fixtures store exactly what HF was called with (q and k *before* the
# l2norm) and what it returned; tests/test_gated_delta.py moves the layout to (B, H, L, D) and
# normalises q and k before calling mha.gated_delta_rule, which expects them normalised.

GATED_DELTA_ROOT = Path(__file__).resolve().parent.parent  # the repository
GATED_DELTA_DIR = GATED_DELTA_ROOT / "tests" / "fixtures" / "hf"


def _gated_delta_inputs(
    seed: int, B: int, L: int, H: int, Dk: int, Dv: int, Hk: int | None = None
) -> dict:
    """Random q, k (B, L, Hk, Dk), v (B, L, H, Dv), log-decays g <= 0, betas in (0, 1), a state
    (B, H, Dk, Dv). Hk < H: each q/k head serves H // Hk value heads (Qwen3-Next: 16 and 32)."""
    gen = torch.Generator().manual_seed(seed)
    Hk = H if Hk is None else Hk
    return {
        "query": torch.randn(B, L, Hk, Dk, generator=gen),
        "key": torch.randn(B, L, Hk, Dk, generator=gen),
        "value": torch.randn(B, L, H, Dv, generator=gen),
        # like the model: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
        "g": -torch.exp(torch.randn(H, generator=gen) * 0.5)
        * torch.nn.functional.softplus(torch.randn(B, L, H, generator=gen)),
        "beta": torch.sigmoid(torch.randn(B, L, H, generator=gen)),
        "initial_state": torch.randn(B, H, Dk, Dv, generator=gen) * 0.5,
    }


def make_gated_delta() -> None:
    """Both of HF's forms, with and without an initial state, a length that no chunk divides."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    cases = {  # name: (function, chunk_size, L, initial state?, q/k heads)
        "chunk16_state": (hf.torch_chunk_gated_delta_rule, 16, 37, True, 2),
        "chunk64": (hf.torch_chunk_gated_delta_rule, 64, 100, False, 2),
        "recurrent_state": (hf.torch_recurrent_gated_delta_rule, None, 37, True, 2),
        "recurrent": (hf.torch_recurrent_gated_delta_rule, None, 20, False, 2),
        "chunk8_shared_keys": (hf.torch_chunk_gated_delta_rule, 8, 19, True, 1),
    }
    GATED_DELTA_DIR.mkdir(parents=True, exist_ok=True)
    for seed, (case, (fn, chunk_size, L, with_state, Hk)) in enumerate(cases.items()):
        x = _gated_delta_inputs(seed, B=2, L=L, H=2, Dk=8, Dv=6, Hk=Hk)
        state = x["initial_state"] if with_state else None
        kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
        out, final = fn(
            x["query"], x["key"], x["value"], x["g"], x["beta"], initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs,
        )  # fmt: skip
        arrays = {name: t.numpy() for name, t in x.items() if with_state or name != "initial_state"}
        arrays |= {
            "out": out.numpy(),  # (B, L, H, Dv)
            "final_state": final.numpy(),  # (B, H, Dk, Dv)
            "chunk_size": np.array(-1 if chunk_size is None else chunk_size),
            "function": np.array(fn.__name__),
            "transformers_version": np.array(transformers.__version__),
        }
        path = GATED_DELTA_DIR / f"gated_delta_{case}.npz"
        np.savez_compressed(path, **arrays)
        print(f"{path.relative_to(GATED_DELTA_ROOT)}: {path.stat().st_size} bytes")


FAMILIES["gated_delta"] = make_gated_delta

# --- end of gated_delta ---------------------------------------------------------------------


def main(argv: list[str]) -> None:
    names = argv or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    torch.manual_seed(0)
    for name in names:
        FAMILIES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
