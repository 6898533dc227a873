"""Checkers for chapter 3, multi-head attention.

Each checker runs the learner's answer on fixed inputs and compares it with PyTorch's own
``torch.nn.MultiheadAttention`` (or with a head split written as plain slicing). When the answer
is wrong it recomputes the usual mistakes — ``view`` without ``transpose`` (the bug of the post
``002``), heads interleaved instead of contiguous, no ``1/√D`` scale, ``1/√E`` instead, no output
projection, softmax over the queries — and names the one that matches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ._check import ExerciseError, check_close, passed

__all__ = [
    "SHAPE_EXERCISE",
    "check_merge_heads",
    "check_mha_shape_predictions",
    "check_multi_head_forward",
    "check_seed_mha_fix",
    "check_split_heads",
]


def _matches(actual: object, candidate: Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    """True if ``actual`` is a tensor numerically equal to ``candidate``."""
    if not isinstance(actual, Tensor) or actual.shape != candidate.shape:
        return False
    return bool(
        torch.allclose(actual.detach().to(candidate.dtype), candidate, atol=atol, rtol=rtol)
    )


def _call(fn: Callable[..., object], what: str, hint: str, *args: object) -> object:
    """Call the learner's code; turn a crash into an ``ExerciseError`` that quotes it."""
    try:
        return fn(*args)
    except Exception as err:  # the learner's bug, reported with a hint
        message = str(err).splitlines()[0] if str(err) else ""
        extra = hint
        if "view size is not compatible" in message:
            extra = (
                "view() needs memory laid out in the new order; after a transpose it is not. Use "
                ".reshape(...) (or .contiguous().view(...)) to merge the heads back."
            )
        raise ExerciseError(f"{what} raised {type(err).__name__}: {message}. {extra}") from err


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g)


# ----------------------------------------------------------------------------------------------
# The ways to split and merge heads: the right one and the usual wrong ones
# ----------------------------------------------------------------------------------------------


def _split(t: Tensor, H: int, how: str) -> Tensor:
    """(B, N, H·D) -> (B, H, N, D): ``ok`` by slicing, or a typical mistake."""
    B, N, W = t.shape
    D = W // H
    if how == "ok":
        return torch.stack(t.split(D, dim=-1), dim=1)  # head h = features h·D .. (h+1)·D - 1
    if how == "flat":
        return t.reshape(B, H, N, D)  # view without transpose (the post's view(B·H, -1, D))
    if how == "interleaved":
        return t.reshape(B, N, D, H).permute(0, 3, 1, 2)  # head h = features h, h+H, h+2H, ...
    raise ValueError(how)


def _merge(t: Tensor, how: str) -> Tensor:
    """(B, H, N, D) -> (B, N, H·D): ``ok`` by concatenation, or a typical mistake."""
    B, H, N, D = t.shape
    if how == "ok":
        return torch.cat(t.unbind(1), dim=-1)  # [head 0 | head 1 | ...]
    if how == "flat":
        return t.reshape(B, N, H * D)  # view without transpose (the post's view(B, -1, d_model))
    if how == "interleaved":
        return t.permute(0, 2, 3, 1).reshape(B, N, D * H)
    raise ValueError(how)


_HINT_SPLIT_FLAT = (
    "You reshaped (B, L, E) straight into (B, H, L, D) — a view without a transpose, the bug of the "
    "post's second implementation (view(B·H, -1, D)). A view only reinterprets memory, which holds x "
    "token by token, so your 'head 0' is made of chunks of the first tokens, not of features 0..D-1 "
    "of every token. Split the last dim first, x.view(B, L, H, D), then move the head dim in front "
    "of the tokens with .transpose(1, 2)."
)
_HINT_SPLIT_NO_TRANSPOSE = (
    "You split the features into (B, L, H, D) but did not move the heads in front of the tokens: "
    "add .transpose(1, 2) to get (B, H, L, D), so that every head sees all L tokens."
)
_HINT_SPLIT_SEED = (
    "That is the post's (B·H, L, D) layout, and it is more than a shape problem: viewing (B, L, E) "
    "as (B·H, -1, D) without a transpose puts chunks of the same tokens into one 'head'. Return "
    "(B, H, L, D) = x.view(B, L, H, D).transpose(1, 2)."
)
_HINT_INTERLEAVED = (
    "Your heads take every H-th feature (h, h+H, h+2H, ...). Head h must own the contiguous block "
    "of features h·D .. (h+1)·D - 1: that is how nn.MultiheadAttention, mha.MultiHeadAttention and "
    "every pretrained checkpoint lay out the rows of W_Q, W_K and W_V (and the columns of W_O). "
    "Use view(B, L, H, D), not view(B, L, D, H)."
)
_HINT_MERGE_FLAT = (
    "You reshaped (B, H, L, D) straight into (B, L, H·D) — a view without a transpose, the merge of "
    "the post's second implementation. Row i of the result must be [head 0 of token i | head 1 of "
    "token i | ...]; with a plain reshape it is a chunk of head 0's rows instead. Move the tokens "
    "back in front of the heads with .transpose(1, 2), then .reshape(B, L, H·D)."
)


def check_split_heads(split_heads: Callable[[Tensor, int], Tensor]) -> None:
    """Check ``split_heads(x, num_heads)``: ``(B, L, E) -> (B, H, L, D)`` with ``D = E // H``.

    Head ``h`` must hold features ``h·D .. (h+1)·D - 1`` of every token, the layout of
    ``nn.MultiheadAttention``. The reference is written with slicing (``x.split(D, -1)``), not with
    ``view``, so it cannot share a layout mistake with the answer.
    """
    g = torch.Generator().manual_seed(30)
    cases = [(_randn(g, 2, 5, 12), 3), (_randn(g, 1, 4, 8), 2), (_randn(g, 3, 6, 12), 4)]
    for x, H in cases:
        B, L, E = x.shape
        D = E // H
        what = f"split_heads(x, {H}) with x of shape {tuple(x.shape)}"
        out = _call(
            split_heads,
            what,
            "x.view(B, L, H, D).transpose(1, 2) works for any B and L.",
            x.clone(),
            H,
        )
        ref = _split(x, H, "ok")  # (B, H, L, D)
        if isinstance(out, Tensor) and out.shape != ref.shape:
            if out.shape == (B * H, L, D):
                raise ExerciseError(f"{what} has shape {tuple(out.shape)}. {_HINT_SPLIT_SEED}")
            if out.shape == (B, L, H, D):
                raise ExerciseError(
                    f"{what} has shape {tuple(out.shape)}. {_HINT_SPLIT_NO_TRANSPOSE}"
                )
        if _matches(out, _split(x, H, "flat")):
            hint = _HINT_SPLIT_FLAT
        elif _matches(out, _split(x, H, "interleaved")):
            hint = _HINT_INTERLEAVED
        else:
            hint = "Head h of token i must be x[b, i, h·D:(h+1)·D]."
        check_close(out, ref, what=what, hint=hint, atol=0.0, rtol=0.0)
    passed("check_split_heads", "head h holds features h·D..(h+1)·D-1 of every token")


def check_merge_heads(merge_heads: Callable[[Tensor], Tensor]) -> None:
    """Check ``merge_heads(x)``: ``(B, H, L, D) -> (B, L, H·D)``, the concatenation of the heads.

    Row ``i`` of the result must be ``[head 0 of token i | head 1 of token i | ...]``, as in
    ``Concat(head_1, ..., head_h)``; the reference is ``torch.cat`` over the heads.
    """
    g = torch.Generator().manual_seed(31)
    cases = [_randn(g, 2, 3, 5, 4), _randn(g, 1, 2, 4, 3), _randn(g, 3, 4, 6, 2)]
    for x in cases:
        B, H, L, D = x.shape
        what = f"merge_heads(x) with x of shape {tuple(x.shape)}"
        out = _call(
            merge_heads,
            what,
            "x.transpose(1, 2).reshape(B, L, H·D) works for any B, H, L, D.",
            x.clone(),
        )
        ref = _merge(x, "ok")  # (B, L, H·D)
        if isinstance(out, Tensor) and out.shape == (B, H * L, D):
            raise ExerciseError(
                f"{what} has shape {tuple(out.shape)}: you stacked the heads along the tokens. "
                "Concatenate them along the features, (B, L, H·D)."
            )
        if _matches(out, _merge(x, "flat")):
            hint = _HINT_MERGE_FLAT
        elif _matches(out, _merge(x, "interleaved")):
            hint = (
                "You interleaved the heads feature by feature. Concatenate whole heads: "
                "[head 0 (D values) | head 1 (D values) | ...], i.e. transpose(1, 2) then reshape."
            )
        else:
            hint = "Row i of the result must be torch.cat([x[b, 0, i], x[b, 1, i], ...])."
        check_close(out, ref, what=what, hint=hint, atol=0.0, rtol=0.0)
    passed("check_merge_heads", "heads concatenated in order along the features")


# ----------------------------------------------------------------------------------------------
# The forward pass of multi-head attention
# ----------------------------------------------------------------------------------------------


def _torch_mha(E: int, H: int, kdim: int, vdim: int, g: torch.Generator) -> nn.MultiheadAttention:
    """A ``nn.MultiheadAttention`` with weights drawn from ``g`` (the global RNG is left alone)."""
    with torch.random.fork_rng(devices=[]):
        ref = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(_randn(g, *p.shape) * 0.5)
    return ref.eval()


def _projections_of(
    ref: nn.MultiheadAttention,
) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """The four projections of ``ref`` as ``nn.Linear`` modules (weights copied)."""
    E = ref.embed_dim
    if ref._qkv_same_embed_dim:
        ws = ref.in_proj_weight.split(E)  # 3 × (E, E)
    else:
        ws = (ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight)
    bs = ref.in_proj_bias.split(E)
    with torch.random.fork_rng(devices=[]):
        projs = [nn.Linear(w.shape[1], w.shape[0]) for w in ws] + [nn.Linear(E, E)]
    with torch.no_grad():
        for lin, w, b in zip(projs, ws, bs):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        projs[3].weight.copy_(ref.out_proj.weight)
        projs[3].bias.copy_(ref.out_proj.bias)
    return projs[0], projs[1], projs[2], projs[3]


@torch.no_grad()
def _mha_variant(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    projs: tuple[nn.Module, nn.Module, nn.Module, nn.Module],
    H: int,
    *,
    split: str = "ok",
    merge: str = "ok",
    scale: str = "head",
    softmax_dim: int = -1,
    out_proj: bool = True,
) -> Tensor:
    """Multi-head attention, correct with the defaults, or with one of the usual mistakes."""
    q_proj, k_proj, v_proj, o_proj = projs
    E = query.shape[-1]
    D = E // H
    q = _split(q_proj(query), H, split)  # (B, H, L, D)
    k = _split(k_proj(key), H, split)  # (B, H, S, D)
    v = _split(v_proj(value), H, split)  # (B, H, S, D)
    factor = {"head": 1 / math.sqrt(D), "none": 1.0, "model": 1 / math.sqrt(E)}[scale]
    weights = torch.softmax(q @ k.transpose(-2, -1) * factor, dim=softmax_dim)  # (B, H, L, S)
    out = _merge(weights @ v, merge)  # (B, L, E)
    return o_proj(out) if out_proj else out


_FORWARD_MISTAKES: list[tuple[dict[str, object], str]] = [
    (
        {"split": "flat", "merge": "flat"},
        "You split and merge the heads with a view and no transpose, as the post's second "
        "implementation does. " + _HINT_SPLIT_FLAT,
    ),
    ({"split": "flat"}, _HINT_SPLIT_FLAT),
    ({"merge": "flat"}, "The split is right, the merge is not. " + _HINT_MERGE_FLAT),
    ({"split": "interleaved", "merge": "interleaved"}, _HINT_INTERLEAVED),
    (
        {"scale": "none"},
        (
            "The scores are not scaled. Multiply q @ kᵀ by 1/√D, with D = E // num_heads the head "
            "dim, before the softmax."
        ),
    ),
    (
        {"scale": "model"},
        (
            "You scaled by 1/√E, the model width. Each head is an attention of dimension D = E // "
            "num_heads, so its scores are scaled by 1/√D."
        ),
    ),
    (
        {"out_proj": False},
        (
            "You returned Concat(head_1, ..., head_h) without the output projection W_O. Apply "
            "out_proj to the merged heads: it is what mixes the heads' results."
        ),
    ),
    (
        {"softmax_dim": -2},
        (
            "The softmax runs over the keys (dim=-1, the S axis), so that every query's weights sum "
            "to 1; you normalised over the queries (dim=-2)."
        ),
    ),
]


def _forward_hint(
    out: object, query: Tensor, key: Tensor, value: Tensor, projs: tuple, H: int
) -> str:
    for kwargs, hint in _FORWARD_MISTAKES:
        if _matches(out, _mha_variant(query, key, value, projs, H, **kwargs), atol=1e-4):
            return hint
    return (
        "Check each step against the chapter: project, split (view(B, N, H, D).transpose(1, 2)), "
        "softmax(q @ kᵀ / √D) over the keys, weights @ v, merge (transpose(1, 2).reshape(B, L, E)), "
        "out_proj."
    )


def _shape_hint(out: Tensor, B: int, H: int, L: int, E: int) -> str:
    D = E // H
    shape = tuple(out.shape)
    if shape == (B * H, L, D) or shape == (B, H, L, D):
        return "These are still the per-head outputs: merge the heads back to (B, L, E) and apply out_proj."
    if shape[:2] == (B, H) and len(shape) == 4:
        return "These look like attention weights (B, H, L, S); multiply them by the values."
    return f"The output has one row of width E = {E} per query: (B, L, E) = {(B, L, E)}."


def check_multi_head_forward(
    multi_head_forward: Callable[..., Tensor],
) -> None:
    """Check ``multi_head_forward(query, key, value, q_proj, k_proj, v_proj, out_proj, num_heads)``.

    The projections are ``nn.Linear`` modules holding the weights of a ``torch.nn.MultiheadAttention``;
    the answer must return that module's output ``(B, L, E)``. Tested on self-attention and on
    cross-attention with ``L ≠ S`` and key/value widths ``kdim ≠ vdim ≠ E``.
    """
    g = torch.Generator().manual_seed(32)
    cases = []
    # self-attention: B=2, L=S=5, E=12, H=3
    ref = _torch_mha(12, 3, 12, 12, g)
    x = _randn(g, 2, 5, 12)
    cases.append(("self-attention, x (2, 5, 12), num_heads=3", ref, x, x, x))
    # cross-attention: L=4, S=7, E=12, H=4, kdim=7, vdim=5
    ref = _torch_mha(12, 4, 7, 5, g)
    cases.append(
        (
            "cross-attention, query (2, 4, 12), key (2, 7, 7), value (2, 7, 5), num_heads=4",
            ref,
            _randn(g, 2, 4, 12),
            _randn(g, 2, 7, 7),
            _randn(g, 2, 7, 5),
        )
    )
    for label, ref, query, key, value in cases:
        H = ref.num_heads
        B, L, E = query.shape
        projs = _projections_of(ref)
        what = f"multi_head_forward on {label}"
        with torch.no_grad():
            expected, _ = ref(query, key, value, need_weights=False)  # (B, L, E)
            out = _call(
                multi_head_forward,
                what,
                "Name the shapes at every step: (B, L, E) -> (B, H, L, D) -> (B, H, L, S) -> "
                "(B, H, L, D) -> (B, L, E).",
                query.clone(),
                key.clone(),
                value.clone(),
                *projs,
                H,
            )
        if isinstance(out, tuple):
            raise ExerciseError(
                f"{what} returned a tuple; return only the output tensor (B, L, E)."
            )
        if isinstance(out, Tensor) and out.shape != expected.shape:
            raise ExerciseError(
                f"{what} has shape {tuple(out.shape)}, expected {tuple(expected.shape)}. "
                + _shape_hint(out, B, H, L, E)
            )
        hint = _forward_hint(out, query, key, value, projs, H)
        check_close(out, expected, what=what, hint=hint, atol=1e-4, rtol=1e-4)
    passed(
        "check_multi_head_forward", "matches torch.nn.MultiheadAttention, self- and cross-attention"
    )


# ----------------------------------------------------------------------------------------------
# Spot the bug: the post's second implementation
# ----------------------------------------------------------------------------------------------


def check_seed_mha_fix(cls: type) -> None:
    """Check a repaired version of the post's class ``MultiHeadAttention(d_model, num_heads)``.

    The class must keep the post's interface: linear layers ``query_fc``, ``key_fc``, ``value_fc``
    and ``fc`` of shape ``(d_model, d_model)`` and ``forward(query, key, value) -> output``. The
    checker loads the weights of a ``torch.nn.MultiheadAttention`` into it and compares the outputs,
    for self-attention and for cross-attention with a key sequence of another length.
    """
    g = torch.Generator().manual_seed(33)
    E, H = 12, 3
    with torch.random.fork_rng(devices=[]):
        try:
            model = cls(E, H)
        except Exception as err:
            raise ExerciseError(
                f"{getattr(cls, '__name__', cls)}(12, 3) raised {type(err).__name__}: {err}. "
                "Keep the constructor of the post: (d_model, num_heads)."
            ) from err
    layers = {}
    for name in ("query_fc", "key_fc", "value_fc", "fc"):
        layer = getattr(model, name, None)
        if (
            not isinstance(layer, nn.Linear)
            or tuple(layer.weight.shape) != (E, E)
            or layer.bias is None
        ):
            raise ExerciseError(
                f"The module needs the post's layer {name} = nn.Linear(d_model, d_model) (with bias); "
                "fix the bug in forward and keep the layers as they are."
            )
        layers[name] = layer
    ref = _torch_mha(E, H, E, E, g)
    projs = _projections_of(ref)
    with torch.no_grad():
        for name, src in zip(layers, projs):
            layers[name].weight.copy_(src.weight)
            layers[name].bias.copy_(src.bias)
    model.eval()
    x = _randn(g, 2, 5, E)
    cases = [
        ("self-attention, x of shape (2, 5, 12)", x, x, x),
        (
            "cross-attention, query (2, 4, 12), key and value (2, 7, 12)",
            _randn(g, 2, 4, E),
            *([_randn(g, 2, 7, E)] * 2),
        ),
    ]
    for label, query, key, value in cases:
        what = f"the repaired module on {label}"
        with torch.no_grad():
            expected, _ = ref(query, key, value, need_weights=False)  # (B, L, E)
            out = _call(
                model,
                what,
                "Split with view(B, N, H, D).transpose(1, 2), merge with transpose(1, 2).reshape.",
                query.clone(),
                key.clone(),
                value.clone(),
            )
        if isinstance(out, tuple):
            raise ExerciseError(
                f"{what} returned a tuple; return only the output, as the post does."
            )
        if isinstance(out, Tensor) and out.shape != expected.shape:
            raise ExerciseError(
                f"{what} has shape {tuple(out.shape)}, expected {tuple(expected.shape)}. "
                + _shape_hint(out, query.shape[0], H, query.shape[1], E)
            )
        hint = _forward_hint(out, query, key, value, projs, H)
        check_close(out, expected, what=what, hint=hint, atol=1e-4, rtol=1e-4)
    passed("check_seed_mha_fix", "the post's class now matches torch.nn.MultiheadAttention")


# ----------------------------------------------------------------------------------------------
# Predict the shapes, then run
# ----------------------------------------------------------------------------------------------

#: The module and inputs of the "predict the shapes" exercise.
SHAPE_EXERCISE: dict[str, object] = {
    "module": {"embed_dim": 12, "num_heads": 4, "kdim": 5, "vdim": 7, "num_kv_heads": 2},
    "query": (2, 3, 12),
    "key": (2, 9, 5),
    "value": (2, 9, 7),
}

_SHAPE_KEYS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "out_proj.weight",
    "weights",
    "out",
    "num_parameters",
)


def _actual_shapes() -> dict[str, object]:
    import mha  # imported here: the package imports this module while it initialises

    spec = SHAPE_EXERCISE
    with torch.random.fork_rng(devices=[]):
        module = mha.MultiHeadAttention(**spec["module"])
    query, key, value = (torch.zeros(*spec[n]) for n in ("query", "key", "value"))
    with torch.no_grad():
        out, weights = module(query, key, value, need_weights=True)
    actual: dict[str, object] = {
        name: tuple(p.shape) for name, p in module.named_parameters() if name.endswith("weight")
    }
    actual["weights"] = tuple(weights.shape)
    actual["out"] = tuple(out.shape)
    actual["num_parameters"] = sum(p.numel() for p in module.parameters())
    return actual


def _shape_entry_hint(name: str, predicted: object, actual: object) -> str:
    if (
        name.endswith("weight")
        and isinstance(predicted, tuple)
        and predicted == tuple(reversed(actual))
    ):
        return "nn.Linear stores its weight as (out_features, in_features)."
    if name in ("k_proj.weight", "v_proj.weight"):
        return (
            "k_proj and v_proj read kdim / vdim features and produce num_kv_heads·D features "
            "(D = embed_dim // num_heads): with fewer key/value heads they are smaller than q_proj."
        )
    if name in ("q_proj.weight", "out_proj.weight"):
        return "q_proj maps E to E (H heads of D), and out_proj maps the concatenated heads (E) back to E."
    if name == "weights":
        return (
            "one (L, S) matrix per *query* head: the key/value heads are shared (repeated), the "
            "weights are not. Rows are queries (L), columns keys (S)."
        )
    if name == "out":
        return "one row of width E per query: (B, L, E), whatever kdim, vdim or S are."
    return "count weights and biases of the four projections: out_features·(in_features + 1) each."


def check_mha_shape_predictions(predictions: dict[str, object]) -> None:
    """Check predicted shapes for ``mha.MultiHeadAttention(12, 4, kdim=5, vdim=7, num_kv_heads=2)``.

    ``predictions`` maps each of ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``,
    ``out_proj.weight``, ``weights`` (``need_weights=True``), ``out`` to a shape tuple, and
    ``num_parameters`` to an int, for query ``(2, 3, 12)``, key ``(2, 9, 5)``, value ``(2, 9, 7)``.
    The checker builds that module, runs it, and compares.
    """
    if not isinstance(predictions, dict):
        raise ExerciseError(f"predictions should be a dict, got {type(predictions).__name__}.")
    missing = [k for k in _SHAPE_KEYS if k not in predictions]
    if missing:
        raise ExerciseError(f"predictions is missing {', '.join(missing)}.")
    actual = _actual_shapes()
    problems = []
    for name in _SHAPE_KEYS:
        value = predictions[name]
        if value is ... or (isinstance(value, (tuple, list)) and ... in value):
            raise ExerciseError(f"Replace the ... in predictions[{name!r}] by your prediction.")
        if name == "num_parameters":
            ok_type = isinstance(value, int) and not isinstance(value, bool)
            predicted: object = value
        else:
            ok_type = isinstance(value, (tuple, list, torch.Size)) and all(
                isinstance(n, int) and not isinstance(n, bool) for n in value
            )
            predicted = tuple(value) if ok_type else value
        if not ok_type:
            kind = "an int" if name == "num_parameters" else "a tuple of ints"
            raise ExerciseError(f"predictions[{name!r}] should be {kind}, got {value!r}.")
        if predicted != actual[name]:
            problems.append(
                f"{name}: you predicted {predicted}, the module has {actual[name]}. Hint: "
                + _shape_entry_hint(name, predicted, actual[name])
            )
    if problems:
        raise ExerciseError(
            f"{len(problems)} of {len(_SHAPE_KEYS)} predictions are off.\n" + "\n".join(problems)
        )
    passed(
        "check_mha_shape_predictions",
        f"all {len(_SHAPE_KEYS)} predictions match the running module",
    )
