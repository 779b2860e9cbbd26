"""dsforge's modules import one another in one direction: no import cycles, lazy ones included,
and every import between packages goes down the layers of docs/architecture.md.

A function-level `import` that only dodges a cycle still couples the two modules both ways,
so every `import dsforge...` / `from dsforge... import` counts, at any nesting level. Importing
`dsforge.a.b` runs `dsforge/a/__init__.py` first, so it counts as importing `dsforge.a` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "dsforge"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` denotes: itself, or the closest enclosing module that exists."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # `from dsforge.x import y` imports the module dsforge.x.y when there is one
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            if name == "dsforge" or name.startswith("dsforge."):
                target = _target(name, modules)
                if target and target != module:
                    found.add(target)
                    found |= _packages_entered(target, module, modules)
    return found


def _packages_entered(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """The packages whose `__init__` importing `target` runs: those enclosing it but not the
    importer (Python has entered those already), below the top-level `dsforge`."""
    parts = target.split(".")
    enclosing = {".".join(parts[:n]) for n in range(2, len(parts))}
    return {name for name in enclosing
            if name in modules and not (importer == name or importer.startswith(name + "."))}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan): each module in
    one reaches every other through imports, so every import cycle lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle in component {sorted(component)}")


def _shown(component: set[str], graph: dict[str, set[str]]) -> str:
    paths = {name: str(path.relative_to(REPO)) for name, path in _modules().items()}
    cycle = " -> ".join(paths[name] for name in cycle_in(component, graph))
    return f"{cycle}  (modules that reach one another: {', '.join(sorted(component))})"


def test_the_graph_sees_lazy_and_from_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import dsforge.recipe.loader as loader\n"
                    "from dsforge.search import explain\n"  # a module: the edge goes to it
                    "from dsforge.problems import RecipeError\n"  # a name: the edge goes to its module
                    "def f():\n"
                    "    if True:\n"
                    "        from dsforge.translate.groups import rank_groups\n"
                    "class C:\n"
                    "    def g(self):\n"
                    "        import dsforge.cli\n"
                    "from .estimate import bubble\n"
                    "import json\n")
    assert _imports("dsforge.m", path, _modules()) == {
        "dsforge.recipe.loader", "dsforge.search.explain", "dsforge.problems",
        "dsforge.translate.groups", "dsforge.cli", "dsforge.estimate.bubble",
        # the packages those imports enter, whose __init__ runs first
        "dsforge.recipe", "dsforge.search", "dsforge.translate", "dsforge.estimate"}
    inner = tmp_path / "inner.py"  # a module of dsforge.recipe: its package is entered already
    inner.write_text("from dsforge.recipe.loader import load_recipe\nfrom dsforge.search import explain\n")
    assert _imports("dsforge.recipe.inner", inner, _modules()) == {
        "dsforge.recipe.loader", "dsforge.search.explain", "dsforge.search"}
    assert "dsforge.recipe.loader" in import_graph()["dsforge.search.command"]


def test_cycles_are_found_and_shown_as_a_path():
    graph = {"a": {"b"}, "b": {"c", "e"}, "c": {"a"}, "d": {"a"}, "e": {"b"}}
    assert tangles(graph) == [{"a", "b", "c", "e"}]
    assert cycle_in({"a", "b", "c", "e"}, graph) == ["a", "b", "c", "a"]
    assert tangles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    found = tangles(graph)
    assert not found, "import cycles:\n" + "\n".join(_shown(c, graph) for c in found)


# The packages from the top down (docs/architecture.md). A module imports only its own package
# and packages of lower layers; the packages of one layer are siblings that import neither.
LAYERS = (
    ("dsforge.__main__",),
    ("dsforge.cli",),
    ("dsforge.plan",),
    ("dsforge.search",),
    ("dsforge.calibrate",),
    ("dsforge.bench",),
    ("dsforge.launch", "dsforge.runtime", "dsforge.cost"),
    ("dsforge.translate",),
    ("dsforge.estimate",),
    ("dsforge.recipe",),
    ("dsforge.hf",),
    ("dsforge.ckpt",),
    ("dsforge.data",),
    ("dsforge.schema", "dsforge.job", "dsforge.tokenizer"),
    ("dsforge.hardware",),
    ("dsforge.problems", "dsforge.files", "dsforge.units", "dsforge.lock", "dsforge.versions",
     "dsforge.host_memory"),
)
# Inside a rank the same rule, from the top down: rank.py, then the sub-packages of runtime/.
RUNTIME_LAYERS = (("dsforge.runtime",), ("dsforge.runtime.rank",), ("dsforge.runtime.loop",),
                  ("dsforge.runtime.checkpoint",), ("dsforge.runtime.assemble",),
                  ("dsforge.runtime.guard",))


# Inside runtime/loop/: the Trainer wires its parts and runs the step; the parts sit below it
# and beside each other (none imports another, but for the bad-step part's values), each
# owning its state (issue 48).
LOOP_LAYERS = (("dsforge.runtime.loop.trainer",),
               ("dsforge.runtime.loop.checkpointer", "dsforge.runtime.loop.reporter",
                "dsforge.runtime.loop.meter"),
               ("dsforge.runtime.loop.bad_steps",))


def _layer_of(module: str, layers) -> tuple[int, str] | None:
    """(layer index, the unit of `layers` that holds `module`), or None outside them all."""
    for index, layer in enumerate(layers):
        for unit in layer:
            if module == unit or module.startswith(unit + "."):
                return index, unit
    return None


def downward_problems(graph: dict[str, set[str]], layers) -> list[str]:
    """Each import from one unit of `layers` to another that does not go down a layer."""
    problems = []
    for module, targets in sorted(graph.items()):
        here = _layer_of(module, layers)
        for target in sorted(targets):
            there = _layer_of(target, layers)
            if here is None or there is None or here[1] == there[1] or there[0] > here[0]:
                continue
            way = "across its layer" if there[0] == here[0] else "up"
            problems.append(f"{module} imports {target}: {way}, from {here[1]} to {there[1]}")
    return problems


def test_every_module_has_a_layer():
    graph = import_graph()
    assert [m for m in graph if m != "dsforge" and _layer_of(m, LAYERS) is None] == []
    runtime = [m for m in graph if m.startswith("dsforge.runtime")]
    assert [m for m in runtime if _layer_of(m, RUNTIME_LAYERS) is None] == []


def test_imports_go_down_the_layers():
    graph = import_graph()
    problems = downward_problems(graph, LAYERS) + downward_problems(graph, RUNTIME_LAYERS[1:]) \
        + downward_problems(graph, LOOP_LAYERS)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_the_layer_check_sees_upward_and_sideways_imports():
    layers = (("a",), ("b", "c"), ("d",))
    graph = {"a.x": {"b.y", "d"}, "b.y": {"c.z", "b.w"}, "d": {"a.x"}, "c.z": set(), "b.w": set()}
    assert downward_problems(graph, layers) == [
        "b.y imports c.z: across its layer, from b to c", "d imports a.x: up, from d to a"]



def test_the_cli_stays_thin():
    """cli.py gathers commands and hands them on (docs/architecture.md): at most 300 lines, and
    `dsforge run`'s command body under 25 (its policy lives in launch/entry.py). A command
    with many options keeps them beside its code (search/options.py, launch/sbatch.py), its
    logic elsewhere too."""
    import ast
    import inspect

    from dsforge import cli

    source = inspect.getsource(cli)
    assert len(source.splitlines()) <= 300
    run = next(node for node in ast.parse(source).body
               if isinstance(node, ast.FunctionDef) and node.name == "run")
    assert run.end_lineno - run.lineno + 1 < 25


def test_no_module_grows_past_600_lines():
    """Small modules with obvious names (issue 41): a module past 600 lines is split by what
    it holds (as schema/ is by recipe section) before it grows further; the package's and the
    benchmarks' alike (the GPU kit's, issue 48)."""
    modules = [p for folder in ("dsforge", "benchmarks")
               for p in sorted((REPO / folder).rglob("*.py"))]
    assert REPO / "benchmarks" / "gpu" / "kit.py" in modules
    long = {str(p.relative_to(REPO)): n for p in modules
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_the_cost_model_needs_no_torch():
    """dsforge/cost/ is torch-free (a laptop plans and refits without it)."""
    import subprocess
    import sys

    code = ("import sys, dsforge.cost.step_time, dsforge.cost.fit, dsforge.cost.profile, "
            "dsforge.cost.floor_fit; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


# Where a user names a run directory, or a rank reads it from its job word: the only places
# in the package that make a RunDir from a path (issue 41). Every other function takes one.
RUN_DIR_MADE_IN = {"job/run_dir.py", "job/word.py", "launch/entry.py", "hf/export.py",
                   "bench/run.py"}


def test_the_run_directory_travels_as_a_value():
    """A signature says which directory it means: `run_dir: RunDir`, never a bare Path (but
    for the --run-dir options a user gives), and RunDir(path) only where a directory is named."""
    import re

    package = REPO / "dsforge"
    made = {str(p.relative_to(package)) for p in package.rglob("*.py")
            if re.search(r"\bRunDir\(", p.read_text())}
    assert made <= RUN_DIR_MADE_IN, made - RUN_DIR_MADE_IN
    # The options' --run-dir (RunOptions, sbatch) and the texts that carry its path: the job
    # word's field and the batch script's.
    bare = {str(p.relative_to(package)) for p in package.rglob("*.py")
            if re.search(r"\brun_dir: (Path|str)\b", p.read_text())}
    assert bare == {"launch/run_options.py", "launch/sbatch.py", "job/word.py", "launch/slurm.py"}, bare
