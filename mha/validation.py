"""Argument checks shared by every public function of ``mha``.

One rule everywhere: an argument of the wrong *type* raises ``TypeError``, a value of the right
type that cannot be used raises ``ValueError``, and every message names the argument and what it
got (shapes for tensors), so a mistake is found from the message alone. Functions return the
checked value, so a caller can write ``n = positive_int("n", n)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

LOW_PRECISION = (torch.float16, torch.bfloat16)


def shape(t: Tensor) -> tuple[int, ...]:
    """``t.shape`` as a plain tuple, which prints as ``(2, 4, 8)`` in messages."""
    return tuple(t.shape)


def tensor(
    name: str,
    value: Any,
    *,
    floating: bool = False,
    ndim: int | None = None,
    layout: str | None = None,
) -> Tensor:
    """A tensor (optionally of a floating dtype and with exactly ``ndim`` dims).

    ``layout`` names the expected dims in the message, e.g. ``"(B, H, L, D)"``, so that a reader
    sees which dim is missing rather than only how many there should be.
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        dims = f"{ndim} dims" if layout is None else f"{ndim} dims {layout}"
        raise ValueError(f"{name} must have {dims}, got shape {shape(value)}")
    return value


def function(name: str, value: Any) -> Callable[..., object]:
    """Something callable (a function, a lambda, a module)."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__}")
    return value


def flag(name: str, value: Any) -> bool:
    """A real ``bool`` (``0``/``1`` or a tensor would hide a mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def _number(name: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} ({value!r})")


def positive_int(name: str, value: Any) -> int:
    """An ``int`` greater than zero."""
    _number(name, value, int, "an int")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    """An ``int`` that is zero or more."""
    _number(name, value, int, "an int")
    if value < 0:
        raise ValueError(f"{name} must be zero or positive, got {value}")
    return value


def divisible(name: str, value: int, by_name: str, by: int, *, hint: str = "") -> int:
    """``value`` an exact multiple of ``by`` (e.g. the query heads of a key/value head's group);
    ``hint`` ends the message (how else to satisfy the rule, if there is a way)."""
    if value % by:
        hint = f" {hint}" if hint else ""
        raise ValueError(f"{name} ({value}) must be divisible by {by_name} ({by}){hint}")
    return value


def head_split(
    embed_dim: Any, num_heads: Any, head_dim: Any = None, *, hint: str = ""
) -> tuple[int, int, int]:
    """``(E, H, D)`` of a layer whose ``embed_dim`` feeds ``num_heads`` heads of ``head_dim``
    numbers each; without ``head_dim`` the heads share the width evenly, ``D = E // H`` (``hint``:
    see :func:`divisible`)."""
    E, H = positive_int("embed_dim", embed_dim), positive_int("num_heads", num_heads)
    if head_dim is not None:
        return E, H, positive_int("head_dim", head_dim)
    return E, H, divisible("embed_dim", E, "num_heads", H, hint=hint) // H


def positive_float(name: str, value: Any) -> float:
    """A finite number greater than zero."""
    _number(name, value, (int, float), "a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def probability(name: str, value: Any) -> float:
    """A dropout probability in ``[0, 1)``."""
    _number(name, value, (int, float), "a float")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def scale(value: Any) -> float | None:
    """``None`` (use ``1/sqrt(D)``) or a finite number multiplying the scores."""
    if value is None:
        return None
    _number("scale", value, (int, float), "a float or None")
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value!r}")
    return float(value)


def one_of(name: str, value: Any, choices: Sequence[object]) -> object:
    """One of a fixed set of choices."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(str, choices))}")
    return value


def _qkv_agree(query: Tensor, key: Tensor, value: Tensor) -> None:
    """Query, key and value share a dtype and a device, and query and key a head dim."""
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device} and {value.device}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same head dim, got query {shape(query)} and key {shape(key)}"
        )


def qkv(query: Any, key: Any, value: Any, *, enable_gqa: bool = False) -> int:
    """Check that query, key and value fit together; return the group size ``H // Hkv``.

    Shapes:
        query ``(..., H, L, D)``, key ``(..., Hkv, S, D)``, value ``(..., Hkv, S, Dv)``. Without
        ``enable_gqa`` all leading dims must be equal (``Hkv = H``, group size 1): a batch is never
        broadcast silently. With it, ``H`` must be a multiple of ``Hkv`` and the other leading dims
        equal; query head ``i`` then reads key/value head ``i // (H // Hkv)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        tensor(name, t, floating=True)
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have at least 2 dims (..., length, dim), got shape {shape(t)}"
            )
    _qkv_agree(query, key, value)
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S, got key {shape(key)} and value {shape(value)}"
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(
            f"key and value must have the same leading dims, got key {shape(key)} and value {shape(value)}"
        )
    same = query.shape[:-2] == key.shape[:-2]
    if same:
        return 1
    gqa_fits = (
        enable_gqa
        and query.dim() >= 3
        and query.dim() == key.dim()
        and query.shape[:-3] == key.shape[:-3]
        and query.shape[-3] % key.shape[-3] == 0
    )
    if not gqa_fits:
        what = (
            "the same leading (batch) dims"
            if not enable_gqa
            else "the same batch dims and a head count (dim -3) that is a multiple of key's"
        )
        raise ValueError(
            f"query, key and value must have {what}, got query {shape(query)}, key {shape(key)} "
            f"and value {shape(value)}"
        )
    return query.shape[-3] // key.shape[-3]


def attn_mask(mask: Any, target: tuple[int, ...]) -> Tensor:
    """A bool keep-mask or float bias that broadcasts to the scores ``target`` ``(..., L, S)``.

    The mask may have fewer dims and size-1 dims, but it may never *grow* the scores (that would
    be a silent broadcast of the batch).
    """
    tensor("attn_mask", mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    m = shape(mask)
    if not _broadcasts(m, tuple(target)):
        raise ValueError(
            f"attn_mask of shape {m} is not broadcastable to the scores {tuple(target)}"
        )
    return mask


def integer_tensor(name: str, value: Any, *, ndim: int | None = None) -> Tensor:
    """A tensor of an integer dtype (not bool, floating or complex), e.g. positions or lengths."""
    tensor(name, value, ndim=ndim)
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    return value


def cu_seqlens(name: str, value: Any, total: int, total_name: str) -> list[int]:
    """FlashAttention's ``cu_seqlens``: ``(B + 1,)`` int32 prefix sums of the sequence lengths.

    They must start at 0, never decrease (an empty sequence repeats a value), and end at the
    packed length ``total`` (the length of ``total_name``). Returns them as a list of ints.
    """
    tensor(name, value, ndim=1, layout="(B + 1,)")
    if value.dtype != torch.int32:
        raise TypeError(
            f"{name} must be an int32 tensor (FlashAttention's layout), got dtype {value.dtype}"
        )
    if value.numel() < 2:
        raise ValueError(f"{name} must hold B + 1 >= 2 offsets, got shape {shape(value)}")
    offsets = [int(x) for x in value.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]} (in {offsets})")
    drops = [i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(
            f"{name} must be non-decreasing (prefix sums of lengths), got {offsets[i - 1]} then "
            f"{offsets[i]} at index {i} (in {offsets})"
        )
    if offsets[-1] != total:
        raise ValueError(
            f"{name} must end at the packed length of {total_name} ({total}), got {offsets[-1]}"
        )
    return offsets


def cu_seqlens_pair(
    cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int, total_k: int
) -> tuple[list[int], list[int]]:
    """Query and key ``cu_seqlens`` (see :func:`cu_seqlens`) of the same sequences, ending at the
    packed lengths of query and key; returns both as lists of ints."""
    starts_q = cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "query")
    starts_k = cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "key")
    if len(starts_q) != len(starts_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"shapes {shape(cu_seqlens_q)} and {shape(cu_seqlens_k)}"
        )
    return starts_q, starts_k


def shared_prefix(prefix_key: Any, prefix_value: Any, key: Tensor, value: Tensor) -> None:
    """A shared prefix laid out as the checked packed ``key`` and ``value``: ``(P, Hkv, D)`` and
    ``(P, Hkv, Dv)``, with their dtype and device."""
    tensor("prefix_key", prefix_key, floating=True, ndim=3, layout="(P, Hkv, D)")
    tensor("prefix_value", prefix_value, floating=True, ndim=3, layout="(P, Hkv, Dv)")
    if prefix_key.dtype != key.dtype or prefix_value.dtype != key.dtype:
        raise TypeError(
            f"prefix_key and prefix_value must have key's dtype {key.dtype}, got "
            f"{prefix_key.dtype} and {prefix_value.dtype}"
        )
    if prefix_key.device != key.device or prefix_value.device != key.device:
        raise ValueError(
            f"prefix_key and prefix_value must be on key's device {key.device}, got "
            f"{prefix_key.device} and {prefix_value.device}"
        )
    if (
        prefix_key.shape[0] != prefix_value.shape[0]
        or prefix_key.shape[1:] != key.shape[1:]
        or prefix_value.shape[1:] != value.shape[1:]
    ):
        raise ValueError(
            f"prefix_key (P, Hkv, D) and prefix_value (P, Hkv, Dv) must have one P and key's "
            f"and value's (Hkv, D) and (Hkv, Dv), got prefix_key {shape(prefix_key)}, "
            f"prefix_value {shape(prefix_value)}, key {shape(key)} and value {shape(value)}"
        )


def packed_qkv(query: Any, key: Any, value: Any) -> int:
    """Check packed (varlen) query, key and value; return the group size ``H // Hkv``.

    Shapes:
        query ``(total_q, H, D)``, key ``(total_k, Hkv, D)``, value ``(total_k, Hkv, Dv)``, with
        ``H`` a multiple of ``Hkv``.
    """
    layouts = {
        "query": "(total_q, H, D)",
        "key": "(total_k, Hkv, D)",
        "value": "(total_k, Hkv, Dv)",
    }
    for name, t in (("query", query), ("key", key), ("value", value)):
        tensor(name, t, floating=True, ndim=3, layout=layouts[name])
    _qkv_agree(query, key, value)
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must have the same total_k and Hkv, got key {shape(key)} and value {shape(value)}"
        )
    H, Hkv = query.shape[1], key.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"query's heads ({H}) must be a multiple of key's ({Hkv}), got query {shape(query)} "
            f"and key {shape(key)}"
        )
    return H // Hkv


def _broadcasts(small: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if a tensor of shape ``small`` broadcasts to ``target`` without growing it."""
    return len(small) <= len(target) and all(
        a in (1, b) for a, b in zip(reversed(small), reversed(target))
    )


def sinks(value: Any, query_shape: tuple[int, ...]) -> Tensor:
    """Sink logits: a floating tensor broadcasting to the query's leading dims (e.g. ``(H,)``)."""
    tensor("sinks", value, floating=True)
    if not _broadcasts(shape(value), query_shape[:-2]):
        raise ValueError(
            f"sinks of shape {shape(value)} must broadcast to the query's leading dims "
            f"{query_shape[:-2]} (query {query_shape})"
        )
    return value


def split_sinks(value: Any, out_shape: tuple[int, ...]) -> Tensor:
    """Sink logits beside partials ``out (splits, ..., L, Dv)``: a floating tensor broadcasting to
    ``...`` (e.g. ``(H,)``): one logit per head for the whole row, never one per split."""
    tensor("sinks", value, floating=True)
    if not _broadcasts(shape(value), out_shape[1:-2]):
        raise ValueError(
            f"sinks of shape {shape(value)} must broadcast to the partials' dims between splits "
            f"and (L, Dv), {out_shape[1:-2]} (out {out_shape})"
        )
    return value


def positions(name: str, value: Any, target: tuple[int, ...]) -> int | Tensor:
    """Token positions: an ``int`` offset ``p0`` (positions ``p0 … p0+L-1``) or an integer tensor.

    A tensor must be ``(L,)`` or broadcast to ``target`` ``(..., L)`` (like :func:`attn_mask`, it
    may have fewer dims and size-1 dims but never grow ``target``). Positions count tokens, so
    none may be negative; a float is refused rather than truncated.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{name} (an offset) must be >= 0, got {value}")
        return value
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{name} must be an int offset or an integer tensor, "
            f"got {type(value).__name__} ({value!r})"
        )
    integer_tensor(name, value)
    p = shape(value)
    if not (0 < len(p) and p[-1] == target[-1] and _broadcasts(p, target)):
        raise ValueError(
            f"{name} of shape {p} must be (L,) or broadcast to {tuple(target)} (..., L)"
        )
    if value.numel() and int(value.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {int(value.min())}")
    return value


def index(name: str, value: Any, size: int, what: str) -> int:
    """An ``int`` index into ``size`` items, in ``[0, size)``: a negative one is an error here,
    not Python's count from the end (which would silently read another sequence's data).

    ``what`` says in the message where ``size`` comes from, e.g. ``"the cache holds 2 sequences"``.
    """
    _number(name, value, int, "an int")
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in [0, {size}), got {value} ({what})")
    return value


def floating_dtype(name: str, value: Any) -> torch.dtype | None:
    """``None`` (torch's default) or a floating ``torch.dtype``."""
    if value is None:
        return None
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or None, got {type(value).__name__}")
    if not value.is_floating_point:
        raise TypeError(f"{name} must be a floating dtype, got {value}")
    return value


def matches_parameters(name: str, value: Tensor, weight: Tensor) -> Tensor:
    """An input a module's ``nn.Linear`` can take: the dtype and device of its parameters.

    Without this check a float64 input to a float32 module fails deep inside ``F.linear`` with
    a ``RuntimeError`` that names neither the argument nor the module. Under autocast the
    layers cast their inputs themselves, so the dtype may differ there.
    """
    if value.dtype != weight.dtype and not torch.is_autocast_enabled(value.device.type):
        raise TypeError(
            f"{name} has dtype {value.dtype} but the module's parameters are {weight.dtype}; "
            f"convert one of them (e.g. {name}.to({weight.dtype}) or module.to({value.dtype}))"
        )
    if value.device != weight.device:
        raise ValueError(
            f"{name} is on {value.device} but the module's parameters are on {weight.device}"
        )
    return value


def kv_step(key: Any, value: Any) -> None:
    """The keys and values of one cache update: ``(B, Hkv, S_new, D)`` and ``(B, Hkv, S_new, Dv)``."""
    tensor("key", key, floating=True, ndim=4, layout="(B, Hkv, S_new, D)")
    tensor("value", value, floating=True, ndim=4, layout="(B, Hkv, S_new, Dv)")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"key and value must agree in (B, Hkv, S_new), got key {shape(key)} "
            f"and value {shape(value)}"
        )
    if key.device != value.device:
        raise ValueError(
            f"key and value must be on one device, got {key.device} and {value.device}"
        )


def kv_fits(key: Tensor, value: Tensor, store_k: Tensor, store_v: Tensor, dims: str) -> None:
    """A cache update must match the stored keys/values in ``dims`` and the head dims, and
    in dtype and device (``torch.cat`` or a write would otherwise promote or fail deep inside).

    ``dims`` is ``"(B, Hkv)"`` for a cache laid out like the keys, ``"Hkv"`` for a block pool.
    """
    lead = (
        (key.shape[:2], store_k.shape[:2])
        if dims == "(B, Hkv)"
        else (key.shape[1], store_k.shape[1])
    )
    if lead[0] != lead[1] or (key.shape[-1], value.shape[-1]) != (
        store_k.shape[-1],
        store_v.shape[-1],
    ):
        raise ValueError(
            f"new keys {shape(key)} and values {shape(value)} do not match the cached keys "
            f"{shape(store_k)} and values {shape(store_v)} ({dims} and the head dims must agree)"
        )
    if key.dtype != store_k.dtype or value.dtype != store_v.dtype:
        raise TypeError(
            f"new keys and values must have the cache's dtype {store_k.dtype} and "
            f"{store_v.dtype}, got {key.dtype} and {value.dtype}"
        )
    if key.device != store_k.device:
        raise ValueError(
            f"new keys must be on the cache's device {store_k.device}, got {key.device}"
        )


def partials(out: Any, lse: Any) -> None:
    """Partial attention outputs and their logsumexps, one per split of the keys.

    Shapes:
        out ``(splits, ..., L, Dv)``, lse ``(splits, ..., L)``: exactly ``out.shape[:-1]``, since
        a broadcast lse (e.g. one split, or one row) would weigh the wrong partials. lse holds
        softmax statistics, so it is out's dtype, or float32 for float16/bfloat16 outputs
        (what :func:`mha.flash_attention` returns with ``return_lse=True``).
    """
    tensor("out", out, floating=True)
    tensor("lse", lse, floating=True)
    if out.dim() < 3:
        raise ValueError(
            f"out must have at least 3 dims (splits, ..., L, Dv), got shape {shape(out)}"
        )
    if lse.dim() >= 1 and lse.shape[0] != out.shape[0]:
        raise ValueError(
            f"out and lse must have the same number of splits (dim 0), got out {shape(out)} "
            f"and lse {shape(lse)}"
        )
    if shape(lse) != shape(out)[:-1]:
        raise ValueError(
            f"lse must have out's shape without its last dim (splits, ..., L) = "
            f"{shape(out)[:-1]}, got out {shape(out)} and lse {shape(lse)}"
        )
    expected = torch.float32 if out.dtype in LOW_PRECISION else out.dtype
    if lse.dtype != expected:
        raise TypeError(
            f"lse must have dtype {expected} for out of dtype {out.dtype}, got {lse.dtype}"
        )
    if out.device != lse.device:
        raise ValueError(f"out and lse must be on one device, got {out.device} and {lse.device}")


def _pools(
    query: Tensor, key_pool: Any, value_pool: Any, others: dict[str, Any]
) -> tuple[int, int]:
    """The pools of a paged cache beside an already checked ``query`` whose last dim is ``D``
    and whose heads are ``query.shape[-3]`` (paged) or ``query.shape[1]`` (packed): one dtype,
    one device with ``others``, ``D`` shared, ``H`` a multiple of ``Hkv``. Returns
    ``(groups, block_size)``."""
    tensor("key_pool", key_pool, floating=True, ndim=4, layout="(N, Hkv, block_size, D)")
    tensor("value_pool", value_pool, floating=True, ndim=4, layout="(N, Hkv, block_size, Dv)")
    if len({query.dtype, key_pool.dtype, value_pool.dtype}) > 1:
        raise TypeError(
            f"query, key_pool and value_pool must have one dtype, got {query.dtype}, "
            f"{key_pool.dtype} and {value_pool.dtype}"
        )
    named = {"query": query, "key_pool": key_pool, "value_pool": value_pool, **others}
    present = {n: t for n, t in named.items() if isinstance(t, Tensor)}
    if len({t.device for t in present.values()}) > 1:
        raise ValueError(
            f"{', '.join(present)} must be on one device, got "
            + ", ".join(str(t.device) for t in present.values())
        )
    H, D = query.shape[-3] if query.dim() == 4 else query.shape[1], query.shape[-1]
    (_, Hkv, bs, Dk) = key_pool.shape
    if shape(key_pool)[:3] != shape(value_pool)[:3] or D != Dk:
        raise ValueError(
            f"key_pool must be (N, Hkv, block_size, D) with query's D and value_pool's "
            f"(N, Hkv, block_size), got query {shape(query)}, key_pool {shape(key_pool)} and "
            f"value_pool {shape(value_pool)}"
        )
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"query heads ({H}) must be a multiple of the pools' key/value heads ({Hkv}), got "
            f"query {shape(query)} and key_pool {shape(key_pool)}"
        )
    return H // Hkv, bs


def _table_fits(block_table: Tensor, seq_lens: Tensor, B: int, bs: int, batch: str) -> list[int]:
    """``block_table (B, M)`` and ``seq_lens (B,)`` for ``B`` sequences, every length within the
    table's ``M · block_size`` slots; returns the lengths as ints."""
    if block_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(
            f"block_table (B, M) and seq_lens (B,) need {batch} B = {B}, got block_table "
            f"{shape(block_table)} and seq_lens {shape(seq_lens)}"
        )
    lens = [int(n) for n in seq_lens.tolist()]
    capacity = block_table.shape[1] * bs
    if any(not 0 <= n <= capacity for n in lens):
        raise ValueError(
            f"seq_lens must be in [0, {capacity}] (block_table's {block_table.shape[1]} columns "
            f"of block_size {bs}), got {lens}"
        )
    return lens


def _blocks_exist(block_table: Tensor, first: list[int], last: list[int], N: int) -> None:
    """Every table entry in columns ``[first[b], last[b])`` of row ``b`` is a block of the pool
    (an entry outside them may be ``-1``)."""
    col = torch.arange(block_table.shape[1], device=block_table.device)  # (M,)
    lo = torch.tensor(first, device=block_table.device)[:, None]  # (B, 1)
    hi = torch.tensor(last, device=block_table.device)[:, None]  # (B, 1)
    read = block_table[(col >= lo) & (col < hi)]  # the entries that are read
    if read.numel() and (read.min() < 0 or read.max() >= N):
        raise ValueError(
            f"block_table must hold block numbers in [0, {N}) (the pools' N) wherever the "
            f"queries read, got values from {read.min().item()} to {read.max().item()}"
        )


def paged(
    query: Any, key_pool: Any, value_pool: Any, block_table: Any, seq_lens: Any
) -> tuple[int, int]:
    """The arguments of :func:`mha.paged_attention`; returns ``(groups, block_size)``.

    Shapes:
        query ``(B, H, L, D)``, pools ``(N, Hkv, block_size, D)`` and ``(N, Hkv, block_size, Dv)``,
        block_table ``(B, M)`` of block numbers in ``[0, N)`` (``-1`` past a sequence's blocks),
        seq_lens ``(B,)`` with ``0 <= seq_lens[b] <= M · block_size``.
    """
    tensor("query", query, floating=True, ndim=4, layout="(B, H, L, D)")
    integer_tensor("block_table", block_table, ndim=2)
    integer_tensor("seq_lens", seq_lens, ndim=1)
    groups, bs = _pools(
        query, key_pool, value_pool, {"block_table": block_table, "seq_lens": seq_lens}
    )
    lens = _table_fits(block_table, seq_lens, query.shape[0], bs, "query's batch")
    _blocks_exist(block_table, [0] * len(lens), [math.ceil(n / bs) for n in lens], len(key_pool))
    return groups, bs


def blocks_read(
    counts: list[int], lens: list[int], block_size: int, window: int | None
) -> tuple[list[int], list[int]]:
    """The table columns ``[first, last)`` each sequence of :func:`mha.paged_varlen_attention`
    reads (none when it has no query): its blocks up to its last position, from the block
    holding the oldest key in any of its ``counts[b]`` queries' windows."""
    first, last = [], []
    for n, S in zip(counts, lens):
        lo = 0 if window is None else max(0, S - n - window + 1)  # oldest key seen
        first.append(lo // block_size)
        last.append(math.ceil(S / block_size) if n else lo // block_size)
    return first, last


def paged_varlen(
    query: Any,
    key_pool: Any,
    value_pool: Any,
    block_table: Any,
    cu_seqlens_q: Any,
    seq_lens: Any,
    scale_: Any,
    sinks_: Any,
    window: Any,
) -> tuple[list[int], list[int], float]:
    """The arguments of :func:`mha.paged_varlen_attention`; returns the query offsets, the
    lengths (as ints) and the scale (``1/sqrt(D)`` when ``scale_`` is None).

    Shapes:
        query ``(total_q, H, D)``, pools ``(N, Hkv, block_size, D)`` and ``(N, Hkv, block_size,
        Dv)``, block_table ``(B, M)``, cu_seqlens_q ``(B + 1,)`` int32, seq_lens ``(B,)``,
        sinks ``(H,)``.
    """
    tensor("query", query, floating=True, ndim=3, layout="(total_q, H, D)")
    integer_tensor("block_table", block_table, ndim=2)
    integer_tensor("seq_lens", seq_lens, ndim=1)
    others = {"block_table": block_table, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens}
    _, bs = _pools(query, key_pool, value_pool, {**others, "sinks": sinks_})
    starts = cu_seqlens("cu_seqlens_q", cu_seqlens_q, query.shape[0], "query")
    lens = _table_fits(block_table, seq_lens, len(starts) - 1, bs, "cu_seqlens_q's")
    counts = [b - a for a, b in zip(starts[:-1], starts[1:])]
    over = [b for b in range(len(lens)) if counts[b] > lens[b]]
    if over:
        b = over[0]
        raise ValueError(
            f"sequence {b} has {counts[b]} queries (cu_seqlens_q) but seq_lens[{b}] = {lens[b]}: "
            f"the queries are the last positions stored, so there can be at most seq_lens of them"
        )
    if window is not None:
        positive_int("window", window)
    H, D = query.shape[1], query.shape[2]
    if sinks_ is not None:
        tensor("sinks", sinks_, floating=True)
        if shape(sinks_) != (H,):
            raise ValueError(
                f"sinks must hold one logit per query head, shape ({H},), got "
                f"{shape(sinks_)} (query {shape(query)})"
            )
    _blocks_exist(block_table, *blocks_read(counts, lens, bs, window), len(key_pool))
    checked = scale(scale_)
    return starts, lens, 1.0 / math.sqrt(D) if checked is None else checked
