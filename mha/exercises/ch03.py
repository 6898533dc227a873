"""Chapter 3, multi-head attention: the exercises as data for :mod:`._harness`.

References: torch's ``F.multi_head_attention_forward`` and a head split by slicing; mistakes:
``view`` without ``transpose`` (the post ``002``), interleaved heads, the wrong scale, no W_O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..multihead import MultiHeadAttention
from ._harness import Case, Exercise, ExerciseError, Mistake, as_int, as_shape

# Split (B, N, H·D) -> (B, H, N, D) and merge back: right (by slicing, so that it cannot share a
# layout mistake with the learner's view) and the usual wrong ways.
_SPLITS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "ok": lambda t, H: torch.stack(t.chunk(H, dim=-1), dim=1),  # head h: features h·D..(h+1)·D-1
    "flat": lambda t, H: t.reshape(t.shape[0], H, t.shape[1], -1),  # the post's view(B·H, -1, D)
    "interleaved": lambda t, H: t.unflatten(-1, (-1, H)).permute(0, 3, 1, 2),  # h, h+H, h+2H...
}
_MERGES: dict[str, Callable[[Tensor], Tensor]] = {
    "ok": lambda t: torch.cat(t.unbind(1), dim=-1),  # [head 0 | head 1 | ...]
    "flat": lambda t: t.reshape(t.shape[0], t.shape[2], -1),  # the post's view(B, -1, d_model)
    "interleaved": lambda t: t.permute(0, 2, 3, 1).flatten(2),
}
_HINT_SPLIT_FLAT = (
    "You reshaped (B, L, E) straight into (B, H, L, D) — a view without a transpose, the bug of "
    "the post's second implementation (view(B·H, -1, D)). A view only reinterprets memory, which "
    "holds x token by token, so your 'head 0' is made of chunks of the first tokens, not of "
    "features 0..D-1 of every token. Split the last dim first, x.view(B, L, H, D), then move the "
    "head dim in front of the tokens with .transpose(1, 2)."
)
_HINT_INTERLEAVED = (
    "Your heads take every H-th feature (h, h+H, h+2H, ...). Head h must own the contiguous block "
    "of features h·D .. (h+1)·D - 1: that is how nn.MultiheadAttention, mha.MultiHeadAttention and "
    "every pretrained checkpoint lay out the rows of W_Q, W_K and W_V (and the columns of W_O). "
    "Use view(B, L, H, D), not view(B, L, D, H)."
)
_HINT_MERGE_FLAT = (
    "You reshaped (B, H, L, D) straight into (B, L, H·D) — a view without a transpose, the merge "
    "of the post's second implementation. Row i of the result must be [head 0 of token i | head 1 "
    "of token i | ...]; with a plain reshape it is a chunk of head 0's rows instead. Move the "
    "tokens back in front of the heads with .transpose(1, 2), then .reshape(B, L, H·D)."
)


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g)


def _split_cases() -> list[Case]:
    g = torch.Generator().manual_seed(30)
    cases = [(_randn(g, 2, 5, 12), 3), (_randn(g, 1, 4, 8), 2), (_randn(g, 3, 6, 12), 4)]
    return [Case(f"split_heads(x, {H}) with x of shape {tuple(x.shape)}", (x, H)) for x, H in cases]


SPLIT_HEADS = Exercise(
    "check_split_heads",
    "head h holds features h·D..(h+1)·D-1 of every token",
    _SPLITS["ok"],
    _split_cases,
    (
        Mistake(_SPLITS["flat"], _HINT_SPLIT_FLAT),
        Mistake(
            lambda x, H: x.reshape(x.shape[0] * H, -1, x.shape[-1] // H),
            "That is the post's (B·H, L, D) layout, and it is more than a shape problem: "
            "viewing (B, L, E) as (B·H, -1, D) without a transpose puts chunks of the same "
            "tokens into one 'head'. Return (B, H, L, D) = x.view(B, L, H, D)"
            ".transpose(1, 2).",
        ),
        Mistake(
            lambda x, H: x.unflatten(-1, (H, -1)),
            "You split the features into (B, L, H, D) but did not move the heads in front of "
            "the tokens: add .transpose(1, 2), so that every head sees all L tokens.",
        ),
        Mistake(_SPLITS["interleaved"], _HINT_INTERLEAVED),
    ),
    hint="Head h of token i must be x[b, i, h·D:(h+1)·D].",
    crash_hint="x.view(B, L, H, D).transpose(1, 2) works for any B and L.",
    atol=0.0,
    rtol=0.0,
    params=("split_heads",),
    doc="Check ``split_heads(x, num_heads)``: (B, L, E) -> (B, H, L, D), head h = features "
    "h·D..(h+1)·D-1 of every token, as in ``nn.MultiheadAttention``.",
)


def _merge_cases() -> list[Case]:
    g = torch.Generator().manual_seed(31)
    cases = [_randn(g, 2, 3, 5, 4), _randn(g, 1, 2, 4, 3), _randn(g, 3, 4, 6, 2)]
    return [Case(f"merge_heads(x) with x of shape {tuple(x.shape)}", (x,)) for x in cases]


MERGE_HEADS = Exercise(
    "check_merge_heads",
    "heads concatenated in order along the features",
    _MERGES["ok"],
    _merge_cases,
    (
        Mistake(_MERGES["flat"], _HINT_MERGE_FLAT),
        Mistake(
            lambda x: x.transpose(1, 2).view(x.shape[0], x.shape[2], -1),
            "view() needs memory laid out in the new order; after a transpose it is not. Use "
            ".reshape(...) (or .contiguous().view(...)) to merge the heads back.",
        ),
        Mistake(
            _MERGES["interleaved"],
            "You interleaved the heads feature by feature. Concatenate whole heads: [head 0 "
            "(D values) | head 1 (D values) | ...], i.e. transpose(1, 2) then reshape.",
        ),
        Mistake(
            lambda x: x.flatten(1, 2),
            "You stacked the heads along the tokens. Concatenate them along the features, "
            "(B, L, H·D).",
        ),
    ),
    hint="Row i of the result must be torch.cat([x[b, 0, i], x[b, 1, i], ...]).",
    crash_hint="x.transpose(1, 2).reshape(B, L, H·D) works for any B, H, L, D.",
    atol=0.0,
    rtol=0.0,
    params=("merge_heads",),
    doc="Check ``merge_heads(x)``: (B, H, L, D) -> (B, L, H·D), row i = [head 0 of token i | "
    "head 1 of token i | ...].",
)


@torch.no_grad()
def _torch_mha(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    q_proj: nn.Linear,
    k_proj: nn.Linear,
    v_proj: nn.Linear,
    out_proj: nn.Linear,
    num_heads: int,
) -> Tensor:
    """torch's multi-head attention, given the projections (q, k, v, out) and num_heads."""
    out, _ = F.multi_head_attention_forward(
        query.transpose(0, 1),  # (L, B, E)
        key.transpose(0, 1),
        value.transpose(0, 1),
        query.shape[-1],
        num_heads,
        None,
        torch.cat([q_proj.bias, k_proj.bias, v_proj.bias]),
        None,
        None,
        False,
        0.0,
        out_proj.weight,
        out_proj.bias,
        training=False,
        need_weights=False,
        use_separate_proj_weight=True,
        q_proj_weight=q_proj.weight,
        k_proj_weight=k_proj.weight,
        v_proj_weight=v_proj.weight,
    )
    return out.transpose(0, 1)  # (B, L, E)


@torch.no_grad()
def _mha_variant(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    q_proj: nn.Module,
    k_proj: nn.Module,
    v_proj: nn.Module,
    out_proj: nn.Module,
    num_heads: int,
    *,
    split: str = "ok",
    merge: str = "ok",
    scale: str = "head",
    dim: int = -1,
    project: bool = True,
):
    """Multi-head attention written out: right with the defaults, or with one usual mistake."""
    H, E = num_heads, query.shape[-1]
    q, k, v = (
        _SPLITS[split](p(t), H)  # (B, H, L or S, D)
        for p, t in zip((q_proj, k_proj, v_proj), (query, key, value))
    )
    factor = {"head": 1 / math.sqrt(E // H), "none": 1.0, "model": 1 / math.sqrt(E)}[scale]
    heads = torch.softmax(q @ k.transpose(-2, -1) * factor, dim=dim) @ v  # (B, H, L, D)
    if merge == "none":
        return heads  # the heads never merged
    out = _MERGES[merge](heads)  # (B, L, E)
    return out_proj(out) if project else out


_MHA_MISTAKES: list[tuple[dict[str, Any], str]] = [
    (
        {"split": "flat", "merge": "flat"},
        "You split and merge the heads with a view and no "
        "transpose, as the post's second implementation does. " + _HINT_SPLIT_FLAT,
    ),
    ({"split": "flat"}, _HINT_SPLIT_FLAT),
    ({"merge": "flat"}, "The split is right, the merge is not. " + _HINT_MERGE_FLAT),
    ({"split": "interleaved", "merge": "interleaved"}, _HINT_INTERLEAVED),
    (
        {"scale": "none"},
        (
            "The scores are not scaled. Multiply q @ kᵀ by 1/√D, with D = E // "
            "num_heads the head dim, before the softmax."
        ),
    ),
    (
        {"scale": "model"},
        (
            "You scaled by 1/√E, the model width. Each head is an attention of "
            "dimension D = E // num_heads, so its scores are scaled by 1/√D."
        ),
    ),
    (
        {"project": False},
        (
            "You returned Concat(head_1, ..., head_h) without the output "
            "projection W_O. Apply out_proj to the merged heads: it is what mixes "
            "the heads' results."
        ),
    ),
    (
        {"dim": -2},
        (
            "The softmax runs over the keys (dim=-1, the S axis), so that every query's "
            "weights sum to 1; you normalised over the queries (dim=-2)."
        ),
    ),
    (
        {"merge": "none"},
        (
            "These are still the per-head outputs (B, H, L, D): merge the heads "
            "back to (B, L, E) and apply out_proj."
        ),
    ),
]
_HINT_MHA = (
    "Check each step against the chapter: project, split (view(B, N, H, D).transpose(1, 2)), "
    "softmax(q @ kᵀ / √D) over the keys, weights @ v, merge (transpose(1, 2).reshape(B, L, E)), "
    "out_proj."
)


def _linear(g: torch.Generator, fan_in: int, fan_out: int) -> nn.Linear:
    """An ``nn.Linear`` with weights from ``g`` (``skip_init`` leaves the global RNG alone)."""
    layer = nn.utils.skip_init(nn.Linear, fan_in, fan_out)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * _randn(g, *p.shape))
    return layer


def _mha_case(
    g: torch.Generator, label: str, L: int, S: int, H: int, kdim: int = 12, vdim: int = 12
) -> Case:
    """``(query, key, value, q_proj, k_proj, v_proj, out_proj, num_heads)``, B = 2, E = 12;
    self-attention when ``S`` is 0."""
    projs = (_linear(g, 12, 12), _linear(g, kdim, 12), _linear(g, vdim, 12), _linear(g, 12, 12))
    query = _randn(g, 2, L, 12)
    key, value = (_randn(g, 2, S, kdim), _randn(g, 2, S, vdim)) if S else (query, query)
    return Case(label, (query, key, value, *projs, H))


def _forward_cases() -> list[Case]:
    g = torch.Generator().manual_seed(32)
    return [
        _mha_case(g, "multi_head_forward on self-attention, x (2, 5, 12), num_heads=3", 5, 0, 3),
        _mha_case(
            g,
            "multi_head_forward on cross-attention, query (2, 4, 12), key (2, 7, 7), "
            "value (2, 7, 5), num_heads=4",
            4,
            7,
            4,
            kdim=7,
            vdim=5,
        ),
    ]


MULTI_HEAD_FORWARD = Exercise(
    "check_multi_head_forward",
    "matches torch.nn.MultiheadAttention, self- and cross-attention",
    _torch_mha,
    _forward_cases,
    tuple(Mistake(partial(_mha_variant, **kwargs), hint) for kwargs, hint in _MHA_MISTAKES),
    hint=_HINT_MHA,
    crash_hint="Name the shapes at every step: (B, L, E) -> (B, H, L, D) -> (B, H, L, S) -> "
    "(B, H, L, D) -> (B, L, E).",
    atol=1e-4,
    rtol=1e-4,
    params=("multi_head_forward",),
    doc="""Check ``multi_head_forward(query, key, value, q_proj, k_proj, v_proj, out_proj,
    num_heads) -> (B, L, E)`` against torch's ``nn.MultiheadAttention`` with those weights, on
    self-attention and on cross-attention with L ≠ S and kdim ≠ vdim ≠ E.""",
)

_POST_LAYERS = ("query_fc", "key_fc", "value_fc", "fc")


def _post_class(**variant: Any) -> type[nn.Module]:
    """The post's class ``MultiHeadAttention(d_model, num_heads)``, computing ``_mha_variant``."""

    class Post(nn.Module):
        def __init__(self, d_model: int, num_heads: int) -> None:
            super().__init__()
            self.num_heads = num_heads
            for name in _POST_LAYERS:
                setattr(self, name, nn.Linear(d_model, d_model))

        def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            q_fc, k_fc, v_fc, fc = (getattr(self, name) for name in _POST_LAYERS)
            return _mha_variant(query, key, value, q_fc, k_fc, v_fc, fc, self.num_heads, **variant)

    return Post


def _run_post_class(cls: type, case: Case) -> object:
    """Build the learner's class, load the case's weights into the post's layers, and run it."""
    query, key, value, *projs, H = case.args
    with torch.random.fork_rng(devices=[]):  # the constructor's init draws from the global RNG
        try:
            model = cls(12, H)
        except Exception as err:  # the learner's bug, quoted back
            raise ExerciseError(
                f"{getattr(cls, '__name__', cls)}(12, {H}) raised {type(err).__name__}: {err}. "
                "Keep the constructor of the post: (d_model, num_heads)."
            ) from err
    for name, proj in zip(_POST_LAYERS, projs):
        layer = getattr(model, name, None)
        if not isinstance(layer, nn.Linear) or layer.weight.shape != (12, 12) or layer.bias is None:
            raise ExerciseError(
                f"The module needs the post's layer {name} = nn.Linear(d_model, d_model) (with "
                "bias); fix the bug in forward and keep the layers as they are."
            )
        layer.load_state_dict(proj.state_dict())
    with torch.no_grad():
        return model.eval()(query.clone(), key.clone(), value.clone())


def _seed_fix_cases() -> list[Case]:
    g = torch.Generator().manual_seed(33)
    self_case = _mha_case(
        g, "the repaired module on self-attention, x of shape (2, 5, 12)", 5, 0, 3
    )
    query, key = _randn(g, 2, 4, 12), _randn(g, 2, 7, 12)
    label = "the repaired module on cross-attention, query (2, 4, 12), key and value (2, 7, 12)"
    return [self_case, Case(label, (query, key, key, *self_case.args[3:]))]


SEED_MHA_FIX = Exercise(
    "check_seed_mha_fix",
    "the post's class now matches torch.nn.MultiheadAttention",
    _torch_mha,
    _seed_fix_cases,
    tuple(Mistake(_post_class(**kwargs), hint) for kwargs, hint in _MHA_MISTAKES),
    hint=_HINT_MHA,
    crash_hint="Split with view(B, N, H, D).transpose(1, 2), merge with transpose(1, 2).reshape.",
    atol=1e-4,
    rtol=1e-4,
    call=_run_post_class,
    solution=_post_class(),
    params=("cls",),
    doc="""Check a repaired version of the post's class ``MultiHeadAttention(d_model, num_heads)``
    (layers ``query_fc``, ``key_fc``, ``value_fc``, ``fc``; ``forward(query, key, value)``) against
    torch's ``nn.MultiheadAttention`` with the same weights, self- and cross-attention.""",
)

#: The module and inputs of the "predict the shapes" exercise.
SHAPE_EXERCISE: dict[str, Any] = {
    "module": {"embed_dim": 12, "num_heads": 4, "kdim": 5, "vdim": 7, "num_kv_heads": 2},
    "query": (2, 3, 12),
    "key": (2, 9, 5),
    "value": (2, 9, 7),
}
_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight")
_SHAPE_KEYS = (*_WEIGHTS, "weights", "out", "num_parameters")


def _true_shapes() -> dict[str, object]:
    """Build the module of :data:`SHAPE_EXERCISE`, run it, and read off the shapes."""
    with torch.random.fork_rng(devices=[]):
        module = MultiHeadAttention(**SHAPE_EXERCISE["module"])
    with torch.no_grad():
        out, weights = module(
            *(torch.zeros(*SHAPE_EXERCISE[n]) for n in ("query", "key", "value")), need_weights=True
        )
    truth = {n: tuple(p.shape) for n, p in module.named_parameters() if n in _WEIGHTS}
    return {
        **truth,
        "weights": tuple(weights.shape),
        "out": tuple(out.shape),
        "num_parameters": sum(p.numel() for p in module.parameters()),
    }


def _as_predictions(predictions: object) -> tuple[object, ...]:
    """The predictions in the order of ``_SHAPE_KEYS``, each a shape tuple or an int."""
    if not isinstance(predictions, dict):
        raise ExerciseError(f"predictions should be a dict, got {type(predictions).__name__}.")
    missing = [k for k in _SHAPE_KEYS if k not in predictions]
    if missing:
        raise ExerciseError(f"predictions is missing {', '.join(missing)}.")
    for name, value in predictions.items():
        if value is ... or (isinstance(value, (tuple, list)) and ... in value):
            raise ExerciseError(f"Replace the ... in predictions[{name!r}] by your prediction.")
    return tuple(
        (as_int if n == "num_parameters" else as_shape)(predictions[n], f"predictions[{n!r}]")
        for n in _SHAPE_KEYS
    )


_HINT_KV = (
    "k_proj and v_proj read kdim / vdim features and produce num_kv_heads·D features (D = "
    "embed_dim // num_heads): with fewer key/value heads they are smaller than q_proj."
)
_HINT_QO = "q_proj maps E to E (H heads of D), and out_proj maps the concatenated heads (E) to E."

MHA_SHAPE_PREDICTIONS = Exercise(
    "check_mha_shape_predictions",
    f"all {len(_SHAPE_KEYS)} predictions match the running module",
    _true_shapes,
    mistakes=tuple(
        Mistake(
            lambda t, n=n: {**t, n: t[n][::-1]},
            "nn.Linear stores its weight as (out_features, in_features).",
        )
        for n in ("k_proj.weight", "v_proj.weight")  # q_proj and out_proj are square
    ),
    hint={
        "q_proj.weight": _HINT_QO,
        "k_proj.weight": _HINT_KV,
        "v_proj.weight": _HINT_KV,
        "out_proj.weight": _HINT_QO,
        "weights": "one (L, S) matrix per *query* head: the key/value heads are shared "
        "(repeated), the weights are not. Rows are queries (L), columns keys (S).",
        "out": "one row of width E per query: (B, L, E), whatever kdim, vdim or S are.",
        "num_parameters": "count weights and biases of the four projections: "
        "out_features·(in_features + 1) each.",
    },
    outputs=_SHAPE_KEYS,
    prediction=True,
    report_all=True,
    convert=_as_predictions,
    params=("predictions",),
    doc="""Check predicted shapes (``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``,
    ``out_proj.weight``, ``weights``, ``out``) and ``num_parameters`` of :data:`SHAPE_EXERCISE`'s
    ``mha.MultiHeadAttention``, by building and running it.""",
)

EXERCISES = (SPLIT_HEADS, MERGE_HEADS, MULTI_HEAD_FORWARD, SEED_MHA_FIX, MHA_SHAPE_PREDICTIONS)
check_split_heads = SPLIT_HEADS.checker()
check_merge_heads = MERGE_HEADS.checker()
check_multi_head_forward = MULTI_HEAD_FORWARD.checker()
check_seed_mha_fix = SEED_MHA_FIX.checker()
check_mha_shape_predictions = MHA_SHAPE_PREDICTIONS.checker()
