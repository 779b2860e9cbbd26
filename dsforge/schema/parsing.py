"""Values written as text in a recipe: time limits, data splits, the profiled steps; and the
recipe name's rule."""

from __future__ import annotations

import math
import re

from dsforge.problems import Problem
from dsforge.schema.limits import MAX_NAME, NAME_PATTERN


_UNIT_TIME = re.compile(r"([0-9]+)([smhd])")  # 90s, 45m, 3h, 2d
_DAY_TIME = re.compile(r"([0-9]+)-([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")  # D-HH[:MM[:SS]]
_CLOCK_TIME = re.compile(r"(?:([0-9]+):)?([0-9]+):([0-9]+)")  # [HH:]MM:SS
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def time_limit_seconds(value: int | str | None) -> int | None:
    """Seconds of a train.time_limit (None: no limit); ValueError when it is not one.

    An integer is seconds. A string is a whole number with a unit, `90s`, `45m`, `3h`, `2d`,
    or one of Slurm's `--time` forms that has a colon or a day: `MM:SS`, `HH:MM:SS`, `D-HH`,
    `D-HH:MM`, `D-HH:MM:SS`. A bare number in a string is refused: Slurm reads "90" as
    minutes, a recipe's integer 90 is seconds. (YAML 1.1 reads an unquoted 1:30:00 as the
    integer 5400: the same seconds.)"""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a time limit")
    if isinstance(value, int):
        return value
    text = value.strip()
    if match := _UNIT_TIME.fullmatch(text):
        return int(match[1]) * _UNIT_SECONDS[match[2]]
    if match := _DAY_TIME.fullmatch(text):
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        limits = (hours <= 23, minutes <= 59, seconds <= 59)
    elif match := _CLOCK_TIME.fullmatch(text):
        days = 0
        hours, minutes, seconds = (int(g or 0) for g in match.groups())
        limits = (minutes <= 59 or match[1] is None, seconds <= 59)
    else:
        raise ValueError(f"{value!r} is not a time limit")
    if not all(limits):
        raise ValueError(f"{value!r}: a field is out of range")
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


def split_parts(split: str) -> list[float] | None:
    """The numbers of a split string ("98,1,1" or "98/1/1"; missing trailing parts are 0), or
    None when it is not up to three finite non-negative numbers."""
    parts = [part.strip() for part in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= 3:
        return None
    try:
        values = [float(part) for part in parts]
    except ValueError:
        return None
    if any(not math.isfinite(v) or v < 0 for v in values):
        return None
    return values + [0.0] * (3 - len(values))


def split_shares(split: str) -> tuple[float, float, float] | None:
    """The train/validation/test shares of a valid split (percent adding up to 100, or
    fractions adding up to 1), or None."""
    values = split_parts(split)
    if values is None:
        return None
    total = sum(values)
    if not any(math.isclose(total, whole, rel_tol=1e-6) for whole in SPLIT_TOTALS):
        return None
    return values[0] / total, values[1] / total, values[2] / total


SPLIT_TOTALS = (100.0, 1.0)


def split_problem(split: str) -> Problem | None:
    """D6: a split is percent adding up to 100 (or fractions adding up to 1). Megatron
    normalises any numbers; dsforge refuses a total like 101, which is more often a typo."""
    values = split_parts(split)
    if values is None:
        return Problem(rule="D6", fields={"data.split": split},
                       message="must be up to three non-negative numbers for train, validation "
                               "and test, separated by commas",
                       fix='use e.g. data.split: "98,1,1"')
    if split_shares(split) is not None:
        return None
    total = sum(values)
    if total <= 0:
        fix = 'use e.g. data.split: "98,1,1"'
    else:
        fix = "use data.split: \"" + ",".join(f"{100 * v / total:.4g}" for v in values) + "\""
        given = len(re.split(r"[,/]", split))
        if 1 < total < 100 and given < 3:  # percent with a share left out: the rest for it
            rest = ",".join(f"{v:g}" for v in [*values[:given], 100 - total])
            fix = f'use data.split: "{rest}" (the rest for the next share), or {fix[4:]}'
    return Problem(rule="D6", fields={"data.split": split},
                   message=f"adds up to {total:g}: the shares of train, validation and test are "
                           "percent adding up to 100 (or fractions adding up to 1)", fix=fix)


_PROFILE = re.compile(r"([0-9]{1,9}):([0-9]{1,9})")


def profile_steps(text: str) -> tuple[int, int] | None:
    """"A:B" -> (A, B) with 0 <= A <= B; None when `text` is not such a range."""
    match = _PROFILE.fullmatch(text.strip())
    if match is None:
        return None
    first, last = int(match.group(1)), int(match.group(2))
    return (first, last) if first <= last else None


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (trial division up to sqrt(n): n may be a world of a
    million ranks, and validation asks again for every value it suggests)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def name_problems(name: str) -> list[Problem]:
    """N1: a recipe name is a plain file-name word; it names the run directory
    (runs/NAME-TIME) and must not lead out of it."""
    if len(name) <= MAX_NAME and NAME_PATTERN.fullmatch(name):
        return []
    plain = re.sub(r"[^A-Za-z0-9._-]+", "_", name[:MAX_NAME]).lstrip("._-") or "my_run"
    return [Problem(rule="N1", fields={"name": name},
                    message=f"must be a plain name: letters, digits, '.', '_' and '-', not "
                            f"starting with '.' or '-', at most {MAX_NAME} characters (it names "
                            "the run directory)",
                    fix=f"use e.g. name: {plain}")]
