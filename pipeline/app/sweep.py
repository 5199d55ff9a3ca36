"""`compress sweep SPEC`: many runs from one small TOML, each its own run folder, one summary and one exit code.

    [sweep]
    recipes = ["a.toml", "b.toml"]        # several recipes (paths relative to the spec's folder), or
    recipe = "tiny.toml"                  # one recipe and a matrix of --set overrides (every combination)
    set = ['run.output_dir="/data/runs"'] # optional: --set overrides applied to every run
    [sweep.matrix]
    "quantize.0.bits" = [3, 4]
    "model.source" = ["config:tiny-llama", "/models/other"]

Every run is loaded and checked (`compress check`) before the first one starts: an unknown key, or a recipe that
fails its check, is exit 2 naming it with nothing run. A matrix run is named "<run.name>-<last key part><value>..."
(e.g. tiny-bits3). The runs go one after another, each with its own recipe's [run] executor (with "ray", the units
of each run are spread over the cluster); the sweep's exit code is the worst (highest) of the runs'.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.app.execute import execute
from pipeline.base.errors import CompressError, Interrupted, RecipeError
from pipeline.plan import check
from pipeline.recipe import load_recipe
from pipeline.results import schema
from pipeline.results.gates import gates_summary

log = logging.getLogger("compress")
KEYS = {"recipes", "recipe", "set", "matrix"}


@dataclass
class SweepRun:
    label: str  # what the summary and errors call it
    path: Path
    overrides: list[str]
    slug: str = ""  # a matrix run: appended to its recipe's run.name


def _value_text(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def _slug(key: str, v) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key.rsplit(".", 1)[-1] + str(v))


def parse_spec(spec: Path, extra_sets: Sequence[str] = ()) -> list[SweepRun]:
    """The runs a spec describes; RecipeError naming the key or the file when it is malformed."""
    try:
        data = tomllib.loads(spec.read_text())
    except FileNotFoundError:
        raise RecipeError(f"sweep spec not found: {spec}") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{spec}: invalid TOML: {e}") from None
    unknown = sorted(set(data) - {"sweep"}) + sorted(f"sweep.{k}" for k in set(data.get("sweep", {})) - KEYS)
    if unknown:
        raise RecipeError(f"{spec}: unknown key(s) {', '.join(unknown)} (a spec has [sweep] with "
                          f"{', '.join(sorted(KEYS))})")
    s = data.get("sweep", {})
    if ("recipes" in s) == ("recipe" in s):
        raise RecipeError(f"{spec}: [sweep] needs exactly one of recipes = [...] or recipe = \"...\"")
    common = [str(x) for x in s.get("set", [])] + list(extra_sets)
    base = spec.parent
    if "recipes" in s:
        if "matrix" in s:
            raise RecipeError(f"{spec}: [sweep.matrix] goes with recipe = \"...\", not with recipes = [...]")
        return [SweepRun(str(r), base / r, common) for r in s["recipes"]]
    matrix = s.get("matrix", {})
    for k, vals in matrix.items():
        if not isinstance(vals, list) or not vals:
            raise RecipeError(f"{spec}: sweep.matrix.{k} must be a non-empty list of values")
    keys = list(matrix)
    runs = []
    for combo in itertools.product(*(matrix[k] for k in keys)) if keys else [()]:
        sets = [f"{k}={_value_text(v)}" for k, v in zip(keys, combo, strict=True)]
        label = s["recipe"] + ("".join(f" --set {x}" for x in sets))
        runs.append(SweepRun(label, base / s["recipe"], common + sets,
                             "-".join(_slug(k, v) for k, v in zip(keys, combo, strict=True))))
    return runs


def load_all(runs: list[SweepRun]):
    """[(run, recipe, plan)], every recipe loaded and checked, or RecipeError naming the first that fails."""
    out = []
    folders: dict[Path, str] = {}
    for run in runs:
        try:
            r = load_recipe(run.path, run.overrides)
            if run.slug:
                r = load_recipe(run.path, run.overrides + [f"run.name={json.dumps(r.run.name + '-' + run.slug)}"])
            plan = check(r)
        except RecipeError as e:
            raise RecipeError(f"sweep run {run.label}: {e} (nothing was run)") from None
        folder = run_folder(r)
        if folder in folders:
            raise RecipeError(f"sweep runs {folders[folder]} and {run.label} would share the run folder {folder} "
                              "(nothing was run)")
        folders[folder] = run.label
        out.append((run, r, plan))
    return out


def run_folder(recipe) -> Path:
    """The run folder, resolved (symlinks, "..", relative to the working directory as `compress run` writes it):
    "artifacts" and "$PWD/artifacts" are one folder, and two runs in it would delete each other's exports."""
    return (Path(recipe.run.output_dir) / recipe.run.name).resolve()


def run_sweep(spec: Path, extra_sets: Sequence[str] = ()) -> tuple[list[dict], int]:
    """Run every run of SPEC one after another; ([summary row per run], the worst exit code)."""
    checked = load_all(parse_spec(spec, extra_sets))
    rows = []
    for i, (run, r, plan) in enumerate(checked, 1):
        folder = run_folder(r)
        log.info("sweep %d/%d: %s -> %s (executor %s)", i, len(checked), run.label, folder, r.run.executor)
        try:
            code = execute(r, run.path, plan)
        except Interrupted:
            raise
        except CompressError as e:
            log.error("sweep run %s: %s", run.label, e)
            code = e.exit_code
        rows.append(summary_row(run.label, folder, code))
    return rows, max((row["exit_code"] for row in rows), default=0)


def summary_row(label: str, folder: Path, code: int) -> dict:
    row = {"run": folder.name, "recipe": label, "folder": str(folder), "exit_code": code, "status": "-",
           "best": "-", "gates": "-"}
    try:
        report = schema.load(folder)
    except CompressError:
        return row
    ratios = {n: e.ppl_ratio for n, e in report.variants.items() if e.ppl_ratio is not None}
    best = min(ratios, key=ratios.__getitem__) if ratios else None
    row.update(status=report.run.status, gates=gates_summary(report.gates) if report.run.gates_evaluated else "-",
               best=f"{best} (ppl ratio {ratios[best]:.4f})" if best else "-")
    return row


def summary_table(rows: list[dict]) -> str:
    head = f"{'run':<28}{'status':<14}{'exit':>5}  {'best variant':<34}gates"
    return "\n".join([head] + [f"{r['run']:<28}{r['status']:<14}{r['exit_code']:>5}  {r['best']:<34}{r['gates']}"
                               for r in rows])
