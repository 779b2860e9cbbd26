"""X1: the optional packages a recipe asks for are installed.

Checked before launch, so a job does not start its ranks only to find that the reporting
rank cannot track (the tracker would then warn and go on without). Packages are looked up
with importlib.util.find_spec, which imports nothing: tensorboard and wandb take seconds to
import and start nothing until asked.
"""

from __future__ import annotations

import importlib.util

from dsforge.problems import Problem
from dsforge.schema import Recipe

# recipe field -> (the package it needs, the dsforge extra that installs it, what uses it)
_NEEDS = {
    "tracking.tensorboard": ("tensorboard", "tensorboard",
                             "torch.utils.tensorboard writes its event files through it"),
    "tracking.wandb": ("wandb", "wandb", "Weights & Biases tracking runs through it"),
}


def missing_extras(recipe: Recipe) -> list[Problem]:
    """An X1 problem for each optional feature the recipe turns on whose package is missing."""
    asked = {"tracking.tensorboard": recipe.tracking.tensorboard,
             "tracking.wandb": recipe.tracking.wandb}
    return [_missing(field, *_NEEDS[field]) for field, on in asked.items()
            if on and not _installed(_NEEDS[field][0])]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _missing(field: str, package: str, extra: str, why: str) -> Problem:
    return Problem(rule="X1", fields={field: True},
                   message=f"needs the {package} package, which is not installed ({why})",
                   fix=f"pip install 'dsforge[{extra}]', or set {field}: false")
