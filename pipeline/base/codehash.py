"""The code a unit's outputs come from, found by reading imports instead of listing files by hand.

A unit names its entry modules and any data files it reads, as paths under pipeline/:

    Unit("quantize/w4", ..., code=("stages/quantize.py",))
    Unit("load", ..., code=("stages/load.py", "model_configs/*.json"))

`code_files` follows, from each entry module, transitively within the pipeline package:
  - `import pipeline.x`, `from pipeline.x import y` (y itself when it is a module), `from . import y`,
    at module level and inside functions alike (a lazy import is still an import);
  - string constants naming a pipeline module: "pipeline.quant.gptqmodel_driver" that a method imports by name,
    "-m", "pipeline.base.worker" in a subprocess command, "pipeline.x:function";
  - the package __init__.py files Python runs on the way to a module;
  - data files a module declares it reads, as a module-level `CODE_DATA = ("model_configs/*.json",)`.
`code_hash` is the sha256 of those files' paths and bytes: editing a file a unit imports reruns it, editing
any other file does not.

The bytes are the code this process loaded, not the disk at unit start: `LOADED` reads the package's files once,
when the harness imports this module at the start of a run (`Loaded`). A file edited during a long run would
otherwise be hashed as new while this process runs the old one, and a later run with the new code would skip the
unit. `Loaded.changed(entries)` names a unit's files that differ on disk from what was loaded (its worker processes
would run those): the runner then records no outputs for it (pipeline/app/runner.py).

Plug-ins are never followed from an import: the registry imports every method file
(pipeline/quant/methods/<name>.py), and a unit that quantizes, measures or exports a variant names its method's file
as an entry (pipeline.quant.registry.method_code), so editing one method reruns that method's units and no other's.
A method file imports no other method file (tests/unit/test_method_identity.py).

The harness is never followed: pipeline.app.runner records outputs, it does not compute them (nor does pipeline.app.cli,
nor pipeline.base.unit, the Unit types every stage imports), so its report and manifest code (which imports the report
renderers) is in no unit's identity; this module and pipeline.base.identity compute cache keys (a change to them changes
the keys anyway).
"""
from __future__ import annotations

import ast
import hashlib
import re
from functools import lru_cache
from pathlib import Path

PACKAGE = "pipeline"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # pipeline/ (this file is pipeline/base/codehash.py)
# pipeline.app.cli parses arguments and dispatches (a subprocess that runs `-m pipeline.app.cli serve` names the module
# that does the work beside it); followed, it would put every stage's code in any unit that spawns a CLI command
HARNESS = frozenset({"pipeline.app.runner", "pipeline.base.unit", "pipeline.base.codehash", "pipeline.base.identity",
                     "pipeline.app.cli"})
# reached only as a unit's entry, never through an import (see above)
PLUGINS = ("pipeline.quant.methods.",)
DATA_DECLARATION = "CODE_DATA"
_MODULE_STRING = re.compile(r"pipeline(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*)?")


def module_name(path: Path, root: Path = PACKAGE_DIR) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str, root: Path = PACKAGE_DIR) -> Path | None:
    """The file Python runs for module `name` (a .py or a package's __init__.py); None for a namespace
    package (a folder without __init__.py) or a name that is not a module of the package."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _is_module(name: str, root: Path) -> bool:
    return module_file(name, root) is not None or (name != PACKAGE and root.joinpath(*name.split(".")[1:]).is_dir())


class Loaded:
    """The files under `root` as this process found them when it made this snapshot (the start of a run)."""

    def __init__(self, root: Path = PACKAGE_DIR) -> None:
        self.root = Path(root).resolve()
        self.files = {p: p.read_bytes() for p in sorted(self.root.rglob("*"))
                      if p.is_file() and "__pycache__" not in p.parts}

    def read(self, path: Path) -> bytes:
        """The file as loaded; one that appeared since (no process of this run has run it yet): as on disk."""
        got = self.files.get(path)
        return got if got is not None else path.read_bytes()

    def changed(self, entries: tuple[str, ...]) -> list[str]:
        """The entries' files (as loaded) whose bytes on disk are no longer the loaded ones, relative to root."""
        out = []
        for p in code_files(tuple(entries), self.root, self):
            try:
                now: bytes | None = p.read_bytes()
            except OSError:
                now = None
            if now != self.read(p):
                out.append(p.relative_to(self.root).as_posix())
        return out


LOADED = Loaded()  # at import: the harness (pipeline.app.runner) imports this module when a run starts


def _scan(path: Path, root: Path, loaded: Loaded | None = None) -> tuple[frozenset[str], tuple[str, ...]]:
    """(pipeline module names `path` imports or names, data globs it declares)."""
    source = loaded.read(path) if loaded is not None else path.read_bytes()
    return _scan_source(source, module_name(path, root), path.name == "__init__.py")


@lru_cache(maxsize=512)
def _scan_source(source: bytes, module: str, is_package: bool) -> tuple[frozenset[str], tuple[str, ...]]:
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.fullmatch(node.value):
            names.add(node.value.partition(":")[0])
    data: tuple[str, ...] = ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == DATA_DECLARATION
                                                for t in node.targets):
            data = tuple(ast.literal_eval(node.value))
    return frozenset(n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")), data


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _glob(pattern: str, root: Path) -> list[Path]:
    found = sorted(p for p in root.glob(pattern) if p.is_file())
    if not found:
        raise ValueError(f"code entry {pattern!r} matches no file under {root}")
    return found


def code_files(entries: tuple[str, ...], root: Path = PACKAGE_DIR, loaded: Loaded | None = None) -> list[Path]:
    """Every file under `root` that the entries' code runs or reads (see the module docstring), sorted; imports
    read from `loaded` when given."""
    root = Path(root).resolve()
    files: set[Path] = set()
    todo: list[str] = []
    for pattern in entries:
        for p in _glob(pattern, root):
            if p.suffix == ".py":
                todo.append(module_name(p, root))
            else:
                files.add(p)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name in HARNESS:
            continue
        seen.add(name)
        todo.extend(n for n in _with_parents(name)[:-1] if n not in seen)
        path = module_file(name, root)
        if path is None:
            continue  # a namespace package, or an attribute imported with `from pipeline.x import name`
        files.add(path)
        imported, data = _scan(path, root, loaded)
        todo.extend(n for n in imported if n not in seen and _is_module(n, root) and not n.startswith(PLUGINS))
        for pattern in data:
            files.update(_glob(pattern, root))
    return sorted(files)


def code_hash(entries: tuple[str, ...], root: Path = PACKAGE_DIR, loaded: Loaded | None = None) -> str:
    """sha256 of the source and data files a unit's outputs come from (paths and bytes): as `loaded` holds them
    when given (the runner passes LOADED: the code this process loaded), else as on disk."""
    root = Path(root).resolve()
    h = hashlib.sha256()
    for p in code_files(tuple(entries), root, loaded):
        data = loaded.read(p) if loaded is not None else p.read_bytes()
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + data + b"\0")
    return h.hexdigest()
