"""Chapter 3, multi-head attention: the exercises as data for :mod:`._harness`, the post
``002``'s ``view`` without ``transpose`` among the mistakes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import block as _block_module
from .. import multihead as _multihead_module
from ..block import TransformerBlock
from ..multihead import MultiHeadAttention
from ._harness import (
    Case,
    Exercise,
    ExerciseError,
    as_int,
    as_mapping,
    as_shape,
    defined_in,
    publish,
    randn64,
    tr,
)

#: Everything mha/multihead.py defines (the layer, its private split and merge, the caches): the
#: split, the merge and the whole layer are what chapter 3's learner writes.
_MULTIHEAD: tuple[Callable[..., Any], ...] = tuple(defined_in(_multihead_module))
_NO_LAYER_CODE = (
    "split and merge the heads yourself, with view/reshape and transpose, without "
    "mha.MultiHeadAttention's own code."
)


def _split_by_library(x: Tensor, H: int) -> Tensor:
    """The layer's private ``_project`` (projections replaced by the identity), which splits."""
    same = nn.Identity()
    layer = SimpleNamespace(
        num_heads=H,
        num_kv_heads=H,
        head_dim=x.shape[-1] // H,
        q_proj=same,
        k_proj=same,
        v_proj=same,
    )
    return MultiHeadAttention._project(layer, x, x.clone(), x.clone())[0]  # type: ignore[arg-type]


def _merge_by_library(x: Tensor, out_proj: Any = None) -> Tensor:
    """The layer's private ``_merge`` (with ``out_proj`` the identity unless given)."""
    layer = SimpleNamespace(out_proj=out_proj or nn.Identity(), _report=lambda **steps: None)
    return MultiHeadAttention._merge(layer, x)  # type: ignore[arg-type]


def _merge_by_module_helper(x: Tensor) -> Tensor:
    """The right merge, after a private helper of mha/multihead.py reached around the ban."""
    keep = _multihead_module._and_mask(None, torch.ones(1, dtype=torch.bool))
    return torch.cat(x.unbind(1), dim=-1) * keep


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
_SPLIT_FLAT = (
    "A view without a transpose (the post's view(B·H, -1, D)) makes 'head 0' out of chunks of the "
    "first tokens, since memory holds x token by token: use x.view(B, L, H, D).transpose(1, 2)."
)
_INTERLEAVED = (
    "Head h owns the contiguous features h·D..(h+1)·D-1 (as in nn.MultiheadAttention and every "
    "checkpoint), not every H-th one: view(B, L, H, D), not view(B, L, D, H)."
)
_MERGE_FLAT = (
    "A reshape of (B, H, L, D) without a transpose makes row i a chunk of head 0's rows: use "
    ".transpose(1, 2).reshape(B, L, H·D)."
)


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g)


def _split_cases() -> list[Case]:
    g = torch.Generator().manual_seed(30)
    cases = [(_randn(g, 2, 5, 12), 3), (_randn(g, 1, 4, 8), 2), (_randn(g, 3, 6, 12), 4)]
    return [Case(f"split_heads(x, {H}) with x of shape {tuple(x.shape)}", (x, H)) for x, H in cases]


_WRONG_SPLIT = f"The post's (B·H, L, D) layout, and more than a shape problem. {_SPLIT_FLAT}"
_NOT_IN_FRONT = "Move the heads in front of the tokens with .transpose(1, 2): (B, H, L, D)."
SPLIT_HEADS = Exercise(
    "check_split_heads",
    "head h holds features h·D..(h+1)·D-1 of every token",
    _SPLITS["ok"],
    _split_cases,
    variants=(
        lambda x, H: x.view(x.shape[0], x.shape[1], H, -1).transpose(1, 2),
        lambda x, H: x.unflatten(-1, (H, -1)).permute(0, 2, 1, 3),
    ),
    mistakes=(
        (_SPLITS["flat"], _SPLIT_FLAT),
        (lambda x, H: x.reshape(x.shape[0] * H, -1, x.shape[-1] // H), _WRONG_SPLIT),
        (lambda x, H: x.unflatten(-1, (H, -1)), _NOT_IN_FRONT),
        (_SPLITS["interleaved"], _INTERLEAVED),
        (_split_by_library, _NO_LAYER_CODE),
    ),
    hint="Head h of token i must be x[b, i, h·D:(h+1)·D].",
    crash_hint="x.view(B, L, H, D).transpose(1, 2) works for any B and L.",
    atol=0.0,
    rtol=0.0,
    forbidden=_MULTIHEAD,
    forbidden_hint=_NO_LAYER_CODE,
    # the layer splits its heads in its private _project: mha has no public split
    rewrites=(MultiHeadAttention._project,),
    params=("split_heads",),
    doc="Check ``split_heads(x, num_heads)``: (B, L, E) -> (B, H, L, D), head h = features "
    "h·D..(h+1)·D-1 of every token, as in ``nn.MultiheadAttention``.",
)


def _merge_cases() -> list[Case]:
    g = torch.Generator().manual_seed(31)
    cases = [_randn(g, 2, 3, 5, 4), _randn(g, 1, 2, 4, 3), _randn(g, 3, 4, 6, 2)]
    return [Case(f"merge_heads(x) with x of shape {tuple(x.shape)}", (x,)) for x in cases]


_VIEW = "After a transpose view() fails: use .reshape(...) (or .contiguous().view(...))."
MERGE_HEADS = Exercise(
    "check_merge_heads",
    "heads concatenated in order along the features",
    _MERGES["ok"],
    _merge_cases,
    variants=(
        lambda x: x.transpose(1, 2).reshape(*x.shape[::2], -1),
        lambda x: x.permute(0, 2, 1, 3).flatten(2),
        lambda x: torch.cat([x[:, h] for h in range(x.shape[1])], dim=-1),
    ),
    mistakes=(
        (_MERGES["flat"], _MERGE_FLAT),
        (lambda x: x.transpose(1, 2).view(x.shape[0], x.shape[2], -1), _VIEW),
        (_MERGES["interleaved"], "Concatenate whole heads, not feature by feature."),
        (lambda x: x.flatten(1, 2), "Concatenate the heads along the features, not tokens."),
        (_merge_by_library, _NO_LAYER_CODE),
        (_merge_by_module_helper, _NO_LAYER_CODE),
    ),
    hint="Row i of the result must be torch.cat([x[b, 0, i], x[b, 1, i], ...]).",
    crash_hint="x.transpose(1, 2).reshape(B, L, H·D) works for any B, H, L, D.",
    atol=0.0,
    rtol=0.0,
    forbidden=_MULTIHEAD,
    forbidden_hint=_NO_LAYER_CODE,
    # the layer merges its heads (and applies W_O) in its private _merge: no public merge
    rewrites=(MultiHeadAttention._merge,),
    params=("merge_heads",),
    doc="Check ``merge_heads(x)``: (B, H, L, D) -> (B, L, H·D), row i = [head 0 of token i | "
    "head 1 of token i | ...].",
)


@torch.no_grad()
def _torch_mha(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Tensor:
    """torch's multi-head attention; ``args`` = (q_proj, k_proj, v_proj, out_proj, num_heads)."""
    *projs, num_heads = args
    weights = {f"{n}_proj_weight": p.weight for n, p in zip("qkv", projs)}
    bias, out_proj = torch.cat([p.bias for p in projs[:3]]), projs[3]
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # (N, B, width)
    rest = (query.shape[-1], num_heads, None, bias, None, None, False, 0.0)
    forward: Any = F.multi_head_attention_forward  # positional: see torch's signature
    out, _ = forward(
        q, k, v, *rest, out_proj.weight, out_proj.bias, use_separate_proj_weight=True, **weights
    )
    return out.transpose(0, 1)  # (B, L, E)


@torch.no_grad()
def _mha_variant(query: Tensor, key: Tensor, value: Tensor, *args: Any, **slip: Any) -> Tensor:
    """Multi-head attention written out, ``args`` as in :func:`_torch_mha`: right without ``slip``,
    or with one usual mistake."""
    *projs, H = args
    split, merge = _SPLITS[slip.get("split", "ok")], slip.get("merge", "ok")
    q, k, v = (split(p(t), H) for p, t in zip(projs, (query, key, value)))  # (B, H, N, D)
    factor = {"head": q.shape[-1] ** -0.5, "none": 1.0, "model": query.shape[-1] ** -0.5}
    scores = q @ k.transpose(-2, -1) * factor[slip.get("scale", "head")]  # (B, H, L, S)
    heads = torch.softmax(scores, dim=slip.get("dim", -1)) @ v  # (B, H, L, D)
    if merge == "none":
        return heads  # the heads never merged
    out = _MERGES[merge](heads)  # (B, L, E)
    return projs[3](out) if slip.get("project", True) else out


_D = "D = E // num_heads"
_BOTH_FLAT = f"Split and merge, as the post's second implementation does: {_SPLIT_FLAT}"
_MHA_MISTAKES: list[tuple[dict[str, Any], str]] = [
    ({"split": "flat", "merge": "flat"}, _BOTH_FLAT),
    ({"split": "flat"}, _SPLIT_FLAT),
    ({"merge": "flat"}, f"The split is right, the merge is not. {_MERGE_FLAT}"),
    ({"split": "interleaved", "merge": "interleaved"}, _INTERLEAVED),
    ({"scale": "none"}, f"Scale the scores q @ kᵀ by 1/√D, {_D}, before the softmax."),
    ({"scale": "model"}, f"Scale by 1/√D, {_D} the head dim, not by 1/√E."),
    ({"project": False}, "Apply out_proj (W_O) to the merged heads: it mixes their results."),
    ({"dim": -2}, "Softmax over the keys (dim=-1), so that every query's weights sum to 1."),
    ({"merge": "none"}, "These are the per-head outputs (B, H, L, D): merge, then out_proj."),
]
_MHA_HINT = (
    "Check each step: project, split (view(B, N, H, D).transpose(1, 2)), softmax(q @ kᵀ / √D) "
    "over the keys, weights @ v, merge (transpose(1, 2).reshape(B, L, E)), out_proj."
)
#: torch's layer, and all of mha's layer code and the block that contains the layer.
_NO_TORCH_MHA: tuple[Callable[..., Any], ...] = (
    F.multi_head_attention_forward,
    nn.MultiheadAttention.forward,
    *_MULTIHEAD,
    *defined_in(_block_module),
)
_MHA_REWRITES: tuple[Callable[..., Any], ...] = (
    F.multi_head_attention_forward,
    nn.MultiheadAttention.forward,
    MultiHeadAttention.forward,
)
_NO_TORCH_MHA_HINT = "write it yourself, without nn.MultiheadAttention or mha.MultiHeadAttention."


def _sdpa_forward(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Tensor:
    """Multi-head attention with view/transpose and torch's SDPA for the heads (allowed)."""
    *projs, H = args
    B, L, E = query.shape
    q, k, v = (
        p(t).view(B, -1, H, E // H).transpose(1, 2) for p, t in zip(projs, (query, key, value))
    )
    return projs[3](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, E))


def _torch_layer(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Tensor:
    """A shortcut: the projected inputs fed to torch's own multi-head attention."""
    *projs, H = args
    with torch.random.fork_rng(devices=[]):
        layer = nn.MultiheadAttention(query.shape[-1], H, batch_first=True)
    qkv = (p(t) for p, t in zip(projs, (query, key, value)))
    return layer(*qkv, need_weights=False)[0]


def _course_module(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Tensor:
    """A shortcut: the course's own module (with weights of its own)."""
    with torch.random.fork_rng(devices=[]):
        module = MultiHeadAttention(
            query.shape[-1], args[-1], kdim=key.shape[-1], vdim=value.shape[-1]
        )
    return module(query, key, value)[0]


def _by_private_merge(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Tensor:
    """The heads by hand, then merged by the layer's private ``_merge`` around the ban."""
    *projs, H = args
    B, L, E = query.shape
    q, k, v = (
        p(t).view(B, -1, H, E // H).transpose(1, 2) for p, t in zip(projs, (query, key, value))
    )
    heads = torch.softmax(q @ k.mT / (E // H) ** 0.5, dim=-1) @ v  # (B, H, L, D)
    return _merge_by_library(heads, projs[3])


def _linear(g: torch.Generator, fan_in: int, fan_out: int) -> nn.Linear:
    """An ``nn.Linear`` with weights from ``g`` (``skip_init`` leaves the global RNG alone)."""
    layer = nn.utils.skip_init(nn.Linear, fan_in, fan_out)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * _randn(g, *p.shape))
    return layer


def _mha_case(g: torch.Generator, label: str, L: int, S: int, H: int, kv: int = 12, v: int = 12):
    """``(query, key, value, q_proj, k_proj, v_proj, out_proj, H)``, B = 2, E = 12; self-attention
    when ``S`` is 0."""
    projs = (_linear(g, 12, 12), _linear(g, kv, 12), _linear(g, v, 12), _linear(g, 12, 12))
    query = _randn(g, 2, L, 12)
    key, value = (_randn(g, 2, S, kv), _randn(g, 2, S, v)) if S else (query, query)
    return Case(label, (query, key, value, *projs, H))


def _forward_cases() -> list[Case]:
    g = torch.Generator().manual_seed(32)
    cross = "query (2, 4, 12), key (2, 7, 7), value (2, 7, 5), num_heads=4"
    return [
        _mha_case(g, "multi_head_forward on self-attention, x (2, 5, 12), num_heads=3", 5, 0, 3),
        _mha_case(g, f"multi_head_forward on cross-attention, {cross}", 4, 7, 4, kv=7, v=5),
    ]


MULTI_HEAD_FORWARD = Exercise(
    "check_multi_head_forward",
    "matches torch.nn.MultiheadAttention, self- and cross-attention",
    _torch_mha,
    _forward_cases,
    variants=(_mha_variant, _sdpa_forward),
    mistakes=(
        *((partial(_mha_variant, **slip), hint) for slip, hint in _MHA_MISTAKES),
        (_torch_layer, _NO_TORCH_MHA_HINT),
        (_course_module, _NO_TORCH_MHA_HINT),
        (_by_private_merge, _NO_TORCH_MHA_HINT),
    ),
    hint=_MHA_HINT,
    crash_hint="Name the shapes at every step: (B, L, E) -> (B, H, L, D) -> (B, H, L, S) -> "
    "(B, H, L, D) -> (B, L, E).",
    atol=1e-4,
    rtol=1e-4,
    forbidden=_NO_TORCH_MHA,
    forbidden_hint=_NO_TORCH_MHA_HINT,
    rewrites=_MHA_REWRITES,
    params=("multi_head_forward",),
    doc="Check ``multi_head_forward(query, key, value, q_proj, k_proj, v_proj, out_proj, "
    "num_heads) -> (B, L, E)`` against torch's ``nn.MultiheadAttention`` with those weights, on "
    "self-attention and on cross-attention with L ≠ S and kdim ≠ vdim ≠ E.",
)

_POST_LAYERS = ("query_fc", "key_fc", "value_fc", "fc")


def _post_bmm(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Tensor:
    """The post's ``(B·H, N, D)`` layout for ``torch.bmm``, with the split and merge repaired."""
    *projs, H = args
    B, L, E = query.shape

    def split(t: Tensor) -> Tensor:  # (B, N, E) -> (B, H, N, D) -> (B·H, N, D)
        return t.view(B, -1, H, E // H).transpose(1, 2).reshape(B * H, -1, E // H)

    q, k, v = (split(p(t)) for p, t in zip(projs, (query, key, value)))
    weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / (E // H) ** 0.5, -1)  # (B·H, L, S)
    out = torch.bmm(weights, v).view(B, H, L, -1).transpose(1, 2)  # (B, L, H, D)
    return projs[3](out.reshape(B, L, E))


def _post_class(**slip: Any) -> type[nn.Module]:
    """The post's class ``MultiHeadAttention(d_model, num_heads)``, computing ``_mha_variant``
    (or, with ``layout="bmm"``, the post's own layout; with ``shortcut``, that function)."""
    layout, shortcut = slip.pop("layout", None), slip.pop("shortcut", None)
    forward = shortcut or (_post_bmm if layout == "bmm" else None)

    class Post(nn.Module):
        def __init__(self, d_model: int, num_heads: int) -> None:
            super().__init__()
            self.num_heads = num_heads
            for name in _POST_LAYERS:
                setattr(self, name, nn.Linear(d_model, d_model))

        def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            layers = [getattr(self, name) for name in _POST_LAYERS]
            if forward:
                return forward(query, key, value, *layers, self.num_heads)
            return _mha_variant(query, key, value, *layers, self.num_heads, **slip)

    return Post


def _run_post_class(cls: type, case: Case) -> object:
    """Build the learner's class, load the case's weights into the post's layers, and run it."""
    query, key, value, *projs, H = case.args
    with torch.random.fork_rng(devices=[]):  # the constructor's init draws from the global RNG
        try:
            model = cls(12, H)
        except Exception as err:  # the learner's bug, quoted back
            message = (
                "{cls}(12, {H}) raised {kind}: {err}. "
                "Keep the constructor of the post: (d_model, num_heads)."
            )
            name = getattr(cls, "__name__", cls)
            raise ExerciseError(
                tr(message, cls=name, H=H, kind=type(err).__name__, err=err)
            ) from err
    for name, proj in zip(_POST_LAYERS, projs):
        layer = getattr(model, name, None)
        if not isinstance(layer, nn.Linear) or layer.weight.shape != (12, 12) or layer.bias is None:
            message = (
                "The module needs the post's layer {name} = nn.Linear(d_model, d_model) (with "
                "bias); fix the bug in forward and keep the layers as they are."
            )
            raise ExerciseError(tr(message, name=name))
        layer.load_state_dict(proj.state_dict())
    with torch.no_grad():
        return model.eval()(query.clone(), key.clone(), value.clone())


def _seed_fix_cases() -> list[Case]:
    g = torch.Generator().manual_seed(33)
    own = _mha_case(g, "the repaired module on self-attention, x of shape (2, 5, 12)", 5, 0, 3)
    query, key = _randn(g, 2, 4, 12), _randn(g, 2, 7, 12)
    label = "the repaired module on cross-attention, query (2, 4, 12), key and value (2, 7, 12)"
    return [own, Case(label, (query, key, key, *own.args[3:]))]


SEED_MHA_FIX = Exercise(
    "check_seed_mha_fix",
    "the post's class now matches torch.nn.MultiheadAttention",
    _torch_mha,
    _seed_fix_cases,
    variants=(_post_class(), _post_class(layout="bmm")),
    mistakes=(
        *((_post_class(**slip), hint) for slip, hint in _MHA_MISTAKES),
        (_post_class(shortcut=_torch_layer), _NO_TORCH_MHA_HINT),
        (_post_class(shortcut=_by_private_merge), _NO_TORCH_MHA_HINT),
    ),
    hint=_MHA_HINT,
    crash_hint="Split with view(B, N, H, D).transpose(1, 2), merge with transpose(1, 2).reshape.",
    atol=1e-4,
    rtol=1e-4,
    call=_run_post_class,
    forbidden=_NO_TORCH_MHA,
    forbidden_hint=_NO_TORCH_MHA_HINT,
    rewrites=_MHA_REWRITES,
    params=("cls",),
    doc="Check a repaired version of the post's class ``MultiHeadAttention(d_model, num_heads)`` "
    "(layers ``query_fc``, ``key_fc``, ``value_fc``, ``fc``; ``forward(query, key, value)``) "
    "against torch's ``nn.MultiheadAttention`` with the same weights, self- and cross-attention.",
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
    inputs = (torch.zeros(*SHAPE_EXERCISE[n]) for n in ("query", "key", "value"))
    with torch.no_grad():
        out, weights = module(*inputs, need_weights=True)
    return {
        **{n: tuple(p.shape) for n, p in module.named_parameters() if n in _WEIGHTS},
        "weights": tuple(weights.shape),
        "out": tuple(out.shape),
        "num_parameters": sum(p.numel() for p in module.parameters()),
    }


def _as_predictions(predictions: object) -> tuple[object, ...]:
    """The predictions in the order of ``_SHAPE_KEYS``, each a shape tuple or an int."""
    predictions = as_mapping(predictions, _SHAPE_KEYS)
    for name, value in predictions.items():
        if value is ... or (isinstance(value, (tuple, list)) and ... in value):
            message = "Replace the ... in predictions[{name!r}] by your prediction."
            raise ExerciseError(tr(message, name=name))
    return tuple(
        (as_int if n == "num_parameters" else as_shape)(predictions[n], f"predictions[{n!r}]")
        for n in _SHAPE_KEYS
    )


_KV = "k_proj and v_proj map kdim / vdim to num_kv_heads·D features (D = embed_dim // num_heads)."
_QO = "q_proj maps E to E (H heads of D), and out_proj maps the concatenated heads (E) to E."
MHA_SHAPE_PREDICTIONS = Exercise(
    "check_mha_shape_predictions",
    f"all {len(_SHAPE_KEYS)} predictions match the running module",
    _true_shapes,
    prediction=True,
    variants=(
        lambda t: t,
        lambda t: {**t, "out": list(t["out"]), "weights": torch.Size(t["weights"])},
    ),
    mistakes=tuple(  # q_proj and out_proj are square
        (lambda t, n=n: {**t, n: t[n][::-1]}, "nn.Linear's weight is (out, in) features.")
        for n in ("k_proj.weight", "v_proj.weight")
    ),
    hint={
        **dict.fromkeys(_WEIGHTS[1:3], _KV),
        **dict.fromkeys(_WEIGHTS[::3], _QO),
        "weights": "one (L, S) matrix per *query* head: key/value heads are shared, weights not.",
        "out": "one row of width E per query: (B, L, E), whatever kdim, vdim or S are.",
        "num_parameters": "count the four projections' weights and biases: "
        "out_features·(in_features + 1) each.",
    },
    outputs=_SHAPE_KEYS,
    report_all=True,
    convert=_as_predictions,
    params=("predictions",),
    doc="Check predicted shapes (the four ``*_proj.weight``, ``weights``, ``out``) and "
    "``num_parameters`` of :data:`SHAPE_EXERCISE`'s ``mha.MultiHeadAttention``, by running it.",
)


# --- 3.4: the pre-norm block's forward, LayerNorm written by hand --------------------------------


def _layer_norm(norm: nn.LayerNorm, x: Tensor, **slip: Any) -> Tensor:
    """``norm`` applied to ``x`` by its formula: right without ``slip``, or with a usual slip."""
    mean = x.mean(-1, keepdim=True)  # (B, L, 1)
    var = x.var(-1, keepdim=True, unbiased=bool(slip.get("unbiased")))  # (B, L, 1)
    eps = slip.get("eps", norm.eps)
    if slip.get("eps_outside"):
        h = (x - mean) / (var.sqrt() + eps)
    else:
        h = (x - mean) / torch.sqrt(var + eps)  # (B, L, E)
    if slip.get("no_affine"):
        return h
    return h * norm.weight + norm.bias  # per feature


def _block_slip(block: Any, x: Tensor, is_causal: bool = False, **slip: Any) -> Tensor:
    """The pre-norm block: right without ``slip``, or with one of the usual slips."""
    norm_slip = {k: slip[k] for k in ("unbiased", "eps", "eps_outside", "no_affine") if k in slip}
    causal = False if slip.get("no_causal") else is_causal
    second = block.norm1 if slip.get("one_norm") else block.norm2
    if slip.get("post_norm"):  # the original Transformer: normalise after the addition
        x = _layer_norm(block.norm1, x + block.attn(x, is_causal=causal)[0], **norm_slip)
        return _layer_norm(second, x + block.mlp(x), **norm_slip)
    h = _layer_norm(block.norm1, x, **norm_slip)  # (B, L, E)
    if slip.get("norm_stream"):  # the stream itself replaced by its normalised copy
        x = h
    x = x + block.attn(h, is_causal=causal)[0]  # (B, L, E)
    return x + block.mlp(_layer_norm(second, x, **norm_slip))  # (B, L, E)


def _block_by_var_mean(block: Any, x: Tensor, is_causal: bool = False) -> Tensor:
    def norm(n: nn.LayerNorm, t: Tensor) -> Tensor:
        var, mean = torch.var_mean(t, dim=-1, keepdim=True, correction=0)
        return torch.addcmul(n.bias, (t - mean) * torch.rsqrt(var + n.eps), n.weight)

    attn, _ = block.attn(norm(block.norm1, x), is_causal=is_causal)
    x = attn + x
    return block.mlp(norm(block.norm2, x)) + x


def _block_by_centred(block: Any, x: Tensor, is_causal: bool = False) -> Tensor:
    def norm(n: nn.LayerNorm, t: Tensor) -> Tensor:
        c = t - t.sum(-1, keepdim=True) / t.shape[-1]  # centred
        std = ((c * c).mean(-1, keepdim=True) + n.eps) ** 0.5
        return n.weight * (c / std) + n.bias

    steps = (
        (block.norm1, lambda h: block.attn(h, is_causal=is_causal)[0]),
        (block.norm2, block.mlp),
    )
    for n, sublayer in steps:  # each sublayer reads a normalised copy and adds back
        x = x + sublayer(norm(n, x))
    return x


def _block_cases() -> list[Case]:
    """Float64 blocks with norms whose weights differ (so that a mixed-up norm shows), a stream far
    from mean 0 and variance 1, a token of nearly equal features (where eps matters)."""
    g = torch.Generator().manual_seed(34)
    cases = []
    for E, H, eps, causal in ((16, 4, 1e-5, False), (16, 4, 1e-5, True), (12, 3, 1e-2, True)):
        torch_state = torch.random.get_rng_state()
        torch.manual_seed(34)  # the block's own initialisation; the global RNG is restored below
        block = TransformerBlock(E, H, norm_eps=eps, dtype=torch.float64)
        torch.random.set_rng_state(torch_state)
        with torch.no_grad():
            for norm in (block.norm1, block.norm2):
                norm.weight.copy_(1 + 0.5 * randn64(g, E))
                norm.bias.copy_(0.5 * randn64(g, E))
        x = randn64(g, 2, 5, E) * 3 + 2  # (B, L, E)
        x[0, 1] = 4 + 0.01 * randn64(g, E)  # a token of nearly equal features
        label = f"my_block(block, x, is_causal={causal}) with E = {E}, norm_eps = {eps:g}"
        cases.append(Case(label, (block, x, causal)))
    return cases


_NO_BLOCK = (
    "write the block's forward yourself: do not call the block (TransformerBlock.forward), its "
    "norms (block.norm1(x), nn.LayerNorm) or F.layer_norm; compute LayerNorm from its formula."
)
_PRE_NORM = (
    "Pre-norm normalises the copy each sublayer reads, not the sum: x = x + attn(norm1(x)), "
    "then x = x + mlp(norm2(x)). Normalising after the addition is the original post-norm."
)
_STREAM = (
    "Add each sublayer's result to the stream x itself, not to its normalised copy: the "
    "residual path never passes through a norm."
)
_BIASED = (
    "LayerNorm divides by E, not E - 1: use the biased variance, x.var(-1, unbiased=False) "
    "(or correction=0)."
)
_EPS = "Use the block's own epsilon, block.norm1.eps: it is not always 1e-5."
_EPS_INSIDE = "eps goes inside the square root: (x - mean) / sqrt(var + eps)."
_AFFINE = "Finish the norm with its learned scale and shift: h * norm.weight + norm.bias."
_TWO_NORMS = "Each sublayer has its own norm: norm1 before the attention, norm2 before the MLP."
_CAUSAL_ON = "Pass is_causal on to the attention: block.attn(h, is_causal=is_causal)."
PRE_NORM_BLOCK = Exercise(
    "check_pre_norm_block",
    "equals mha.TransformerBlock with the same weights (float64; causal and not; norms with "
    "their own weights and eps), LayerNorm written by hand",
    lambda block, x, is_causal=False: block(x, is_causal=is_causal),
    _block_cases,
    variants=(_block_slip, _block_by_var_mean, _block_by_centred),
    mistakes=(
        (partial(_block_slip, post_norm=True), _PRE_NORM),
        (partial(_block_slip, norm_stream=True), _STREAM),
        (partial(_block_slip, unbiased=True), _BIASED),
        (partial(_block_slip, eps=1e-5), _EPS),
        (partial(_block_slip, eps_outside=True), _EPS_INSIDE),
        (partial(_block_slip, no_affine=True), _AFFINE),
        (partial(_block_slip, one_norm=True), _TWO_NORMS),
        (partial(_block_slip, no_causal=True), _CAUSAL_ON),
        (lambda block, x, is_causal=False: block(x, is_causal=is_causal), _NO_BLOCK),
        (
            lambda block, x, is_causal=False: (
                _block_slip(block, x, is_causal) + 0 * F.layer_norm(x, x.shape[-1:])
            ),
            _NO_BLOCK,
        ),
    ),
    hint="x = x + block.attn(norm1(x), is_causal=is_causal)[0]; then x = x + block.mlp(norm2(x)); "
    "norm(x) = (x - mean) / sqrt(var + eps) * weight + bias over the last dim.",
    crash_hint="block.attn returns a pair (out, weights): take out = block.attn(h, ...)[0].",
    atol=1e-10,
    rtol=1e-8,
    forbidden=(
        *defined_in(_block_module),  # every function of mha/block.py (it has no private one)
        nn.LayerNorm.forward,
        F.layer_norm,
        torch.layer_norm,
        torch.native_layer_norm,
    ),
    forbidden_hint=_NO_BLOCK,
    rewrites=(TransformerBlock.forward, F.layer_norm),
    params=("my_block",),
    doc="Check ``my_block(block, x, is_causal=False)``, the pre-norm forward of a "
    "``mha.TransformerBlock`` written from its parts (``block.attn``, ``block.mlp``) with LayerNorm "
    "by its formula, against the block itself.",
)


EXERCISES = publish(globals())
