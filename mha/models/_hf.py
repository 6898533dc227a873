"""What the families share: reading an HF config, loading an HF state_dict, checking inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .. import validation as validate
from ..multihead import ContiguousCache
from ..rope import _rope_frequencies, yarn_frequencies


def require(config: Mapping[str, Any], family: str, *keys: str) -> list[Any]:
    """The values of ``keys`` in ``config``; a ValueError naming every missing one."""
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValueError(f"{family} config is missing {missing}")
    return [config[k] for k in keys]


def layer_type(config: Mapping[str, Any], family: str, layer_idx: int) -> str:
    """``config["layer_types"][layer_idx]`` (e.g. ``"sliding_attention"``), checked."""
    (types,) = require(config, family, "layer_types")
    if layer_idx >= len(types):
        raise ValueError(
            f"layer_idx must be < {len(types)} (the config's layer_types), got {layer_idx}"
        )
    return str(types[layer_idx])


def head_dim(config: Mapping[str, Any], family: str) -> int:
    """``head_dim`` if the config has one, else ``hidden_size // num_attention_heads``."""
    if config.get("head_dim") is not None:
        return int(config["head_dim"])
    E, H = require(config, family, "hidden_size", "num_attention_heads")
    return int(E) // int(H)


def attention_dims(config: Mapping[str, Any], family: str) -> tuple[int, int, int, int]:
    """``(E, H, Hkv, D)`` of a GQA layer: hidden size, query heads, key/value heads, head dim."""
    E, H, Hkv = require(config, family, "hidden_size", "num_attention_heads", "num_key_value_heads")
    return int(E), int(H), int(Hkv), head_dim(config, family)


def check_layer_idx(config: Mapping[str, Any], layer_idx: int) -> None:
    """A ValueError unless ``0 <= layer_idx < num_hidden_layers`` (when the config says it)."""
    layers = config.get("num_hidden_layers")
    if layers is not None and not 0 <= layer_idx < layers:
        raise ValueError(f"layer_idx ({layer_idx}) must be in [0, {layers}) (num_hidden_layers)")


def projections(
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    bias: bool,
    q_parts: int = 1,
) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """``q_proj, k_proj, v_proj, o_proj`` of a GQA layer (``q_proj`` makes ``q_parts`` vectors of
    ``head_dim`` per head, e.g. 2 for a query and a gate); a ValueError unless ``num_kv_heads``
    divides ``num_heads``."""
    validate.divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
    return (
        nn.Linear(hidden_size, num_heads * head_dim * q_parts, bias=bias),
        nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias),
        nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias),
        nn.Linear(num_heads * head_dim, hidden_size, bias=bias),
    )


def rope(config: Mapping[str, Any], family: str, head_dim: int) -> tuple[Tensor, float, int]:
    """RoPE as the config sets it: ``(frequencies (R/2,), attention_factor, rotary_dim R)``.

    Reads ``rope_parameters`` (transformers >= 5) or the older top-level ``rope_theta`` with
    ``rope_scaling``; ``partial_rotary_factor`` there or at the top level; rope types ``default``
    and ``yarn``.
    """
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params = dict(config.get("rope_scaling") or {})
        if config.get("rope_theta") is not None:
            params.setdefault("rope_theta", config["rope_theta"])
    if params.get("rope_theta") is None:
        raise ValueError(f"{family} config is missing ['rope_theta'] (in rope_parameters)")
    base = float(params["rope_theta"])
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    R = int(head_dim * float(partial))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return _rope_frequencies(R, base, torch.float32, None), 1.0, R
    if kind != "yarn":
        raise ValueError(f"{family}: rope_type must be 'default' or 'yarn', got {kind!r}")
    if params.get("original_max_position_embeddings") is None:
        raise ValueError(f"{family} config is missing ['original_max_position_embeddings']")
    L0 = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # as HF: the ratio of the new context to the trained one
        (max_pos,) = require(config, family, "max_position_embeddings")
        factor = max_pos / L0
    frequencies, attention_factor = yarn_frequencies(
        R,
        base=base,
        factor=float(factor),
        original_max_position_embeddings=L0,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
    )
    if params.get("attention_factor") is not None:
        attention_factor = float(params["attention_factor"])
    return frequencies, attention_factor, R


M = TypeVar("M", bound=nn.Module)


def check_keys(expected: Mapping[str, Any], state_dict: Mapping[str, Any], what: str) -> None:
    """A ValueError naming the keys of ``expected`` that ``state_dict`` lacks and the ones it
    has besides (``what`` names it in the message, e.g. ``"gpt_oss state_dict"``)."""
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{what} does not fit the config: missing keys {missing}, unexpected keys {unexpected}"
        )


def load(module: M, state_dict: Mapping[str, Any], family: str) -> M:
    """Copy HF's weights into ``module`` (same keys); a ValueError names what does not fit."""
    expected = module.state_dict()
    check_keys(expected, state_dict, f"{family} state_dict")
    weights = {}
    for name, target in expected.items():
        value = torch.as_tensor(state_dict[name])
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{family} state_dict[{name!r}] has shape {tuple(value.shape)}, "
                f"the config implies {tuple(target.shape)}"
            )
        weights[name] = value.to(target.dtype)
    module.load_state_dict(weights)
    return module


def check_input(x: Any, positions: Any, hidden_size: int, kv_cache: Any = None) -> int | Tensor:
    """Check ``x`` ``(B, L, E)``, positions ``(L,)`` or ``(B, L)`` and the cache; return the
    positions as RoPE wants them for ``(B, H, L, D)``: an int offset (the tokens already cached),
    ``(L,)`` or ``(B, 1, L)``."""
    if kv_cache is not None and not isinstance(kv_cache, ContiguousCache):
        raise TypeError(
            "kv_cache must be a cache whose update returns all its keys and values (mha.KVCache, "
            f"PreallocatedKVCache, QuantizedKVCache), got {type(kv_cache).__name__}"
        )
    validate.tensor("x", x, floating=True, ndim=3, layout="(B, L, E)")
    B, L, E = x.shape
    if E != hidden_size:
        raise ValueError(f"x must have E = hidden_size = {hidden_size}, got x {tuple(x.shape)}")
    if positions is None:
        return 0 if kv_cache is None else len(kv_cache)
    validate.integer_tensor("positions", positions)
    if tuple(positions.shape) not in {(L,), (B, L)}:
        raise ValueError(
            f"positions must have shape (L,) = ({L},) or (B, L) = ({B}, {L}), "
            f"got {tuple(positions.shape)}"
        )
    return positions if positions.dim() == 1 else positions[:, None, :]  # (L,) or (B, 1, L)


def causal_keep_mask(L: int, S: int, window: int | None, device: torch.device) -> Tensor:
    """Keep-mask of ``L`` new queries over ``S`` keys, the queries being the last ``L`` tokens
    (bottom-right: the cache holds the first ``S - L``): key ``j`` is kept for query ``i`` when
    ``j <= i`` and, in a sliding layer, ``i - j < window``.

    Shapes:
        returns ``(L, S)`` bool.
    """
    i = torch.arange(S - L, S, device=device)[:, None]  # (L, 1) the queries' token indices
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    keep = j <= i  # (L, S)
    return keep if window is None else keep & (i - j < window)
