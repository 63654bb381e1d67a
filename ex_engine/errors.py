"""Exceptions raised by ex_engine.

Every error a user can see is a ``FactorError`` (or a subclass), and each message names the
factor, the argument or plugin at fault, the rule, what was expected and what came.
"""
from __future__ import annotations

import numbers


def _rebuild_error(cls, args, state):
    """A FactorError (or subclass) from what ``FactorError.__reduce__`` gave: its message
    arguments and its attributes, without calling its ``__init__`` (whose parameters differ
    from class to class)."""
    try:
        err = cls.__new__(cls, *args)
    except TypeError:   # a MemoryError subclass: its __new__ refuses a class it did not make
        err = BaseException.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class FactorError(Exception):
    """Base class of every ex_engine error.

    Every one pickles and copies with its message and attributes (an error raised in a worker
    process, a ProcessPoolExecutor's or torch.multiprocessing's, reaches the caller as itself),
    whatever its subclass's ``__init__`` takes."""

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def is_integer(v) -> bool:
    """``v`` is an integer of Python or NumPy (numbers.Integral) and not a bool (True is no
    count, size or index): the argument checks' test for an integer value."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (YAML's parser errors span several: notes and table rows
    keep one)."""
    return " ".join(str(exc).split())


def printable(text: str) -> str:
    """``text`` with every character that is not printable (control characters such as a
    newline or an escape sequence's ESC, format characters such as a bidi override) written as
    Python escapes ('\\n', '\\x1b'): strings from a library, a child process or a file name,
    for tables and messages (one line each; nothing that drives a terminal)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cut_text(text: str, limit: int) -> str:
    """``text`` made printable (printable()), then cut to ``limit`` characters, the cut said:
    '... (N more characters)'."""
    text = printable(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class FactorNotFoundError(FactorError, KeyError):
    """No factor of that name is registered (neither ready nor with a Python fallback)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ArgumentError(FactorError, ValueError):
    """An argument broke a rule of the factor's manifest.

    Attributes: factor, argument, rule, expected, got.
    """

    def __init__(self, factor: str, argument: str, rule: str, expected, got):
        self.factor, self.argument, self.rule = factor, argument, rule
        self.expected, self.got = expected, got
        super().__init__(f"{factor}: argument '{argument}': {rule}: expected {expected}, got {got}")


class DTypeError(ArgumentError, TypeError):
    """Wrong element type."""


class ShapeError(ArgumentError):
    """Wrong rank, wrong size, or a shape relation between arguments broken."""


class LayoutError(ArgumentError):
    """Non-contiguous or mis-strided array, or a misaligned pointer."""


class TensorLayoutError(LayoutError, DTypeError):
    """A torch tensor that is not one strided block of memory (sparse, mkldnn, nested): a
    LayoutError, the class of its rule ('layout'). It is a DTypeError too (so a TypeError),
    what these tensors raised before, so that code catching DTypeError for them still does."""


class DeviceError(ArgumentError):
    """An array lives on the host where device memory is needed, or on another device."""


class KernelError(FactorError, RuntimeError):
    """A plugin kernel returned an error status (named), or CUDA reported an error after it."""

    def __init__(self, factor: str, status: int, status_name: str, detail: str = ""):
        self.factor, self.status, self.status_name, self.detail = factor, status, status_name, detail
        msg = f"{factor}: kernel returned {status_name} ({status})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class DeviceSideError(FactorError, RuntimeError):
    """A kernel flagged bad input on the device (e.g. topk_ids outside [0, E))."""
