"""Multi-head attention, from intuition to GPU: the code of the course.

The package mirrors PyTorch's names and argument order, so what you learn here transfers:

* :func:`scaled_dot_product_attention` — the readable reference (``mha/attention.py``)
* :func:`flash_attention` — FlashAttention's tiled forward pass in plain PyTorch (``mha/flash.py``)
* :func:`linear_attention` — kernel-feature-map attention in O(L) (``mha/linear_attention.py``)
* :func:`causal_mask`, :func:`padding_mask`, :func:`sliding_window_mask` — keep-masks (``mha/masks.py``)
* :class:`MultiHeadAttention`, :class:`KVCache` — the module and its decoding cache (``mha/multihead.py``)
* :class:`PreallocatedKVCache`, :class:`PagedKVCache`, :func:`flash_decoding` — caches that serve
  and split-KV decoding (``mha/decoding.py``)
* :func:`apply_rope` — rotary position embedding, Llama's rotate-half pairing (``mha/rope.py``)
* :class:`MultiHeadLatentAttention`, :class:`LatentCache` — DeepSeek's latent attention (``mha/mla.py``)
* :func:`kv_cache_bytes`, :class:`AttentionConfig` — KV-cache memory of real models (``mha/kv_memory.py``)
* :mod:`mha.flex` — the course's masks as FlexAttention ``mask_mod``/``score_mod`` functions
* :func:`expect_error` — show a deliberate error in a notebook without stopping it (``mha/demo.py``)
* :mod:`mha.validation` — the argument checks every public function shares
* :mod:`mha.bench`, :mod:`mha.claims`, :mod:`mha.viz`, :mod:`mha.hardware`, :mod:`mha.exercises` —
  measuring, asserting a measured claim with its margin, drawing, inspecting the machine, and
  checking your answers to the exercises (loaded on first use).
"""

import importlib

from .attention import scaled_dot_product_attention, softmax
from .decoding import PagedKVCache, PreallocatedKVCache, flash_decoding, merge_partials
from .demo import expect_error
from .flash import flash_attention, online_softmax_update, tile_schedule
from .kv_memory import AttentionConfig, kv_cache_bytes
from .linear_attention import linear_attention
from .masks import causal_mask, causal_mask_bottom_right, padding_mask, sliding_window_mask
from .mla import LatentCache, MultiHeadLatentAttention
from .multihead import KVCache, MultiHeadAttention
from .rope import apply_rope, rope_frequencies

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("bench", "claims", "exercises", "flex", "hardware", "viz")


def __getattr__(name: str):
    # mha.bench, mha.exercises, mha.hardware and mha.viz load on first use: `import mha` stays
    # light (no matplotlib), and the exercises, which build on all of mha, import it without a cycle.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionConfig",
    "KVCache",
    "LatentCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PagedKVCache",
    "PreallocatedKVCache",
    "apply_rope",
    "bench",
    "causal_mask",
    "causal_mask_bottom_right",
    "claims",
    "exercises",
    "expect_error",
    "flash_attention",
    "flash_decoding",
    "flex",
    "hardware",
    "kv_cache_bytes",
    "linear_attention",
    "merge_partials",
    "online_softmax_update",
    "padding_mask",
    "rope_frequencies",
    "scaled_dot_product_attention",
    "sliding_window_mask",
    "softmax",
    "tile_schedule",
    "viz",
]
