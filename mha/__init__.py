"""Multi-head attention, from intuition to GPU: the code of the course.

The package mirrors PyTorch's names and argument order, so what you learn here transfers:

* :func:`scaled_dot_product_attention` — the readable reference (``mha/attention.py``)
* :func:`flash_attention` — FlashAttention's tiled forward pass in plain PyTorch (``mha/flash.py``)
* :func:`linear_attention` — kernel-feature-map attention in O(L) (``mha/linear_attention.py``)
* :func:`gated_delta_rule` — the gated delta rule of Gated DeltaNet, recurrent and chunked
  (``mha/gated_delta.py``)
* :func:`causal_mask`, :func:`padding_mask`, :func:`sliding_window_mask` — keep-masks (``mha/masks.py``)
* :class:`MultiHeadAttention`, :class:`KVCache` — the module and its decoding cache (``mha/multihead.py``)
* :class:`TransformerBlock` — that module in a pre-norm Transformer block, with an MLP (``mha/block.py``)
* :class:`PreallocatedKVCache`, :func:`flash_decoding` — a cache that serves and split-KV
  decoding (``mha/decoding.py``)
* :class:`PagedKVCache`, :func:`paged_attention` — a pool of blocks and attention through its
  block table (``mha/paged.py``)
* :func:`ring_attention`, :class:`TensorParallelAttention` — attention across processes on
  ``torch.distributed`` (``mha/distributed.py``)
* :func:`varlen_attention` — packed sequences, FlashAttention's ``cu_seqlens`` layout (``mha/varlen.py``)
* :func:`paged_varlen_attention` — prompt chunks and decode steps in one call over the paged pool
  (``mha/chunked_prefill.py``)
* :class:`RecurrentStatePool` — one fixed-size state slot per request for the linear-attention
  layers of a hybrid model (``mha/models/state_pool.py``)
* :class:`SlidingWindowPagedCache` — a paged cache for a sliding-window layer that frees the blocks
  no query can see any more (``mha/window_cache.py``)
* :class:`HybridCache` — the caches of a hybrid model's full, sliding and linear layers, one
  admission for all (``mha/hybrid_cache.py``)
* :func:`cascade_attention` — a shared prefix attended once for the whole batch (``mha/cascade.py``)
* :func:`tree_attention_mask`, :func:`verify_greedy` — speculative decoding's verification step
  (``mha/speculative.py``)
* :func:`apply_rope` — rotary position embedding, Llama's rotate-half pairing (``mha/rope.py``)
* :func:`yarn_frequencies` — YaRN's RoPE speeds for a longer context (``mha/rope.py``)
* :func:`rms_norm`, :class:`RMSNorm` — RMSNorm, e.g. on each head's queries and keys (``mha/norms.py``)
* :func:`from_hf` — attention layers of 2026's open models (gpt-oss, Qwen3-Next) from Hugging
  Face configs and weights (``mha/models/``)
* :class:`MultiHeadLatentAttention`, :class:`LatentCache` — DeepSeek's latent attention (``mha/mla.py``)
* :func:`quantize_kv`, :class:`QuantizedKVCache` — keys and values in 8 bits (``mha/kv_quant.py``)
* :func:`kv_cache_bytes`, :class:`AttentionConfig` — KV-cache memory of real models (``mha/kv_memory.py``)
* :func:`topk_sparse_attention`, :func:`topk_keep_mask` — DeepSeek's top-k sparse attention
  (``mha/sparse.py``)
* :func:`from_hf` — an attention layer of a 2026 open model from its Hugging Face config and weights
  (``mha/models/``: DeepSeek's MLA in ``deepseek_v3.py``)
* :mod:`mha.flex` — the course's masks as FlexAttention ``mask_mod``/``score_mod`` functions
* :mod:`mha.validation` — the argument checks every public function shares
* :func:`mha.device.capabilities` — the dtypes and kernels to use on a device (``mha/device.py``)

Two folders build on that code, and nothing in it imports them:

* ``mha/lab/`` — the instruments that measure and draw: :mod:`mha.timing`, :mod:`mha.memory`,
  :mod:`mha.bench`, :mod:`mha.fit`, :mod:`mha.claims`, :mod:`mha.hardware`, :mod:`mha.viz`,
  :mod:`mha.charts`, :mod:`mha.figures`, :mod:`mha.shapes`, :mod:`mha.processes`, :mod:`mha.writer` (each is ``mha.lab.<name>``, see :mod:`mha.lab`), and
  :func:`expect_error`, which shows a deliberate error in a notebook without stopping it;
* ``mha/exercises/`` — :mod:`mha.exercises`, the checkers of your answers to the exercises.

The lab's modules, :mod:`mha.exercises` and :mod:`mha.flex` load on first use (``mha.viz`` is
``mha.lab.viz``, the same module), so ``import mha`` does not import matplotlib.
"""

import importlib

from .attention import scaled_dot_product_attention, softmax
from .block import TransformerBlock
from .cascade import cascade_attention
from .chunked_prefill import paged_varlen_attention
from .decoding import PreallocatedKVCache, flash_decoding, merge_partials
from .device import quiet_missing_gpu_notice as _quiet_missing_gpu_notice
from .distributed import TensorParallelAttention, count_traffic, ring_attention
from .flash import flash_attention, online_softmax_update, tile_schedule
from .gated_delta import gated_delta_rule
from .hybrid_cache import HybridCache
from .kv_memory import AttentionConfig, kv_cache_bytes
from .kv_quant import QuantizedKV, QuantizedKVCache, quantize_kv
from .lab import MODULES as _LAB_MODULES
from .lab.demo import expect_error
from .linear_attention import linear_attention
from .masks import causal_mask, causal_mask_bottom_right, padding_mask, sliding_window_mask
from .mla import LatentCache, MultiHeadLatentAttention
from .models import from_hf
from .models.state_pool import RecurrentStatePool
from .multihead import KVCache, MultiHeadAttention
from .norms import RMSNorm, rms_norm
from .paged import PagedKVCache, paged_attention
from .rope import apply_rope, rope_frequencies, yarn_frequencies
from .sparse import topk_keep_mask, topk_sparse_attention
from .speculative import Verification, tree_attention_mask, verify_greedy
from .varlen import varlen_attention
from .window_cache import SlidingWindowPagedCache

# A CUDA build of torch without a GPU (Colab's CPU runtime) logs that it found no CUDA runtime
# when torch's timer or compiler is first imported: dropped, the setup cell says so already.
_quiet_missing_gpu_notice()

__version__ = "0.1.0"

# name -> the module `mha.<name>` stands for, imported on first use.
_LAZY = {"exercises": ".exercises", "flex": ".flex"} | {m: f".lab.{m}" for m in _LAB_MODULES}


def __getattr__(name: str):
    # The lab, mha.exercises and mha.flex load on first use: `import mha` stays light (no
    # matplotlib), and the exercises, which build on all of mha, import it without a cycle.
    # `mha.viz` is `mha.lab.viz` itself (the module object), not a copy.
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        globals()[name] = module  # found directly from now on
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionConfig",
    "HybridCache",
    "KVCache",
    "LatentCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PagedKVCache",
    "PreallocatedKVCache",
    "QuantizedKV",
    "QuantizedKVCache",
    "RMSNorm",
    "RecurrentStatePool",
    "SlidingWindowPagedCache",
    "TensorParallelAttention",
    "TransformerBlock",
    "Verification",
    "apply_rope",
    "bench",
    "cascade_attention",
    "causal_mask",
    "causal_mask_bottom_right",
    "charts",
    "claims",
    "count_traffic",
    "demo",
    "exercises",
    "expect_error",
    "figures",
    "fit",
    "flash_attention",
    "gated_delta_rule",
    "flash_decoding",
    "flex",
    "from_hf",
    "hardware",
    "kv_cache_bytes",
    "linear_attention",
    "memory",
    "merge_partials",
    "online_softmax_update",
    "padding_mask",
    "paged_attention",
    "paged_varlen_attention",
    "processes",
    "quantize_kv",
    "ring_attention",
    "rms_norm",
    "rope_frequencies",
    "scaled_dot_product_attention",
    "shapes",
    "sliding_window_mask",
    "softmax",
    "tile_schedule",
    "timing",
    "topk_keep_mask",
    "topk_sparse_attention",
    "tree_attention_mask",
    "varlen_attention",
    "verify_greedy",
    "viz",
    "writer",
    "yarn_frequencies",
]
