"""How many bytes the key/value cache of a real model needs: a calculator and published configs.

A decoder keeps, for every layer and every token it has seen, what its attention needs of that token
later. How much that is depends on the kind of attention:

* **MHA / GQA / MQA**: a key and a value per key/value head, ``2 · Hkv · D`` numbers per token
  and layer (``Hkv = H`` for MHA, a few for GQA, one for MQA);
* **sliding-window layers** keep only the last ``window`` tokens (a rolling buffer), so their
  cache stops growing once the context is longer than the window;
* **MLA** (multi-head latent attention, DeepSeek-V2/V3) keeps one latent vector of
  ``kv_lora_rank`` numbers per token and layer, plus one shared RoPE key of ``qk_rope_head_dim``
  numbers, whatever the number of heads (see :mod:`mha.mla`).

:func:`kv_cache_bytes` adds this up; :data:`CONFIGS` holds published configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import validation as validate


@dataclass(frozen=True)
class AttentionConfig:
    """The attention shape of a decoder, as far as its key/value cache is concerned.

    Args:
        name: a label for tables and plots.
        num_layers: number of attention layers.
        num_heads: query heads ``H`` per layer.
        num_kv_heads: key/value heads ``Hkv`` per layer (``H`` for MHA, 1 for MQA). For MLA it
            plays no part in the cache (every head rebuilds its keys from the shared latent).
        head_dim: ``D``, the dimension of one key (and one value) head.
        sliding_window: the window of the sliding-window layers, or ``None`` (every layer global).
        window_layers: indices of the layers that use the window; ``None`` means all layers
            (only with ``sliding_window``).
        kv_lora_rank: the MLA latent dimension ``C``; ``None`` for ordinary key/value heads.
        qk_rope_head_dim: MLA's decoupled RoPE key, shared by all heads, cached next to the
            latent (0 without it).
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            validate.positive_int(field, getattr(self, field))
        validate.divisible("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        if self.sliding_window is not None:
            validate.positive_int("sliding_window", self.sliding_window)
        if self.window_layers is not None:
            if self.sliding_window is None:
                raise ValueError("window_layers needs a sliding_window, got sliding_window=None")
            if not isinstance(self.window_layers, tuple):
                raise TypeError(
                    f"window_layers must be a tuple of layer indices, "
                    f"got {type(self.window_layers).__name__}"
                )
            for i in self.window_layers:
                validate.non_negative_int("window_layers[i]", i)
                if i >= self.num_layers:
                    raise ValueError(
                        f"window_layers has layer {i}, but num_layers is {self.num_layers}"
                    )
        if self.kv_lora_rank is not None:
            validate.positive_int("kv_lora_rank", self.kv_lora_rank)
        validate.non_negative_int("qk_rope_head_dim", self.qk_rope_head_dim)
        if self.qk_rope_head_dim and self.kv_lora_rank is None:
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) is part of MLA's cache; "
                "it needs kv_lora_rank"
            )

    @property
    def kind(self) -> str:
        """``"MLA"``, ``"MQA"``, ``"GQA"`` or ``"MHA"``."""
        if self.kv_lora_rank is not None:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "MHA" if self.num_kv_heads == self.num_heads else "GQA"

    @property
    def elements_per_token_per_layer(self) -> int:
        """Numbers cached per token in one (global) layer."""
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + self.qk_rope_head_dim  # latent c and the rope key
        return 2 * self.num_kv_heads * self.head_dim  # a key and a value per kv head

    def uses_window(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps only the last ``sliding_window`` tokens."""
        if self.sliding_window is None:
            return False
        return self.window_layers is None or layer in self.window_layers


def kv_cache_bytes(
    config: AttentionConfig, seq_len: int, *, batch: int = 1, bytes_per_element: int = 2
) -> int:
    """Bytes of key/value cache a decoder holds after ``seq_len`` tokens.

    Sum over layers of ``batch · tokens_kept · elements_per_token_per_layer · bytes_per_element``,
    where a sliding-window layer keeps ``min(seq_len, sliding_window)`` tokens and every other
    layer keeps all ``seq_len``. For MHA this is ``2 · layers · H · D · bytes · tokens``.

    Args:
        config: the model's attention shape.
        seq_len: tokens in the context (prompt and generated so far).
        batch: sequences decoded at once.
        bytes_per_element: 2 for float16/bfloat16 (the default), 1 for an 8-bit cache, 4 for float32.
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    seq_len = validate.positive_int("seq_len", seq_len)
    batch = validate.positive_int("batch", batch)
    bytes_per_element = validate.positive_int("bytes_per_element", bytes_per_element)
    window = config.sliding_window
    tokens = sum(
        min(seq_len, window) if window is not None and config.uses_window(layer) else seq_len
        for layer in range(config.num_layers)
    )  # token slots over all layers
    return batch * tokens * config.elements_per_token_per_layer * bytes_per_element


# Published configurations. Each number comes from the source named next to it; only the fields
# that decide the cache are kept. Head dims not given in a config.json are hidden_size / heads.
CONFIGS: dict[str, AttentionConfig] = {
    c.name: c
    for c in (
        # meta-llama/Llama-2-7b-hf config.json: 32 layers, 32 heads, 32 kv heads, hidden 4096.
        AttentionConfig("Llama-2-7B", 32, 32, 32, 128),
        # The Llama 3 Herd of Models (Dubey et al., 2024), Table 3: 32 layers, 32 heads,
        # 8 kv heads, width 4096.
        AttentionConfig("Llama-3-8B", 32, 32, 8, 128),
        # Same table: 80 layers, 64 heads, 8 kv heads, width 8192.
        AttentionConfig("Llama-3-70B", 80, 64, 8, 128),
        # Same table: 126 layers, 128 heads, 8 kv heads, width 16384.
        AttentionConfig("Llama-3.1-405B", 126, 128, 8, 128),
        # mistralai/Mistral-7B-v0.1 config.json: 32 layers, 32 heads, 8 kv heads, hidden 4096,
        # sliding_window 4096 in every layer (Mistral 7B paper, Jiang et al., 2023: a rolling
        # buffer cache of W = 4096 tokens).
        AttentionConfig("Mistral-7B-v0.1", 32, 32, 8, 128, sliding_window=4096),
        # tiiuae/falcon-7b config.json: n_layer 32, n_head 71, hidden_size 4544 (head dim 64),
        # multi_query true (one key/value head).
        AttentionConfig("Falcon-7B", 32, 71, 1, 64),
        # google/gemma-2-9b config.json: 42 layers, 16 heads, 8 kv heads, head_dim 256,
        # sliding_window 4096; Gemma 2 report (2024): local and global layers alternate; in
        # Hugging Face transformers the even-numbered layers are the sliding ones.
        AttentionConfig(
            "Gemma-2-9B", 42, 16, 8, 256, sliding_window=4096, window_layers=tuple(range(0, 42, 2))
        ),
        # deepseek-ai/DeepSeek-V2 config.json and the DeepSeek-V2 paper (2024), section 2.1:
        # 60 layers, 128 heads of dim 128, kv_lora_rank 512, qk_rope_head_dim 64.
        AttentionConfig("DeepSeek-V2", 60, 128, 128, 128, kv_lora_rank=512, qk_rope_head_dim=64),
        # deepseek-ai/DeepSeek-V3 config.json: 61 layers, 128 heads, kv_lora_rank 512,
        # qk_rope_head_dim 64 (qk_nope_head_dim and v_head_dim 128).
        AttentionConfig("DeepSeek-V3", 61, 128, 128, 128, kv_lora_rank=512, qk_rope_head_dim=64),
    )
}
