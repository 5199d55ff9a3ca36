"""The package's import graph has no cycles and runs down its layers: every `import pipeline.x` /
`from pipeline.x import y`, at module level or inside a function (a lazy import is still a dependency), read from the
source with ast."""
from __future__ import annotations

import ast
from pathlib import Path

from pipeline.base.codehash import PACKAGE_DIR, module_file, module_name


def imports(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            out.update(f"{base}.{a.name}" if module_file(f"{base}.{a.name}") else base for a in node.names)
    return {m for m in out if m.startswith("pipeline.") and module_file(m) is not None and m != name}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    g = graph()
    assert "pipeline.base.worker" in g and "pipeline.eval.speed" in g["pipeline.stages.validate"] | {"pipeline.eval.speed"}
    assert cycles(g) == []


def test_no_private_names_are_imported_across_packages():
    """`from pipeline.a.b import _private` only inside pipeline.a (a private name is its package's business)."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        here = module_name(path).rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("pipeline."):
                there = node.module if path.name != "__init__.py" and module_file(node.module) and \
                    module_file(node.module).name == "__init__.py" else node.module.rpartition(".")[0]
                for a in node.names:
                    if a.name.startswith("_") and there != here:
                        found.append(f"{module_name(path)} imports {node.module}.{a.name}")
    assert found == []


def test_every_pipeline_import_names_a_module_that_exists():
    """A moved module leaves no import of its old name behind (the graph above skips names with no file)."""
    missing = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("pipeline"):
                if module_file(node.module) is None and not (PACKAGE_DIR / node.module.split(".", 1)[-1]
                                                              .replace(".", "/")).is_dir():
                    missing.append(f"{module_name(path)}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                missing += [f"{module_name(path)}: import {a.name}" for a in node.names
                            if a.name.startswith("pipeline.") and module_file(a.name) is None]
    assert not missing, missing


# ---------------------------------------------------------------- layers (the design's "Layout"), ground first
# A module imports only from its own package and from packages on lower floors. Packages on one floor are siblings:
# they import none of each other. A root module (pipeline/recipe.py, ...) is a package of its own.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("base",),  # errors, files, env, registries, code identity, Unit types, workers, peak memory, logging
    ("model", "data"),  # where weights and text come from; model families as data
    ("budget",),  # memory formulas and run-time offload decisions
    ("quant",),  # the methods behind one registry, and loading any checkpoint they write
    ("speculative", "eval", "serve"),  # measuring
    ("results",),  # report.json: schema, merges, gates, renderers
    ("publish",),
    ("stages",),
    ("recipe", "estimate"),
    ("plan",),
    ("app",),  # cli, execute, runner, units, executors, sweep
)
FLOOR = {package: n for n, floor in enumerate(LAYERS) for package in floor}


def package_of(module: str) -> str:
    """"pipeline.eval.speed" -> "eval", "pipeline.recipe" -> "recipe"; pipeline/__init__.py stands on the ground."""
    return module.split(".")[1] if "." in module else "base"


def function_level_imports() -> list[str]:
    """`module:line` of every import of a pipeline module inside a function."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import) and any(a.name.startswith("pipeline") for a in node.names) or \
                            isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("pipeline")):
                        found.append(f"{module_name(path)}:{node.lineno}")
    return sorted(set(found))


def test_every_package_has_a_floor():
    assert {package_of(m) for m in graph()} <= set(FLOOR), "a new package: give it a floor in LAYERS"


# ---------------------------------------------------------------- modules loaded by a declared name
# Some modules are imported by a dotted name instead of an import statement, each kind through one loading point: a
# plug-in's work, a quantization method's (QuantMethod.work / reload_work) or a serving engine's (Engine.work), loaded
# by pipeline.base.registry.load_work; and a CLI command (pipeline.app.cli COMMANDS, loaded by its LazyGroup). A
# declared name is a dependency like an import: it must resolve, and it counts for the layer order (not for the cycle
# check: a work module imports its own plug-in's declarations, which name it only to load it when the work runs,
# never on import).


def named_imports() -> dict[str, set[str]]:
    """{declaring module: the modules it names for loading}."""
    from pipeline.app.cli import COMMANDS
    from pipeline.eval.measures import all_measurements
    from pipeline.quant.registry import METHODS
    from pipeline.results.render import render_module
    from pipeline.serve.engines import ENGINES

    out = {"pipeline.app.cli": {path.partition(":")[0] for path, _ in COMMANDS.values()}}
    for m in all_measurements():  # a measurement's worker task, and its report.md section (loaded by render.py)
        out.setdefault(type(m).__module__, set()).add(m.work.partition(":")[0])
        if m.renders:
            out.setdefault("pipeline.results.render", set()).add(render_module(m.key))
    plugins = [METHODS.get(n) for n in METHODS] + [ENGINES.get(n) for n in ENGINES]
    for plugin in plugins:
        for attr in ("work", "reload_work"):
            if getattr(plugin, attr, None):
                owner = next(c for c in type(plugin).__mro__ if attr in vars(c))  # the class that declares it
                out.setdefault(owner.__module__, set()).add(getattr(plugin, attr))
    return out


def top_level_names(module: str) -> set[str]:
    """What a module of the package defines or imports at its top (read from the source); empty if it has no file."""
    path = module_file(module)
    if path is None:
        return set()
    names: set[str] = set()
    for node in ast.parse(path.read_bytes()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_method_names_a_work_module_that_resolves():
    from pipeline.quant.registry import METHODS

    for name in METHODS:
        method = METHODS.get(name)
        assert isinstance(getattr(method, "work", None), str), f"{name}: no `work` module declared"
        assert {"quantize", "save"} <= top_level_names(method.work), f"{name}: {method.work} has no quantize/save"
        if method.reload_work is not None:
            assert "load_own" in top_level_names(method.reload_work), f"{name}: {method.reload_work}"
    works = set().union(*named_imports().values())
    assert {"pipeline.quant.work.gptq", "pipeline.quant.work.gptq_kernels"} <= works


def test_every_engine_work_module_resolves():
    from pipeline.serve.engines import ENGINES

    works = {n: ENGINES.get(n).work for n in ENGINES}
    assert works["transformers"] == "pipeline.serve.work.transformers" and works["llama.cpp"]
    for name, work in works.items():
        assert work is None or "serve" in top_level_names(work), f"{name}: {work} has no serve()"


def test_every_cli_command_resolves_with_the_help_it_declares():
    """`compress --help` lists each command from its declared help, without importing it: the declaration is the
    command's own first paragraph."""
    import importlib

    import click

    from pipeline.app.cli import COMMANDS, cli

    assert cli.list_commands(click.Context(cli)) == sorted(COMMANDS)
    for name, (path, declared) in COMMANDS.items():
        module, _, attr = path.partition(":")
        assert attr in top_level_names(module), path
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command) and command.name == name, path
        assert " ".join(command.help.split("\n\n")[0].split()) == declared, f"{name}: declared help is not its own"


def test_a_declared_name_that_runs_up_the_layers_is_caught():
    named = named_imports()
    assert "pipeline.quant.work.rtn" in named["pipeline.quant.methods.rtn"]
    assert "pipeline.app.commands.check" in named["pipeline.app.cli"]
    assert upward({"pipeline.quant.methods.x": {"pipeline.app.commands.check"}}) == \
        ["pipeline.quant.methods.x -> pipeline.app.commands.check"]


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {t}" for m, targets in edges.items() for t in sorted(targets)
            if package_of(m) != package_of(t) and FLOOR[package_of(t)] >= FLOOR[package_of(m)]]


def test_no_import_runs_up_the_layers():
    edges = graph()
    for m, named in named_imports().items():
        edges[m] = edges[m] | named
    up = upward(edges)
    print(f"\n{len(function_level_imports())} function-level imports of pipeline modules")
    assert up == [], "imports from a floor to a higher one, or between siblings"


def test_no_package_level_cycles():
    packages: dict[str, set[str]] = {}
    for m, targets in graph().items():
        packages.setdefault(package_of(m), set()).update(package_of(t) for t in targets if package_of(t) != package_of(m))
    assert cycles(packages) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]], "the check itself finds a package cycle"


# ---------------------------------------------------------------- imports inside functions
# An import inside a function stays only where a library must load late, and says why in a `# late:` comment on its
# line, or on the line above the run of imports it opens. The reasons, by kind:
#   - `compress check` and `compress --help` load no torch: a module they import (the recipe schema, the plan, the
#     model and data sources) reaches torch, a data reader or the Hub client in a function;
#   - tame() (pipeline/base/env.py) and the offline switches of eval/tasks.py set environment variables libraries
#     read once, on import: those libraries are imported after them;
#   - optional extras (ray, llama-cpp-python's quantizer) load only when a recipe or command uses them;
#   - a registry's plug-in that the registry's own consumers import (serve/engines/vllm.py -> serve/server.py).
# Everything else is imported at the top of its module. What used to load late for the first reason now lives in
# modules loaded by a declared name (see "modules loaded by a declared name" above): each quantization method's and
# serving engine's work (pipeline/quant/work/, pipeline/serve/work/) and each CLI command (pipeline/app/commands/);
# the run after tame() is pipeline/app/execute_tamed.py, imported once. #33 asked for at most 30.
MAX_FUNCTION_LEVEL_IMPORTS = 25
LATE = "# late:"


def late_imports(root: Path = PACKAGE_DIR) -> list[tuple[str, bool]]:
    """(`module:line`, whether it gives its reason) of every import statement inside a function of pipeline/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        seen: set[int] = set()
        for fn in ast.walk(ast.parse(path.read_bytes())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            bodies = [b for n in ast.walk(fn) for b in (getattr(n, f, None) for f in ("body", "orelse", "finalbody"))
                      if isinstance(b, list)]
            for body in bodies:
                opener = None
                for st in body:
                    if not isinstance(st, (ast.Import, ast.ImportFrom)):
                        opener = None
                        continue
                    opener = opener or st
                    if id(st) in seen:
                        continue
                    seen.add(id(st))
                    own = lines[st.lineno - 1: st.end_lineno]
                    above = lines[opener.lineno - 2] if opener.lineno > 1 else ""
                    found.append((f"{module_name(path, root)}:{st.lineno}",
                                  any(LATE in ln for ln in own) or above.strip().startswith(LATE)))
    return found


def test_late_imports_are_counted_with_their_reasons(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os\n"  # module level: not counted
        "def f():\n"
        "    # late: why\n"
        "    import a\n"
        "    from b import c  # the comment above covers the run\n"
        "    x = 1\n"
        "    import d\n"
        "    if x:\n"
        "        import e  # late: on its own line\n"
        "    class K:\n"
        "        def g(self):\n"
        "            import h\n")
    assert late_imports(tmp_path) == [("pipeline.m:4", True), ("pipeline.m:5", True), ("pipeline.m:7", False),
                                      ("pipeline.m:9", True), ("pipeline.m:12", False)]


def test_function_level_imports_are_few_and_say_why():
    found = late_imports()
    print(f"\n{len(found)} function-level imports (bound {MAX_FUNCTION_LEVEL_IMPORTS})")
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, "import it at the top of its module, or say why it loads late"
    assert [where for where, why in found if not why] == [], f"each needs a '{LATE} <reason>' comment"
