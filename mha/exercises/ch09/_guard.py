"""Chapter 9's structural check: the largest tensor an answer makes, views of its inputs aside.

A paged decode that gathers a whole sequence, or a ring that scores more than one shard of keys
at a time, shows itself by the size of what it makes. :func:`mha.exercises._harness.never_larger`
counts every tensor; here a view of an input (the pool read block by block through
``key_pool[block]``, a shard ``k[..., a:b, :]``) costs nothing and is not counted, and neither
is a tensor of ``allowed`` elements (the assembled output, in any layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import Tensor
from torch.overrides import TorchFunctionMode


class Oversized(Exception):
    """The answer made a tensor of the guard's limit or more that is not a view of an input."""


def _storage(t: Tensor) -> int:
    """Where ``t``'s memory starts (a view shares its base's); -1 for a tensor without one."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


class _Largest(TorchFunctionMode):
    def __init__(self, limit: int, inputs: Sequence[Tensor], allowed: int) -> None:
        super().__init__()
        self.limit, self.allowed = limit, allowed
        self.storages = {_storage(t) for t in inputs} - {-1}
        self.seen: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, Tensor)
                and t.numel() >= self.limit
                and t.numel() != self.allowed
                and _storage(t) not in self.storages
            ):
                self.seen.append(tuple(t.shape))
                raise Oversized(self.text)
        return out

    text = ""  # what Oversized says


@contextlib.contextmanager
def no_tensor_as_large(
    limit: int, inputs: Sequence[Tensor], message: str, allowed: int = -1
) -> Iterator[list[tuple[int, ...]]]:
    """Raise :class:`Oversized` (``message``) if the code inside makes a tensor of ``limit``
    elements or more that is neither a view of one of ``inputs`` nor of ``allowed`` elements.
    An answer that catches the error is still rejected on the way out."""
    mode = _Largest(limit, inputs, allowed)
    mode.text = message
    with mode:
        yield mode.seen
    if mode.seen:
        raise Oversized(message)
