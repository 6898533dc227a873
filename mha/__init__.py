"""Multi-head attention, from intuition to GPU: the code of the course.

The package mirrors PyTorch's names and argument order, so what you learn here transfers:

* :func:`scaled_dot_product_attention` — the readable reference (``mha/attention.py``)
* :func:`flash_attention` — FlashAttention's tiled forward pass in plain PyTorch (``mha/flash.py``)
* :func:`linear_attention` — kernel-feature-map attention in O(L) (``mha/linear_attention.py``)
* :func:`causal_mask`, :func:`padding_mask`, :func:`sliding_window_mask` — keep-masks (``mha/masks.py``)
* :class:`MultiHeadAttention`, :class:`KVCache` — the module and its decoding cache (``mha/multihead.py``)
* :func:`expect_error` — show a deliberate error in a notebook without stopping it (``mha/demo.py``)
* :mod:`mha.validation` — the argument checks every public function shares
* :mod:`mha.bench`, :mod:`mha.viz`, :mod:`mha.hardware`, :mod:`mha.exercises` — measuring, drawing,
  inspecting the machine, and checking your answers to the exercises (loaded on first use).
"""

import importlib

from .attention import scaled_dot_product_attention, softmax
from .demo import expect_error
from .flash import flash_attention, online_softmax_update, tile_schedule
from .linear_attention import linear_attention
from .masks import causal_mask, causal_mask_bottom_right, padding_mask, sliding_window_mask
from .multihead import KVCache, MultiHeadAttention

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("bench", "exercises", "hardware", "viz")


def __getattr__(name: str):
    # mha.bench, mha.exercises, mha.hardware and mha.viz load on first use: `import mha` stays
    # light (no matplotlib), and the exercises, which build on all of mha, import it without a cycle.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "bench",
    "causal_mask",
    "causal_mask_bottom_right",
    "exercises",
    "expect_error",
    "flash_attention",
    "hardware",
    "linear_attention",
    "online_softmax_update",
    "padding_mask",
    "scaled_dot_product_attention",
    "sliding_window_mask",
    "softmax",
    "tile_schedule",
    "viz",
]
