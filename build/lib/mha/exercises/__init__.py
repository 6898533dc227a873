"""Auto-checkers for the course's exercises.

Every exercise is one declaration, an :class:`Exercise` (``_harness.py``) in its chapter's module
(``mha.exercises.ch01`` ...): a reference built on PyTorch's own operators, input cases,
tolerances, correct variants and known mistakes with their hints. Each ``check_*`` prints one line
on success, says "not attempted yet" while the answer is still the notebook's stub, and raises
:class:`ExerciseError` (an ``AssertionError``) with a targeted hint on a wrong answer. The checkers
are re-exported here. They speak English, or Chinese after ``set_language("zh")`` (or with
``MHA_LANG=zh`` set before the first import).

How to add an exercise (three places: the chapter's module, ``_zh.py``, the notebook; the tests
are generated from the declaration): the README's "How to add an exercise".
"""

import importlib
import pkgutil

from ._harness import Exercise, ExerciseError, get_language, set_language

#: The chapters' modules, ch01 ... (each defines its exercises and their checkers).
CHAPTERS = tuple(
    importlib.import_module(f".{info.name}", __name__)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name)
    if info.name.startswith("ch") and info.name[2:].isdigit()
)
#: Every exercise of the course, in chapter order.
EXERCISES: tuple[Exercise, ...] = tuple(ex for module in CHAPTERS for ex in module.EXERCISES)
__all__ = ["CHAPTERS", "EXERCISES", "Exercise", "ExerciseError", "get_language", "set_language"]
for _module in CHAPTERS:
    for _ex in _module.EXERCISES:
        globals()[_ex.name] = getattr(_module, _ex.name)  # the chapter's own checker
        __all__.append(_ex.name)
del _module, _ex
