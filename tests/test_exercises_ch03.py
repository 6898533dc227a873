"""The chapter 3 checkers accept correct answers and reject the typical wrong ones with the right hint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mha.exercises
from mha.exercises import ExerciseError
from mha.exercises.ch03 import (
    check_merge_heads,
    check_mha_shape_predictions,
    check_multi_head_forward,
    check_seed_mha_fix,
    check_split_heads,
)


def test_checkers_are_reexported():
    for name in (
        "check_split_heads",
        "check_merge_heads",
        "check_multi_head_forward",
        "check_seed_mha_fix",
        "check_mha_shape_predictions",
    ):
        assert getattr(mha.exercises, name) is globals()[name]


# ---------------------------------------------------------------------------------------------
# check_split_heads / check_merge_heads
# ---------------------------------------------------------------------------------------------


def split_ok(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, num_heads, E // num_heads).transpose(1, 2)


def split_view_only(x, num_heads):
    B, L, E = x.shape
    return x.view(B, num_heads, L, E // num_heads)


def split_seed(x, num_heads):
    B, _, E = x.shape
    return x.view(B * num_heads, -1, E // num_heads)


def split_no_transpose(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, num_heads, E // num_heads)


def split_interleaved(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, E // num_heads, num_heads).permute(0, 3, 1, 2)


def split_crashes(x, num_heads):
    return x.view(num_heads, -1, 7)


def test_split_heads_accepts_reference(capsys):
    check_split_heads(split_ok)
    assert "✅ check_split_heads" in capsys.readouterr().out


def test_split_heads_accepts_other_correct_forms():
    check_split_heads(lambda x, h: x.unflatten(-1, (h, -1)).permute(0, 2, 1, 3))
    check_split_heads(lambda x, h: torch.stack(x.chunk(h, dim=-1), dim=1))


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (split_view_only, "view without a transpose"),
        (split_seed, "post's (B·H, L, D) layout"),
        (split_no_transpose, "add .transpose(1, 2)"),
        (split_interleaved, "every H-th feature"),
        (split_crashes, "raised RuntimeError"),
    ],
)
def test_split_heads_rejects(fn, expected):
    with pytest.raises(ExerciseError) as err:
        check_split_heads(fn)
    assert expected in str(err.value)


def merge_ok(x):
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B, L, H * D)


def merge_view_only(x):
    B, H, L, D = x.shape
    return x.reshape(B, L, H * D)


def merge_view_after_transpose(x):
    B, H, L, D = x.shape
    return x.transpose(1, 2).view(B, L, H * D)


def merge_interleaved(x):
    B, H, L, D = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, L, H * D)


def merge_along_tokens(x):
    B, H, L, D = x.shape
    return x.reshape(B, H * L, D)


def test_merge_heads_accepts_reference(capsys):
    check_merge_heads(merge_ok)
    check_merge_heads(lambda x: torch.cat(x.unbind(1), dim=-1))
    assert "✅ check_merge_heads" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (merge_view_only, "view without a transpose"),
        (merge_view_after_transpose, "Use .reshape(...)"),
        (merge_interleaved, "interleaved the heads"),
        (merge_along_tokens, "stacked the heads along the tokens"),
    ],
)
def test_merge_heads_rejects(fn, expected):
    with pytest.raises(ExerciseError) as err:
        check_merge_heads(fn)
    assert expected in str(err.value)


# ---------------------------------------------------------------------------------------------
# check_multi_head_forward
# ---------------------------------------------------------------------------------------------


def make_forward(*, scale="head", split="ok", merge="ok", out_proj=True, softmax_dim=-1):
    def forward(query, key, value, q_proj, k_proj, v_proj, o_proj, num_heads):
        B, L, E = query.shape
        S = key.shape[1]
        H, D = num_heads, E // num_heads

        def heads(t, n):
            if split == "ok":
                return t.view(B, n, H, D).transpose(1, 2)  # (B, H, n, D)
            if split == "seed":
                return t.view(B * H, -1, D)  # the post's split
            return t.view(B, n, D, H).permute(0, 3, 1, 2)  # interleaved

        q, k, v = heads(q_proj(query), L), heads(k_proj(key), S), heads(v_proj(value), S)
        factor = {"head": 1 / math.sqrt(D), "none": 1.0, "model": 1 / math.sqrt(E)}[scale]
        weights = torch.softmax(q @ k.transpose(-2, -1) * factor, dim=softmax_dim)
        out = weights @ v
        if merge == "ok":
            out = out.view(B, H, L, D).transpose(1, 2).reshape(B, L, E)
        elif merge == "seed":
            out = out.reshape(B, -1, E)
        else:
            out = out.view(B, H, L, D).permute(0, 2, 3, 1).reshape(B, L, E)
        return o_proj(out) if out_proj else out

    return forward


def sdpa_forward(query, key, value, q_proj, k_proj, v_proj, o_proj, num_heads):
    B, L, E = query.shape
    S = key.shape[1]
    D = E // num_heads
    q = q_proj(query).view(B, L, num_heads, D).transpose(1, 2)
    k = k_proj(key).view(B, S, num_heads, D).transpose(1, 2)
    v = v_proj(value).view(B, S, num_heads, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v)
    return o_proj(out.transpose(1, 2).reshape(B, L, E))


def test_multi_head_forward_accepts_reference(capsys):
    check_multi_head_forward(make_forward())
    check_multi_head_forward(sdpa_forward)
    assert "✅ check_multi_head_forward" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"scale": "none"}, "The scores are not scaled"),
        ({"scale": "model"}, "You scaled by 1/√E"),
        ({"out_proj": False}, "without the output projection W_O"),
        ({"split": "seed", "merge": "seed"}, "as the post's second implementation does"),
        ({"merge": "seed"}, "The split is right, the merge is not"),
        ({"split": "interleaved", "merge": "interleaved"}, "every H-th feature"),
        ({"softmax_dim": -2}, "you normalised over the queries"),
    ],
)
def test_multi_head_forward_rejects(kwargs, expected):
    with pytest.raises(ExerciseError) as err:
        check_multi_head_forward(make_forward(**kwargs))
    assert expected in str(err.value)


def test_multi_head_forward_rejects_per_head_output():
    def per_head(query, key, value, q_proj, k_proj, v_proj, o_proj, num_heads):
        B, L, E = query.shape
        D = E // num_heads
        q = q_proj(query).view(B, L, num_heads, D).transpose(1, 2)
        k = k_proj(key).view(B, -1, num_heads, D).transpose(1, 2)
        v = v_proj(value).view(B, -1, num_heads, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D): never merged

    with pytest.raises(ExerciseError, match="merge the heads back"):
        check_multi_head_forward(per_head)


def test_multi_head_forward_does_not_touch_global_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    check_multi_head_forward(make_forward())
    assert torch.equal(before, torch.get_rng_state())


# ---------------------------------------------------------------------------------------------
# check_seed_mha_fix
# ---------------------------------------------------------------------------------------------


class SeedMHA(nn.Module):
    """The post's second implementation, bug included."""

    split_ok = False
    merge_ok = False

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.d_model = d_model
        self.query_fc = nn.Linear(d_model, d_model)
        self.key_fc = nn.Linear(d_model, d_model)
        self.value_fc = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, d_model)

    def forward(self, query, key, value):
        batch_size = query.size(0)
        d = self.d_model // self.num_heads
        query, key, value = self.query_fc(query), self.key_fc(key), self.value_fc(value)
        if self.split_ok:
            query, key, value = (
                t.view(batch_size, -1, self.num_heads, d)
                .transpose(1, 2)
                .reshape(batch_size * self.num_heads, -1, d)
                for t in (query, key, value)
            )
        else:
            query = query.view(batch_size * self.num_heads, -1, d)
            key = key.view(batch_size * self.num_heads, -1, d)
            value = value.view(batch_size * self.num_heads, -1, d)
        scores = torch.bmm(query, key.transpose(1, 2)) / np.sqrt(d)
        output = torch.bmm(F.softmax(scores, dim=-1), value)
        if self.merge_ok:
            output = (
                output.view(batch_size, self.num_heads, -1, d)
                .transpose(1, 2)
                .reshape(batch_size, -1, self.d_model)
            )
        else:
            output = output.view(batch_size, -1, self.d_model)
        return self.fc(output)


class SeedFixed(SeedMHA):
    split_ok = True
    merge_ok = True


class SeedSplitFixedOnly(SeedMHA):
    split_ok = True


class SeedRenamed(SeedFixed):
    def __init__(self, d_model, num_heads):
        super().__init__(d_model, num_heads)
        self.W_o = self.fc
        del self.fc

    def forward(self, query, key, value):
        self.fc = self.W_o
        return super().forward(query, key, value)


def test_seed_fix_accepts_repaired_class(capsys):
    check_seed_mha_fix(SeedFixed)
    assert "✅ check_seed_mha_fix" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (SeedMHA, "as the post's second implementation does"),
        (SeedSplitFixedOnly, "The split is right, the merge is not"),
        (SeedRenamed, "needs the post's layer fc"),
    ],
)
def test_seed_fix_rejects(cls, expected):
    with pytest.raises(ExerciseError) as err:
        check_seed_mha_fix(cls)
    assert expected in str(err.value)


# ---------------------------------------------------------------------------------------------
# check_mha_shape_predictions
# ---------------------------------------------------------------------------------------------

RIGHT = {
    "q_proj.weight": (12, 12),
    "k_proj.weight": (6, 5),
    "v_proj.weight": (6, 7),
    "out_proj.weight": (12, 12),
    "weights": (2, 4, 3, 9),
    "out": (2, 3, 12),
    "num_parameters": 396,
}


def test_shape_predictions_accept_the_truth(capsys):
    check_mha_shape_predictions(dict(RIGHT))
    check_mha_shape_predictions({**RIGHT, "out": [2, 3, 12], "weights": torch.Size([2, 4, 3, 9])})
    assert "✅ check_mha_shape_predictions" in capsys.readouterr().out


def test_shape_predictions_match_the_module():
    module = mha.MultiHeadAttention(12, 4, kdim=5, vdim=7, num_kv_heads=2)
    out, weights = module(
        torch.zeros(2, 3, 12), torch.zeros(2, 9, 5), torch.zeros(2, 9, 7), need_weights=True
    )
    assert tuple(out.shape) == RIGHT["out"] and tuple(weights.shape) == RIGHT["weights"]
    assert sum(p.numel() for p in module.parameters()) == RIGHT["num_parameters"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"k_proj.weight": (5, 6)}, "(out_features, in_features)"),
        ({"k_proj.weight": (12, 5)}, "num_kv_heads·D"),
        ({"weights": (2, 2, 3, 9)}, "one (L, S) matrix per *query* head"),
        ({"out": (2, 3, 7)}, "one row of width E per query"),
        ({"num_parameters": 4 * 12 * 12 + 4 * 12}, "out_features·(in_features + 1)"),
        ({"out": ...}, "Replace the ..."),
        ({"out": "(2, 3, 12)"}, "should be a tuple of ints"),
    ],
)
def test_shape_predictions_reject(change, expected):
    with pytest.raises(ExerciseError) as err:
        check_mha_shape_predictions({**RIGHT, **change})
    assert expected in str(err.value)


def test_shape_predictions_report_missing_keys():
    partial = dict(RIGHT)
    del partial["weights"]
    with pytest.raises(ExerciseError, match="missing weights"):
        check_mha_shape_predictions(partial)
