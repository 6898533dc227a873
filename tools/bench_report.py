"""The course's performance targets, each a ratio against PyTorch measured side by side in one run.

    python tools/bench_report.py            # or: make bench
    python tools/bench_report.py --quick    # tiny sizes: a smoke test of the report itself
    python tools/bench_report.py --strict   # exit 1 when a target is missed

Every line names what is compared, the measured ratio, its target and the times it comes from;
a line starting ``[SKIP]`` names a measurement this run did not make, and why.
The measurements use :mod:`mha.lab.timing` (``torch.utils.benchmark`` timers) and
:mod:`mha.lab.memory` (real peak memory).
Timings on a shared machine vary: ratios are medians of alternating pairs where the claim is a
speed-up, and the header line prints the load average so a busy run can be recognised.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import bench_serving
import torch
import torch.nn.functional as F
from bench_checks import Check, randn, times
from torch import nn

import mha
from mha.lab.memory import MiB, peak_memory
from mha.lab.timing import compare_times, paired_ratio


def _cached_kv(cache: mha.KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a cache that a prefill has filled (None before its first update)."""
    assert cache.key is not None and cache.value is not None, "the cache is empty"
    return cache.key, cache.value


def module_vs_torch(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    """Our module on torch's fused kernel vs ``nn.MultiheadAttention``, same weights, inference."""
    checks = []
    sizes = [(2, 32, 64, 4), (2, 64, 64, 4)] if quick else [(8, 256, 512, 8), (2, 1024, 512, 8)]
    for B, L, E, H in sizes:
        theirs = nn.MultiheadAttention(E, H, batch_first=True).to(dev).eval()
        ours = mha.MultiHeadAttention.from_torch(theirs, backend="sdpa").eval()
        x = randn((B, L, E), dev, g)
        with torch.no_grad():
            torch.testing.assert_close(
                ours(x)[0], theirs(x, x, x, need_weights=False)[0], atol=1e-4, rtol=1e-4
            )
            ratio, t_ours, t_theirs = paired_ratio(
                functools.partial(ours, x),
                functools.partial(theirs, x, x, x, need_weights=False),
                pairs=3 if quick else 5,
                min_run_time=run_time,
            )
        checks.append(
            Check(
                f"MultiHeadAttention(backend='sdpa') / nn.MultiheadAttention time, B={B} L={L} E={E} H={H}",
                ratio,
                1.0,
                True,
                times("ours", t_ours, "torch", t_theirs),
            )
        )
    return checks


def tiled_attention(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    """``mha.flash_attention`` against the math version and torch's fused kernel at a long length."""
    B, H, L, D = (1, 2, 256, 16) if quick else (1, 8, 4096, 64)
    q, k, v = (randn((B, H, L, D), dev, g) for _ in range(3))
    size = f"B={B} H={H} L=S={L} D={D}"
    pairs = 3 if quick else 5
    with torch.no_grad():
        torch.testing.assert_close(
            mha.flash_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v),
            atol=1e-4,
            rtol=1e-4,
        )
        mem_math = peak_memory(mha.scaled_dot_product_attention, q, k, v, warmup=False)
        mem_flash = peak_memory(mha.flash_attention, q, k, v, warmup=False)
        t = compare_times(
            {
                "math": lambda: mha.scaled_dot_product_attention(q, k, v),
                "flash": lambda: mha.flash_attention(q, k, v),
            },
            rounds=1 if quick else 2,
            min_run_time=run_time,
        )
        vs_sdpa, t_flash, t_sdpa = paired_ratio(
            lambda: mha.flash_attention(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v),
            pairs=pairs,
            min_run_time=run_time,
        )
        skip, t_full, t_causal = paired_ratio(
            lambda: mha.flash_attention(q, k, v),
            lambda: mha.flash_attention(q, k, v, is_causal=True),
            pairs=pairs,
            min_run_time=run_time,
        )
    return [
        Check(
            f"flash_attention / math attention peak memory, {size}",
            mem_flash / mem_math,
            0.05,
            True,
            f"flash ~{mem_flash / MiB:.1f} MiB, math ~{mem_math / MiB:.1f} MiB",
        ),
        Check(
            f"flash_attention / math attention time, {size}",
            t["flash"].median / t["math"].median,
            1.0,
            True,
            times("flash", t["flash"], "math", t["math"]),
        ),
        Check(
            f"flash_attention / torch SDPA time (median of pairs), {size}",
            vs_sdpa,
            1.6,
            True,
            times("flash", t_flash, "sdpa", t_sdpa),
        ),
        Check(
            f"flash_attention causal tile-skipping speed-up, full / causal (median of pairs), {size}",
            skip,
            1.8,
            False,
            times("full", t_full, "causal", t_causal),
        ),
    ]


def reference_overhead(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    """The readable reference must not pay for features it does not use."""
    B, H, L, D = (2, 2, 64, 32) if quick else (8, 8, 256, 64)
    q, k, v = (randn((B, H, L, D), dev, g) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    with torch.no_grad():
        ratio, t_mha, t_inline = paired_ratio(
            lambda: mha.scaled_dot_product_attention(q, k, v),
            lambda: torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v,
            pairs=3 if quick else 5,
            min_run_time=run_time,
        )
    return [
        Check(
            f"mha.scaled_dot_product_attention / inline softmax(q @ k.T * scale) @ v time, B={B} H={H} L=S={L} D={D}",
            ratio,
            1.3,
            True,
            times("mha", t_mha, "inline", t_inline),
        )
    ]


def _error_ratio(ours: torch.Tensor, theirs: torch.Tensor, golden: torch.Tensor) -> float:
    """Our max error against float64 as a multiple of torch's (inf when ours is not finite)."""
    err = (ours.double() - golden).abs().max().item()
    ref = (theirs.double() - golden).abs().max().item() + torch.finfo(ours.dtype).eps
    return err / ref if math.isfinite(err) else math.inf


def _low_precision_cases(
    dev: torch.device, g: torch.Generator, quick: bool
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """float64 (q, k, v) with logit spreads (std) of 1, 9, 25 and 49, and |q·k| beyond 65504."""
    L, D = (32, 32) if quick else (256, 64)
    q, k, v = (randn((2, 4, L, D), dev, g).double() for _ in range(3))
    return [(s * q, s * k, v) for s in (1.0, 3.0, 5.0, 7.0)] + [(30 * q, 30 * q, v)]


def low_precision(dev: torch.device, g: torch.Generator, quick: bool) -> list[Check]:
    """float16/bfloat16 error against float64, as a multiple of torch SDPA's error (worst case)."""
    cases = _low_precision_cases(dev, g, quick)
    torch.manual_seed(0)
    golden_layer = mha.MultiHeadAttention(64, 4, dtype=torch.float64).to(dev).eval()
    x = randn((2, 32 if quick else 256, 64), dev, g).double()
    checks = []
    with torch.no_grad():
        golden_layer.q_proj.weight.mul_(6.0)  # large weights: logits with a spread of tens
        golden_layer.k_proj.weight.mul_(6.0)
        golden_out = golden_layer(x, is_causal=True)[0]
        for dtype in (torch.float16, torch.bfloat16):
            worst = {"scaled_dot_product_attention": 0.0, "flash_attention": 0.0}
            for q, k, v in cases:
                golden = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                lq, lk, lv = (t.to(dtype) for t in (q, k, v))
                theirs = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
                for name, so_far in worst.items():
                    ours = getattr(mha, name)(lq, lk, lv, is_causal=True)
                    worst[name] = max(so_far, _error_ratio(ours, theirs, golden))
            layers = {
                b: mha.MultiHeadAttention(64, 4, backend=b, dtype=dtype).to(dev).eval()
                for b in ("sdpa", "math", "flash")
            }
            for layer in layers.values():
                layer.load_state_dict(golden_layer.state_dict())
            theirs = layers["sdpa"](x.to(dtype), is_causal=True)[0]
            for backend in ("math", "flash"):
                ours = layers[backend](x.to(dtype), is_causal=True)[0]
                worst[f"MultiHeadAttention(backend={backend!r})"] = _error_ratio(
                    ours, theirs, golden_out
                )
            kind = str(dtype).removeprefix("torch.")
            for name, ratio in worst.items():
                what = (
                    f"worst of {len(cases)} inputs"
                    if "Multi" not in name
                    else "vs the 'sdpa' backend"
                )
                checks.append(
                    Check(
                        f"{name} {kind} error / torch's error vs float64, {what}",
                        ratio,
                        3.0,
                        True,
                        "logit spreads up to 49 and |q·k| beyond float16's range",
                    )
                )
    return checks


def _decode_width(
    E: int, dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    H, P, pairs = 8, 64 if quick else 1024, 3 if quick else 7
    Hkv = H // 4
    layers = {
        kv: mha.MultiHeadAttention(E, H, num_kv_heads=kv, backend="sdpa").to(dev).eval()
        for kv in (H, Hkv)
    }
    x = randn((1, P + 1, E), dev, g)
    new = x[:, P:]  # (1, 1, E) the token being decoded
    caches = {kv: mha.KVCache() for kv in layers}
    checks = []

    def step(kv: int) -> Callable[[], object]:
        def run() -> object:
            cache = mha.KVCache()
            cache.update(*_cached_kv(caches[kv]))  # the cache as the prefix left it
            return layers[kv](new, is_causal=True, kv_cache=cache)

        return run

    with torch.no_grad():
        for kv, layer in layers.items():
            layer(x[:, :P], is_causal=True, kv_cache=caches[kv])
        if E == 1024:
            layer = layers[H]
            proj = (layer.q_proj, layer.k_proj, layer.v_proj)

            def three_linear() -> list[torch.Tensor]:
                # the same job as layer._project: project, then split the heads, (B, H, 1, D)
                return [p(new).view(1, 1, H, E // H).transpose(1, 2) for p in proj]

            ratio, t_ours, t_three = paired_ratio(
                lambda: layer._project(new, new, new),
                three_linear,
                pairs=pairs,
                min_run_time=run_time,
            )
            checks.append(
                Check(
                    f"decode step q/k/v projection and head split / three nn.Linear time, B=1 L=1 E={E}",
                    ratio,
                    1.0,
                    True,
                    times("ours", t_ours, "three", t_three),
                )
            )
        ratio, t_gqa, t_mha = paired_ratio(step(Hkv), step(H), pairs=pairs, min_run_time=run_time)
        checks.append(
            Check(
                f"decode step with GQA (H={H}, Hkv={Hkv}) / without GQA time, cache {P}, E={E}",
                ratio,
                1.0,
                True,
                times("GQA", t_gqa, "MHA", t_mha),
            )
        )
        q = randn((1, H, 1, E // H), dev, g)
        k, v = _cached_kv(caches[Hkv])  # (1, Hkv, P, D)
        ratio, t_grouped, t_repeated = paired_ratio(
            lambda: mha.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            lambda: mha.scaled_dot_product_attention(
                q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
            ),
            pairs=pairs,
            min_run_time=run_time,
        )
        checks.append(
            Check(
                f"decode attention, grouped / repeated key-value heads time, Hkv={Hkv} cache {P} E={E}",
                ratio,
                1.0,
                True,
                times("grouped", t_grouped, "repeated", t_repeated),
            )
        )
    return checks


def decode_step(dev: torch.device, g: torch.Generator, quick: bool, run_time: float) -> list[Check]:
    """One decoding step (B=1, one new token) after a prefix of 1024 cached tokens, E=512 and 1024."""
    return [c for E in (512, 1024) for c in _decode_width(E, dev, g, quick, run_time)]


def _paged_update_time(
    S: int, dev: torch.device, g: torch.Generator, run_time: float
) -> Callable[[], object]:
    """A decode step's write into a paged cache holding ``S`` positions per sequence; each call
    writes one token per sequence, then drops it again (``truncate``), so ``S`` stays put."""
    B, Hkv, D = 8, 2, 64
    cache = mha.PagedKVCache(block_size=16)
    cache.update(randn((B, Hkv, S, D), dev, g), randn((B, Hkv, S, D), dev, g))
    k, v = randn((B, Hkv, 1, D), dev, g), randn((B, Hkv, 1, D), dev, g)

    def step() -> None:
        cache.update(k, v)
        for b in range(B):
            cache.truncate(b, S)

    return step


def serving(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check | str]:
    """The paged cache (chapter 9.1): an update costs the same at any length; a decode step
    through ``paged_attention``, and through FlexAttention's paged attention (its peer), against
    torch's SDPA over a contiguous cache."""
    short, long = (16, 256) if quick else (256, 4096)
    pairs = 3 if quick else 7
    ratio, t_long, t_short = paired_ratio(
        _paged_update_time(long, dev, g, run_time),
        _paged_update_time(short, dev, g, run_time),
        pairs=pairs,
        min_run_time=run_time,
    )
    checks: list[Check | str] = [
        Check(
            f"PagedKVCache update (and truncate) at {long} / at {short} cached tokens, B=8 Hkv=2 D=64",
            ratio,
            1.2,
            True,
            times(f"at {long}", t_long, f"at {short}", t_short),
        )
    ]
    B, H, Hkv, D, S = (2, 8, 2, 64, 256) if quick else (8, 8, 2, 64, 2048)
    k, v = randn((B, Hkv, S, D), dev, g), randn((B, Hkv, S, D), dev, g)
    q = randn((B, H, 1, D), dev, g)
    cache = mha.PagedKVCache(block_size=16)
    cache.update(k, v)
    assert cache.key_pool is not None and cache.value_pool is not None  # the update made them
    args = (q, cache.key_pool, cache.value_pool, cache.block_table, cache.seq_lens)
    with torch.no_grad():
        torch.testing.assert_close(
            mha.paged_attention(*args),
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            atol=1e-5,
            rtol=1e-4,
        )
        ratio, t_paged, t_sdpa = paired_ratio(
            lambda: mha.paged_attention(*args),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            pairs=pairs,
            min_run_time=run_time,
        )
    checks.append(
        Check(
            f"paged_attention / SDPA over a contiguous cache time, B={B} H={H} Hkv={Hkv} D={D} S={S}",
            ratio,
            1.5,
            True,
            times("paged", t_paged, "SDPA", t_sdpa),
        )
    )
    checks += bench_serving.flex_paged_decode(
        q, k, v, cache, quick=quick, pairs=pairs, run_time=run_time
    )
    return checks


@dataclass
class MixedBatch:
    """One serving step: prompt chunks and decode steps over a paged pool (chapter 9.5), and the
    same sequences as an engine without a paged kernel holds them (contiguous, one per call).

    ``args`` are :func:`mha.paged_varlen_attention`'s ``(query, key_pool, value_pool,
    block_table, cu_seqlens_q, seq_lens)``; ``qs``, ``ks``, ``vs`` ``(1, H|Hkv, n_b|S_b, D)`` and
    ``masks`` (the causal mask aligned bottom-right, None for a decode step) per sequence.
    """

    args: tuple[torch.Tensor, ...]
    qs: list[torch.Tensor]
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    masks: list[torch.Tensor | None]

    def per_sequence(self) -> list[torch.Tensor]:
        """One SDPA call per sequence over its contiguous cache; ``(1, H, n_b, D)`` each."""
        return [
            F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mb, enable_gqa=True)
            for qb, kb, vb, mb in zip(self.qs, self.ks, self.vs, self.masks)
        ]

    def packed(self, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sequence outputs packed as the one call returns them: ``(total_q, H, D)``."""
        return torch.cat([o[0].transpose(0, 1) for o in outs])


def mixed_batch(
    counts: Sequence[int],
    cached: int,
    H: int,
    Hkv: int,
    D: int,
    bs: int,
    dev: torch.device,
    g: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> MixedBatch:
    """Sequences with ``counts[b]`` queries each (a prompt chunk, or 1: a decode step) over
    ``cached`` positions already in the pool, their blocks scattered through it."""
    lens = [cached + n for n in counts]  # the chunk's or the step's keys are in the pool already
    blocks = [math.ceil(S / bs) for S in lens]
    pool_k = randn((sum(blocks), Hkv, bs, D), dev, g).to(dtype)
    pool_v = randn((sum(blocks), Hkv, bs, D), dev, g).to(dtype)
    order = torch.randperm(sum(blocks), generator=g).to(dev)  # blocks scattered in the pool
    table = torch.full((len(counts), max(blocks)), -1, dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = order[used : used + n].int()
        used += n
    cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=dev)
    q = randn((sum(counts), H, D), dev, g).to(dtype)
    seq_lens = torch.tensor(lens, device=dev)

    def contiguous(pool: torch.Tensor, b: int) -> torch.Tensor:
        rows = pool[table[b, : blocks[b]].long()]  # (n_blocks, Hkv, bs, D)
        return rows.transpose(0, 1).reshape(1, Hkv, -1, D)[:, :, : lens[b]].contiguous()

    return MixedBatch(
        args=(q, pool_k, pool_v, table, cu, seq_lens),
        qs=[q[a:z].transpose(0, 1)[None].contiguous() for a, z in itertools.pairwise(cu.tolist())],
        ks=[contiguous(pool_k, b) for b in range(len(counts))],  # (1, Hkv, S_b, D) each
        vs=[contiguous(pool_v, b) for b in range(len(counts))],
        masks=[None if n == 1 else _bottom_right(n, S, dev) for n, S in zip(counts, lens)],
    )


def chunked_prefill(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    """Chunked prefill (chapter 9.5): one ``paged_varlen_attention`` call for a mixed batch of
    prompt chunks and decode steps over the paged pool, against what an engine without it runs:
    one SDPA call per sequence over its contiguous cache (the causal mask bottom-right)."""
    chunk, decodes, cached = (32, 6, 128) if quick else (256, 28, 2048)
    H, Hkv, D, bs = 8, 2, 64, 16
    batch = mixed_batch([chunk] * 4 + [1] * decodes, cached, H, Hkv, D, bs, dev, g)

    def one_call() -> torch.Tensor:
        return mha.paged_varlen_attention(*batch.args)

    with torch.no_grad():
        want = batch.packed(batch.per_sequence())  # (total_q, H, D)
        torch.testing.assert_close(one_call(), want, atol=1e-4, rtol=1e-4)
        ratio, t_ours, t_sdpa = paired_ratio(
            one_call, batch.per_sequence, pairs=3 if quick else 7, min_run_time=run_time
        )
    return [
        Check(
            f"paged_varlen_attention (4 chunks of {chunk} + {decodes} decodes over {cached} "
            f"cached) / one SDPA per sequence over contiguous caches time, H={H} Hkv={Hkv} D={D}",
            ratio,
            1.5,
            True,
            times("one call", t_ours, "per sequence", t_sdpa),
        )
    ]


def _bottom_right(L: int, S: int, dev: torch.device) -> torch.Tensor:
    """Keep-mask of ``L`` queries that are the last ``L`` of ``S`` positions: ``(L, S)`` bool."""
    return torch.arange(S, device=dev)[None, :] <= torch.arange(S - L, S, device=dev)[:, None]


def packed_attention(
    dev: torch.device, g: torch.Generator, quick: bool, run_time: float
) -> list[Check]:
    """Packed (varlen) causal attention vs the padded batch, lengths varying 8x, same operations.

    The padded side runs what ``mha.varlen_attention`` runs for one sequence (scores, mask,
    softmax, weighted sum) on the whole padded batch ``(B, H, L_max, D)`` with a padding-and-
    causal mask; the packed side is ``mha.varlen_attention`` itself. The FLOP ratio is exact.
    """
    from mha.varlen import pack

    lengths = [8, 12, 16, 20, 28, 36, 48, 64] if quick else [64, 96, 128, 160, 224, 288, 384, 512]
    B, H, D, L_max = len(lengths), 8, 64, max(lengths)
    seqs = [randn((n, H, D), dev, g) for n in lengths]
    q, cu = pack(seqs)  # (total, H, D), (B + 1,)
    q_pad = torch.zeros(B, H, L_max, D, device=dev)
    for b, s in enumerate(seqs):
        q_pad[b, :, : len(s)] = s.transpose(0, 1)  # (H, L_b, D)
    keep = mha.padding_mask(lengths, L_max).to(dev) & mha.causal_mask(L_max, device=dev)

    def padded() -> torch.Tensor:
        scores = q_pad @ q_pad.transpose(-2, -1) * D**-0.5  # (B, H, L_max, L_max)
        weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        return weights @ q_pad  # (B, H, L_max, D)

    def packed() -> torch.Tensor:
        return mha.varlen_attention(q, q, q, cu, cu, is_causal=True)  # (total, H, D)

    out_pad, out_packed = padded(), packed()
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        torch.testing.assert_close(
            out_packed[start : start + n], out_pad[b, :, :n].transpose(0, 1), atol=1e-4, rtol=1e-4
        )
    ratio, t_pad, t_packed = paired_ratio(
        padded, packed, pairs=3 if quick else 5, min_run_time=run_time
    )
    flops = B * L_max * L_max / sum(n * n for n in lengths)
    return [
        Check(
            f"padded / packed (varlen) causal attention time, lengths {lengths[0]}..{L_max} "
            f"(8x spread), B={B} H={H} D={D}",
            ratio,
            1.0,
            False,
            times("padded", t_pad, "packed", t_packed) + f"; FLOP ratio {flops:.2f}",
        )
    ]


def run_report(
    *,
    quick: bool = False,
    device: str | torch.device = "cpu",
    log: Callable[[str], None] | None = None,
) -> list[Check]:
    """Measure every target; call ``log`` with each line as soon as it is measured (and with
    the line of a measurement skipped, which is no Check)."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    run_time = 0.02 if quick else 0.2
    checks: list[Check] = []
    sections: list[Callable[[], Sequence[Check | str]]] = [
        lambda: module_vs_torch(dev, g, quick, run_time),
        lambda: tiled_attention(dev, g, quick, run_time),
        lambda: reference_overhead(dev, g, quick, run_time),
        lambda: low_precision(dev, g, quick),
        lambda: decode_step(dev, g, quick, run_time),
        lambda: serving(dev, g, quick, run_time),
        lambda: bench_serving.prefix_caching(dev, g, quick, run_time),
        lambda: packed_attention(dev, g, quick, run_time),
        lambda: chunked_prefill(dev, g, quick, run_time),
    ]
    for section in sections:
        for check in section():
            if not isinstance(check, str):
                checks.append(check)
            if log is not None:
                log(str(check))
    return checks


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the performance report; return the exit code."""
    parser = argparse.ArgumentParser(
        prog="python tools/bench_report.py",
        description="Measure mha against PyTorch: each line is a ratio measured in this run.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke test of the report"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 if a target is missed"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's own choice, usually one per core)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads <= 0:
            parser.error(f"--threads must be a positive int, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: not a device: {args.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")

    try:  # other work on the machine inflates timings; say how busy it was
        load = f", load average ~{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):  # not available on Windows
        load = ""
    print(
        f"bench_report: torch {torch.__version__}, device {dev}, {torch.get_num_threads()} threads"
        f"{load}{', quick sizes (smoke test)' if args.quick else ''}"
    )
    checks = run_report(quick=args.quick, device=dev, log=lambda line: print(line, flush=True))
    failed = sum(not c.passed for c in checks)
    print(f"{len(checks) - failed}/{len(checks)} targets met")
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
