"""The one error the data tools raise for bad input: which argument, which value, why, how to fix."""

from __future__ import annotations

from typing import Any

EXIT_INVALID = 2  # as every other dsforge command that refuses its input


class DataError(ValueError):
    """Bad input to `dsforge data`: `argument` is the command-line name (INPUT, --tokenizer, ...)
    or the field, `value` what was given, `fix` what to do instead."""

    def __init__(self, argument: str, value: Any, message: str, fix: str = ""):
        self.argument, self.value, self.message, self.fix = argument, value, message, fix
        text = f"{argument}={value!r}: {message}" if value is not None else f"{argument}: {message}"
        super().__init__(f"{text}. Fix: {fix}" if fix else text)

    def __reduce__(self):  # crosses process boundaries (raised inside a tokenizing worker)
        return type(self), (self.argument, self.value, self.message, self.fix)


def missing_library(library: str, extra: str, argument: str, value: Any) -> DataError:
    return DataError(argument, value, f"needs the Python package '{library}', which is not "
                     "installed", f"pip install 'dsforge[{extra}]'")
