"""Show a deliberate error in a notebook without stopping it.

A chapter that demonstrates an error ("this raises, and here is the message") must still run to the
end under Colab's and Jupyter's *Run all*, which honour no cell tags. :func:`expect_error` shows the
error and lets the notebook go on, while still asserting that the error happens::

    with mha.expect_error(KeyError):
        animals["kitten"]
    # prints: KeyError: 'kitten'

If the block raises nothing, or an exception of another type, the demonstration is wrong and the
cell fails loudly with an ``AssertionError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class ExpectedError:
    """What :func:`expect_error` caught; ``value`` is set when the ``with`` block has ended."""

    value: BaseException | None = None

    @property
    def message(self) -> str:
        """``"TypeName: message"``, exactly as :func:`expect_error` prints it."""
        return format_error(self.value) if self.value is not None else ""


def format_error(error: BaseException) -> str:
    """``"KeyError: 'kitten'"``: the type's name and the message, as IPython's minimal traceback."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


@contextmanager
def expect_error(
    expected: type[BaseException] | tuple[type[BaseException], ...],
    *,
    match: str | None = None,
) -> Iterator[ExpectedError]:
    """Run a block that must raise ``expected``; print the error and carry on.

    Args:
        expected: the exception type (or a tuple of types) the block must raise; subclasses count.
        match: if given, a regular expression that the printed message must contain
            (``re.search``), so the cell also asserts *which* error it shows.

    Yields:
        An :class:`ExpectedError`, whose ``value`` is the caught exception after the block.

    Raises:
        AssertionError: the block raised nothing, an exception of another type (chained as the
            cause, so its traceback is kept), or a message that does not match ``match``.
    """
    expected_types = expected if isinstance(expected, tuple) else (expected,)
    names = " or ".join(t.__name__ for t in expected_types)
    caught = ExpectedError()
    try:
        yield caught
    except expected_types as error:
        caught.value = error
    except Exception as error:  # any other error: the demonstration is wrong
        raise AssertionError(
            f"expected {names}, but the block raised {format_error(error)}"
        ) from error
    else:
        raise AssertionError(f"expected {names}, but the block raised nothing")
    shown = format_error(caught.value)
    if match is not None and not re.search(match, shown):
        raise AssertionError(f"expected {names} matching {match!r}, got {shown}")
    print(shown)
