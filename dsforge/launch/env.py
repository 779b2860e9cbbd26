"""Names of environment variables forwarded to ranks (rule H4).

The values travel inside the job word (dsforge/launch/job.py), never through a shell; a name
must still be a valid identifier, since the rank puts it into its environment and DeepSpeed's
runner would paste it into a remote command line.
"""

from __future__ import annotations

import re
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
