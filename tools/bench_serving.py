"""The report's serving lines (chapter 9): prefix caching, and FlexAttention's paged attention.

:func:`prefix_caching` serves requests that share system prompts through a small model, once
with :class:`mha.PagedKVCache`'s prefix caching and once without: the hit rate must be what the
prompts' shared whole blocks predict, the outputs must not change, and the time must drop.
:func:`flex_paged_decode` runs the paged decode step of ``bench_report.serving`` through
PyTorch's FlexAttention, compiled, reading the same pool through the same block table: the peer
of :func:`mha.paged_attention`. ``tools/bench_report.py`` calls both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from bench_checks import Check, randn, times
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import mha
from mha.lab.timing import paired_ratio, time_fn

# --- prefix caching -----------------------------------------------------------------------------


def predicted_reuse(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Positions each prompt finds cached when the prompts arrive one after another, computed
    from the prompts alone: the whole blocks it shares with an earlier prompt (every token up to
    the block's end agrees), leaving at least its last token to compute. Assumes nothing cached
    is evicted."""
    reused = []
    for i, p in enumerate(prompts):
        limit = (len(p) - 1) // block_size  # whole blocks before the last token
        best = 0
        for earlier in prompts[:i]:
            same = next(
                (t for t, (a, b) in enumerate(zip(p, earlier)) if a != b), min(len(p), len(earlier))
            )  # the length of the common prefix
            best = max(best, same // block_size)
        reused.append(min(best, limit) * block_size)
    return reused


def _workload(g: torch.Generator, quick: bool, vocab: int) -> tuple[list[list[int]], int]:
    """Prompts = one of three system prompts + a short user part, the systems interleaved.

    Returns the prompts and the number of requests per system prompt."""
    lengths, per_system, user = (
        ((200, 240, 280), 3, (8, 24)) if quick else ((200, 260, 330), 12, (16, 48))
    )
    systems = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    order = [s for _ in range(per_system) for s in range(len(systems))]
    order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
    prompts = []
    for s in order:
        n = int(torch.randint(user[0], user[1] + 1, (1,), generator=g))
        prompts.append(systems[s] + torch.randint(0, vocab, (n,), generator=g).tolist())
    return prompts, per_system


def prefix_caching(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    """Requests on three shared system prompts, prefilled one after another through a small
    model (a stack of :class:`mha.TransformerBlock` with a :class:`mha.PagedKVCache` per layer),
    each request ending before the next arrives: with prefix caching against without."""
    E, H, Hkv, layers, bs, vocab = (64, 4, 2, 1, 16, 1000) if quick else (128, 8, 2, 2, 16, 1000)
    prompts, per_system = _workload(g, quick, vocab)
    torch.manual_seed(0)
    model = [mha.TransformerBlock(E, H, num_kv_heads=Hkv).to(dev).eval() for _ in range(layers)]
    embed = randn((vocab, E), dev, g)
    # A pool that holds every block of every request: nothing cached is evicted.
    num_blocks = sum(math.ceil(len(p) / bs) for p in prompts)

    def serve(caching: bool) -> tuple[Tensor, list[int]]:
        """Each request's last output ``(R, E)`` and the positions it found cached."""
        caches = [
            mha.PagedKVCache(bs, num_blocks=num_blocks, prefix_caching=caching) for _ in model
        ]
        last, reused = [], []
        for tokens in prompts:
            rows = [c.add_sequence(tokens if caching else None) for c in caches]
            start = int(caches[0].seq_lens[rows[0]])  # positions found cached (the same per layer)
            x = embed[torch.tensor(tokens[start:], device=dev)][None]  # (1, to compute, E)
            for block, cache in zip(model, caches):
                x = block(x, is_causal=True, kv_cache=cache)  # (1, to compute, E)
            last.append(x[0, -1])  # the prompt's last position: what the first new token needs
            reused.append(start)
            for cache, row in zip(caches, rows):
                cache.free_sequence(row)  # the request is done; with caching its blocks stay
        return torch.stack(last), reused

    with torch.no_grad():
        (out_cached, reused), (out_plain, none) = serve(True), serve(False)
        torch.testing.assert_close(out_cached, out_plain)
        predicted = predicted_reuse(prompts, bs)
        if none != [0] * len(prompts) or reused != predicted:  # checked under python -O too
            raise AssertionError(f"positions reused {reused}, predicted {predicted}")
        ratio, t_cached, t_plain = paired_ratio(
            lambda: serve(True),
            lambda: serve(False),
            pairs=3 if quick else 5,
            min_run_time=run_time,
        )
    total = sum(map(len, prompts))
    hit = sum(reused) / total
    # The bound. Computing only the last 1 - h of a prompt's positions costs 1 - h of the
    # projections and the MLP, and about 1 - h² of the causal attention (the late positions,
    # which attend to the most keys, are the ones computed): at most ~1 - h² of the work. The target,
    # 1 - h/2, leaves room for the work per request that both runs do (0.60 for h = 0.8).
    target = 1 - hit / 2
    return [
        Check(
            f"prefill with / without prefix caching time, {len(prompts)} requests on 3 system "
            f"prompts ({per_system} each), hit rate {hit:.3f} of {total:,} prompt tokens, "
            f"{layers} block(s) E={E} H={H} Hkv={Hkv} block_size={bs}",
            ratio,
            round(target, 3),
            True,
            times("cached", t_cached, "plain", t_plain)
            + "; hit rate = the shared whole blocks' (exact); last outputs equal",
        )
    ]


# --- FlexAttention's paged attention ----------------------------------------------------------


def flex_paged_block_mask(
    block_table: Tensor,
    seq_lens: Tensor,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    group: int,
) -> BlockMask:
    """The block mask of a decode step over a :class:`mha.PagedKVCache`'s pool, for FlexAttention.

    FlexAttention sees the whole pool as one sequence of ``num_blocks · Hkv · block_size`` keys:
    the pool ``(N, Hkv, block_size, D)`` viewed as it lies in memory, so key ``i`` is offset
    ``i % block_size`` of key/value head ``(i // block_size) % Hkv`` of physical block
    ``i // (block_size · Hkv)``. One mask block is one head of one physical block. The queries
    are one row of ``G`` per sequence and key/value head (the query heads that share it, as
    :func:`mha.paged_attention` groups them), and the block mask lists for each row exactly the
    blocks of the sequence's block-table row, in that head: FlexAttention reads those in place,
    each once for the ``G`` heads, and skips the rest of the pool. The blocks before a
    sequence's last are full (no mask is evaluated in them); in a partly filled last block the
    ``mask_mod`` maps each physical position back to the sequence's logical position through a
    physical-to-logical table (PyTorch's paged-attention recipe) and keeps the positions stored.

    Shapes:
        block_table ``(B, M)`` int (``-1`` past a sequence's blocks), seq_lens ``(B,)``; the
        mask is for queries ``(B, Hkv, group, D)`` (``group`` = ``G``, query heads per key/value
        head) and keys ``(1, 1, N · Hkv · block_size, D)``.
    """
    B, M = block_table.shape
    Hkv, bs, dev = num_kv_heads, block_size, block_table.device
    lens = seq_lens.to(dev, torch.int64)  # (B,)
    used = (lens + bs - 1) // bs  # (B,) blocks each sequence reaches
    logical = torch.arange(M, device=dev)  # (M,) logical block numbers
    valid = logical < used[:, None]  # (B, M)
    physical = torch.where(valid, block_table.long(), num_blocks)  # (B, M); N: "none"
    # physical -> logical block, per sequence; -1 where a physical block is not the sequence's
    to_logical = torch.full((B, num_blocks + 1), -1, dtype=torch.int64, device=dev)
    to_logical.scatter_(1, physical, torch.where(valid, logical, -1))
    to_logical = to_logical[:, :num_blocks]  # (B, N)
    heads = torch.arange(Hkv, device=dev)[:, None]  # (Hkv, 1)
    blocks = physical[:, None, :].clamp(max=num_blocks - 1) * Hkv + heads  # (B, Hkv, M)
    width = num_blocks * Hkv  # mask blocks in the pool
    full = lens // bs  # (B,) blocks filled to the end: read without a mask
    partial = used - full  # (B,) 1 where the last block is partly filled, else 0
    last = blocks.gather(2, (used - 1).clamp(min=0)[:, None, None].expand(B, Hkv, 1))

    def per_row(counts: Tensor, listed: Tensor) -> tuple[Tensor, Tensor]:
        """(B, Hkv, 1) counts and (B, Hkv, 1, width) indices, zero-padded, as BlockMask takes."""
        indices = torch.zeros(B, Hkv, 1, width, dtype=torch.int32, device=dev)
        indices[:, :, 0, : listed.shape[-1]] = listed.int()
        return counts[:, None, None].expand(B, Hkv, 1).int(), indices

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = kv_idx // bs  # physical block · Hkv + key/value head
        mine = to_logical[b, block // Hkv]  # its logical block in sequence b, or -1
        position = mine * bs + kv_idx % bs  # the logical position
        return (mine >= 0) & (block % Hkv == h) & (position < lens[b])  # decode: sees all

    kv_num, kv_idx = per_row(partial, last)
    full_num, full_idx = per_row(full, blocks)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(group, bs),
        mask_mod=mask_mod,
        seq_lengths=(group, width * bs),
        compute_q_blocks=False,  # a decode step: no backward pass, no column-wise index
    )


def flex_paged_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    attend: Callable[..., Tensor] = flex_attention,
) -> Tensor:
    """One decode step per sequence through FlexAttention over the pool, in place (as
    :func:`mha.paged_attention`): the block mask of :func:`flex_paged_block_mask` is built from
    the block table in each call, as an engine does each step.

    Args:
        attend: ``flex_attention`` itself (eager: slow, for checking), or a compiled copy.

    Shapes:
        query ``(B, H, 1, D)``, pools ``(N, Hkv, block_size, D)`` (contiguous), block_table
        ``(B, M)``, seq_lens ``(B,)``; returns ``(B, H, 1, Dv)``. ``H`` a multiple of ``Hkv``.
    """
    B, H, _, D = query.shape
    N, Hkv, bs, _ = key_pool.shape
    assert key_pool.is_contiguous() and value_pool.is_contiguous(), "a view needs the pool as is"
    mask = flex_paged_block_mask(block_table, seq_lens, N, Hkv, bs, H // Hkv)
    keys = key_pool.view(1, 1, N * Hkv * bs, D)  # the pool as it lies in memory: no copy
    values = value_pool.view(1, 1, N * Hkv * bs, value_pool.shape[-1])
    rows = query.view(B, Hkv, H // Hkv, D)  # the G query heads of a key/value head: one row
    out = attend(rows, keys, values, block_mask=mask, enable_gqa=True)  # (B, Hkv, G, Dv)
    return out.view(B, H, 1, -1)


def flex_paged_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: mha.PagedKVCache,
    *,
    quick: bool,
    pairs: int,
    run_time: float,
) -> list[Check | str]:
    """FlexAttention's paged attention, compiled, against SDPA over the contiguous cache: the
    peer of ``bench_report.serving``'s ``paged_attention`` line, on the same pool and table.

    Returns its Check, or a line saying why it was skipped (``--quick``, or no compiler)."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    name = f"FlexAttention paged (compiled) / SDPA over a contiguous cache time, B={B} H={H} Hkv={Hkv} D={D} S={S}"
    if quick:
        return [
            f"[SKIP] {name}: --quick skips it (torch.compile's first call takes ~15 s on a CPU); "
            "the full report measures it"
        ]
    assert cache.key_pool is not None and cache.value_pool is not None
    args = (q, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens)
    compiled = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        try:
            out = flex_paged_attention(*args, attend=compiled)  # the first call compiles
        except Exception as error:  # no C++ compiler, or inductor cannot build on this machine
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
            return [f"[SKIP] {name}: torch.compile failed on this machine ({reason})"]
        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)
        torch.testing.assert_close(out, sdpa(), atol=1e-5, rtol=1e-4)
        ratio, t_flex, t_sdpa = paired_ratio(
            lambda: flex_paged_attention(*args, attend=compiled),
            sdpa,
            pairs=pairs,
            min_run_time=run_time,
        )
        N, _, bs, _ = cache.key_pool.shape
        t_mask = time_fn(
            flex_paged_block_mask, *args[3:], N, Hkv, bs, H // Hkv, min_run_time=run_time
        )  # part of flex's time; an engine builds it once per step for all the layers
    return [
        Check(
            name,
            ratio,
            1.5,
            True,
            times("flex", t_flex, "SDPA", t_sdpa)
            + f" (flex includes building its block mask from the table, ~{t_mask.ms:.3f} ms)",
        )
    ]
