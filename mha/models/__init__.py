"""Attention layers of 2026's open models, built from a Hugging Face module's config and weights.

:func:`from_hf` reads the config (``config.to_dict()``) and the attention module's own
``state_dict`` and returns our module, built from the course's pieces (``mha.rope``,
``mha.scaled_dot_product_attention`` with its ``sinks``, ``mha.norms``, the masks); the tests
check that it gives Hugging Face's output. One module per family:

* ``gpt_oss`` (:mod:`mha.models.gpt_oss`) — learned sinks, sliding/full layers, YaRN RoPE;
* ``qwen3_next`` (:mod:`mha.models.qwen3_next`) — the full-attention layer: output gate, QK-norm,
  partial RoPE; and the linear-attention layer (:mod:`mha.models.gated_deltanet`): Gated DeltaNet
  with its projections, short convolution, gates and gated RMSNorm, decoding with a fixed-size
  state per request;
* ``deepseek_v3`` (:mod:`mha.models.deepseek_v3`) — MLA: low-rank query, compressed KV with its
  RMSNorm, decoupled RoPE, YaRN;
* ``deepseek_v32`` (:mod:`mha.models.deepseek_v32`) — V3's MLA with the lightning indexer's
  top-k selection (DeepSeek Sparse Attention).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import validation as validate

# family -> the module that builds it (imported when first asked for).
FAMILIES = {
    "deepseek_v3": ".deepseek_v3",
    "deepseek_v32": ".deepseek_v32",  # V3's MLA plus the lightning indexer's top-k selection
    "gpt_oss": ".gpt_oss",
    "qwen3_next": ".qwen3_next",
}


def from_hf(
    family: str, config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int = 0
) -> nn.Module:
    """Our attention module for layer ``layer_idx`` of a Hugging Face model.

    Args:
        family: ``"gpt_oss"``, ``"qwen3_next"``, ``"deepseek_v3"`` or ``"deepseek_v32"``
            (see ``FAMILIES``).
        config: the HF config as a dict (``config.to_dict()``).
        state_dict: the HF attention module's own ``state_dict`` (its keys, e.g.
            ``"q_proj.weight"``, ``"sinks"``); tensors or numpy arrays.
        layer_idx: which layer (it decides e.g. gpt-oss's sliding window).

    Returns:
        A module called as ``module(x, positions=None, *, kv_cache=None)``: causal self-attention
        over ``x`` ``(B, L, E)`` -> ``(B, L, E)``; ``positions`` ``(L,)`` or ``(B, L)`` (default
        ``0 … L-1``, after the cached tokens with a cache) feed RoPE only. With ``kv_cache`` (e.g.
        :class:`mha.KVCache`), the tokens of ``x`` follow those already cached: decoding a chunk
        or a token at a time equals one pass over the whole sequence.

    Raises:
        ValueError: an unknown family, a config without a key the family needs, a state_dict with
            a missing, unexpected or mis-shaped weight, or a layer_idx the config does not have.
    """
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: family must be one of {sorted(FAMILIES)}")
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (config.to_dict()), got {type(config).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of weights, got {type(state_dict).__name__}")
    validate.non_negative_int("layer_idx", layer_idx)
    module = importlib.import_module(FAMILIES[family], __name__)
    return module.from_hf(config, state_dict, layer_idx=layer_idx)


class Fixture(NamedTuple):
    """One case stored by ``tools/hf_fixtures.py``: HF's module run on fixed inputs."""

    config: dict[str, Any]  # the HF config, config.to_dict()
    state_dict: dict[str, Tensor]  # the HF attention module's own weights, its own keys
    layer_idx: int
    x: Tensor  # (B, L, E) the input
    positions: Tensor  # (B, L) the positions given to RoPE
    out: Tensor  # (B, L, E) HF's output (eager attention, float32)
    prefill: int  # in the cached run, the first chunk's length; then one token at a time
    out_cached: Tensor  # (B, L, E) HF's output of that cached run (its DynamicCache)
    rope_inv_freq: Tensor  # (R/2,) HF's RoPE speeds (YaRN's where the config sets it)
    rope_attention_scaling: float  # HF's factor on cos and sin (YaRN's attention factor)
    transformers_version: str


FIXTURES = Path(__file__).parent / "fixtures"


def load_fixture(name: str) -> Fixture:
    """Load ``mha/models/fixtures/<name>.npz`` (e.g. ``"gpt_oss_sliding"``), as tensors."""
    path = FIXTURES / f"{name}.npz"
    if not path.is_file():
        known = sorted(p.stem for p in FIXTURES.glob("*.npz"))
        raise ValueError(f"no fixture named {name!r}; there are {known}")
    import numpy as np  # here: `import mha` does not need numpy

    with np.load(path) as data:
        state = {k.split("/", 1)[1]: torch.from_numpy(data[k]) for k in data.files if "/" in k}
        return Fixture(
            config=json.loads(str(data["config"])),
            state_dict=state,
            layer_idx=int(data["layer_idx"]),
            x=torch.from_numpy(data["x"]),
            positions=torch.from_numpy(data["positions"]),
            out=torch.from_numpy(data["out"]),
            prefill=int(data["prefill"]),
            out_cached=torch.from_numpy(data["out_cached"]),
            rope_inv_freq=torch.from_numpy(data["rope_inv_freq"]),
            rope_attention_scaling=float(data["rope_attention_scaling"]),
            transformers_version=str(data["transformers_version"]),
        )


__all__ = ["FAMILIES", "Fixture", "from_hf", "load_fixture"]
