"""Section 8.3, decoding is memory-bound: the exercise as data for :mod:`.._harness`.

Reference: the FLOPs and bytes of a decode step counted as the chapter's ``attention_traffic``;
mistakes: FLOPs per kv head or halved, the batch missing (in both counts or in the bytes), only K
read, the cache read per query head, the query and output left out or counted per kv head,
numbers for bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from .._harness import Case, Exercise, publish, whole

# --- the traffic of a decode step ---------------------------------------------------------------


def _decode_traffic_reference(
    batch: int, num_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, nbytes: int
) -> tuple[int, int]:
    """(FLOPs, bytes) of one decode step, counted as the chapter's ``attention_traffic`` (L = 1):
    4D FLOPs per (query head, key); each query and output once, each cached key and value once."""
    flops = batch * num_heads * 4 * head_dim * seq_len
    numbers = batch * (2 * num_heads * head_dim + 2 * num_kv_heads * seq_len * head_dim)
    return flops, numbers * nbytes


def _decode_traffic_cases() -> list[Case]:
    shapes = (  # batch, query heads, kv heads, cached tokens, head dim, bytes per number
        ("one sequence, MHA, 16-bit", (1, 32, 32, 4096, 128, 2)),
        ("8 sequences, GQA with 8 kv heads, 16-bit", (8, 32, 8, 1024, 128, 2)),
        ("4 sequences, MQA, float32", (4, 71, 1, 2048, 64, 4)),
        ("3 sequences, GQA with 4 kv heads, 8-bit", (3, 16, 4, 100, 256, 1)),
    )
    return [Case(f"decode_traffic{args} ({what})", args) for what, args in shapes]


def _traffic(flops: Callable[..., int], numbers: Callable[..., int], times_bytes: bool = True):
    """A decode-traffic answer from its FLOP count and its count of numbers moved."""

    def answer(B: int, H: int, Hkv: int, S: int, D: int, nb: int) -> tuple[int, int]:
        moved = numbers(B, H, Hkv, S, D)
        return flops(B, H, Hkv, S, D), moved * nb if times_bytes else moved

    return answer


def _right_flops(B: int, H: int, Hkv: int, S: int, D: int) -> int:
    return B * H * 4 * D * S


def _right_numbers(B: int, H: int, Hkv: int, S: int, D: int) -> int:
    return B * (2 * H * D + 2 * Hkv * S * D)


def _decode_traffic_by_head(
    batch: int, num_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, nbytes: int
) -> tuple[int, int]:
    """Head by head: each query head's pairs, queries and outputs; each kv head's cache."""
    flops = moved = 0
    for _ in range(batch):
        for _ in range(num_heads):
            flops += seq_len * (2 * head_dim + 2 * head_dim)  # q·k, then p·v
            moved += 2 * head_dim * nbytes  # its query in, its output out
        moved += num_kv_heads * 2 * seq_len * head_dim * nbytes  # K and V of the cache
    return flops, moved


_HINT_TRAFFIC = {
    "flops": "FLOPs = batch · num_heads · 4 · head_dim · seq_len: every query head scores "
    "seq_len keys (q·k, 2·head_dim FLOPs each) and sums as many values (2·head_dim each).",
    "bytes": "bytes = batch · bytes_per_element · (2 · num_heads · head_dim + 2 · num_kv_heads "
    "· seq_len · head_dim): each query head reads its query and writes its output, each "
    "key/value head's keys and values are read once.",
}

DECODE_TRAFFIC = Exercise(
    "check_decode_traffic",
    "FLOPs and bytes of a decode step, for MHA, GQA and MQA, as attention_traffic counts",
    _decode_traffic_reference,
    _decode_traffic_cases,
    variants=(
        _traffic(_right_flops, _right_numbers),
        _decode_traffic_by_head,
        lambda B, H, Hkv, S, D, nb: (
            2 * (2 * D * S * H * B),
            nb * B * 2 * D * (H + Hkv * S),
        ),
    ),
    mistakes=(
        (
            _traffic(lambda B, H, Hkv, S, D: B * Hkv * 4 * D * S, _right_numbers),
            "Every query head computes its own q·k and p·v over all seq_len keys, even when it "
            "shares its key/value head: the FLOPs count num_heads, not num_kv_heads.",
        ),
        (
            _traffic(lambda B, H, Hkv, S, D: B * H * 2 * D * S, _right_numbers),
            "Half the FLOPs: per (query head, key), q·k is head_dim multiply-adds, 2·head_dim "
            "FLOPs, and the weighted sum of the values another 2·head_dim: 4·head_dim.",
        ),
        (
            _traffic(lambda B, H, Hkv, S, D: B * H * D * S, _right_numbers),
            "A multiply-add is 2 FLOPs, and there are two products per (query head, key): q·k "
            "and p·v, 4·head_dim FLOPs in all.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: 2 * D * (H + Hkv * S)),
            "Each sequence reads its own cache (and its own query and output): the bytes grow "
            "with the batch as the FLOPs do, so batching does not raise attention's intensity.",
        ),
        (
            _traffic(
                lambda B, H, Hkv, S, D: H * 4 * D * S, lambda B, H, Hkv, S, D: 2 * D * (H + Hkv * S)
            ),
            "The batch is missing: each of the batch's sequences does its own step, with its "
            "own query and its own cache. Multiply FLOPs and bytes by batch.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * (2 * H * D + Hkv * S * D)),
            "The cache holds keys and values, and the step reads both: 2 · num_kv_heads · "
            "seq_len · head_dim numbers per sequence.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * (2 * H * D + 2 * H * S * D)),
            "A key/value head is read once for all the query heads that share it: the cache "
            "read counts num_kv_heads, not num_heads (that sharing is GQA's saving).",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * 2 * Hkv * S * D),
            "Count as attention_traffic does: besides the cache, each query head reads its "
            "query and writes its output, 2 · num_heads · head_dim numbers per sequence.",
        ),
        (
            _traffic(_right_flops, lambda B, H, Hkv, S, D: B * (2 * Hkv * D + 2 * Hkv * S * D)),
            "Queries and outputs belong to the query heads: 2 · num_heads · head_dim numbers, "
            "not 2 · num_kv_heads · head_dim.",
        ),
        (
            _traffic(_right_flops, _right_numbers, times_bytes=False),
            "These are numbers, not bytes: multiply by bytes_per_element.",
        ),
    ),
    hint=_HINT_TRAFFIC,
    crash_hint="decode_traffic(batch, num_heads, num_kv_heads, seq_len, head_dim, "
    "bytes_per_element) takes six ints and returns a tuple (flops, bytes).",
    outputs=("flops", "bytes"),
    convert=whole,
    rewrites=(),  # arithmetic: attention_traffic is the chapter's own cell, not mha's
    params=("decode_traffic",),
    doc="Check ``decode_traffic(batch, num_heads, num_kv_heads, seq_len, head_dim, "
    "bytes_per_element) -> (flops, bytes)``: one decode step of attention (one new query per "
    "sequence over a cache of ``seq_len`` tokens), counted as the chapter's "
    "``attention_traffic``.",
)


EXERCISES = publish(globals())
