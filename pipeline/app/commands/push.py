"""`compress push`: the Hub client, on a finished run's folder (under its lock), recorded in its report."""
from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path

import click

from pipeline.app.commands import EPILOG
from pipeline.app.runner import RunLock
from pipeline.base.errors import CompressError, RecipeError
from pipeline.publish.hub import publish_run
from pipeline.recipe import load_recipe, validate
from pipeline.results import schema


@click.command(epilog=EPILOG)
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False), default=None,
              help="A recipe whose [publish] table says where to push (default: the one in the run's lock). "
                   "Only its [publish] table is used: what is pushed is what the run's report lists.")
@click.option("--dry-run/--no-dry-run", default=None, help="Print which files would go where; touch nothing "
              "(default: the [publish] table's dry_run).")
@click.option("--partial/--no-partial", default=None, help="Push the exports whose gates passed even if others "
              "failed (default: the [publish] table's partial).")
def push(run_dir: str, recipe_path: str | None, dry_run: bool | None, partial: bool | None) -> None:
    """Publish the exports the finished run's report lists (re-checks the publish rule and file hashes first)."""
    path = Path(run_dir)
    cfg = _publish_config(path, recipe_path)
    cfg = cfg.model_copy(update={k: v for k, v in (("dry_run", dry_run), ("partial", partial)) if v is not None})
    with RunLock(path):  # exit 3 while a run (or another push) holds the folder
        try:
            section = publish_run(path, cfg, logging.getLogger("compress"))
        except CompressError as e:
            _record_publish(path, getattr(e, "section", None) or _failed_section(e))
            raise
        _record_publish(path, section)
    click.echo(json.dumps(section.model_dump(mode="json"), indent=2, default=str))


def _publish_config(run_dir: Path, recipe_path: str | None):
    if recipe_path:
        r = load_recipe(recipe_path)
    else:
        lock = run_dir / "recipe.lock.toml"
        if not lock.is_file():
            raise RecipeError(f"{run_dir} has no recipe.lock.toml: is it a compress run folder?")
        r = validate(tomllib.loads(lock.read_text())["recipe"], lock)
    if r.publish is None:
        raise RecipeError("the recipe has no [publish] table: nothing says where to push")
    return r.publish


def _failed_section(e: CompressError):
    return schema.PublishSection(status="failed", reason=str(e))


def _record_publish(run_dir: Path, section) -> None:
    """`compress push` writes its outcome into the run's report (publish.items[] for a push)."""
    try:
        report = schema.load(run_dir)
    except CompressError:
        return  # no readable report: the refusal itself already says so
    report.publish = section
    schema.save(report, run_dir)
