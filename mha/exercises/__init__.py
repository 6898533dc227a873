"""Auto-checkers for the course's exercises.

Every ``check_*`` function takes the learner's function, runs it on fixed inputs against a
reference built on PyTorch's own operators, prints one line on success and raises
``AssertionError`` with a targeted hint on failure. The checkers live in one module per chapter
(``mha.exercises.ch01`` ...) and are all re-exported here, so a notebook can call
``mha.exercises.check_softmax(my_softmax)``.
"""

import importlib
import pkgutil

from ._check import ExerciseError, check_close, passed

__all__ = ["ExerciseError", "check_close", "passed"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("ch"):
        _module = importlib.import_module(f"{__name__}.{_info.name}")
        for _name in dir(_module):
            if _name.startswith("check_"):
                globals()[_name] = getattr(_module, _name)
                __all__.append(_name)
