"""A unit's identity covers its own variant's method file and the shared code, not every method's: editing one
method's file (pipeline/quant/methods/<name>.py) reruns that method's variants and the units that measure or export
them, no other unit. Checked on the units the runner builds for recipes/methods.toml, hashed the way the runner hashes
them, over a copy of the package whose files the test edits; tests/e2e/test_method_edit_rerun.py checks it through
the CLI."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.base.codehash import PACKAGE_DIR, code_hash, module_file
from pipeline.app.units import build_units
from pipeline.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def units():
    recipe = load_recipe(ROOT / "recipes" / "methods.toml")
    head, exports = build_units(recipe)
    return {u.key: u for u in head + exports}


def hashes(units, root: Path) -> dict[str, str]:
    return {k: code_hash(u.code, root) for k, u in units.items()}


def edited(tmp_path: Path, rel: str) -> Path:
    root = tmp_path / "pipeline"
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    with open(root / rel, "a") as f:
        f.write("\n# edited\n")
    return root


def changed(units, tmp_path, rel) -> set[str]:
    before = hashes(units, PACKAGE_DIR)
    after = hashes(units, edited(tmp_path, rel))
    return {k for k in units if before[k] != after[k]}


def methods_of(units) -> dict[str, str]:
    return {k: u.config["variant"]["method"] for k, u in units.items() if k.startswith("quantize/")}


def variant_units(units, names: set[str]) -> set[str]:
    """Every unit of these variants: quantize/<v>, validate/<v>/..., export/<v>."""
    return {k for k in units if any(k == f"quantize/{n}" or k.startswith(f"validate/{n}/") or k == f"export/{n}"
                                    for n in names)}


def names_of(units, *methods: str) -> set[str]:
    return {k.removeprefix("quantize/") for k, m in methods_of(units).items() if m in methods}


def test_editing_torchao_reruns_only_the_torchao_variants(units, tmp_path):
    torchao = names_of(units, "torchao")
    assert torchao and len(torchao) < len(methods_of(units))
    assert changed(units, tmp_path, "quant/methods/torchao.py") == variant_units(units, torchao)


def test_editing_gptq_reruns_only_the_gptq_variants(units, tmp_path):
    """AWQ and AutoRound share GPTQModel's driver (quant/gptqmodel_driver.py), not GPTQ's method file."""
    assert changed(units, tmp_path, "quant/methods/gptq.py") == variant_units(units, names_of(units, "gptq"))


def test_editing_a_methods_work_reruns_only_its_variants(units, tmp_path):
    """The method file names its work module (pipeline/quant/work/gptq.py), which the identity follows."""
    assert changed(units, tmp_path, "quant/work/gptq.py") == variant_units(units, names_of(units, "gptq"))


def test_editing_the_shared_gptqmodel_driver_reruns_the_methods_built_on_it(units, tmp_path):
    """(their method files import it, and a variant's validate and export units name its method file)"""
    got = changed(units, tmp_path, "quant/gptqmodel_driver.py")
    assert got == variant_units(units, names_of(units, "gptq", "awq", "autoround", "rtn"))


def test_editing_a_method_the_recipe_does_not_use_reruns_nothing(units, tmp_path):
    assert not names_of(units, "bnb-nf4") and changed(units, tmp_path, "quant/methods/bnb.py") == set()


def test_editing_a_shared_quantize_module_reruns_every_variant(units, tmp_path):
    assert changed(units, tmp_path, "quant/api.py") == set(methods_of(units))


def test_a_method_file_imports_no_other_method_file():
    """The identity rule above relies on it (pipeline/base/codehash.py PLUGINS): what two methods share lives in a module
    of its own."""
    from tests.unit.test_import_graph import imports

    folder = PACKAGE_DIR / "quant" / "methods"
    for path in sorted(folder.glob("*.py")):
        others = {m for m in imports(path) if m.startswith("pipeline.quant.methods.")}
        assert not others, f"{path.name} imports {sorted(others)}"


def test_a_work_module_imports_no_other_method_or_work_module():
    """A method's work (pipeline/quant/work/<name>.py, which its method file names) is in that method's identity
    only: it imports its own method file at most, and no other method's file or work."""
    from pipeline.quant.registry import METHODS
    from tests.unit.test_import_graph import imports

    for name in METHODS:
        method = METHODS.get(name)
        own = type(method).__module__
        for work in filter(None, (method.work, method.reload_work)):
            others = {m for m in imports(module_file(work)) if m.startswith(("pipeline.quant.methods.",
                                                                               "pipeline.quant.work.")) and m != own}
            assert not others, f"{work} imports {sorted(others)}"


def test_every_method_file_is_registered_and_declares_its_file():
    from pipeline.quant.registry import METHOD_MODULES, METHODS

    folder = PACKAGE_DIR / "quant" / "methods"
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") == sorted(METHOD_MODULES)
    for name in METHODS:
        assert (PACKAGE_DIR / METHODS.get(name).file).is_file(), name


def test_the_serve_unit_covers_the_server_not_the_cli():
    from pipeline.base.codehash import code_files

    files = {p.relative_to(PACKAGE_DIR).as_posix() for p in code_files(("stages/validate.py",))}
    assert "serve/server.py" in files and "cli.py" not in files
    # stages/kinds.py: the unit-key classes every stage names its own and its deps' keys with (no stage code)
    assert not {f for f in files if f.startswith("stages/")} - {"stages/__init__.py", "stages/validate.py", "stages/draft.py",
                                                                "stages/kinds.py"}
