"""Multi-head attention as a module, with swappable attention backends and a key/value cache.

The layer knows no cache type: a cache passed as ``kv_cache=`` stores the new keys and values and
attends over itself (:meth:`KVCacheProtocol.attend`). The caches whose keys are one contiguous
tensor share :class:`ContiguousCache`'s ``attend``; a paged cache reads its blocks its own way.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from . import validation as validate
from .attention import _attention
from .flash import _flash_attention
from .masks import _causal_mask
from .rope import _apply_rope

BACKENDS = ("math", "sdpa", "flash", "triton")
STEPS = ("q", "k", "v", "weights", "heads", "concat", "out")  # what a step hook is handed


#: How a layer attends over contiguous keys (its backend): ``attention(q, k, v, attn_mask,
#: is_causal, need_weights) -> (out, weights | None)``, e.g. :meth:`MultiHeadAttention._attend`.
Attention = Callable[
    [Tensor, Tensor, Tensor, Tensor | None, bool, bool], tuple[Tensor, Tensor | None]
]


@runtime_checkable
class KVCacheProtocol(Protocol):
    """What ``kv_cache=`` needs: :class:`KVCache` here, and the serving caches of
    ``mha/decoding.py``, ``mha/paged.py`` and ``mha/kv_quant.py`` all provide it.

    ``attend(query, key, value, ...)`` stores this call's keys ``(B, Hkv, S_new, D)`` and values
    and returns the attention of the queries ``(B, H, S_new, D)`` over everything the cache holds,
    with ``is_causal`` aligned bottom-right (the new queries are the last positions): how the
    keys are read is the cache's business, so the layer that calls it knows no cache type.
    ``update(key, value)`` only stores (and returns what the cache holds, for a contiguous
    cache); ``len(cache)`` is the number of positions stored (``S``); ``nbytes`` the memory the
    cache holds; ``reset()`` empties it for a new sequence.
    """

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def reset(self) -> None: ...

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]: ...

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        dropout_p: float = 0.0,
        scale: float | None = None,
        attention: Attention | None = None,
    ) -> tuple[Tensor, Tensor | None]: ...


def _check_cache_step(query: Tensor, key: Tensor, value: Tensor) -> int:
    """The arguments of a cache's ``attend``: one query row per new key; returns ``H // Hkv``.

    Shapes:
        query ``(B, H, S_new, D)``, key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``.
    """
    validate.kv_step(key, value)
    validate.tensor("query", query, floating=True, ndim=4, layout="(B, H, S_new, D)")
    groups = validate.qkv(query, key, value, enable_gqa=True)
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(
            "query must have one row per new key and value (B, H, S_new, D), got query "
            f"{validate.shape(query)} and key {validate.shape(key)}"
        )
    return groups


def _and_mask(attn_mask: Tensor | None, keep: Tensor) -> Tensor:
    """Combine a user mask (bool keep-mask or float bias, already checked) with a bool
    keep-mask ``(L, S)``."""
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


class ContiguousCache:
    """The ``attend`` of every cache whose :meth:`update` returns all its keys and values as
    tensors ``(B, Hkv, S, D)``: :class:`KVCache`, :class:`mha.PreallocatedKVCache`,
    :class:`mha.QuantizedKVCache` (a subclass provides ``update``)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        dropout_p: float = 0.0,
        scale: float | None = None,
        attention: Attention | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Store ``key``, ``value`` and attend from ``query`` over all the cache holds.

        ``is_causal`` is aligned bottom-right: the ``S_new`` new queries are the last of the
        ``S`` positions, so each sees the whole cache and the new tokens up to itself.

        Args:
            query, key, value: this step's queries and new keys and values.
            attn_mask: keep-mask or float bias broadcasting to ``(B, H, S_new, S)``.
            is_causal, need_weights: future keys hidden; weights returned (else ``None``).
            dropout_p, scale: of the default attention (scale defaults to ``1/sqrt(D)``).
            attention: attends over the contiguous keys, e.g. a layer's backend
                (:data:`Attention`); default :func:`mha.scaled_dot_product_attention`'s math.

        Shapes:
            query ``(B, H, S_new, D)``, key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``
            -> out ``(B, H, S_new, Dv)``, weights ``(B, H, S_new, S)`` or ``None``.
        """
        groups = _check_cache_step(query, key, value)
        validate.flag("is_causal", is_causal)
        validate.flag("need_weights", need_weights)
        dropout_p, scale = validate.probability("dropout_p", dropout_p), validate.scale(scale)
        if attn_mask is not None:  # the scores cover the cached keys too
            B, H, L, _ = query.shape
            validate.attn_mask(attn_mask, (B, H, L, len(self) + L))
        key, value = self.update(key, value)  # (B, Hkv, S, D): the cache, new tokens last
        L, S = query.shape[-2], key.shape[-2]
        if is_causal and L and S > L:  # the L new queries are the last L of the S positions
            keep = _causal_mask(L, S, diagonal=S - L, device=query.device)  # (L, S)
            attn_mask, is_causal = _and_mask(attn_mask, keep), False  # bottom-right
        if attention is not None:
            return attention(query, key, value, attn_mask, is_causal, need_weights)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        out, weights = _attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, groups, return_weights=True
        )  # (B, H, L, Dv), (B, H, L, S)
        return out, (weights if need_weights else None)


class KVCache(ContiguousCache):
    """The keys and values of the tokens seen so far, for decoding one step (or chunk) at a time.

    Pass one ``KVCache()`` as ``kv_cache=`` to every call of :meth:`MultiHeadAttention.forward`
    while decoding a sequence. It stores keys and values *after* projection and head split, and
    before grouped-query heads are repeated, so its memory is what a real cache costs;
    ``attend`` (from :class:`ContiguousCache`) appends them and attends over all of them.

    Shapes:
        key ``(B, Hkv, S, D)``, value ``(B, Hkv, S, Dv)`` where ``S`` grows with every update.
    """

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.value: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.key is None else self.key.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        if self.key is None or self.value is None:
            return 0
        return (
            self.key.numel() * self.key.element_size()
            + self.value.numel() * self.value.element_size()
        )

    def reset(self) -> None:
        self.key = self.value = None

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys and values; return everything cached so far.

        Shapes:
            key ``(B, Hkv, S_new, D)``, value ``(B, Hkv, S_new, Dv)``; returns
            ``(B, Hkv, S_old + S_new, D)`` and ``(B, Hkv, S_old + S_new, Dv)``. ``S_new = 0``
            adds nothing and returns what the cache holds.
        """
        validate.kv_step(key, value)
        if self.key is None or self.value is None:
            self.key, self.value = key, value
        else:
            validate.kv_fits(key, value, self.key, self.value, "(B, Hkv)")
            self.key = torch.cat([self.key, key], dim=-2)  # (B, Hkv, S_old + S_new, D)
            self.value = torch.cat([self.value, value], dim=-2)  # (B, Hkv, S_old + S_new, Dv)
        return self.key, self.value


class MultiHeadAttention(nn.Module):
    """Multi-head attention: project, split into heads, attend per head, concatenate, project.

    Args:
        embed_dim: model width ``E`` of the queries and of the output.
        num_heads: number of query heads ``H``; each has dimension ``D = E // H``.
        bias: whether the four projections have biases.
        kdim: width of the key input (cross-attention); defaults to ``embed_dim``.
        vdim: width of the value input; defaults to ``embed_dim``.
        dropout: dropout on the attention weights while training.
        num_kv_heads: number of key/value heads (grouped-query attention); ``1`` is multi-query
            attention, ``num_heads`` (the default) is ordinary multi-head attention. Query head
            ``i`` uses key/value head ``i // (num_heads // num_kv_heads)``.
        backend: ``"math"`` (:func:`mha.scaled_dot_product_attention`), ``"sdpa"`` (torch's fused
            ``F.scaled_dot_product_attention``), ``"flash"`` (:func:`mha.flash_attention`) or
            ``"triton"`` (the chapter-6 kernel; needs ``triton``). All give the same numbers.
        rope: rotate queries and keys by their positions (:func:`mha.apply_rope`) after the head
            split. Queries and keys both count positions from 0 (from ``len(kv_cache)`` with a
            cache), which is what self-attention needs; keys are cached already rotated.
        rope_base: RoPE's ``base`` (10000 in Llama 2, 500000 in Llama 3).

    Shapes:
        query ``(B, L, E)``, key ``(B, S, kdim)``, value ``(B, S, vdim)`` → out ``(B, L, E)``.

    ``forward``'s ``attn_mask`` is a bool keep-mask (``True`` = may attend) or a float mask added
    to the scores, broadcasting to ``(B, H, L, S)``; with a cache ``S`` counts the cached keys too.
    ``is_causal`` is aligned top-left without a cache (as in PyTorch) and bottom-right with one:
    each new query sees the whole cache and the new tokens up to itself. Only the math path
    produces weights, so the other backends use it when ``need_weights`` is set.

    :meth:`register_step_hook` lets a function watch the tensors of every step of ``forward``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        num_kv_heads: int | None = None,
        backend: str = "math",
        rope: bool = False,
        rope_base: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        embed_dim, num_heads, head_dim = validate.head_split(embed_dim, num_heads)
        num_kv_heads = (
            num_heads
            if num_kv_heads is None
            else validate.positive_int("num_kv_heads", num_kv_heads)
        )
        validate.divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
        validate.flag("bias", bias)
        validate.floating_dtype("dtype", dtype)
        kdim = embed_dim if kdim is None else validate.positive_int("kdim", kdim)
        vdim = embed_dim if vdim is None else validate.positive_int("vdim", vdim)
        dropout = validate.probability("dropout", dropout)
        validate.one_of("backend", backend, BACKENDS)
        if backend in ("flash", "triton") and dropout > 0:
            raise ValueError(f"backend {backend!r} has no attention dropout; got dropout={dropout}")

        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.kdim, self.vdim, self.dropout, self.backend = kdim, vdim, float(dropout), backend
        self.rope = validate.flag("rope", rope)
        self.rope_base = validate.positive_float("rope_base", rope_base)
        if rope and self.head_dim % 2:
            raise ValueError(
                f"rope rotates pairs and needs an even head dim, got embed_dim ({embed_dim}) / "
                f"num_heads ({num_heads}) = {self.head_dim}"
            )
        kv_width = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._stacked: tuple[list, list, Tensor, Tensor | None] | None = None  # see _stacked_qkv
        self._step_hooks: OrderedDict[int, Callable[[str, Tensor], object]] = OrderedDict()

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        rope = f", rope=True, rope_base={self.rope_base:g}" if self.rope else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, backend={self.backend!r}"
            f"{rope}"
        )

    def _check_inputs(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        kv_cache: KVCacheProtocol | None,
    ) -> None:
        """Every argument of :meth:`forward`, checked once, before any work is done."""
        validate.flag("is_causal", is_causal)
        validate.flag("need_weights", need_weights)
        if kv_cache is not None and not isinstance(kv_cache, KVCacheProtocol):
            raise TypeError(
                "kv_cache must be a cache with update, __len__, nbytes and reset (and attend, "
                f"as mha.KVCache has), got {type(kv_cache).__name__}"
            )
        for name, t, width, proj in (
            ("query", query, self.embed_dim, self.q_proj),
            ("key", key, self.kdim, self.k_proj),
            ("value", value, self.vdim, self.v_proj),
        ):
            validate.tensor(name, t, floating=True)
            if t.dim() != 3:
                raise ValueError(
                    f"{name} must be batch-first (B, length, width), got shape {tuple(t.shape)}"
                )
            if t.shape[-1] != width:
                raise ValueError(
                    f"{name} must have width {width} ({'embed_dim' if name == 'query' else name[0] + 'dim'}), "
                    f"got shape {tuple(t.shape)}"
                )
            validate.matches_parameters(name, t, proj.weight)
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(
                f"query, key and value must have the same batch size, got query {tuple(query.shape)}, "
                f"key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length S, got key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if attn_mask is not None:  # with a cache, the scores also cover the cached keys
            S = key.shape[1] + (0 if kv_cache is None else len(kv_cache))
            validate.attn_mask(attn_mask, (query.shape[0], self.num_heads, query.shape[1], S))
        if not need_weights:  # (with need_weights every backend uses the math path)
            self._check_backend(query, attn_mask, is_causal, kv_cache)

    def _check_backend(
        self,
        query: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        kv_cache: KVCacheProtocol | None,
    ) -> None:
        """What the flash and triton backends cannot do, checked before any work is done."""
        if self.backend == "flash" and attn_mask is not None and attn_mask.requires_grad:
            raise ValueError(
                "backend 'flash' does not compute a gradient for attn_mask; pass "
                f"attn_mask.detach() (attn_mask {tuple(attn_mask.shape)} requires grad)"
            )
        if self.backend != "triton":
            return
        # With a cache, is_causal becomes a bottom-right mask (see ContiguousCache.attend).
        if attn_mask is not None or (is_causal and kv_cache is not None and query.shape[1]):
            raise ValueError(
                "backend 'triton' supports is_causal but no attn_mask (with a kv_cache, "
                "is_causal is a bottom-right mask); use another backend"
            )
        from .triton_flash import _check_dtype, _check_head_dim  # optional: triton is an extra

        _check_dtype("query", query)
        _check_head_dim(
            self.head_dim, f"embed_dim ({self.embed_dim}) / num_heads ({self.num_heads})"
        )

    def register_step_hook(self, hook: Callable[[str, Tensor], object]) -> RemovableHandle:
        """Call ``hook(step, tensor)`` with the result of each step while :meth:`forward` runs.

        The steps, in order (:data:`STEPS`): ``"q"``, ``"k"``, ``"v"`` after the head split
        (before RoPE and the cache), ``"weights"`` (only with ``need_weights=True``), ``"heads"``
        (the per-head outputs), ``"concat"`` (the heads side by side, before ``out_proj``) and
        ``"out"``. What the hook returns is ignored; it should not change the tensor. As with
        torch's module hooks, ``handle.remove()`` on the returned handle unregisters it. Without
        a hook, ``forward`` does no extra work.

        Shapes:
            q ``(B, H, L, D)``, k and v ``(B, Hkv, S, D)``, weights ``(B, H, L, S)``, heads
            ``(B, H, L, D)``, concat and out ``(B, L, E)``.
        """
        validate.function("hook", hook)
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle

    def _report(self, **steps: Tensor | None) -> None:
        """Hand each step's tensor (``None``: not computed) to the step hooks, in order."""
        for hook in self._step_hooks.values():
            for step, tensor in steps.items():
                if tensor is not None:
                    hook(step, tensor)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCacheProtocol | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Args:
            query, key, value: the sequences; ``key`` defaults to ``query``, ``value`` to ``key``.
            attn_mask, is_causal, need_weights: a mask, future keys hidden, weights returned.
            kv_cache: a :class:`KVCache` (any :class:`KVCacheProtocol`): it stores k and v and
                attends over all it holds.

        Shapes:
            query ``(B, L, E)``, key/value ``(B, S, kdim/vdim)`` → ``(B, L, E)``, ``(B, H, L, S)``.
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value, attn_mask, is_causal, need_weights, kv_cache)
        q, k, v = self._project(query, key, value)  # (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, D)
        self._report(q=q, k=k, v=v)  # to the step hooks, if any
        q, k = self._rotate(q, k, kv_cache)  # RoPE, if on: positions go on after the cache
        if kv_cache is None:
            out, weights = self._attend(q, k, v, attn_mask, is_causal, need_weights)  # (B, H, L, D)
        else:  # the cache stores k and v and attends over all it holds, in its own way
            out, weights = kv_cache.attend(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=is_causal,
                need_weights=need_weights,
                dropout_p=self.dropout if self.training else 0.0,
                attention=self._attend,
            )  # (B, H, L, D)
        self._report(weights=weights, heads=out)
        return self._merge(out), weights

    def _rotate(
        self, q: Tensor, k: Tensor, kv_cache: KVCacheProtocol | None
    ) -> tuple[Tensor, Tensor]:
        """RoPE (when ``rope=True``): the new tokens sit at positions ``start, start + 1, …`` with
        ``start = len(kv_cache)`` (0 without a cache). Keys are rotated before they enter the
        cache, so a cached key is never rotated twice.

        Shapes:
            q ``(B, H, L, D)``, k ``(B, Hkv, S_new, D)`` -> the same shapes.
        """
        if not self.rope:
            return q, k
        start = 0 if kv_cache is None else len(kv_cache)
        return _apply_rope(q, start, self.rope_base), _apply_rope(k, start, self.rope_base)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project the inputs and split the heads.

        Shapes:
            query ``(B, L, E)``, key ``(B, S, kdim)``, value ``(B, S, vdim)``; returns
            q ``(B, H, L, D)``, k ``(B, Hkv, S, D)``, v ``(B, Hkv, S, D)``.
        """
        B, L, _ = query.shape
        S = key.shape[1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if key is query and value is query:  # self-attention: one matmul instead of three
            qkv = F.linear(query, *self._stacked_qkv())  # (B, L, (H + 2·Hkv)·D)
            heads = qkv.view(B, L, H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2·Hkv, L, D)
            q, k, v = heads.split([H, Hkv, Hkv], dim=1)  # (B, H, L, D), (B, Hkv, L, D) twice
            return q, k, v
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        q = q.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = k.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        return q, k, v

    def _stacked_qkv(self) -> tuple[Tensor, Tensor | None]:
        """The weights of ``q_proj``, ``k_proj`` and ``v_proj`` stacked into one ``(E + 2·Hkv·D, E)``.

        The three ``nn.Linear`` modules stay the parameters. While gradients are needed the stack
        is rebuilt on every call, so that it is part of the autograd graph; at inference it is
        kept and rebuilt only when a weight changes (new storage or an in-place update), so a
        decoding step does not copy the weights again for every token.
        """
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weights: list[Tensor] = [p.weight for p in projections]
        biases: list[Tensor] = [b for b in (p.bias for p in projections) if b is not None]

        def stack() -> tuple[Tensor, Tensor | None]:
            return torch.cat(weights), torch.cat(biases) if biases else None  # (E + 2·Hkv·D, E)

        params = weights + biases
        if torch.is_grad_enabled() and any(t.requires_grad for t in params):
            return stack()
        # Where each parameter lives and how often it was changed in place. The cache keeps the
        # tensors it was built from, so no new weight can be allocated at one of these addresses.
        stamp = [(t.data_ptr(), t._version) for t in params]
        if self._stacked is None or self._stacked[0] != stamp:
            with torch.no_grad():
                self._stacked = (stamp, [t.detach() for t in params], *stack())
        return self._stacked[2], self._stacked[3]

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention per head on the chosen backend.

        Grouped key/value heads are read in place by the math and flash backends (each group's
        query rows are stacked against their shared head) and handed to torch with
        ``enable_gqa`` by the sdpa backend; the triton backend's kernel reads one key/value
        head per query head, so for it they are copied with ``repeat_interleave``.

        Shapes:
            q ``(B, H, L, D)``, k and v ``(B, Hkv, S, D)``, attn_mask broadcasting to
            ``(B, H, L, S)``; returns out ``(B, H, L, D)`` and weights ``(B, H, L, S)`` or ``None``.
        """
        (_, H, L, _), S = q.shape, k.shape[-2]
        groups = H // self.num_kv_heads  # query heads per key/value head
        scale = 1.0 / math.sqrt(self.head_dim)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights or self.backend == "math":  # only the math path has the weights
            out, weights = _attention(
                q, k, v, attn_mask, dropout_p, is_causal, scale, groups, return_weights=True
            )  # (B, H, L, D), (B, H, L, S)
            return out, (weights if need_weights else None)
        if self.backend == "sdpa":
            if is_causal and attn_mask is not None:  # torch takes one or the other, not both
                if L and S:  # (with L or S = 0 there is no score to hide)
                    attn_mask = _and_mask(attn_mask, _causal_mask(L, S, device=q.device))
                is_causal = False
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask, dropout_p, is_causal, enable_gqa=groups > 1
            ), None
        if self.backend == "flash":
            out, _ = _flash_attention(q, k, v, attn_mask, is_causal, scale, groups=groups)
            return out, None
        from .triton_flash import _triton_attention  # optional: triton is an extra

        if groups > 1:  # the chapter-6 kernel reads one key/value head per query head
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # (B, H, S, D)
        return _triton_attention(q, k, v, is_causal, scale), None

    def _merge(self, out: Tensor) -> Tensor:
        """Concatenate the heads and mix them with ``W_O``: ``(B, H, L, D) -> (B, L, E)``."""
        B, H, L, D = out.shape
        concat = out.transpose(1, 2).reshape(B, L, H * D)  # concat heads -> (B, L, E)
        out = self.out_proj(concat)  # (B, L, E)
        self._report(concat=concat, out=out)
        return out

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, backend: str = "math"
    ) -> MultiHeadAttention:
        """Build a :class:`MultiHeadAttention` with the weights of a ``nn.MultiheadAttention``.

        The module must be batch-first. Its bool masks mean "masked out"; pass ``~mask`` to ours.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}"
            )
        if not module.batch_first:
            raise ValueError("module must be built with batch_first=True (ours is batch-first)")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no counterpart here")
        ref = module.out_proj.weight
        ours = cls(
            module.embed_dim,
            module.num_heads,
            bias=module.in_proj_bias is not None,
            kdim=module.kdim,
            vdim=module.vdim,
            dropout=module.dropout,
            backend=backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        E = module.embed_dim
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                q_w, k_w, v_w = module.in_proj_weight.split(E)  # 3 × (E, E)
            else:
                q_w, k_w, v_w = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
            for proj, w in ((ours.q_proj, q_w), (ours.k_proj, k_w), (ours.v_proj, v_w)):
                proj.weight.copy_(w)
            if module.in_proj_bias is not None:
                for proj, b in zip(
                    (ours.q_proj, ours.k_proj, ours.v_proj), module.in_proj_bias.split(E)
                ):
                    proj.bias.copy_(b)
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                ours.out_proj.bias.copy_(module.out_proj.bias)
        return ours
