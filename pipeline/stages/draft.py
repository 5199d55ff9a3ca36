"""draft: build a small draft model from the verifier and distil it against that verifier."""
from __future__ import annotations

import logging

from pipeline.runner import Unit, UnitContext

log = logging.getLogger("compress")


def verifier_key(recipe) -> str:
    v = recipe.draft.verifier
    return "load" if v == "baseline" else f"quantize/{v}"


def unit(recipe) -> Unit:
    cfg = recipe.draft
    deps = sorted({"load", verifier_key(recipe)})
    config = {"draft": cfg.model_dump(mode="json"), "calibration": recipe.calibration.model_dump(mode="json")}
    return Unit("draft", config, lambda ctx: run(ctx, recipe), deps=deps, merge=merge)


def run(ctx: UnitContext, recipe) -> dict:
    from pipeline.calib import training_documents
    from pipeline.speculative.stage_api import build_draft

    texts = training_documents(recipe.calibration)
    metrics = build_draft(ctx.dep(verifier_key(recipe)), recipe.draft, texts, ctx.out, ctx.work, ctx.seed, log)
    metrics["verifier"] = recipe.draft.verifier
    return metrics


def merge(report: dict, m: dict) -> None:
    d = report.get("draft") or {}
    d.update({"name": "draft", "verifier": m.get("verifier"), "checkpoint": "draft", "distill": m})
    for k in ("layers", "vocab_size", "num_layers"):
        if k in m:
            d[k] = m[k]
    report["draft"] = d
