"""Auto-checkers for the course's exercises.

Every exercise is data (:class:`Exercise` in ``_harness.py``): a reference built on PyTorch's own
operators, input cases, tolerances, and its known mistakes with their hints. Each ``check_*``
prints one line on success, says "not attempted yet" while the answer is still the notebook's stub,
and raises :class:`ExerciseError` (an ``AssertionError``) with a targeted hint on a wrong answer.
The checkers live in one module per chapter (``mha.exercises.ch01`` ...) and are re-exported here.
They speak English, or Chinese after ``set_language("zh")`` (or with ``MHA_LANG=zh`` set before the
first import).
"""

from . import ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08
from ._harness import Exercise, ExerciseError, get_language, set_language

#: Every exercise of the course, in chapter order.
EXERCISES: tuple[Exercise, ...] = ()
__all__ = ["EXERCISES", "Exercise", "ExerciseError", "get_language", "set_language"]
for _module in (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08):
    EXERCISES += _module.EXERCISES
    for _ex in _module.EXERCISES:
        globals()[_ex.name] = getattr(_module, _ex.name)
        __all__.append(_ex.name)
del _module, _ex
