"""Problems found in a recipe: what is wrong, with which fields and values, and how to fix it."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import click

EXIT_INVALID = 2  # the exit status of every command that reports problems

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
        where = ", ".join(f"{name}={_show(value)}" for name, value in self.fields.items())
        text = f"[{self.rule}] {where}: {self.message}" if where else f"[{self.rule}] {self.message}"
        return f"{text}. Fix: {self.fix}" if self.fix else text

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "severity": self.severity, "fields": dict(self.fields),
                "message": self.message, "fix": self.fix}


class RecipeError(ValueError):
    """Raised with every problem found at once, never only the first."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def errors(problems: Iterable[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def warnings(problems: Iterable[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "warning"]


def print_problems(source: str, problems: Iterable[Problem]) -> None:
    """`source: N errors` and one line per problem, on stderr."""
    problems = tuple(problems)
    count = len(errors(problems))
    click.echo(f"{source}: {count} error{'s' if count != 1 else ''}", err=True)
    for problem in problems:
        click.echo(f"  {problem.severity}: {problem}", err=True)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean "x"?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' Did you mean "{close[0]}"?' if close else ""


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


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
