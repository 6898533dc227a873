"""Chapter 8's checkers: correct answers written unlike the references pass, typical wrong answers
fail with their hint, the library shortcuts trip without leaving the library patched, and the
notebook's stubs print "not attempted yet"."""

from __future__ import annotations

import pytest
import torch

import mha
import mha.exercises
from mha import decoding, rope
from mha.exercises import ExerciseError, ch08


def _rope_by_rotation_matrices(x, positions):
    """Each pair times its 2×2 rotation matrix [[cos, -sin], [sin, cos]]."""
    D = x.shape[-1]
    theta = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    a = positions.double()[:, None] * theta  # (L, D/2)
    rot = torch.stack(
        [torch.stack([a.cos(), -a.sin()], -1), torch.stack([a.sin(), a.cos()], -1)], -2
    )
    pairs = torch.stack([x[..., : D // 2], x[..., D // 2 :]], -1)  # (..., L, D/2, 2)
    turned = (rot @ pairs.unsqueeze(-1)).squeeze(-1)  # (..., L, D/2, 2)
    return torch.cat([turned[..., 0], turned[..., 1]], -1)


def _merge_by_max_shift(out1, lse1, out2, lse2):
    m = torch.maximum(lse1, lse2)[..., None]
    w1, w2 = (lse1[..., None] - m).exp(), (lse2[..., None] - m).exp()
    return (w1 * out1 + w2 * out2) / (w1 + w2)


def _slot_by_paged_cache(block_table, block_size, seq, t):
    """Read the slot from a PagedKVCache whose table is replaced by the given one."""
    cache = mha.PagedKVCache(block_size=block_size)
    cache.block_table, cache.length = block_table, len(block_table[0]) * block_size
    return cache.slot(seq, t)


def _slot_by_arithmetic(block_table, block_size, seq, t):
    block = t // block_size
    return block_table[seq][block] * block_size + (t - block * block_size)


VARIANTS = {
    "check_rope": [_rope_by_rotation_matrices],
    "check_merge_partials": [_merge_by_max_shift],
    "check_page_lookup": [_slot_by_paged_cache, _slot_by_arithmetic],
}


@pytest.mark.parametrize(
    ("name", "answer"),
    [(name, answer) for name, answers in VARIANTS.items() for answer in answers],
)
def test_correct_variant_passes(name, answer, capsys):
    getattr(mha.exercises, name)(answer)
    assert capsys.readouterr().out.startswith(f"✓ {name}: correct — ")


def test_merge_with_the_library_on_stacked_partials_is_refused():
    def by_library(out1, lse1, out2, lse2):
        return mha.merge_partials(torch.stack([out1, out2]), torch.stack([lse1, lse2]))[0]

    with pytest.raises(ExerciseError, match="without mha.merge_partials"):
        mha.exercises.check_merge_partials(by_library)
    assert mha.merge_partials is decoding.merge_partials  # restored


def test_rope_with_the_library_is_refused_and_restored():
    original = mha.apply_rope
    with pytest.raises(ExerciseError, match="without mha.apply_rope"):
        mha.exercises.check_rope(lambda x, positions: mha.apply_rope(x, positions))
    with pytest.raises(ExerciseError, match="without mha.apply_rope"):
        mha.exercises.check_rope(mha.apply_rope)
    assert mha.apply_rope is original and rope.apply_rope is original


@pytest.mark.parametrize(
    ("name", "answer", "hint"),
    [
        ("check_rope", ch08._rope_mistake("interleaved"), "neighbour pairs"),
        ("check_rope", ch08._rope_mistake("no_two"), "exponent is -2i/D"),
        ("check_rope", ch08._rope_mistake("backwards"), "sine's sign is flipped"),
        ("check_rope", ch08._rope_mistake("ignore_positions"), "Use the positions"),
        ("check_rope", lambda x, positions: x, "Pair coordinate i with i \\+ D/2"),
        (
            "check_merge_partials",
            lambda out1, lse1, out2, lse2: (out1 + out2) / 2,
            "An average weighs both splits alike",
        ),
        ("check_merge_partials", ch08._merge_no_shift, "exp\\(lse\\) overflows"),
        ("check_merge_partials", ch08._merge_no_renormalise, "no longer sum to 1"),
        (
            "check_merge_partials",
            lambda out1, lse1, out2, lse2: lse1.exp() * out1 + lse2.exp() * out2,
            "raised RuntimeError.*lse\\[..., None\\]",
        ),
        ("check_page_lookup", lambda table, bs, seq, t: t, "is not t"),
        (
            "check_page_lookup",
            lambda table, bs, seq, t: table[seq][t % bs] * bs + t // bs,
            "Block and offset are swapped",
        ),
        (
            "check_page_lookup",
            lambda table, bs, seq, t: table[t // bs][seq] * bs + t % bs,
            "one row per sequence",
        ),
        (
            "check_page_lookup",
            lambda table, bs, seq, t: table[seq][t // bs] * bs + t % bs + 1,
            "block_table\\[seq\\]\\[t // block_size\\] \\* block_size",
        ),
        ("check_page_lookup", lambda table, bs, seq, t: "slot 3", "should be an int"),
    ],
)
def test_typical_mistakes_fail_with_their_hint(name, answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(answer)
