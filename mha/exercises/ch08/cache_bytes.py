"""Section 8.5, shrinking the cache: the exercise as data for :mod:`.._harness`.

Reference: the bytes of a KV cache summed layer by layer; mistakes: only keys cached, query heads
for kv heads, the window ignored, applied to every layer, to none when ``window_layers`` is None,
to the wrong layers, or kept at its full size for a short context, MLA counted as heads, without
its RoPE key or twice; and ``mha.kv_cache_bytes``, which the exercise bans.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mha
from mha import kv_memory
from mha.kv_memory import CONFIGS, AttentionConfig

from .._harness import Case, Exercise, defined_in, publish, whole

# --- the bytes of a KV cache ----------------------------------------------------------------------


def _cache_bytes_reference(config: AttentionConfig, seq_len: int, nbytes: int) -> int:
    """Per layer: the tokens it keeps (a windowed layer at most its window) times the numbers
    cached per token (a key and a value per kv head, or MLA's latent and RoPE key)."""
    if config.kv_lora_rank is not None:  # MLA: one latent and one shared RoPE key per token
        per_token = config.kv_lora_rank + config.qk_rope_head_dim
    else:  # MHA, GQA, MQA: a key and a value per key/value head
        per_token = 2 * config.num_kv_heads * config.head_dim
    W, local = config.sliding_window, config.window_layers
    tokens = 0
    for layer in range(config.num_layers):
        windowed = W is not None and (local is None or layer in local)
        tokens += min(seq_len, W) if windowed and W is not None else seq_len
    return tokens * per_token * nbytes


def _cache_bytes_cases() -> list[Case]:
    """Every kind of the chapter's table (published configurations), contexts shorter and longer
    than the windows, toy shapes that change one field at a time, and 1, 2, 4 bytes a number."""
    mla = {"kv_lora_rank": 12, "qk_rope_head_dim": 4}
    toys = {  # GQA with windows in the odd layers; MLA without a RoPE key; MLA, one window
        "toy-windowed-odd": AttentionConfig("toy", 5, 8, 2, 16, 6, window_layers=(1, 3)),
        "toy-MLA-no-rope": AttentionConfig("toy", 3, 4, 4, 8, kv_lora_rank=24),
        "toy-MLA-windowed": AttentionConfig("toy", 4, 4, 4, 8, 5, window_layers=(0,), **mla),
    }
    calls = (
        ("Llama-2-7B", 4096, 1),
        ("Llama-3-8B", 1000, 2),
        ("Falcon-7B", 2048, 4),
        ("Gemma-2-9B", 8192, 2),
        ("toy-windowed-odd", 20, 4),
        ("Mistral-7B-v0.1", 10000, 2),
        ("Mistral-7B-v0.1", 1000, 1),
        ("toy-windowed-odd", 4, 2),
        ("DeepSeek-V2", 4096, 2),
        ("toy-MLA-no-rope", 50, 8),
        ("toy-MLA-windowed", 9, 2),
    )
    cases = []
    for name, seq_len, nbytes in calls:
        config = toys.get(name) or CONFIGS[name]
        shown = f"CONFIGS[{name!r}]" if name in CONFIGS else repr(config)
        cases.append(Case(f"cache_bytes({shown}, {seq_len}, {nbytes})", (config, seq_len, nbytes)))
    return cases


def _cache_bytes_by_counting(config: AttentionConfig, seq_len: int, nbytes: int) -> int:
    """Windowed layers and global layers counted, not walked."""
    if config.kv_lora_rank is None:
        per_token = config.num_kv_heads * config.head_dim * 2
    else:
        per_token = config.qk_rope_head_dim + config.kv_lora_rank
    if config.sliding_window is None:
        local = 0
    elif config.window_layers is None:
        local = config.num_layers
    else:
        local = len(set(config.window_layers))
    kept = local * min(seq_len, config.sliding_window or seq_len)
    kept += (config.num_layers - local) * seq_len
    return nbytes * per_token * kept


def _cache_bytes_layers(
    config: AttentionConfig,
    seq_len: int,
    nbytes: int,
    *,
    windowed: Callable[[int], bool],
    kept: Callable[[int, int], int] = min,
    per_token: Callable[[AttentionConfig], int] | None = None,
) -> int:
    """The reference's sum with one of the usual slips: which layers are windowed, how many
    tokens a windowed layer keeps, the numbers per token."""
    per = (per_token or _numbers_per_token)(config)
    W = config.sliding_window
    tokens = sum(
        kept(seq_len, W) if W is not None and windowed(layer) else seq_len
        for layer in range(config.num_layers)
    )
    return tokens * per * nbytes


def _numbers_per_token(config: AttentionConfig) -> int:
    if config.kv_lora_rank is not None:
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_kv_heads * config.head_dim


def _cache_slip(**slip: Any) -> Callable[[AttentionConfig, int, int], int]:
    """``cache_bytes`` with a slip: ``per_token`` (a function of the config), ``windowed`` (a
    function of the config and the layer) or ``kept`` (tokens of a windowed layer)."""

    def answer(config: AttentionConfig, seq_len: int, nbytes: int) -> int:
        local = config.window_layers
        default = lambda layer: local is None or layer in local  # noqa: E731
        windowed = slip.get("windowed")
        return _cache_bytes_layers(
            config,
            seq_len,
            nbytes,
            windowed=partial(windowed, config) if windowed else default,
            kept=slip.get("kept", min),
            per_token=slip.get("per_token"),
        )

    return answer


def _heads_per_token(count_heads: Callable[[AttentionConfig], int]) -> Callable[..., int]:
    """Numbers per token of a slip in the head count, MLA's layers right."""
    return lambda c: _numbers_per_token(c) if c.kv_lora_rank is not None else count_heads(c)


def _mla_per_token(mla: Callable[[AttentionConfig], int]) -> Callable[..., int]:
    """Numbers per token of a slip in MLA's latent, the other layers right."""
    return lambda c: mla(c) if c.kv_lora_rank is not None else _numbers_per_token(c)


_PER_TOKEN_PROPERTY = vars(AttentionConfig)["elements_per_token_per_layer"]
_NO_KV_CACHE_BYTES = (
    "count the bytes yourself from the config's fields, without mha.kv_cache_bytes or the "
    "config's methods and properties (elements_per_token_per_layer, uses_window, kind)."
)
_HINT_CACHE_BYTES = (
    "Sum over the layers: tokens kept × numbers per token × bytes_per_element. A layer keeps "
    "min(seq_len, sliding_window) tokens if it uses the window (window_layers=None: every "
    "layer), else seq_len; a token holds 2 · num_kv_heads · head_dim numbers, or "
    "kv_lora_rank + qk_rope_head_dim under MLA."
)

CACHE_BYTES = Exercise(
    "check_cache_bytes",
    "bytes of MHA, GQA, MQA, sliding-window and MLA caches, published configurations included",
    _cache_bytes_reference,
    _cache_bytes_cases,
    variants=(
        _cache_bytes_by_counting,
        _cache_slip(),
        lambda config, seq_len, nbytes: (
            nbytes
            * sum(
                (
                    config.kv_lora_rank + config.qk_rope_head_dim
                    if config.kv_lora_rank
                    else 2 * config.num_kv_heads * config.head_dim
                )
                * (
                    seq_len
                    if config.sliding_window is None
                    or config.window_layers is not None
                    and layer not in config.window_layers
                    else min(seq_len, config.sliding_window)
                )
                for layer in range(config.num_layers)
            )
        ),
    ),
    mistakes=(
        (
            lambda config, seq_len, nbytes: mha.kv_cache_bytes(
                config, seq_len, bytes_per_element=nbytes
            ),
            _NO_KV_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=lambda c: c.elements_per_token_per_layer),
            _NO_KV_CACHE_BYTES,
        ),
        (
            lambda config, seq_len, nbytes: _cache_bytes_reference(config, seq_len, 1),
            "These are numbers, not bytes: multiply by bytes_per_element. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=_heads_per_token(lambda c: c.num_kv_heads * c.head_dim)),
            "Only the keys: a cached token holds a key and a value per key/value head, "
            "2 · num_kv_heads · head_dim numbers. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=_heads_per_token(lambda c: 2 * c.num_heads * c.head_dim)),
            "The cache holds the key/value heads only: num_kv_heads, not num_heads (GQA and MQA "
            "share each of them among several query heads). " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(
                windowed=lambda c, layer: c.window_layers is not None and layer in c.window_layers
            ),
            "window_layers=None means every layer uses the window (Mistral); only a tuple names "
            "some of them. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(
                windowed=lambda c, layer: (
                    c.window_layers is not None and layer not in c.window_layers
                )
            ),
            "Local and global are swapped: the layers listed in window_layers are the windowed "
            "ones. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(windowed=lambda config, layer: False),
            "The window is ignored: a sliding-window layer keeps only the last sliding_window "
            "tokens (a rolling buffer), min(seq_len, sliding_window). " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(windowed=lambda config, layer: True),
            "Only the layers in window_layers use the window (Gemma 2 alternates local and "
            "global layers); the others keep all seq_len tokens. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(kept=lambda seq_len, window: window),
            "While the context is shorter than the window, a windowed layer holds only seq_len "
            "tokens: min(seq_len, sliding_window), not sliding_window. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=lambda c: 2 * c.num_kv_heads * c.head_dim),
            "An MLA layer (kv_lora_rank set) caches no keys and values per head: one latent of "
            "kv_lora_rank numbers and one shared RoPE key of qk_rope_head_dim per token, from "
            "which every head rebuilds its keys and values. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(per_token=_mla_per_token(lambda c: c.kv_lora_rank or 0)),
            "MLA also caches its decoupled RoPE key, qk_rope_head_dim numbers per token and "
            "layer, next to the latent: kv_lora_rank + qk_rope_head_dim. " + _HINT_CACHE_BYTES,
        ),
        (
            _cache_slip(
                per_token=_mla_per_token(lambda c: 2 * ((c.kv_lora_rank or 0) + c.qk_rope_head_dim))
            ),
            "MLA's latent is cached once and serves as both key and value: kv_lora_rank + "
            "qk_rope_head_dim numbers, not twice that. " + _HINT_CACHE_BYTES,
        ),
    ),
    hint=_HINT_CACHE_BYTES,
    crash_hint="cache_bytes(config, seq_len, bytes_per_element) reads the fields of an "
    "mha.AttentionConfig (num_layers, num_kv_heads, head_dim, sliding_window, window_layers, "
    "kv_lora_rank, qk_rope_head_dim) and returns an int.",
    convert=whole,
    forbidden=(*defined_in(kv_memory), _PER_TOKEN_PROPERTY.fget, AttentionConfig.uses_window),
    forbidden_hint=_NO_KV_CACHE_BYTES,
    rewrites=(mha.kv_cache_bytes,),
    params=("cache_bytes",),
    doc="Check ``cache_bytes(config, seq_len, bytes_per_element) -> int``: the bytes of key/value "
    "cache of one sequence of ``seq_len`` tokens for an ``mha.AttentionConfig`` (MHA, GQA, MQA, "
    "sliding-window layers, MLA), as ``mha.kv_cache_bytes`` counts them.",
)


EXERCISES = publish(globals())
