"""What stops a command before anything starts, as exceptions cli.py turns into exit code 2:
`Refused` reports its problems (and advice) on stderr, `BadOptions` its message ("Error: ...");
and the warnings that do not stop it (`warn`).
Light on purpose: `dsforge validate` imports it. What `dsforge run` refuses, and in which
order, is launch/checks.py's.
"""

from __future__ import annotations

from typing import Callable

import click

from dsforge.problems import Problem, RecipeError, print_problems
from dsforge.recipe import Resolved, resolve_file

Say = Callable[[str], None]  # prints one of dsforge's own lines


class Refused(Exception):
    """The job must not start: `problems` to print under `source`, then `advice`."""

    def __init__(self, source: str, problems, advice: str = ""):
        super().__init__(source)
        self.source, self.problems, self.advice = source, tuple(problems), advice

    def line(self) -> str:
        """The source and every problem, on one line (a restart's reason)."""
        return f"{self.source}: " + "; ".join(str(p) for p in self.problems)

    def report(self) -> None:
        """The problems under their source, then the advice, on stderr."""
        print_problems(self.source, self.problems)
        if self.advice:
            click.echo(self.advice, err=True)


class BadOptions(Exception):
    """Command-line options that do not go together, or name something unusable."""


def resolve_or_refuse(recipe: str, overrides: tuple[str, ...], world_size: int | None,
                      hostfile: str | None, include: str = "", exclude: str = "") -> Resolved:
    """Load, validate and resolve RECIPE; Refused with every problem found."""
    if world_size is not None and hostfile is not None:
        raise BadOptions("give either --world-size or --hostfile, not both")
    try:
        return resolve_file(recipe, overrides, world_size=world_size, hostfile=hostfile,
                            include=include, exclude=exclude)
    except RecipeError as exc:
        raise Refused(recipe, exc.problems) from None


def warn(problems: list[Problem], say: Say) -> None:
    """Each warning on its own indented line."""
    for warning in problems:
        say(f"  warning: {warning}")
