"""Attention layers of 2026's open models, built from a Hugging Face module's own config and weights.

:func:`from_hf` dispatches on the family name; each family lives in its own module and is imported
only when it is asked for, so ``import mha`` stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

# family name -> the module (in this package) whose ``from_hf(config, state_dict, layer_idx=)``
# builds it
FAMILIES: dict[str, str] = {
    "deepseek_v3": ".deepseek_v3",
    "deepseek_v32": ".deepseek_v32",  # V3's MLA plus the lightning indexer's top-k selection
}


def from_hf(
    family: str, config: Mapping[str, Any], state_dict: Mapping[str, Any], *, layer_idx: int = 0
) -> nn.Module:
    """Our module for one attention layer of a Hugging Face model, with its weights.

    Args:
        family: the model family, one of :data:`FAMILIES` (e.g. ``"deepseek_v3"``).
        config: the Hugging Face config as a dict (``config.to_dict()`` or a ``config.json``).
        state_dict: the Hugging Face attention module's own ``state_dict`` (its own keys, e.g.
            ``kv_a_proj_with_mqa.weight``); tensors or numpy arrays.
        layer_idx: which layer (families whose layers differ, e.g. sliding and full).

    Returns:
        a module ``module(x, positions=None) -> (B, L, E)``: causal self-attention equal to the
        Hugging Face module's output.

    Raises:
        ValueError: an unknown family, a config without a field the family needs, or weights that
            are missing, unexpected or of the wrong shape (the message names them).
    """
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known families: {sorted(FAMILIES)}")
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (config.to_dict()), got {type(config).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    module = importlib.import_module(FAMILIES[family], __name__)
    return module.from_hf(config, state_dict, layer_idx=layer_idx)  # type: ignore[no-any-return]


__all__ = ["FAMILIES", "from_hf"]
