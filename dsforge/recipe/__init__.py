"""The recipe: strict loading, resolution against a world, validation (dataclasses: dsforge/schema/)."""

from dsforge.problems import Problem, RecipeError
from dsforge.recipe.layout import Topology
from dsforge.recipe.loader import load_recipe
from dsforge.recipe.resolve import Layout, Resolved, resolve, resolve_file, topology_for
from dsforge.recipe.validate import validate
from dsforge.schema import Recipe

__all__ = ["Layout", "Problem", "Recipe", "RecipeError", "Resolved", "Topology", "load_recipe",
           "resolve", "resolve_file", "topology_for", "validate"]
