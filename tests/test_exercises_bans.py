"""Banned functions are caught by identity, however the learner reached them.

An exercise that is to write what the library has (softmax, attention, the backward pass, RoPE,
the merge of partials ...) bans the library's version. The checker follows every call the answer
makes (``mha.exercises._harness.watch``): a Python function by its code object, a torch function
by a ``TorchFunctionMode``. So a ban holds for an alias imported before the check (at the top of
this module, as a notebook would have it), an import inside the answer, a helper in another module,
``functools.partial``, a method, and an answer that catches the error; and the check leaves the
library, the profiler and torch's function modes as they were.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import math
import operator
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch import softmax as softmax_alias  # imported before the check, under an alias
from torch.autograd import grad as autograd_grad  # likewise
from torch.nn.functional import scaled_dot_product_attention as sdpa_alias  # likewise

import mha
import mha.exercises
from mha import apply_rope, decoding, flash, kv_memory, merge_partials, rope  # likewise
from mha.exercises import EXERCISES, ExerciseError, _flash_forward, _tiled_backward, ch07
from mha.exercises._harness import defined_in, watch
from mha.gated_delta import gated_delta_rule as gated_delta_alias  # likewise
from mha.kv_memory import kv_cache_bytes as cache_bytes_alias  # likewise
from mha.masks import padding_mask as library_padding_mask


def _attention_backward_by(grads):
    """An attention backward whose gradients come from ``grads(out, (q, k, v), d_out)``."""

    def attention_backward(q, k, v, d_out):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), -1) @ v
        return grads(out, (q, k, v), d_out)

    return attention_backward


def _grad_imported_inside(out, inputs, d_out):
    from torch.autograd import grad as g  # imported during the check

    return g(out, inputs, d_out)


def _by_backward(out, inputs, d_out):
    out.backward(d_out)
    return tuple(t.grad for t in inputs)


def _by_torch_autograd_backward(out, inputs, d_out):
    torch.autograd.backward(out, d_out)
    return tuple(t.grad for t in inputs)


def _caught(out, inputs, d_out):
    """Tries autograd, swallows the error, then answers by the formulas: still rejected."""
    try:
        return autograd_grad(out, inputs, d_out)
    except Exception:  # noqa: BLE001 - what a learner might write
        q, k, v = (t.detach() for t in inputs)
        return ch07._backward(q, k, v, d_out)


def _sink_backward_by(grads):
    """A sink attention backward whose gradients come from ``grads(out, inputs, d_out)``."""

    def sink_attention_backward(q, k, v, sink, d_out):
        q, k, v, sink = (t.clone().requires_grad_() for t in (q, k, v, sink))
        return grads(ch07._sink_forward(q, k, v, sink), (q, k, v, sink), d_out)

    return sink_attention_backward


def _sink_backward_by_softmax_kernel(q, k, v, sink, d_out):
    """The widened softmax's backward by torch's own kernel, the rest by the formulas."""
    B, H, L, D = q.shape
    scores = q @ k.mT / math.sqrt(D)  # (B, H, L, S)
    p = torch.cat([scores, sink.view(1, -1, 1, 1).expand(B, H, L, 1)], -1).softmax(-1)
    dp = torch.cat([d_out @ v.mT, d_out.new_zeros(B, H, L, 1)], -1)  # (B, H, L, S + 1)
    ds = torch._softmax_backward_data(dp, p, -1, p.dtype)  # (B, H, L, S + 1)
    dq, dk = ds[..., :-1] @ k / math.sqrt(D), ds[..., :-1].mT @ q / math.sqrt(D)
    return dq, dk, p[..., :-1].mT @ d_out, ds[..., -1].sum((0, 2))


def gated_delta_step_by_library(state, k, v, g, beta):
    """One gated delta step through the banned function: the token as a sequence of length 1."""
    out = gated_delta_alias(
        *(t.reshape(1, -1, 1, t.shape[-1]) for t in (k, k, v)),  # (1, N, 1, D)
        g.reshape(1, -1, 1),
        beta.reshape(1, -1, 1),
        chunk_size=None,
        initial_state=state.reshape(1, -1, *state.shape[-2:]),  # (1, N, Dk, Dv)
        output_final_state=True,
    )
    return out[1].reshape(state.shape)


SOFTMAX_EVASIONS = {
    "torch.softmax as an alias": lambda x, dim=-1: softmax_alias(x, dim),
    "functools.partial": lambda x, dim=-1: functools.partial(torch.softmax, dim=dim)(x),
    "operator.methodcaller": lambda x, dim=-1: operator.methodcaller("softmax", dim)(x),
    "the C function fetched afresh": lambda x, dim=-1: torch._C._VariableFunctions.softmax(x, dim),
    "Tensor.softmax(x)": lambda x, dim=-1: torch.Tensor.softmax(x, dim),
    "getattr by name": lambda x, dim=-1: getattr(torch, "soft" + "max")(x, dim),
    "nn.Softmax": lambda x, dim=-1: nn.Softmax(dim)(x),
    "torch.special.softmax": lambda x, dim=-1: torch.special.softmax(x, dim),
    "log_softmax().exp()": lambda x, dim=-1: x.log_softmax(dim).exp(),
    "mha.softmax": lambda x, dim=-1: mha.softmax(x, dim),
    "mha.attention.softmax": lambda x, dim=-1: sys.modules["mha.attention"].softmax(x, dim),
}


def _writer_layer_by_private_helper() -> type:
    """Section 4.4's layer that reaches mha's private attention helper by an import of its own."""
    from mha.exercises._writer import Reference

    class Layer(Reference):
        def forward(self, x, real=None, cache=None):
            from mha.attention import _attention as helper  # imported during the check

            B, L, E = x.shape
            q, k, v = (
                p(x).view(B, L, self.num_heads, -1).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            out = helper(q, k, v, None, 0.0, True, self.head_dim**-0.5)
            return self.out_proj(out.transpose(1, 2).reshape(B, L, E))

    return Layer


def _causal_linear_by_private_phi(q, k, v):
    """Causal linear attention by prefix sums, φ taken from mha.linear_attention's _phi."""
    from mha.linear_attention import _phi  # imported during the check

    fq, fk = _phi(q), _phi(k)  # (..., L, D)
    kv = (fk[..., :, None] * v[..., None, :]).cumsum(-3)  # (..., L, D, Dv)
    return (fq[..., :, None] * kv).sum(-2) / (fq * fk.cumsum(-2)).sum(-1, keepdim=True)


def _block_with_its_own_norms(block, x, is_causal=False):
    """The pre-norm forward, right, but through the block's nn.LayerNorm modules."""
    x = x + block.attn(block.norm1(x), is_causal=is_causal)[0]
    return x + block.mlp(block.norm2(x))


def _visible_tiles_by_private_schedule(L, S, block_size, window):
    """One block of query rows at a time, its (rows, S) mask through mha.flash._tile_schedule."""
    from mha.flash import _tile_schedule  # imported during the check

    grid = torch.zeros(-(-L // block_size), -(-S // block_size), dtype=torch.bool)
    for r in range(grid.shape[0]):
        i = torch.arange(r * block_size, min(r * block_size + block_size, L)) + (S - L)
        behind = i[:, None] - torch.arange(S)[None, :]  # (rows of the block, S)
        keep = (behind >= 0) & (behind < window)
        for tile in _tile_schedule(len(i), S, block_size, False, keep):
            grid[r, tile.k0 // block_size] = True
    return grid


EVASIONS = [
    ("check_softmax", name, answer, "without calling torch.softmax")
    for name, answer in SOFTMAX_EVASIONS.items()
] + [
    (
        "check_model_that_writes",
        "mha.attention's private _attention, imported inside the layer's forward",
        _writer_layer_by_private_helper(),
        "write the attention yourself",
    ),
    (
        "check_sdpa",
        "F.sdpa imported under an alias",
        lambda q, k, v: sdpa_alias(q, k, v),
        "without calling a ready-made",
    ),
    (
        "check_sdpa",
        "a helper in another module (mha.flash_attention)",
        lambda q, k, v: flash.flash_attention(q, k, v, block_size=2),
        "without calling a ready-made",
    ),
    (
        "check_multi_head_forward",
        "torch's layer, built inside",
        lambda query, key, value, *projs: nn.MultiheadAttention(
            query.shape[-1], projs[-1], batch_first=True, kdim=key.shape[-1], vdim=value.shape[-1]
        )(projs[0](query), projs[1](key), projs[2](value))[0],
        "without nn.MultiheadAttention",
    ),
    (
        "check_padding_mask",
        "mha.masks.padding_mask imported under an alias",
        lambda lengths, S: library_padding_mask(lengths, S),
        "without mha.padding_mask",
    ),
    (
        "check_online_softmax_update",
        "mha.flash.online_softmax_update",
        lambda *args: flash.online_softmax_update(*args),
        "without mha.online_softmax_update",
    ),
    (
        "check_flash_forward",
        "mha.flash.tile_schedule, imported before the check, for the tiles of a correct loop",
        lambda q, k, v, **kw: (
            flash.tile_schedule(q.shape[-2], k.shape[-2], block_size=kw["block_k"]),
            *_flash_forward._flash_by_key_tiles(q, k, v, **kw),
        )[1:],
        "write the tile loop yourself",
    ),
    (
        "check_flash_forward",
        "Tensor.softmax on one tile, the rest of a correct loop around it",
        lambda q, k, v, **kw: (
            q[..., :4, :].softmax(-1),
            *_flash_forward._flash_per_head(q, k, v, **kw),
        )[1:],
        "write the tile loop yourself",
    ),
    (
        "check_sink_backward",
        "torch.autograd.grad imported under an alias before the check",
        _sink_backward_by(autograd_grad),
        "without autograd",
    ),
    (
        "check_sink_backward",
        "torch.func.vjp",
        lambda q, k, v, sink, d_out: torch.func.vjp(ch07._sink_forward, q, k, v, sink)[1](d_out),
        "without autograd",
    ),
    (
        "check_sink_backward",
        "torch's softmax backward kernel",
        _sink_backward_by_softmax_kernel,
        "without autograd",
    ),
    (
        "check_backward_fix",
        "torch.autograd.grad imported under an alias before the check",
        _attention_backward_by(autograd_grad),
        "without autograd",
    ),
    (
        "check_backward_fix",
        "torch.autograd.grad imported inside the answer",
        _attention_backward_by(_grad_imported_inside),
        "without autograd",
    ),
    ("check_backward_fix", ".backward()", _attention_backward_by(_by_backward), "autograd"),
    (
        "check_backward_fix",
        "torch.autograd.backward",
        _attention_backward_by(_by_torch_autograd_backward),
        "without autograd",
    ),
    (
        "check_backward_fix",
        "the error caught and the formulas used instead",
        _attention_backward_by(_caught),
        "without autograd",
    ),
    (
        "check_backward_fix",
        "mha.flash.flash_attention_backward",
        ch07._by_flash_backward,
        "flash_attention_backward",
    ),
    (
        "check_flash_backward",
        "mha.flash.flash_attention_backward, imported before the check",
        lambda q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16: (
            flash.flash_attention_backward(
                dout, q, k, v, out, lse, None, is_causal, scale=q.shape[-1] ** -0.5, block_size=8
            )
        ),
        "write the tiled backward yourself",
    ),
    (
        "check_flash_backward",
        "a private helper of mha.flash (_tile_scores) inside a loop of its own",
        lambda q, k, v, *rest, **kw: (
            flash._tile_scores(q, k, flash.Tile(0, 1, 0, 1), None, None),
            _tiled_backward._tiled_backward(q, k, v, *rest, **kw),
        )[1],
        "write the tiled backward yourself",
    ),
    (
        "check_flash_backward",
        "torch's CPU flash attention backward kernel",
        lambda q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16: (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, is_causal
            )[:3]
        ),
        "write the tiled backward yourself",
    ),
    (
        "check_flash_backward",
        "the Triton backward's launcher, mha.triton_flash._backward",
        lambda q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16: (
            ch07.triton_flash._backward(
                dout, q, k, v, out, lse, is_causal, q.shape[-1] ** -0.5, 16, 16, False
            )
        ),
        "write the tiled backward yourself",
    ),
    (
        "check_flash_backward",
        "torch.func.vjp",
        lambda q, k, v, out, lse, dout, *, is_causal=False, block_q=16, block_k=16: torch.func.vjp(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), q, k, v
        )[1](dout),
        "write the tiled backward yourself",
    ),
    (
        "check_rope",
        "from mha import apply_rope, before the check",
        lambda x, positions: apply_rope(x, positions),
        "without mha.apply_rope",
    ),
    ("check_rope", "mha.apply_rope passed itself", apply_rope, "without mha.apply_rope"),
    (
        "check_partial_rope",
        "mha.apply_rope with rotary_dim, imported before the check",
        lambda x, positions, R: apply_rope(x, positions, rotary_dim=R),
        "without mha.apply_rope",
    ),
    (
        "check_yarn_frequencies",
        "mha.rope.yarn_frequencies with its tuple unpacked",
        lambda D, base, factor, L0: rope.yarn_frequencies(
            D, base=base, factor=factor, original_max_position_embeddings=L0, truncate=False
        )[0],
        "without mha.yarn_frequencies",
    ),
    (
        "check_rope",
        "mha.rope.apply_rope",
        lambda x, positions: rope.apply_rope(x, positions),
        "without mha.apply_rope",
    ),
    (
        "check_merge_partials",
        "from mha import merge_partials, before the check",
        lambda out1, lse1, out2, lse2: merge_partials(
            torch.stack([out1, out2]), torch.stack([lse1, lse2])
        )[0],
        "without mha.merge_partials",
    ),
    (
        "check_merge_partials",
        "mha.decoding.merge_partials imported inside",
        lambda out1, lse1, out2, lse2: __import__("mha.decoding").decoding.merge_partials(
            torch.stack([out1, out2]), torch.stack([lse1, lse2])
        )[0],
        "without mha.merge_partials",
    ),
    (
        "check_ring_simulation",
        "an SDPA alias for the whole sequence, before the check",
        lambda q, k, v, world: sdpa_alias(q, k, v, is_causal=True),
        "write each block's attention and the merge yourself",
    ),
    (
        "check_ring_simulation",
        "from mha import merge_partials, over the ranks' blocks",
        lambda q, k, v, world: merge_partials(
            torch.stack([sdpa_alias(q, k, v, is_causal=True)]),
            torch.zeros(1, *q.shape[:-1], dtype=q.dtype),
        )[0],
        "write each block's attention and the merge yourself",
    ),
    (
        "check_cache_bytes",
        "from mha.kv_memory import kv_cache_bytes, before the check",
        lambda config, seq_len, nbytes: cache_bytes_alias(
            config, seq_len, bytes_per_element=nbytes
        ),
        "without mha.kv_cache_bytes",
    ),
    (
        "check_cache_bytes",
        "functools.partial of mha.kv_memory.kv_cache_bytes",
        lambda config, seq_len, nbytes: functools.partial(kv_memory.kv_cache_bytes, config)(
            seq_len, bytes_per_element=nbytes
        ),
        "without mha.kv_cache_bytes",
    ),
    (
        "check_cache_bytes",
        "the config's elements_per_token_per_layer, read by operator.attrgetter",
        lambda config, seq_len, nbytes: (
            operator.attrgetter("elements_per_token_per_layer")(config)
            * seq_len
            * config.num_layers
            * nbytes
        ),
        "elements_per_token_per_layer",
    ),
    (
        "check_cache_bytes",
        "the config's uses_window, inside a generator",
        lambda config, seq_len, nbytes: (
            nbytes
            * sum(
                (
                    min(seq_len, config.sliding_window or seq_len)
                    if config.uses_window(i)
                    else seq_len
                )
                * (config.kv_lora_rank or 2 * config.num_kv_heads * config.head_dim)
                for i in range(config.num_layers)
            )
        ),
        "uses_window",
    ),
    (
        "check_topk_keep",
        "mha.sparse.topk_keep_mask through functools.partial",
        lambda scores, topk: functools.partial(sys.modules["mha.sparse"].topk_keep_mask, topk=topk)(
            scores
        ),
        "without mha.topk_keep_mask",
    ),
    (
        "check_bottom_right_causal",
        "functools.partial of mha.masks.causal_mask_bottom_right",
        lambda L, S: functools.partial(__import__("mha.masks").masks.causal_mask_bottom_right)(
            L, S
        ),
        "without mha.causal_mask_bottom_right",
    ),
    (
        "check_packed_causal",
        "mha.varlen.varlen_attention imported inside",
        lambda q, k, v, cu: __import__("mha.varlen").varlen.varlen_attention(
            q, k, v, cu, cu, is_causal=True
        ),
        "without mha.varlen_attention",
    ),
    (
        "check_quantize_per_token",
        "functools.partial of mha.kv_quant.quantize_kv",
        lambda x: tuple(functools.partial(__import__("mha.kv_quant").kv_quant.quantize_kv)(x)),
        "without mha.quantize_kv",
    ),
    (
        "check_quantize_per_channel",
        "mha.quantize_kv with granularity='channel', caught inside",
        lambda x: tuple(mha.quantize_kv(x, granularity="channel")),
        "without mha.quantize_kv",
    ),
    (
        "check_delta_step",
        "mha.gated_delta_rule imported under an alias, one token as a sequence",
        lambda state, k, v, g, beta: gated_delta_step_by_library(state, k, v, g, beta),
        "without mha.gated_delta_rule",
    ),
    (
        "check_causal_linear_attention",
        "mha.linear_attention's private _phi, imported inside",
        _causal_linear_by_private_phi,
        "no function of mha.linear_attention",
    ),
    (
        "check_pre_norm_block",
        "the block's own nn.LayerNorm modules, block.norm1(x)",
        _block_with_its_own_norms,
        "do not call the block",
    ),
    (
        "check_visible_tiles",
        "mha.flash's private _tile_schedule, imported inside, one block of rows at a time",
        _visible_tiles_by_private_schedule,
        "no function of mha.flash",
    ),
]


def _library() -> tuple:
    """What the checks must leave as it is."""
    return (
        torch.softmax,
        torch.Tensor.softmax,
        F.softmax,
        F.scaled_dot_product_attention,
        torch.autograd.grad,
        torch.autograd.backward,
        torch.Tensor.backward,
        mha.apply_rope,
        rope.apply_rope,
        mha.merge_partials,
        decoding.merge_partials,
        mha.kv_cache_bytes,
        kv_memory.AttentionConfig.uses_window,
        mha.gated_delta_rule,
        sys.modules["mha.gated_delta"].gated_delta_rule,
        flash.flash_attention_backward,
        mha.padding_mask,
        mha.MultiHeadAttention.forward,
    )


@pytest.mark.parametrize(
    ("name", "how", "answer", "hint"),
    EVASIONS,
    ids=lambda v: v if isinstance(v, str) and v.startswith("check_") else None,
)
def test_a_banned_function_is_caught_however_it_was_reached(name, how, answer, hint):
    library = _library()
    with pytest.raises(ExerciseError, match=hint):
        getattr(mha.exercises, name)(answer)
    assert _library() == library
    assert sys.getprofile() is None
    assert torch._C._len_torch_function_stack() == 0


def test_every_evasion_is_tried_on_a_checker_that_bans():
    """The evasions prove how a ban is enforced; each exercise's own declaration (the library's
    function and a private helper as mistakes, below) proves what it bans."""
    banned = {ex.name for ex in EXERCISES if ex.forbidden}
    tried = {name for name, *_ in EVASIONS}
    assert tried <= banned
    assert len(tried) >= 10


# --- what every exercise bans, generated from the declarations -------------------------------

FUNCTION_EXERCISES = [ex for ex in EXERCISES if not ex.prediction]


def _library_modules(ex) -> list:
    """The modules of mha whose functions ``ex`` has the learner re-write."""
    names = {inspect.unwrap(f).__module__ for f in ex.rewrites or ()}
    return [sys.modules[n] for n in sorted(names) if n.startswith("mha.")]


def _is_private(function) -> bool:
    name = function.__name__
    return name.startswith("_") and not name.endswith("__")


@pytest.mark.parametrize("ex", FUNCTION_EXERCISES, ids=lambda ex: ex.name)
def test_every_exercise_says_which_library_functions_it_rewrites(ex):
    assert ex.rewrites is not None, (
        f"{ex.name}: declare rewrites= (the library's functions the learner writes, or () when "
        "neither mha nor torch has one)"
    )
    assert not any(inspect.unwrap(f).__module__.startswith("mha.exercises") for f in ex.rewrites)


@pytest.mark.parametrize(
    "ex", [ex for ex in FUNCTION_EXERCISES if ex.rewrites], ids=lambda ex: ex.name
)
def test_a_ban_covers_every_function_of_the_module_it_rewrites(ex):
    banned = {id(inspect.unwrap(f)) for f in ex.forbidden}
    for function in ex.rewrites:
        assert id(inspect.unwrap(function)) in banned, f"{ex.name}: {function.__qualname__}"
    for module in _library_modules(ex):
        missing = [
            f.__qualname__ for f in defined_in(module) if id(inspect.unwrap(f)) not in banned
        ]
        assert not missing, f"{ex.name} leaves {module.__name__}'s {missing} unbanned"


def _banned_call(ex, answer):
    """The banned function ``answer`` calls first while ``ex`` checks it (None: it calls none)."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            ex.check(answer)
        except ExerciseError as err:
            return err.banned
    return None


@pytest.mark.parametrize(
    "ex", [ex for ex in FUNCTION_EXERCISES if ex.rewrites], ids=lambda ex: ex.name
)
def test_the_library_function_and_a_private_helper_are_declared_mistakes(ex):
    """Handed in as the answer, the library's own function is rejected, and so is a private helper
    of its module reached around the ban on the public name (if the module has one)."""
    called = [
        _banned_call(ex, ex.as_answer(fn)) for fn, hint in ex.mistakes if hint == ex.forbidden_hint
    ]
    public = {id(inspect.unwrap(f)) for f in ex.rewrites}
    assert any(f is not None and id(f) in public for f in called), (
        f"{ex.name}: declare the library's function as a mistake (its hint: the ban's)"
    )
    private = {
        id(inspect.unwrap(f)) for m in _library_modules(ex) for f in defined_in(m) if _is_private(f)
    }
    if private:
        assert any(f is not None and id(f) in private for f in called), (
            f"{ex.name}: declare a private helper of the library's module as a mistake"
        )


def test_the_library_works_after_a_ban():
    with pytest.raises(ExerciseError):
        mha.exercises.check_softmax(torch.softmax)
    x = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    torch.testing.assert_close(x.softmax(-1), mha.softmax(x))
    x.softmax(-1).pow(2).sum().backward()
    assert x.grad is not None


def test_watch_restores_the_previous_profiler_and_lets_allowed_calls_through():
    calls = []

    def previous(frame, event, arg):
        calls.append(event)

    sys.setprofile(previous)
    try:
        with watch((torch.softmax, autograd_grad), "banned"):
            y = torch.exp(torch.ones(2)).sum()  # allowed
        assert sys.getprofile() is previous
        with pytest.raises(ExerciseError, match="banned"), watch((torch.softmax,), "banned"):
            functools.partial(torch.softmax, dim=0)(torch.ones(2))
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    assert y.item() == pytest.approx(2 * math.e)


def test_watch_sees_a_banned_builtin_called_inside_an_allowed_python_function():
    def helper(x):  # a function of the learner's, or torch's own Python code
        return x.softmax(-1)

    with pytest.raises(ExerciseError), watch((torch.Tensor.softmax,), "banned"):
        helper(torch.ones(3))


def test_never_larger_catches_a_whole_score_matrix_in_any_layout_and_lets_tiles_through():
    from mha.exercises._harness import never_larger

    q, k = torch.randn(2, 48, 8), torch.randn(2, 64, 8)  # (H, L, D), (H, S, D)
    limit = 48 * 64  # one head's (L, S) scores: no input, output or tile is that large
    with never_larger(limit, "scores") as seen:
        for j in range(0, 64, 16):  # tiles of 16 keys: (H, 48, 16)
            q @ k[:, j : j + 16].transpose(-2, -1)
    assert seen == []
    for whole in (
        lambda: q @ k.transpose(-2, -1),  # (H, L, S)
        lambda: (q[0] @ k[0].T).flatten(),  # one head, flattened
        lambda: torch.einsum("hld,hsd->hsl", q, k),  # transposed
        lambda: (q[:, :, None, :] * k[:, None, :, :]).sum(-1),  # broadcast, no matmul
    ):
        with pytest.raises(ExerciseError, match=r"scores \("):
            with never_larger(limit, "scores {shape}"):
                whole()


def test_never_larger_rejects_an_answer_that_catches_its_error():
    from mha.exercises._harness import never_larger

    with pytest.raises(ExerciseError, match="too big"):
        with never_larger(10, "too big"):
            try:
                torch.zeros(4, 4) + 1
            except ExerciseError:
                pass
