"""The README is the front door and stays consistent with the code: at most 150 lines, its two commands point at
things that exist, its first paragraph names every registered method, its end-to-end figure is generated from a
committed run record (scripts/readme_figure.py), docs/report.md documents the schema version the code writes, and
every relative link (and anchor) of the README, docs/, benchmarks/ and research/ pages resolves. Torch-free."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "gpu").glob("*.md")), *sorted((ROOT / "research").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 150


def test_readme_commands_exist():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/compress run recipes/default.toml" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in text
    assert (ROOT / "scripts" / "setup.sh").is_file() and (ROOT / "recipes" / "default.toml").is_file()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["compress"] == "pipeline.app.cli:main"


def test_readme_names_every_method_first():
    from pipeline.quant.registry import METHODS

    first = README.read_text().split("\n\n")[1]
    missing = [m for m in METHODS if f"`{m}`" not in first]
    assert not missing, f"README's first paragraph does not name: {missing}"


def test_readme_figure_is_generated_from_the_record():
    figure = script_module("readme_figure")
    assert not figure.check(), "run python scripts/readme_figure.py"
    line = figure.figure()
    assert "27 min 36 s" in line and "exit 0" in line  # the committed record: 253 s set-up + 1403 s run


def test_readme_figure_check_catches_a_hand_edit(tmp_path):
    figure = script_module("readme_figure")
    text = README.read_text()
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(figure.figure(), "**16 min 26 s**, typed by hand"))
    assert figure.check(edited)


def test_report_doc_has_the_schema_version_the_code_writes():
    from pipeline.results.schema import SCHEMA_VERSION, Report

    doc = (ROOT / "docs" / "report.md").read_text()
    assert f"## report.json (schema_version {SCHEMA_VERSION})" in doc
    assert f"| `schema_version` | `{SCHEMA_VERSION}` |" in doc
    for key in Report.model_fields:  # every top-level section is documented
        assert f"`{key}" in doc, key
    for code in (0, 1, 2, 3, 4, 5, 6, 130, 143):
        assert f"\n| {code} |" in doc
    assert "ppl_ratio[served: <engine>]" in doc


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_module_commands_in_pages_exist():
    missing = []
    for page in PAGES:
        for package, name in re.findall(r"-m (benchmarks|research)\.([\w.]+)", page.read_text()):
            if not (ROOT / package / (name.replace(".", "/") + ".py")).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {package}.{name}")
    assert not missing, missing
