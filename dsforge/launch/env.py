"""Environment variables for remote ranks, made safe for a remote shell (rule H4).

DeepSpeed's pdsh runner pastes `export NAME=value` into a remote command line without
escaping `$`, backticks or quotes. dsforge builds those words itself: names must be valid
shell identifiers and every value is single-quoted with shlex.
"""

from __future__ import annotations

import re
import shlex
from typing import Mapping

from dsforge.problems import Problem, RecipeError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_names(env: Mapping[str, str]) -> None:
    """Raise RecipeError (rule H4) naming every variable name a shell would misread."""
    problems = [Problem(rule="H4", fields={"variable": name},
                        message="not a valid environment variable name",
                        fix="use letters, digits and underscores, not starting with a digit")
                for name in env if not _NAME.match(name)]
    if problems:
        raise RecipeError(problems)


def export_commands(env: Mapping[str, str]) -> list[str]:
    """`export NAME='value'` words for a remote shell; raises RecipeError on a bad name."""
    check_names(env)
    return [f"export {name}={shlex.quote(str(value))}" for name, value in env.items()]
