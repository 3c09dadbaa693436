"""The launchers' exit convention: which exceptions are expected failures, and their exit codes.

An expected failure ends a launcher run with one ``error: <message>`` line on stderr and no
Python traceback; anything else is a bug and keeps its full traceback (exit 1).

====  ==========================================================================================
code  meaning
====  ==========================================================================================
0     the run finished
1     runtime failure: GPU refused by the hardware policy, training diverged (non-finite loss),
      disk full, permission denied or another I/O error, out of memory
2     configuration, usage or input-data error: bad flag or binding, missing or corrupt dataset,
      an output path that is a file
130   interrupted (Ctrl-C; the launchers' own code, not an exception class here)
====  ==========================================================================================

How an exception is classified (:func:`exit_code_for`), first match wins:

1. an ``exit_code`` attribute (an int from 1 to 125) decides itself: raise :class:`RunError`
   (exit 1) or :class:`UsageError` (exit 2), or set ``exit_code`` on any exception class;
2. :data:`CONFIG_ERRORS` (``ValueError``, ``TypeError``, ``FileNotFoundError``,
   ``NotADirectoryError``, ``IsADirectoryError``; ``hstu.config.gin_utils.ConfigError`` is a
   ``ValueError``) exit 2;
3. :data:`RUNTIME_ERRORS` (``FloatingPointError``, ``OSError`` with all its other subclasses such
   as ``PermissionError`` and ENOSPC, ``MemoryError``) and torch's ``OutOfMemoryError`` exit 1;
4. anything else is unexpected: ``None``.

This module imports nothing from hstu (every layer may use it).
"""

from __future__ import annotations

__all__ = [
    "CONFIG_ERRORS",
    "EXIT_CONFIG",
    "EXIT_OK",
    "EXIT_RUNTIME",
    "RUNTIME_ERRORS",
    "RunError",
    "UsageError",
    "error_line",
    "exit_code_for",
]

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_CONFIG = 2

# checked before RUNTIME_ERRORS: FileNotFoundError and friends are OSErrors too
CONFIG_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
)
RUNTIME_ERRORS: tuple[type[BaseException], ...] = (FloatingPointError, OSError, MemoryError)
# torch.OutOfMemoryError (a RuntimeError), matched by name so this module needs no torch
_RUNTIME_ERROR_NAMES = ("OutOfMemoryError",)


class RunError(RuntimeError):
    """A runtime failure with a message meant to be printed as is (exit 1 unless told)."""

    exit_code: int = EXIT_RUNTIME

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = int(exit_code)


class UsageError(RunError):
    """A usage or configuration problem found outside the config classes (exit 2)."""

    exit_code: int = EXIT_CONFIG


def exit_code_for(exc: BaseException) -> int | None:
    """The exit code of an expected failure, or None for an unexpected exception (a bug)."""
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool) and 1 <= code <= 125:
        return code
    if isinstance(exc, CONFIG_ERRORS):
        return EXIT_CONFIG
    if isinstance(exc, RUNTIME_ERRORS):
        return EXIT_RUNTIME
    if any(cls.__name__ in _RUNTIME_ERROR_NAMES for cls in type(exc).__mro__):
        return EXIT_RUNTIME
    return None


def error_line(exc: BaseException | str) -> str:
    """``error: <message>`` on one line (newlines of a multi-line message become spaces)."""
    text = exc if isinstance(exc, str) else str(exc)
    text = " ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    if not text and isinstance(exc, BaseException):
        text = type(exc).__name__
    return f"error: {text}"
