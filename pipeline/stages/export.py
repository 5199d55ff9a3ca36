"""export: publishable folders — untouched checkpoint files (hard-linked) plus a model card."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import tomli_w

from pipeline.base.fileio import drop_none
from pipeline.base.public import public_tree
from pipeline.base.unit import MANIFEST, METRICS, Unit, UnitContext
from pipeline.quant.registry import model_code
from pipeline.results import schema
from pipeline.results.card import card_recipe, entry_data, write_model_card
from pipeline.results.gates import served_gate_failures
from pipeline.serve import measured
from pipeline.stages.kinds import Draft, Export, Load, Quantize

SKIP_SUFFIXES = (".log", ".jsonl")


def units(recipe, validate_keys: list[str]) -> list[Unit]:
    card_hash = hashlib.sha256(json.dumps(card_recipe(drop_none(recipe.dump())), sort_keys=True).encode()).hexdigest()

    entries = [(q.name, "variant", Quantize.key(q.name), None) for q in recipe.quantize]
    if recipe.export.include_baseline:
        entries.insert(0, ("baseline", "baseline", Load.key(), None))
    if recipe.draft is not None:
        entries.append(("draft", "draft", Draft.key(), recipe.draft.verifier))
    out = []
    for name, kind, src, verifier in entries:
        entry = {"kind": kind, "name": name, "verifier": verifier}
        # the model card shows the recipe (gates included): a change to it re-exports here, before publish,
        # instead of the end-of-run card refresh rewriting README.md behind the export manifest
        cfg = {"export": recipe.export.model_dump(), "entry": entry, "card_recipe": card_hash}
        out.append(Unit(Export.key(name), cfg, functools.partial(run, recipe=recipe, entry=entry, src_key=src),
                        deps=[src] + validate_keys,
                        # its imports (the card renderer, the report schema) and a variant's method (its card text)
                        code=("stages/export.py",) + model_code(recipe, name)))
    return out


def checkpoint_files(src: Path) -> list[Path]:
    """The checkpoint's own files; subfolders (draft/undistilled, draft/fp-distilled: comparison
    drafts) are never exported."""
    return sorted(p for p in src.iterdir()
                  if p.is_file() and p.name not in (MANIFEST, METRICS) and not p.name.startswith(".")
                  and p.suffix not in SKIP_SUFFIXES)


def run(ctx: UnitContext, recipe, entry: dict, src_key: str) -> dict:
    src = ctx.dep(src_key)
    for f in checkpoint_files(src):
        if recipe.export.link == "hardlink":
            try:
                os.link(f, ctx.out / f.name)
                continue
            except OSError:
                pass  # another filesystem: copy instead
        shutil.copy2(f, ctx.out / f.name)
    report = schema.load(ctx.run_dir)
    lock_text = (ctx.run_dir / "recipe.lock.toml").read_text()
    write_model_card(ctx.out, report, entry, recipe_excerpt(recipe, entry), lock_text)
    if entry["kind"] != "draft":  # the figures `compress serve --engine auto` picks an engine by
        section = entry_data(report, entry)
        assert isinstance(section, schema.ModelEntry)  # entry_data gives a DraftEntry for a draft only
        served = section.served
        measured.write(ctx.out, None if served is None else {k: s.model_dump() for k, s in served.items()},
                       served_gate_failures(report, entry["name"]))
    files = {p.name: p.stat().st_size for p in ctx.out.iterdir() if p.is_file()}
    return {**entry, "folder": Export.key(entry["name"]), "files": files}


def recipe_excerpt(recipe, entry: dict) -> str:
    """The recipe tables that made this entry, as its card shows them (local paths reduced to file names)."""
    data = recipe.dump()
    keep = {"model": data["model"], "calibration": data["calibration"]}
    if entry["kind"] == "variant":
        keep["quantize"] = [q for q in data["quantize"] if q["name"] == entry["name"]]
    if entry["kind"] == "draft":
        keep["draft"] = data["draft"]
    return tomli_w.dumps(public_tree(drop_none(keep)))

