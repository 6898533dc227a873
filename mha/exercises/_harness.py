"""The one harness every exercise runs on: an exercise is data, one runner checks every answer.

An :class:`Exercise` is the one way to declare an exercise. It holds a reference (built on
PyTorch's own operators where possible), input cases, tolerances, its correct ``variants`` (answers
written unlike the reference, which the checker must accept) and its known ``mistakes``
(``(wrong answer, hint)`` pairs, which it must reject with that hint); the tests are generated from
them. :meth:`Exercise.check` calls the learner's code on every case and compares with the
reference; on a mismatch it names the first mistake that reproduces the learner's output, else the
generic hint. Crashes, NaN, wrong shapes or dtypes and non-tensors read the same everywhere; what
is not "call the answer and compare" brings a ``custom`` check. A prediction (``prediction=True``)
is a value: its reference returns the true answer, and its variants and mistakes map the truth to
an answer. A hint too long for its line is a named constant just above the exercise.

Functions an exercise bans (``forbidden``) are caught by identity, however the learner reached
them (an alias, ``from ... import``, a helper of their own): :func:`watch` follows every call the
answer makes.

Every fixed text a learner reads goes through :func:`tr`, which looks it up in the catalogue of
the chosen language (:func:`set_language`, or the environment variable ``MHA_LANG`` read on
import; English by default). A message made from values translates its template, not the result:
``tr("has shape {got}, expected {want}", got=..., want=...)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import BuiltinFunctionType, FunctionType, MethodDescriptorType, ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

import mha

from .. import validation as validate
from ._zh import MESSAGES as _ZH

#: The languages the checkers speak: English (the texts in the code) and Chinese (``_zh.py``).
LANGUAGES = ("en", "zh")
_CATALOGUES: dict[str, Mapping[str, str]] = {"en": {}, "zh": _ZH}


def _language_from_environment() -> str:
    """``MHA_LANG`` as a language of :data:`LANGUAGES` ("zh_CN.UTF-8" -> "zh"); English if unset
    or unknown, so that a stray locale never breaks ``import mha.exercises``."""
    value = os.environ.get("MHA_LANG", "").strip().lower()
    value = value.replace("-", "_").split(".")[0].split("_")[0]
    return value if value in LANGUAGES else "en"


_language = _language_from_environment()


def set_language(language: str) -> None:
    """Make the checkers speak ``language``: "en" (the default) or "zh" (中文)."""
    global _language
    if language not in LANGUAGES:
        raise ValueError(f"language must be one of {list(LANGUAGES)}, got {language!r}")
    _language = language


def get_language() -> str:
    """The language the checkers speak now, one of :data:`LANGUAGES`."""
    return _language


def tr(text: str, *args: object, **values: object) -> str:
    """``text`` in the current language; with ``args`` or ``values`` a template, formatted after
    the translation (so the values stay as they are). Texts without a translation stay English."""
    text = _CATALOGUES[_language].get(text, text)
    return text.format(*args, **values) if args or values else text


class ExerciseError(AssertionError):
    """A learner's answer is wrong; the message says how and hints at why. When the answer called
    a banned function, ``banned`` is the first one it called (else None)."""

    banned: Callable[..., Any] | None = None


class NotAttempted(Exception):
    """The answer is still the notebook's stub: the checker says so instead of failing."""


def _stub() -> None: ...


def is_stub(fn: object) -> bool:
    """True if ``fn``'s body is only ``...`` (or ``pass``), as in the notebooks' stubs."""
    code = getattr(getattr(fn, "fn", fn), "__code__", None)  # a Triton kernel wraps its function
    return code is not None and code.co_code == _stub.__code__.co_code


def _unfilled(value: object) -> bool:
    """True for ``None``, ``...`` and containers of nothing else: a prediction not made yet."""
    if value is None or value is Ellipsis:
        return True
    if isinstance(value, Mapping):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(map(_unfilled, value))


class Mistake(NamedTuple):
    """A typical wrong answer and its hint. In a function exercise ``fn`` has the learner's
    signature; in a prediction it maps the true answer to the wrong one."""

    fn: Callable[..., Any]
    hint: str


class Lazy(NamedTuple):
    """A variant or mistake built on first use, such as a Triton kernel (Triton is optional)."""

    build: Callable[[], Any]


@dataclass(frozen=True)
class Case:
    """One input: ``label`` names the call in messages; ``expected`` is the right output when the
    reference cannot compute it from ``args``; ``atol``/``rtol`` override the exercise's."""

    label: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    expected: Any = None
    atol: float | None = None
    rtol: float | None = None


class _Raised(NamedTuple):
    """What the learner's (or a mistake's) code raised instead of returning."""

    err: Exception

    def __str__(self) -> str:
        lines = str(self.err).splitlines()
        return f"{type(self.err).__name__}: {lines[0] if lines else ''}"

    def same(self, other: object) -> bool:
        same_type = isinstance(other, _Raised) and type(other.err) is type(self.err)
        return same_type and str(other) == str(self)


_MISSING = object()  # a part of a mistake's output that does not exist


def _close(a: object, b: object, atol: float, rtol: float, exact_dtype: bool) -> bool:
    """True if ``a`` equals ``b`` within tolerance: tensors (NaN == NaN), sequences, numbers."""
    if isinstance(b, Tensor):
        if not isinstance(a, Tensor) or a.shape != b.shape or exact_dtype and a.dtype != b.dtype:
            return False
        a, b = a.detach().to(b.dtype), b.detach()
        if not b.is_floating_point():
            return torch.equal(a, b)
        return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))
    if isinstance(b, (tuple, list)):
        return (
            isinstance(a, (tuple, list))
            and len(a) == len(b)
            and all(_close(x, y, atol, rtol, exact_dtype) for x, y in zip(a, b))
        )
    if isinstance(b, float) and (type(a) is int or type(a) is float):
        return abs(a - b) <= atol + rtol * abs(b)
    return type(a) is type(b) and a == b


def difference(
    got: object, want: object, *, atol: float, rtol: float, exact_dtype: bool = False
) -> str | None:
    """How ``got`` differs from ``want`` (in ``torch.testing.assert_close``'s words), or None."""
    if not isinstance(want, Tensor):
        if _close(got, want, atol, rtol, False):
            return None
        return tr(
            "is {}, expected {}",
            *(f"{v:.3g}" if isinstance(v, float) else repr(v) for v in (got, want)),
        )
    if not isinstance(got, Tensor):
        return tr("gave {kind}, expected a torch.Tensor", kind=type(got).__name__)
    if got.shape != want.shape:
        return tr("has shape {got}, expected {want}", got=tuple(got.shape), want=tuple(want.shape))
    if exact_dtype and got.dtype != want.dtype:
        return tr("has dtype {got}, expected {want}", got=got.dtype, want=want.dtype)
    got = got.detach().to(want.dtype)
    if got.is_floating_point() and got.isnan().any() and not want.isnan().any():
        return tr("contains NaN")
    try:
        torch.testing.assert_close(got, want.detach(), atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as err:
        summary = "; ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
        return tr("has the right shape but wrong values ({summary})", summary=summary)
    return None


class _Banned(TorchFunctionMode):
    """Sees every torch function called while it is active, however it was reached (an alias,
    ``functools.partial``, a method): the torch half of :func:`watch`."""

    def __init__(self, banned: Sequence[Callable[..., Any]], trip: Callable[[Any], None]) -> None:
        super().__init__()
        self.banned, self.trip = banned, trip

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(func is b for b in self.banned):
            self.trip(func)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch(banned: Sequence[Callable[..., Any]], message: str) -> Iterator[None]:
    """Raise ``ExerciseError(message)`` if the code run inside calls one of the ``banned``
    functions, compared by identity, never by name: Python functions by their code object (a
    profile hook sees every call), torch's C functions and methods by a ``TorchFunctionMode`` and
    by the hook's C calls. An answer that catches the error is still rejected on the way out."""
    if not banned:
        yield
        return
    functions = [inspect.unwrap(f) for f in banned]  # a decorator's wrapper calls the original
    codes = {id(f.__code__): f for f in functions if isinstance(f, FunctionType)}
    builtins = {f for f in banned if isinstance(f, BuiltinFunctionType)}
    methods = {f.__name__: f for f in banned if isinstance(f, MethodDescriptorType)}
    tripped: list[Callable[..., Any]] = []  # what was called, first first

    def error() -> ExerciseError:
        err = ExerciseError(message)
        err.banned = tripped[0]
        return err

    def trip(function: Callable[..., Any]) -> None:
        tripped.append(function)
        raise error()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and id(frame.f_code) in codes:
            trip(codes[id(frame.f_code)])
        elif event == "c_call" and arg in builtins:
            trip(arg)
        elif event == "c_call" and arg.__name__ in methods:
            method = methods[arg.__name__]
            if isinstance(getattr(arg, "__self__", None), method.__objclass__):
                trip(method)  # a method of a tensor: x.softmax(...) reaches here bound to x

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        with _Banned(banned, trip):
            yield
    finally:
        sys.setprofile(previous)
    if tripped:
        raise error()


#: What the backward exercises are to do by hand: autograd in every form, and torch's own kernel.
AUTOGRAD = (
    torch.autograd.grad,
    torch.autograd.backward,
    Tensor.backward,
    *(getattr(torch.func, n) for n in ("grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd")),
    *(getattr(torch.autograd.functional, n) for n in ("jacobian", "vjp", "jvp", "vhp", "hvp")),
    torch._softmax_backward_data,
)


def defined_in(module: ModuleType) -> list[Callable[..., Any]]:
    """Every function ``module`` defines, public and private: its functions and its classes'
    methods (static, class and property ones too). A ban on a module the learner re-writes covers
    all of them, so that a private helper is no way around it."""
    found: list[Callable[..., Any]] = []
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if isinstance(obj, FunctionType):
            found.append(obj)
        elif isinstance(obj, type):
            for member in vars(obj).values():
                member = getattr(member, "__func__", getattr(member, "fget", member))
                if isinstance(member, FunctionType):
                    found.append(member)
    return found


class _SizeLimit(TorchFunctionMode):
    """Sees the result of every torch function called while it is active: the torch half of
    :func:`never_larger`."""

    def __init__(self, limit: int, trip: Callable[[Tensor], None]) -> None:
        super().__init__()
        self.limit, self.trip = limit, trip

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.numel() >= self.limit:
                self.trip(t)
        return out


@contextlib.contextmanager
def never_larger(limit: int, message: str) -> Iterator[list[tuple[int, ...]]]:
    """Raise ``ExerciseError(message)`` if the code run inside makes a tensor of ``limit``
    elements or more, with any torch function, method or operator (``@``, ``*``, ``.float()``).

    What a tiled answer proves with it: a checker picks a case whose inputs, output and tiles are
    all smaller than ``limit = L * S``, so a tensor that large is a whole score matrix (or worse),
    whatever its layout. ``message`` may hold ``{shape}``, the shape of the first such tensor.
    Yields the list of the offending shapes, which is empty when the code passed."""
    limit = validate.positive_int("limit", limit)
    seen: list[tuple[int, ...]] = []

    def trip(t: Tensor) -> None:
        seen.append(tuple(t.shape))
        raise ExerciseError(message.format(shape=tuple(t.shape)))

    with _SizeLimit(limit, trip):
        yield seen
    if seen:  # an answer that caught the error is still rejected on the way out
        raise ExerciseError(message.format(shape=seen[0]))


@dataclass(frozen=True)
class Exercise:
    """One exercise as data, checked by :meth:`check`; its public checker is :meth:`checker`."""

    name: str  # the checker's name, which starts its printed line
    success: str | Callable[[Any], str]  # the detail after "correct —" (or made from the output)
    # The right answer: a function with the learner's signature, or, in a prediction, a function
    # of no argument returning the true answer.
    reference: Callable[..., Any] | None
    cases: Callable[[], Iterable[Case]] = lambda: [Case("your prediction")]  # built on demand
    # Correct answers written unlike the reference (at least two), and typical wrong answers with
    # their hints, tried in order: in a prediction, functions of the true answer.
    variants: Sequence[Any] = ()
    mistakes: Sequence[Mistake | tuple[Any, str]] = ()
    hint: str | Mapping[str, str] | Callable[[str], str] = ""  # generic, or one per output name
    crash_hint: str = ""  # when the learner's code raises an error no mistake explains
    atol: float = 1e-5
    rtol: float = 1e-4
    exact_dtype: bool = False  # must the result have the reference's dtype?
    outputs: tuple[str, ...] = ()  # names of the parts of a tuple answer, compared one by one
    prediction: bool = False  # the answer is a value (or a tuple of values), not a function
    report_all: bool = False  # report every wrong part, not only the first
    call: Callable[[Any, Case], Any] | None = None  # the output of an answer, if not answer(*args)
    convert: Callable[[Any], Any] | None = None  # normalises an output or rejects its type
    # Functions the answer must not call (the library's version of what it is to write), caught
    # by identity however they are reached (see watch), and what the learner reads then.
    forbidden: Sequence[Callable[..., Any]] = ()
    forbidden_hint: str = ""
    # The library's functions that do what the learner is to write (its public entry points, e.g.
    # mha.causal_mask): their modules are banned whole, and the library's function and one of its
    # module's private helpers are declared mistakes. () when neither mha nor torch has one; None
    # (undeclared) only in a prediction.
    rewrites: Sequence[Callable[..., Any]] | None = None
    custom: Callable[[Any], str] | None = None  # a check of its own; returns the success detail
    # The public checker's parameters (several: a tuple answer); a prediction's default to its
    # outputs' names.
    params: tuple[str, ...] = ()
    doc: str = ""  # the public checker's docstring

    def __post_init__(self) -> None:
        object.__setattr__(self, "mistakes", tuple(Mistake(*m) for m in self.mistakes))
        if not self.params:
            params = (self.outputs or ("answer",)) if self.prediction else ("fn",)
            object.__setattr__(self, "params", params)

    def check(self, answer: object) -> None:
        """Print the success line, or "not attempted yet" for a stub; raise ``ExerciseError``
        with a hint for a wrong answer. Warnings of the answer's code never reach stderr."""
        if not (self.prediction or _unfilled(answer) or callable(answer)):
            kind, param = type(answer).__name__, self.params[0]
            message = "{name}: {param} should be a function, got {kind}"
            raise TypeError(tr(message, name=self.name, param=param, kind=kind))
        try:
            if _unfilled(answer) or is_stub(answer):
                raise NotAttempted
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")  # e.g. overflow in exp: the hint says it better
                detail = self.custom(answer) if self.custom else self._run(answer)
        except NotAttempted:  # not an error: "Run all" in Colab goes on past an unsolved exercise
            message = (
                "○ {name}: not attempted yet — write your answer in the cell above, "
                "then run it again."
            )
            print(tr(message, name=self.name))
            return
        print(tr("✓ {name}: correct — {detail}", name=self.name, detail=detail))

    def checker(self) -> Callable[..., None]:
        """The public ``check_*`` function: named ``name``, taking ``params``, documented by
        ``doc``."""
        signature = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in self.params]
        )

        def check(*args: object, **kwargs: object) -> None:
            answer = signature.bind(*args, **kwargs).args
            self.check(answer[0] if len(answer) == 1 else answer)

        check.__name__ = check.__qualname__ = self.name
        check.__doc__ = self.doc
        vars(check)["__signature__"] = signature  # what inspect.signature and help() show
        return check

    def as_answer(self, declared: Any) -> Any:
        """A declared variant or mistake as an answer to the checker."""
        declared = declared.build() if isinstance(declared, Lazy) else declared
        return declared(self._truth()) if self.prediction else declared

    def right_answers(self) -> list[Any]:
        """Every declared variant as an answer the checker must accept (the tests try them)."""
        return [self.as_answer(v) for v in self.variants]

    def accepted_answer(self) -> object:
        """An answer the checker accepts: the first variant."""
        return self.right_answers()[0]

    def wrong_answers(self) -> list[tuple[object, str]]:
        """Every known mistake as an answer to the checker, with its hint (the tests try them)."""
        return [(self.as_answer(fn), hint) for fn, hint in self.mistakes]

    def texts(self) -> list[str]:
        """The fixed texts a learner may read from this checker (their translations are in the
        catalogues); texts made from values go through :func:`tr` where they are made."""
        hints = list(self.hint.values()) if isinstance(self.hint, Mapping) else [self.hint]
        fixed = [self.success, *hints, self.crash_hint, self.forbidden_hint]
        fixed += [hint for _, hint in self.mistakes]
        if self.prediction:  # the label of the default case, "your prediction"
            fixed += [case.label for case in self.cases()]
        return list(dict.fromkeys(t for t in fixed if isinstance(t, str) and t))

    def _truth(self, *args: Any, **kwargs: Any) -> Any:
        """The reference's output; only an exercise with a ``custom`` check has no reference."""
        assert self.reference is not None, f"{self.name} has no reference"
        return self.reference(*args, **kwargs)

    def _run(self, answer: object) -> str:
        want = None
        for index, case in enumerate(self.cases()):
            if case.expected is not None:
                want = case.expected
            else:
                want = self._truth(*case.args, **case.kwargs)
                want = self.convert(want) if self.prediction and self.convert else want
            with watch(self.forbidden, f"{self.name}: {tr(self.forbidden_hint)}"):
                got = self._output(answer, case)
            if index == 0 and (
                got is None or isinstance(got, _Raised) and isinstance(got.err, NotImplementedError)
            ):
                raise NotAttempted
            message = self._diagnose(case, got, want)
            if message:
                raise ExerciseError(message)
        return self.success(want) if callable(self.success) else tr(self.success)

    def _output(self, answer: object, case: Case) -> object:
        """What ``answer`` gives on ``case``: its (converted) output, or what it raised."""
        try:
            if self.call:
                out = self.call(answer, case)
            elif self.prediction:
                out = answer
            else:  # fresh copies: an answer that works in place must not spoil the next case
                assert callable(answer)  # check() turned any other answer away
                out = answer(
                    *[a.clone() if isinstance(a, Tensor) else a for a in case.args], **case.kwargs
                )
        except (ExerciseError, NotAttempted):
            raise
        except Exception as err:  # noqa: BLE001 - the learner's bug: quoted back with a hint
            return _Raised(err)
        return self.convert(out) if self.convert and out is not None else out

    def _tolerance(self, case: Case) -> dict[str, Any]:
        atol = self.atol if case.atol is None else case.atol
        rtol = self.rtol if case.rtol is None else case.rtol
        return {"atol": atol, "rtol": rtol, "exact_dtype": self.exact_dtype}

    def _known(self, case: Case, got: object, want: object, index: int | None) -> str | None:
        """The hint of the first mistake whose output (its part ``index``) is the learner's."""
        atol, rtol, exact = self._tolerance(case).values()
        for answer, hint in self.wrong_answers():
            out = self._output(answer, case)
            if isinstance(got, _Raised) or isinstance(out, _Raised):
                if isinstance(got, _Raised) and got.same(out):
                    return tr(hint)
                continue
            if index is not None:
                out = (
                    out[index]
                    if isinstance(out, tuple) and len(out) == len(self.outputs)
                    else _MISSING
                )
            # a "mistake" that is right on this input says nothing about the learner's answer
            if not _close(out, want, atol, rtol, exact) and _close(got, out, atol, rtol, exact):
                return tr(hint)
        return None

    def _generic_hint(self, name: str) -> str:
        if callable(self.hint):
            return self.hint(name)  # translates its own texts
        return tr(self.hint.get(name, "") if isinstance(self.hint, Mapping) else self.hint)

    def _diagnose(self, case: Case, got: object, want: Any) -> str | None:
        """The error message for a wrong output, or None if ``got`` is right. ``want`` is the
        reference's output: a sequence of the parts named by ``outputs`` when there are any."""
        label = tr(case.label)
        if isinstance(got, _Raised):
            hint = self._known(case, got, want, None) or tr(self.crash_hint)
            return tr("{label} raised {error}. {hint}", label=label, error=got, hint=hint).rstrip()
        if not self.outputs:
            problem = difference(got, want, **self._tolerance(case))
            if not problem:
                return problem
            hint = self._known(case, got, want, None) or self._generic_hint("")
            return tr("{label} {problem}. {hint}", label=label, problem=problem, hint=hint).rstrip()
        if not (isinstance(got, tuple) and len(got) == len(self.outputs)):
            hint = self._known(case, got, want, None) or ""
            names, kind = ", ".join(self.outputs), type(got).__name__
            message = "{label} should return a tuple ({names}), got {kind}. {hint}"
            return tr(message, label=label, names=names, kind=kind, hint=hint).rstrip()
        problems = []
        for index, name in enumerate(self.outputs):
            problem = difference(got[index], want[index], **self._tolerance(case))
            if problem:
                hint = self._known(case, got[index], want[index], index) or self._generic_hint(name)
                message = "{label}: {name} {problem}. {hint}"
                problems.append(tr(message, label=label, name=name, problem=problem, hint=hint))
                if not self.report_all:
                    break
        if self.report_all and problems:
            wrong, total = len(problems), len(self.outputs)
            message = tr("{wrong} of the {total} answers are wrong:", wrong=wrong, total=total)
            problems.insert(0, message)
            return "\n".join(problems)
        return problems[0] if problems else None


def randn64(g: torch.Generator, *shape: int) -> Tensor:
    """Standard normal float64 numbers of ``shape`` from the generator ``g`` (case inputs)."""
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def whole(value: object) -> object:
    """A count as an int if it is one (an integral float, a numpy or 0-dim tensor integer); a
    pair of counts as a tuple. Anything else is left for the checker to reject."""
    if isinstance(value, (tuple, list)):
        return tuple(whole(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, (bool, int)) and hasattr(value, "__index__"):
        try:
            return value.__index__()
        except TypeError:  # a float tensor
            return value
    return value


def as_int(value: object, what: str) -> int:
    """``value`` as an int, or an ``ExerciseError`` naming ``what``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ExerciseError(tr("{what} should be an int, got {value!r}.", what=what, value=value))
    return value.__index__()


def as_mapping(value: object, keys: Sequence[str], what: str = "predictions") -> Mapping:
    """``value`` if it is a dict holding exactly ``keys``, else an ``ExerciseError``."""
    if not isinstance(value, Mapping):
        kind = type(value).__name__
        raise ExerciseError(tr("{what} should be a dict, got {kind}.", what=what, kind=kind))
    missing, unknown = [k for k in keys if k not in value], [k for k in value if k not in keys]
    if missing or unknown:
        message = "{what} should have the keys {keys}; missing {missing}, unknown {unknown}."
        raise ExerciseError(
            tr(message, what=what, keys=list(keys), missing=missing, unknown=unknown)
        )
    return value


def as_shape(value: object, what: str) -> tuple[int, ...]:
    """``value`` (a tuple, list or ``torch.Size`` of ints) as a tuple, or an ``ExerciseError``."""
    if isinstance(value, (tuple, list)) and all(type(n) is int for n in value):
        return tuple(value)
    raise ExerciseError(
        tr("{what} should be a tuple of ints, got {value!r}.", what=what, value=value)
    )


#: Where an exercise is to write attention, the ready-made ones it must not call.
NO_SDPA = (
    F.scaled_dot_product_attention,
    F.multi_head_attention_forward,
    mha.scaled_dot_product_attention,
    mha.flash_attention,
)


def attend(q: Tensor, k: Tensor, v: Tensor | None = None, **slip: Any) -> Tensor:
    """``softmax(q kᵀ / √D, dim=-1) @ v`` (the weights if ``v`` is None), or with a ``slip``: another
    ``scale``, another ``dim``, or a function ``weigh(scores, dim)`` in place of the softmax."""
    scores = q @ k.transpose(-2, -1) * slip.get("scale", q.shape[-1] ** -0.5)  # (..., L, S)
    weights = slip.get("weigh", torch.softmax)(scores, slip.get("dim", -1))  # (..., L, S)
    return weights if v is None else weights @ v  # (..., L, Dv)


def slipped(reference: Callable[..., Any], flag: str) -> Callable[..., Any]:
    """A known mistake made from a reference written with switches: ``reference(*args,
    flag=True)``, the reference with one slip turned on (e.g. ``slipped(_rope_slip, "no_two")``)."""
    return functools.partial(reference, **{flag: True})


def publish(namespace: dict[str, Any]) -> tuple[Exercise, ...]:
    """Define the public checker, ``check_*``, of every :class:`Exercise` in ``namespace`` (a
    chapter module's globals); return the exercises in definition order."""
    exercises = tuple(v for v in namespace.values() if isinstance(v, Exercise))
    for ex in exercises:
        namespace[ex.name] = ex.checker()
    return exercises


def gather(namespace: dict[str, Any], sections: Sequence[Any]) -> tuple[Exercise, ...]:
    """Make the public checkers of a chapter's section modules the chapter package's own (in
    ``namespace``, its globals); return the chapter's exercises in section order."""
    exercises = tuple(ex for section in sections for ex in section.EXERCISES)
    for section in sections:
        for ex in section.EXERCISES:
            namespace[ex.name] = getattr(section, ex.name)  # the section's own checker
    return exercises
