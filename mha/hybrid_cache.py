"""The cache of a hybrid model: one kind of cache per kind of layer, one admission for all.

Models served in 2026 mix layers. gpt-oss alternates sliding-window layers (a window of 128) with
full-attention layers; Qwen3-Next has three Gated DeltaNet (linear-attention) layers for every
full-attention layer. A server gives each layer the cache its kind needs (vLLM's hybrid KV-cache
manager does the same):

* ``"full"`` — a :class:`mha.PagedKVCache`: every position stays, so its blocks grow with the text;
* ``"sliding"`` — a :class:`mha.SlidingWindowPagedCache`: blocks that fall out of the window go
  back to the pool, so a decoding request holds at most ``ceil(window / block_size) + 1``;
* ``"linear"`` — a :class:`mha.RecurrentStatePool`: one fixed-size state slot per request.

:class:`HybridCache` holds them, admits a request into all of them at once (a row of every block
table, a slot of every state pool) and frees it from all of them, and reports the bytes each kind
of layer holds (:meth:`HybridCache.nbytes_by_kind`).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import validation as validate
from .models.state_pool import RecurrentStatePool
from .paged import PagedKVCache
from .window_cache import SlidingWindowPagedCache

#: The kinds of layer a :class:`HybridCache` serves, in the order its reports use.
LAYER_KINDS = ("full", "sliding", "linear")

LayerCache = PagedKVCache | RecurrentStatePool  # a SlidingWindowPagedCache is a PagedKVCache


class HybridCache:
    """A cache per layer of a hybrid model, admitting and freeing requests in all of them at once.

    Layer ``i`` gets a :class:`mha.PagedKVCache` (``"full"``), a
    :class:`mha.SlidingWindowPagedCache` (``"sliding"``) or a :class:`mha.RecurrentStatePool`
    (``"linear"``); ``cache[i]`` is that cache: write and attend through it as through the cache
    alone, with the request's :meth:`row` (paged layers) or :meth:`slot` (linear layers).

    Args:
        layer_types: the kind of each layer, one of ``"full"``, ``"sliding"``, ``"linear"``.
        window: the window of the sliding layers (needed when there are any).
        block_size: positions per block of the paged layers.
        num_blocks: pool size of each paged layer, as in :class:`mha.PagedKVCache`.
        num_slots: how many requests the linear layers' state pools serve at once.

    Shapes:
        as each layer's cache: block tables ``(B, max_blocks)`` with one row per live request, in
        admission order; state pools ``(num_slots, ...)``.
    """

    def __init__(
        self,
        layer_types: Sequence[str],
        *,
        window: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        num_slots: int = 8,
    ) -> None:
        if isinstance(layer_types, str) or not isinstance(layer_types, Sequence):
            raise TypeError(
                "layer_types must be a sequence of layer kinds (e.g. ['sliding', 'full']), got "
                f"{type(layer_types).__name__}"
            )
        if not layer_types:
            raise ValueError("layer_types must name at least one layer, got an empty sequence")
        for kind in layer_types:
            validate.one_of("layer_types[i]", kind, LAYER_KINDS)
        if "sliding" in layer_types and window is None:
            raise ValueError("the sliding layers need a window: pass window=W")
        self.layer_types = tuple(layer_types)
        self.window = None if window is None else validate.positive_int("window", window)
        self.block_size = validate.positive_int("block_size", block_size)
        self.num_slots = validate.positive_int("num_slots", num_slots)
        self.layers: list[LayerCache] = []
        for kind in self.layer_types:
            if kind == "full":
                self.layers.append(PagedKVCache(block_size, num_blocks=num_blocks))
            elif kind == "sliding":
                assert self.window is not None  # checked above
                self.layers.append(
                    SlidingWindowPagedCache(self.window, block_size, num_blocks=num_blocks)
                )
            else:
                self.layers.append(RecurrentStatePool(num_slots))
        self._requests: list[int] = []  # live requests in admission order: row r is _requests[r]
        self._slots: dict[int, int] = {}  # request -> its slot in every state pool
        self._next = 0  # the id of the next request admitted

    def __len__(self) -> int:
        """The number of layers."""
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerCache:
        """The cache of layer ``layer``."""
        validate.index("layer", layer, len(self.layers), f"the model has {len(self.layers)} layers")
        return self.layers[layer]

    @property
    def requests(self) -> list[int]:
        """The live requests, in admission order (request ``requests[r]`` is row ``r``)."""
        return list(self._requests)

    def add_sequence(self) -> int:
        """Admit a request into every layer's cache; returns its id (see :meth:`row`,
        :meth:`slot`). Nothing is admitted if the state pools are full."""
        if "linear" in self.layer_types and len(self._slots) == self.num_slots:
            raise ValueError(
                f"all {self.num_slots} state slots are in use: free a request first (free_sequence)"
            )
        slots = set()
        for cache in self.layers:
            if isinstance(cache, RecurrentStatePool):
                slots.add(cache.add_sequence())
            else:
                cache.add_sequence()
        request, self._next = self._next, self._next + 1
        self._requests.append(request)
        if slots:
            assert len(slots) == 1, slots  # the pools admit and free together
            self._slots[request] = slots.pop()
        return request

    def free_sequence(self, request: int) -> None:
        """End ``request`` in every layer: its blocks and its state slot go back to the pools
        (the rows after it move up by one, as in :meth:`mha.PagedKVCache.free_sequence`)."""
        row = self.row(request)
        for cache in self.layers:
            if isinstance(cache, RecurrentStatePool):
                cache.free_sequence(self._slots[request])
            else:
                cache.free_sequence(row)
        self._requests.pop(row)
        self._slots.pop(request, None)

    def row(self, request: int) -> int:
        """The row of ``request`` in the paged layers' block tables."""
        if isinstance(request, bool) or request not in self._requests:
            raise ValueError(
                f"request must be a live request (one of {self._requests}), got {request!r}"
            )
        return self._requests.index(request)

    def slot(self, request: int) -> int:
        """The slot of ``request`` in the linear layers' state pools."""
        self.row(request)  # a live request
        if request not in self._slots:
            raise ValueError("the model has no linear layers: a request has no state slot")
        return self._slots[request]

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes the live requests hold now, per kind of layer present (blocks in use of the
        paged layers, slots in use of the state pools)."""
        out = {kind: 0 for kind in LAYER_KINDS if kind in self.layer_types}
        for kind, cache in zip(self.layer_types, self.layers):
            out[kind] += cache.nbytes
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the live requests hold now, all layers together."""
        return sum(self.nbytes_by_kind().values())
