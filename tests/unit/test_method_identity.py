"""A quantize unit's identity covers its own method's module and the shared code, not every method's: editing one
method's file reruns that method's variants (and what depends on them), no other unit. Checked on the units the
runner builds for recipes/methods.toml, hashed the way the runner hashes them, over a copy of the package whose files
the test edits."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.codehash import PACKAGE_DIR, code_hash
from pipeline.units import build_units
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


def test_editing_torchao_reruns_only_the_torchao_variants(units, tmp_path):
    torchao = {k for k, m in methods_of(units).items() if m == "torchao"}
    assert torchao and len(torchao) < len(methods_of(units))
    assert changed(units, tmp_path, "quant/torchao.py") == torchao


def test_editing_gptq_reruns_the_variants_built_on_its_code(units, tmp_path):
    """AWQ, RTN and AutoRound are written with GPTQ's saving code (they import quant/gptq.py): they rerun too."""
    got = changed(units, tmp_path, "quant/gptq.py")
    methods = methods_of(units)
    assert {k for k, m in methods.items() if m == "gptq"} <= got
    assert not any(m in ("torchao", "gguf", "bnb-int8") for k, m in methods.items() if k in got)
    assert all(k.startswith("quantize/") for k in got)


def test_editing_a_shared_quantize_module_reruns_every_variant(units, tmp_path):
    assert changed(units, tmp_path, "quant/api.py") == set(methods_of(units))


def test_the_serve_unit_covers_the_server_not_the_cli():
    from pipeline.codehash import code_files

    files = {p.relative_to(PACKAGE_DIR).as_posix() for p in code_files(("stages/validate.py",))}
    assert "serve/server.py" in files and "cli.py" not in files
    assert not {f for f in files if f.startswith("stages/")} - {"stages/__init__.py", "stages/validate.py", "stages/draft.py"}
