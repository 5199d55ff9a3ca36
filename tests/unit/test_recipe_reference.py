"""docs/recipe.md is generated from the recipe's pydantic models (scripts/recipe_reference.py): the committed file is
current, the walk finds every table by following annotations, and a stale file is caught with a clear message."""
from __future__ import annotations

from pathlib import Path

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    return script_module("recipe_reference")


def test_committed_recipe_reference_is_current():
    problems = _generator().check(ROOT / "docs" / "recipe.md")
    assert not problems, "\n".join(problems)


def test_walk_reaches_every_table_through_the_annotations():
    from pipeline.recipe import Recipe

    gen = _generator()
    titles = [s.title for s in gen.sections()]
    for key in ("run", "model", "calibration", "draft", "draft.distill", "draft.measure", "validate.perplexity",
                "validate.smoke", "validate.speed", "validate.gates", "validate.tasks", "validate.serve", "export",
                "publish"):
        assert f"[{key}]" in titles
    assert "[validate.gates.models.<name>]" in titles
    # one [[quantize]] table per member of the discriminated union, its tag row first
    union = [s for s in gen.sections() if s.title.startswith("[[quantize]]")]
    assert len(union) >= 7 and all(s.rows[0].key == "method" for s in union)
    assert '[[quantize]] method = "gptq"' in titles
    # every field of every model appears as a row
    run = next(s for s in gen.sections() if s.title == "[run]")
    assert [r.key for r in run.rows] == list(Recipe.model_fields["run"].annotation.model_fields)


def test_stale_file_is_reported_and_the_header_is_kept(tmp_path):
    gen = _generator()
    doc = tmp_path / "recipe.md"
    header = "# The recipe\n\nHand-written notes.\n\n"
    doc.write_text(header + gen.MARKER + "\n| `old` | row |\n")
    problems = gen.check(doc)
    assert problems and "is stale" in problems[0] and gen.COMMAND in problems[0]
    text = gen.document(doc.read_text())
    assert text.startswith(header + gen.MARKER)
    doc.write_text(text)
    assert gen.check(doc) == []
    doc.write_text(header)
    assert "marker line missing" in gen.check(doc)[0]
