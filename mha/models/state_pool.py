"""A pool of recurrent-state slots: what a server keeps for the linear-attention layers of a hybrid.

A softmax layer's cache grows by a key and a value per token, so a server pages it (section 9.1).
A Gated DeltaNet layer (Qwen3-Next's linear-attention layer, :class:`GatedDeltaNet`) keeps a
fixed-size state per request instead: the convolution's last ``K - 1`` inputs and the delta
rule's ``(Dk, Dv)`` memory per value head. Nothing to page: the server preallocates one *slot*
per request it may serve at once, gives a slot to a request when it is admitted and takes it back
when the request ends (vLLM keeps the states of Mamba-like layers the same way, indexed by
request). A batch of requests, admitted at different times, steps together through their slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import validation as validate
from .gated_deltanet import GatedDeltaNet, RecurrentState


class RecurrentStatePool:
    """Preallocated recurrent states for one :class:`GatedDeltaNet` layer, one slot per request.

    The pools are allocated on the first :meth:`step` (which fixes the layer's sizes, the dtype
    and the device) and written in place afterwards: their storage stays the same.

    Args:
        num_slots: how many requests the pool serves at once.

    Shapes:
        conv ``(num_slots, C, K - 1)`` (``C`` the convolution's channels), memory ``(num_slots,
        Hv, Dk, Dv)`` float32 (or float64 for float64 inputs).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = validate.positive_int("num_slots", num_slots)
        self.conv: Tensor | None = None
        self.memory: Tensor | None = None
        self._free = list(range(num_slots - 1, -1, -1))  # taken from the end: slot 0 first
        self._tokens: dict[int, int] = {}  # live slot -> tokens it has seen

    def add_sequence(self) -> int:
        """Admit a request: a free slot, its state zeroed (no token seen yet)."""
        if not self._free:
            raise ValueError(
                f"all {self.num_slots} slots are in use: free a request first (free_sequence)"
            )
        slot = self._free.pop()
        for pool in (self.conv, self.memory):
            if pool is not None:
                pool[slot].zero_()
        self._tokens[slot] = 0
        return slot

    def free_sequence(self, slot: int) -> None:
        """End the request in ``slot``; the slot serves the next request admitted."""
        self._check_live("slot", slot)
        del self._tokens[slot]
        self._free.append(slot)

    def tokens(self, slot: int) -> int:
        """How many tokens the request in ``slot`` has seen."""
        self._check_live("slot", slot)
        return self._tokens[slot]

    @property
    def nbytes(self) -> int:
        """Bytes of the slots in use: the same after 10 tokens and after 10,000."""
        if self.conv is None or self.memory is None:
            return 0
        per_slot = sum(t[0].numel() * t.element_size() for t in (self.conv, self.memory))
        return len(self._tokens) * per_slot

    def step(self, layer: GatedDeltaNet, x: Tensor, slots: Sequence[int]) -> Tensor:
        """Run ``layer`` on the next tokens of the requests in ``slots``, reading and writing
        their states in place.

        Args:
            layer: the linear-attention layer whose states the pool keeps.
            x: the next ``L`` tokens of each request (a prompt chunk, or ``L = 1`` to decode).
            slots: the slot of each row of ``x``, distinct, each admitted.

        Shapes:
            x ``(B, L, E)`` -> ``(B, L, E)``, ``B = len(slots)``.
        """
        if not isinstance(layer, GatedDeltaNet):
            raise TypeError(f"layer must be a GatedDeltaNet, got {type(layer).__name__}")
        validate.tensor("x", x, floating=True, ndim=3, layout="(B, L, E)")
        slots = list(slots)
        for s in slots:
            self._check_live("slots[i]", s)
        if len(set(slots)) != len(slots) or len(slots) != x.shape[0]:
            raise ValueError(
                f"slots must name one distinct admitted slot per row of x, got {slots} for x "
                f"{validate.shape(x)}"
            )
        conv, memory = self._pools(layer, x)
        index = torch.tensor(slots, device=x.device)  # (B,)
        state = RecurrentState()
        state.conv, state.memory = conv[index], memory[index]  # (B, C, K-1), (B, Hv, Dk, Dv)
        out = layer(x, kv_cache=state)  # (B, L, E)
        assert state.conv is not None and state.memory is not None  # the layer set both
        conv.index_copy_(0, index, state.conv.to(conv.dtype))  # in place: the same storage
        memory.index_copy_(0, index, state.memory.to(memory.dtype))
        for s in slots:
            self._tokens[s] += x.shape[1]
        return out

    def _pools(self, layer: GatedDeltaNet, x: Tensor) -> tuple[Tensor, Tensor]:
        """The pools, allocated (zeros) for ``layer`` and ``x`` on the first step."""
        conv_shape = (self.num_slots, layer.channels, layer.K - 1)
        memory_shape = (self.num_slots, layer.Hv, layer.Dk, layer.Dv)
        if self.conv is None or self.memory is None:
            state_dtype = torch.promote_types(x.dtype, torch.float32)
            self.conv = x.new_zeros(conv_shape)
            self.memory = torch.zeros(memory_shape, dtype=state_dtype, device=x.device)
        elif validate.shape(self.conv) != conv_shape or validate.shape(self.memory) != memory_shape:
            raise ValueError(
                f"the pool holds states {validate.shape(self.conv)} and "
                f"{validate.shape(self.memory)}, but this layer's are {conv_shape} and "
                f"{memory_shape}: one pool per layer"
            )
        return self.conv, self.memory

    def _check_live(self, name: str, slot: object) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or slot not in self._tokens:
            raise ValueError(
                f"{name} must be an admitted slot (one of {sorted(self._tokens)}), got {slot!r}"
            )
