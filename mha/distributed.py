"""Attention across processes: tensor-parallel heads and ring attention on ``torch.distributed``.

When one device cannot hold a model's attention, two cuts are natural, and both are exact:

* **Heads** (tensor parallelism, Megatron-LM): heads never look at each other, so rank ``r`` of
  ``world`` computes ``H / world`` of them. ``W_Q``, ``W_K``, ``W_V`` are cut by output rows
  (column-parallel), ``W_O`` by input columns (row-parallel); each rank's ``W_O`` slice turns its
  heads into a ``(B, L, E)`` partial sum, and one all-reduce adds the partials:
  :class:`TensorParallelAttention`.
* **The sequence** (context parallelism, ring attention): rank ``r`` holds the ``r``-th
  contiguous shard of the queries, keys and values. The key/value shards travel around the ring of
  ranks; at each step a rank attends its queries to the shard it holds and forwards it to the
  next rank, and the partial outputs are merged by their logsumexp, exactly as split-KV decoding
  merges its splits (:func:`mha.merge_partials`): :func:`ring_attention`.

Every byte a rank sends through these functions is counted while :func:`count_traffic` is
active, so the counts can be compared with the formulas. The functions run inside an
initialised process group (the course uses gloo on a CPU; :mod:`mha.lab.processes` starts one);
they are forward passes (serving): the shards received from other ranks carry no gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import validation as validate
from .attention import check_arguments
from .decoding import _merge_partials
from .flash import _flash_attention
from .multihead import MultiHeadAttention
from .rope import _apply_rope

LAYOUTS = ("contiguous", "zigzag")


@dataclass
class Traffic:
    """What this process sent through :mod:`mha.distributed` while it was counting.

    Attributes:
        sent_bytes: payload of the point-to-point sends (ring attention's key/value shards).
        reduced_bytes: payload handed to all-reduce (tensor parallelism's partial outputs); how
            many bytes the all-reduce itself moves depends on its algorithm (a ring all-reduce
            sends ``2 (world - 1) / world`` times this per rank).
        messages: how many sends and all-reduces were started.
    """

    sent_bytes: int = 0
    reduced_bytes: int = 0
    messages: int = 0


_COUNTERS: list[Traffic] = []


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the bytes this process sends through :mod:`mha.distributed` inside the block.

    Example::

        with count_traffic() as traffic:
            out = ring_attention(q, k, v)
        print(traffic.sent_bytes)
    """
    traffic = Traffic()
    _COUNTERS.append(traffic)
    try:
        yield traffic
    finally:
        _COUNTERS.remove(traffic)


def _record(tensor: Tensor, field: str) -> None:
    for traffic in _COUNTERS:
        setattr(traffic, field, getattr(traffic, field) + tensor.numel() * tensor.element_size())
        traffic.messages += 1


def _process_group(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world)`` of ``group`` (the default group when ``None``), checked to exist."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"group: no process group is initialised (group={group!r}); call "
            "torch.distributed.init_process_group first, e.g. through mha.lab.processes.launch"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: Tensor, world_size: int, *, layout: str = "contiguous") -> list[Tensor]:
    """Cut a sequence into ``world_size`` equal shards along dim ``-2``, one per rank.

    ``"contiguous"``: rank ``r`` gets tokens ``[r·L/w, (r+1)·L/w)``. ``"zigzag"``: the sequence
    is cut into ``2w`` chunks and rank ``r`` gets chunks ``r`` and ``2w - 1 - r`` (one early, one
    late), which evens out causal work (see :func:`ring_schedule`).

    Shapes:
        x ``(..., L, X)``; returns ``world_size`` tensors ``(..., L / world_size, X)``.
    """
    x = validate.tensor("x", x)
    world_size = validate.positive_int("world_size", world_size)
    validate.one_of("layout", layout, LAYOUTS)
    if x.ndim < 2:
        raise ValueError(f"x must have a sequence dim and a feature dim, got x {validate.shape(x)}")
    pieces = world_size if layout == "contiguous" else 2 * world_size
    L = x.shape[-2]
    if L % pieces:
        raise ValueError(
            f"sequence length L ({L}) of x {validate.shape(x)} must be divisible by "
            f"{'world_size' if layout == 'contiguous' else '2 * world_size'} ({pieces})"
        )
    chunks = x.chunk(pieces, dim=-2)  # pieces x (..., L / pieces, X)
    if layout == "contiguous":
        return list(chunks)
    return [
        torch.cat([chunks[r], chunks[2 * world_size - 1 - r]], dim=-2)  # (..., L / w, X)
        for r in range(world_size)
    ]


def unshard_sequence(shards: list[Tensor], *, layout: str = "contiguous") -> Tensor:
    """Put the shards of :func:`shard_sequence` back in token order.

    Shapes:
        ``world`` tensors ``(..., L / world, X)`` -> ``(..., L, X)``.
    """
    validate.one_of("layout", layout, LAYOUTS)
    if layout == "contiguous":
        return torch.cat(shards, dim=-2)  # (..., L, X)
    w = len(shards)
    halves = [s.chunk(2, dim=-2) for s in shards]  # rank r: chunks r and 2w - 1 - r
    order = [halves[i][0] for i in range(w)] + [halves[w - 1 - i][1] for i in range(w)]
    return torch.cat(order, dim=-2)  # (..., L, X)


def ring_schedule(world_size: int, *, is_causal: bool = True, layout: str = "contiguous") -> Tensor:
    """What each rank does at each step of ring attention.

    At step ``t``, rank ``r`` holds the key/value shard of rank ``(r - t) mod world``. Counted in
    chunk pairs (a chunk is ``L / world`` tokens for the contiguous layout, ``L / (2 world)`` for
    zigzag), ``work[r, t]`` is the number of (query chunk, key chunk) pairs that rank ``r`` must
    compute at step ``t``, a diagonal pair counting one half (its upper triangle is masked).

    Returns:
        ``work`` ``(world, world)`` float: 0 where a causal rank skips the whole shard.
    """
    world_size = validate.positive_int("world_size", world_size)
    validate.flag("is_causal", is_causal)
    validate.one_of("layout", layout, LAYOUTS)
    w = world_size
    chunks = (
        [[r] for r in range(w)]
        if layout == "contiguous"
        else [[r, 2 * w - 1 - r] for r in range(w)]
    )  # the chunks each rank holds, in token order
    work = torch.zeros(w, w)  # (rank, step)
    for r in range(w):
        for t in range(w):
            src = (r - t) % w
            for i in chunks[r]:  # query chunk
                for j in chunks[src]:  # key chunk
                    if not is_causal or j < i:
                        work[r, t] += 1.0
                    elif j == i:
                        work[r, t] += 0.5
    return work


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    enable_gqa: bool = False,
    layout: str = "contiguous",
) -> Tensor:
    """Attention over a sequence that is split across the ranks of a process group.

    Rank ``r`` of ``world`` holds the ``r``-th shard of the sequence (:func:`shard_sequence`).
    At step ``t = 0 … world-1`` it holds the key/value shard of rank ``(r - t) mod world``: it
    starts sending that shard to rank ``r + 1`` and receiving the next one from rank ``r - 1``,
    attends its queries to the shard it holds meanwhile (computation overlaps the transfer),
    merges the partial output by logsumexp, then waits for the transfer. Each rank sends
    ``world - 1`` key shards and ``world - 1`` value shards in all.

    With ``is_causal``, a key shard that lies wholly after this rank's queries is skipped (it is
    still forwarded), the rank's own shard is attended causally, and earlier shards in full:
    rank ``r`` computes ``r + ½`` shards' worth, so the last rank works longest. The ``"zigzag"``
    layout gives every rank one early and one late chunk, which evens the work out.

    Args:
        query, key, value: this rank's shards.
        is_causal: causal attention over the whole sequence (token order as in the layout).
        scale: multiplies the scores; defaults to ``1/sqrt(D)``.
        group: the process group (default: the default group).
        enable_gqa: key/value may have fewer heads (grouped-query attention).
        layout: how the sequence was sharded, ``"contiguous"`` or ``"zigzag"``.

    Shapes:
        query ``(..., L / world, D)``, key ``(..., L / world, D)``, value ``(..., L / world, Dv)``,
        the same on every rank; returns this rank's output shard ``(..., L / world, Dv)``.
    """
    groups, scale = check_arguments(query, key, value, None, is_causal, scale, enable_gqa)
    validate.one_of("layout", layout, LAYOUTS)
    rank, world = _process_group(group)
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(
            "query and key shards must hold the same tokens (L / world each), got query "
            f"{validate.shape(query)} and key {validate.shape(key)}"
        )
    if layout == "zigzag" and query.shape[-2] % 2:
        raise ValueError(
            f"a zigzag shard holds two equal chunks, got query {validate.shape(query)}"
        )
    compute = torch.float32 if query.dtype in validate.LOW_PRECISION else query.dtype
    q = query.detach().to(compute)
    k, v = key.detach().contiguous(), value.detach().contiguous()  # sent in their own dtype
    out: Tensor | None = None
    lse: Tensor | None = None
    with torch.no_grad():
        for step in range(world):
            src = (rank - step) % world  # whose keys and values this rank holds now
            if step < world - 1:
                k_next, v_next = torch.empty_like(k), torch.empty_like(v)
                pending = _pass_along(k, v, k_next, v_next, rank, world, group)
            for o, l in _partials(
                q, k.to(compute), v.to(compute), rank, src, is_causal, scale, groups, layout, world
            ):
                if out is None or lse is None:
                    out, lse = o, l
                else:
                    out, lse = _merge_partials(torch.stack([out, o]), torch.stack([lse, l]))
            if step < world - 1:
                for work in pending:
                    work.wait()
                k, v = k_next, v_next
    if out is None:  # unreachable: step 0 attends the rank's own shard, which is never skipped
        raise RuntimeError("ring_attention computed no block")
    return out.to(query.dtype)


def _pass_along(
    k: Tensor,
    v: Tensor,
    k_next: Tensor,
    v_next: Tensor,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
) -> list[dist.Work]:
    """Start sending ``k, v`` to the next rank and receiving the previous rank's into
    ``k_next, v_next``; return the transfers to wait for."""
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    works = []
    for tensor in (k, v):
        _record(tensor, "sent_bytes")
        works.append(dist.isend(tensor, group=group, group_dst=nxt))
    for tensor in (k_next, v_next):
        works.append(dist.irecv(tensor, group=group, group_src=prev))
    return [w for w in works if w is not None]


def _partials(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rank: int,
    src: int,
    is_causal: bool,
    scale: float,
    groups: int,
    layout: str,
    world: int,
) -> Iterator[tuple[Tensor, Tensor]]:
    """The partial outputs and logsumexps of this rank's queries against ``src``'s shard.

    Contiguous: one block, skipped past the diagonal. Zigzag: each shard is two chunks (early
    ``rank``, late ``2w - 1 - rank``); every (query chunk, key chunk) pair is computed, causally on
    the diagonal, or skipped, and the two query chunks' results are put back side by side.
    """
    if layout == "contiguous":
        if not is_causal or src < rank:
            yield _flash_attention(q, k, v, None, False, scale, groups=groups)
        elif src == rank:
            yield _flash_attention(q, k, v, None, True, scale, groups=groups)
        return
    mine, theirs = (rank, 2 * world - 1 - rank), (src, 2 * world - 1 - src)
    q_chunks, k_chunks, v_chunks = q.chunk(2, -2), k.chunk(2, -2), v.chunk(2, -2)
    rows = []
    for qi, i in zip(q_chunks, mine, strict=True):
        outs, lses = [], []
        for kj, vj, j in zip(k_chunks, v_chunks, theirs, strict=True):
            if not is_causal or j <= i:
                o, l = _flash_attention(
                    qi, kj, vj, None, is_causal and j == i, scale, groups=groups
                )
                outs.append(o)  # (..., L / 2w, Dv)
                lses.append(l)  # (..., L / 2w)
        if not outs:  # nothing visible in this shard: weight 0 in the merge
            lse = torch.full(qi.shape[:-1], float("-inf"), dtype=_lse_dtype(qi), device=q.device)
            outs, lses = [qi.new_zeros(*qi.shape[:-1], v.shape[-1])], [lse]  # (..., L / 2w, Dv)
        rows.append(_merge_partials(torch.stack(outs), torch.stack(lses)))
    yield (
        torch.cat([rows[0][0], rows[1][0]], dim=-2),  # (..., L / world, Dv)
        torch.cat([rows[0][1], rows[1][1]], dim=-1),  # (..., L / world)
    )


def _lse_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class TensorParallelAttention(nn.Module):
    """This rank's share of a :class:`mha.MultiHeadAttention`: ``H / world`` of its heads.

    Built from the full module (the same weights on every rank), it keeps only its slices:
    the rows of ``W_Q``, ``W_K``, ``W_V`` (and biases) that make its heads, and the columns of
    ``W_O`` that read them, so each rank holds ``1 / world`` of the projection weights. Its
    forward pass attends with its heads, projects them with its ``W_O`` columns into a
    ``(B, L, E)`` partial sum, and all-reduces the partials: every rank returns the full output.
    ``W_O``'s bias is added once, after the sum.

    Args:
        module: the self-attention to split; ``num_heads`` must be divisible by the group's
            size. With grouped-query attention each rank takes whole groups, or, with fewer
            key/value heads than ranks, a copy of the one key/value head its query heads read.
        group: the process group (default: the default group).
    """

    def __init__(self, module: MultiHeadAttention, *, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(module, MultiHeadAttention):
            raise TypeError(
                f"module must be an mha.MultiHeadAttention, got {type(module).__name__}"
            )
        rank, world = _process_group(group)
        H, Hkv, D, E = module.num_heads, module.num_kv_heads, module.head_dim, module.embed_dim
        G = H // Hkv  # query heads per key/value head
        h = H // world if H % world == 0 else 0
        if not h or (h % G and G % h):
            raise ValueError(
                f"num_heads ({H}) must be divisible by the world size ({world}), and each rank's "
                f"heads must hold whole groups of the num_kv_heads ({Hkv}) or lie in one group"
            )
        if module.kdim != E or module.vdim != E:
            raise ValueError(
                f"self-attention only: kdim ({module.kdim}) and vdim ({module.vdim}) must equal "
                f"embed_dim ({E})"
            )
        self.group, self.rank, self.world = group, rank, world
        # With fewer key/value heads than ranks, a key/value head is copied to every rank whose
        # query heads read it (as Megatron-LM does); otherwise each rank holds its groups' heads.
        self.num_heads, self.num_kv_heads, self.head_dim = h, max(1, h // G), D
        self.rope, self.rope_base = module.rope, module.rope_base
        q_rows = slice(rank * h * D, (rank + 1) * h * D)
        first_kv = rank * h // G  # the key/value head of this rank's first query head
        kv_rows = slice(first_kv * D, (first_kv + self.num_kv_heads) * D)
        self.q_proj = _rows(module.q_proj, q_rows)  # E -> H/w·D   (column-parallel)
        self.k_proj = _rows(module.k_proj, kv_rows)  # E -> Hkv/w·D
        self.v_proj = _rows(module.v_proj, kv_rows)  # E -> Hkv/w·D
        self.out_proj = nn.Linear(self.num_heads * D, E, bias=False)  # H/w·D -> E (row-parallel)
        bias = module.out_proj.bias
        with torch.no_grad():
            self.out_proj.weight.copy_(module.out_proj.weight[:, q_rows])  # (E, H/w·D)
        self.out_bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: Tensor, *, is_causal: bool = False) -> Tensor:
        """Self-attention over ``x``, equal to the full module's.

        Shapes:
            x ``(B, L, E)`` (the same on every rank); returns ``(B, L, E)``.
        """
        validate.flag("is_causal", is_causal)
        x = validate.tensor("x", x, floating=True)
        if x.ndim != 3 or x.shape[-1] != self.out_proj.out_features:
            raise ValueError(
                f"x must be (B, L, E) with E = {self.out_proj.out_features}, got x {validate.shape(x)}"
            )
        B, L, _ = x.shape
        h, hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, h, D).transpose(1, 2)  # (B, H/w, L, D)
        k = self.k_proj(x).view(B, L, hkv, D).transpose(1, 2)  # (B, Hkv/w, L, D)
        v = self.v_proj(x).view(B, L, hkv, D).transpose(1, 2)  # (B, Hkv/w, L, D)
        if self.rope:
            q, k = _apply_rope(q, 0, self.rope_base), _apply_rope(k, 0, self.rope_base)
        heads, _ = _flash_attention(
            q, k, v, None, is_causal, D**-0.5, groups=h // hkv
        )  # (B, H/w, L, D)
        out = self.out_proj(
            heads.transpose(1, 2).reshape(B, L, h * D)
        )  # this rank's share, (B, L, E)
        _record(out, "reduced_bytes")
        dist.all_reduce(out, group=self.group)  # sum of every rank's share -> (B, L, E)
        return out if self.out_bias is None else out + self.out_bias


def _rows(linear: nn.Linear, rows: slice) -> nn.Linear:
    """A new ``nn.Linear`` with a copy of ``linear``'s output ``rows`` (weights and bias)."""
    part = nn.Linear(linear.in_features, rows.stop - rows.start, bias=linear.bias is not None)
    with torch.no_grad():
        part.weight.copy_(linear.weight[rows])  # (rows, in_features)
        if linear.bias is not None:
            part.bias.copy_(linear.bias[rows])
    return part.to(linear.weight.dtype)
