"""The machinery that suggests fixes for the cross-section rules (validate.py, data_rules/).

A rule gets the recipe and a `Context`: the world, dp and the batch sizes, and what a fix
needs to check the values it offers. `working` keeps the values of one field with which the
rule holds, checked by running every rule again with that one value changed: it clears the
problem, breaks no rule that holds now, and leaves no problem naming that field. The rest
picks the values to try (divisors, multiples near the current value, ranges cut down to the
values near it) and writes them into the fix ("use parallel.tp in {1, 2, 4}").

The batch fix (B1, B2, L4, L6) is found without running the rules again, from the six numbers
those rules read; the split fix (D10, D11) tries splits with a larger validation share.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from dsforge.problems import Problem, RecipeError
from dsforge.recipe.layout import BatchSizes, Topology, derive_batch
from dsforge.schema import Recipe, TrainConfig, divisors, split_parts


@dataclass(frozen=True)
class Context:
    """What a rule is given besides the recipe."""
    topology: Topology | None
    dp: int | None  # None when the world size is unknown or does not divide
    batch: BatchSizes | None  # None when dp is unknown or the batch does not divide
    # Rule ids the recipe breaks now; None while checking a suggested value (which must not
    # look for suggestions of its own).
    failing: frozenset[str] | None
    # Every rule again, on a recipe with one field changed, in this world, looking for no fixes.
    check: Callable[[Recipe], list[Problem]]


Rule = Callable[[Recipe, Context], Iterator[Problem]]


# ------------------------------------------------------------ checking suggested values

def _with(recipe: Recipe, path: str, value: Any) -> Recipe | None:
    """The recipe with one field (dotted path, e.g. "model.moe.top_k") changed; None when the
    field's own section rejects the value."""
    *sections, name = path.split(".")

    def put(obj: Any, keys: list[str]) -> Any:
        if not keys:
            return dataclasses.replace(obj, **{name: value})
        return dataclasses.replace(obj, **{keys[0]: put(getattr(obj, keys[0]), keys[1:])})

    try:
        return put(recipe, sections)
    except RecipeError:
        return None


def working(recipe: Recipe, ctx: Context, rule: str, path: str, values: Iterable[Any]) -> list[Any]:
    """The values of `path` with which `rule` holds, no rule breaks that holds now, and no
    problem names `path` (which would have the user change it again)."""
    if ctx.failing is None:
        return []
    found = []
    for value in values:
        candidate = _with(recipe, path, value)
        if candidate is None:
            continue
        now = ctx.check(candidate)
        if ({p.rule for p in now} <= ctx.failing - {rule}
                and not any(path in p.fields for p in now)):
            found.append(value)
    return found


def divisors_that_work(recipe: Recipe, ctx: Context, rule: str, path: str, number: int) -> str:
    """'{1, 2, 4}': the divisors of `number` that work for `path`; '' when none do."""
    return choices(working(recipe, ctx, rule, path, divisors(number)))


def multiples_that_work(recipe: Recipe, ctx: Context, rule: str, path: str, step: int,
                        current: int) -> str:
    """'{..., 72, 96, 120, ...}': the multiples of `step` nearest `current` that work."""
    return around(working(recipe, ctx, rule, path, _multiples(step, current)), current)


def largest_that_work(recipe: Recipe, ctx: Context, rule: str, path: str, most: int) -> str:
    """'{..., a, b}': the largest values <= `most` that work; '' when none do."""
    return around(working(recipe, ctx, rule, path, range(max(1, most - 63), most + 1)), most)


# ------------------------------------------------------------------- writing the fix

def use(options: dict[str, str], otherwise: str) -> str:
    """'use a in {..}, or b in {..}' for the options that have values, else `otherwise`."""
    shown = [f"{path} in {values}" for path, values in options.items() if values]
    return "use " + ", or ".join(shown) if shown else otherwise


def choices(values: list[int], limit: int = 12) -> str:
    """'{1, 2, 4}'; '' when there are none."""
    if not values:
        return ""
    shown = ", ".join(map(str, values[:limit]))
    return "{" + shown + (", ..." if len(values) > limit else "") + "}"


def around(values: list[int], current: int, count: int = 4) -> str:
    """Up to `count` of the ascending `values` nearest `current`: one below it, the rest above;
    '' when there are none."""
    if not values:
        return ""
    start = max(0, min(bisect.bisect_left(values, current) - 1, len(values) - count))
    shown = ", ".join(map(str, values[start:start + count]))
    more = ", ..." if start + count < len(values) else ""
    return "{" + ("..., " if start else "") + shown + more + "}"


# ------------------------------------------------------------------- values to try

def _multiples(step: int, current: int) -> list[int]:
    return _near(range(step, 2 * current + 4 * step, step), (current,))


_NEAR = 256  # candidate values tried for a suggestion: enough for around, bounded for any input


def _near(values: range, anchors: Iterable[int]) -> list[int]:
    """`values` when there are few, else those near each anchor (a few below, more above):
    suggestions show the valid values nearest the current one (around), and a range that
    grows with the value (global_batch 10**7) must not be tried whole."""
    if len(values) <= _NEAR:
        return list(values)
    picked: set[int] = set()
    for anchor in anchors:
        at = max(0, min(len(values), (anchor - values.start) // values.step))
        picked.update(values[max(0, at - _NEAR // 8): at + _NEAR // 2])
    return sorted(picked)


# ------------------------------------------------------------------------ the batch fix

BATCH_FIELDS = ("global_batch", "micro_batch", "grad_accum")


def batch_fields(train: TrainConfig) -> dict[str, int]:
    """The batch fields the recipe sets (the others are derived)."""
    return {f"train.{name}": getattr(train, name) for name in BATCH_FIELDS
            if getattr(train, name) is not None}


def microbatch_rule(pp: int, vpp: int, microbatches: int) -> str | None:
    """L6/L4, or None when a pipeline can run this many microbatches per step (the rule,
    validate.pipeline_microbatches, and the batch fix both ask)."""
    if pp == 1:
        return None
    if microbatches < pp:
        return "L6"
    # Megatron-Core groups microbatches per virtual stage in groups of pp; a remainder group
    # smaller than pp raises at the first step.
    return "L4" if vpp > 1 and microbatches % pp else None


def batch_fix(recipe: Recipe, ctx: Context) -> str:
    """Values of the batch fields the recipe sets (global_batch when it sets none), one changed
    at a time, with which the batch and pipeline-microbatch rules hold (the only rules that
    depend on them)."""
    t, p = recipe.train, recipe.parallel
    return _batch_fix_for(t.global_batch, t.micro_batch, t.grad_accum, ctx.dp, p.pp, p.vpp)


# Depends on these six numbers only: a search rejects many recipes that differ in nothing else.
@functools.lru_cache(maxsize=4096)
def _batch_fix_for(global_batch: int | None, micro_batch: int | None, grad_accum: int | None,
                   dp: int, pp: int, vpp: int) -> str:
    given = {"global_batch": global_batch, "micro_batch": micro_batch, "grad_accum": grad_accum}
    options = {}
    for name in [n for n in BATCH_FIELDS if given[n] is not None] or ["global_batch"]:
        fits = []
        for value in _batch_candidates(name, given, dp, pp):
            sizes = derive_batch(**{**given, name: value}, dp=dp)
            if sizes is not None and microbatch_rule(pp, vpp, sizes.grad_accum) is None:
                fits.append(value)
        options[f"train.{name}"] = around(fits, given[name] or 1)
    return use(options, "change train.global_batch, micro_batch or grad_accum")


def _batch_candidates(name: str, given: dict[str, int | None], dp: int, pp: int) -> list[int]:
    """Values of train.`name` to try, near its current value and near the smallest batch a
    pipeline of pp stages runs (pp microbatches)."""
    current = given[name] or 1
    if name == "global_batch":  # a multiple of dp, up to well past the current sizes
        pipeline = pp * (given["micro_batch"] or 1) * (given["grad_accum"] or 1)
        most = 4 * max((given["global_batch"] or 1) // dp, pipeline) + 4
        return _near(range(dp, dp * most + 1, dp), (current, pipeline * dp))
    if given["global_batch"] is not None:
        return _near(range(1, given["global_batch"] // dp + 1), (current, pp))
    return _near(range(1, 4 * max(current, pp) + 1), (current, pp))


# ------------------------------------------------------------------------ the split fix

def split_fix(recipe: Recipe, ctx: Context, rule: str, otherwise: str) -> str:
    """'use data.split: "X", OTHERWISE' with the split nearest the recipe's that clears `rule`
    (checked by validating again), or OTHERWISE alone."""
    found = working(recipe, ctx, rule, "data.split", _split_candidates(recipe.data.split))
    if not found:
        return otherwise.removeprefix("or ")
    return f'use data.split: "{found[0]}"' + (f", {otherwise}" if otherwise else "")


_SHARES = (0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 25, 30, 40, 50)  # validation percent
_COMMON = ((98, 1, 1), (90, 5, 5), (80, 10, 10))


def _split_candidates(split: str) -> list[str]:
    """Splits with a larger validation share taken from training (the test share kept), then
    common ones; written as the recipe writes its split (percent or fractions)."""
    values = split_parts(split)
    total = sum(values)
    scale = 1.0 if math.isclose(total, 1.0, rel_tol=1e-6) else 100.0
    _, validation, test = (100 * v / total for v in values)
    candidates = [(100 - share - test, share, test) for share in _SHARES
                  if share > validation and 100 - share - test > 0]
    written = [",".join(f"{v * scale / 100:.4g}" for v in shares)
               for shares in [*candidates, *_COMMON]]
    return list(dict.fromkeys(written))
