"""Problems found in a recipe: what is wrong, with which fields and values, and how to fix it."""

from __future__ import annotations

import difflib
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import click

EXIT_INVALID = 2  # the exit status of every command that reports problems
SHOWN_CHARS = 80  # longest list, mapping or other structured value a problem shows
SHOWN_TEXT = 400  # longest string (a path, a name) or field name a problem shows
SHOWN_PROBLEMS = 20  # problems printed before "... and N more"

Severity = Literal["error", "warning"]


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One violated rule. `rule` is the id from docs/validation.md (e.g. "L2")."""

    rule: str
    fields: dict[str, Any] = field(default_factory=dict)
    message: str
    fix: str = ""
    severity: Severity = "error"

    def __str__(self) -> str:
        where = ", ".join(f"{_name(name)}={shorten(value)}" for name, value in self.fields.items())
        text = f"[{self.rule}] {where}: {self.message}" if where else f"[{self.rule}] {self.message}"
        return f"{text}. Fix: {self.fix}" if self.fix else text

    def to_dict(self) -> dict[str, Any]:
        fields = {_name(name): value if _plain(value) else shorten(value)
                  for name, value in self.fields.items()}
        return {"rule": self.rule, "severity": self.severity, "fields": fields,
                "message": self.message, "fix": self.fix}


class RecipeError(ValueError):
    """Raised with every problem found at once, never only the first."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = tuple(problems)
        shown = [str(p) for p in self.problems[:SHOWN_PROBLEMS]]
        if len(self.problems) > SHOWN_PROBLEMS:
            shown.append(f"... and {len(self.problems) - SHOWN_PROBLEMS} more")
        super().__init__("\n".join(shown))


def errors(problems: Iterable[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def warnings(problems: Iterable[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "warning"]


def print_problems(source: str, problems: Iterable[Problem]) -> None:
    """`source: N errors` and one line per problem, on stderr: the first SHOWN_PROBLEMS, then
    how many more (10,000 bad hostfile lines are not 10,000 lines of output)."""
    problems = tuple(problems)
    count = len(errors(problems))
    click.echo(f"{source}: {count} error{'s' if count != 1 else ''}", err=True)
    for problem in problems[:SHOWN_PROBLEMS]:
        click.echo(f"  {problem.severity}: {problem}", err=True)
    if len(problems) > SHOWN_PROBLEMS:
        click.echo(f"  ... and {len(problems) - SHOWN_PROBLEMS} more", err=True)


def read_text(path: Path, what: str, *, rule: str, example: str,
              limit: int = 1 << 20) -> str:
    """The UTF-8 text of a file the user named, or a RecipeError that says what is wrong."""
    def problem(message: str, fix: str) -> RecipeError:
        return RecipeError([Problem(rule=rule, fields={what: str(path)}, message=message, fix=fix)])

    noun = what if what.endswith("file") else f"{what} file"
    if path.is_dir():
        raise problem(f"is a directory, not a {noun}", f"name a file, e.g. {example}")
    if not path.exists():
        raise problem(f"{noun} not found", f"check the path, e.g. {example}")
    if not path.is_file():
        raise problem(f"is not a regular file, so not a {noun}", f"name a file, e.g. {example}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise problem(f"cannot be read: {exc.strerror}", "check the file's permissions") from None
    if len(data) > limit:
        raise problem(f"is larger than {limit:,} bytes, far more than a {noun} needs",
                      f"check that this is the {noun} you meant")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise problem(f"is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})",
                      "save it as UTF-8 (e.g. iconv -t UTF-8)") from None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean "x"?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' Did you mean "{close[0]}"?' if close else ""


def shorten(value: Any) -> str:
    """A value as a problem shows it: strings quoted and at most SHOWN_TEXT characters, other
    values at most SHOWN_CHARS. Never builds the full text of a large value first (a YAML
    alias bomb is a few lines that expand to gigabytes; Python refuses str() of integers over
    4300 digits)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return _int_text(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (str, bytes)):
        return _cut(repr(value[:SHOWN_TEXT + 1]), SHOWN_TEXT)
    return _cut(_BOUNDED.repr(value), SHOWN_CHARS)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _int_text(value: int) -> str:
    return str(value) if value.bit_length() <= 64 else f"<an integer of {value.bit_length()} bits>"


def _name(name: Any) -> str:
    """A field's name (a recipe path, an option, a file and line), at most SHOWN_TEXT."""
    return _cut(name[:SHOWN_TEXT + 1], SHOWN_TEXT) if isinstance(name, str) else shorten(name)


def _plain(value: Any) -> bool:
    """Values that to_dict keeps as they are (JSON-ready and short)."""
    if isinstance(value, str):
        return len(value) <= SHOWN_TEXT
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() <= 64
    return value is None or isinstance(value, (bool, float))


class _BoundedRepr(reprlib.Repr):
    """reprlib with few items per level and large integers by size."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple, self.maxset = 3, 4, 4, 4, 4
        self.maxstring, self.maxother = SHOWN_CHARS, SHOWN_CHARS  # inside a structure

    def repr_int(self, x: int, level: int) -> str:
        return _int_text(x)


_BOUNDED = _BoundedRepr()


class Checks:
    """Collects problems for one section; `raise_if_any` raises them all together.

    Sections use it in __post_init__ so a recipe with three local mistakes reports three.
    """

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def require(self, ok: bool, rule: str, fields: dict[str, Any], message: str, fix: str = "",
                severity: Severity = "error") -> bool:
        if not ok:
            self.problems.append(Problem(rule=rule, fields=fields, message=message, fix=fix,
                                         severity=severity))
        return ok

    def raise_if_any(self) -> None:
        if errors(self.problems):
            raise RecipeError(self.problems)
