"""draft: build a small draft model from the verifier and distil it against that verifier."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline.runner import Unit, UnitContext

CODE = ("stages/draft.py", "calib.py", "data.py", "speculative/*.py")

log = logging.getLogger("compress")


def verifier_key(recipe) -> str:
    v = recipe.draft.verifier
    return "load" if v == "baseline" else f"quantize/{v}"


def unit(recipe) -> Unit:
    cfg = recipe.draft
    deps = sorted({"load", verifier_key(recipe)})
    config = {"draft": cfg.model_dump(mode="json"), "calibration": recipe.calibration.model_dump(mode="json")}
    return Unit("draft", config, lambda ctx: run(ctx, recipe), deps=deps, code=CODE)


def run(ctx: UnitContext, recipe) -> dict:
    from pipeline.calib import training_documents
    from pipeline.speculative.stage_api import build_draft

    texts = training_documents(recipe.calibration)
    # layers are copied from the unquantized model (a GPTQ verifier's packed weights cannot be sliced);
    # distillation targets come from the verifier itself. ctx.work survives a kill: checkpoints live there.
    metrics = build_draft(ctx.dep(verifier_key(recipe)), recipe.draft, texts, ctx.out, ctx.work, ctx.seed,
                          log=log.info, base_dir=ctx.dep("load"))
    undistilled = Path(metrics.pop("undistilled_dir"))
    if undistilled.is_dir():  # kept beside the draft so validate can measure what distillation bought
        shutil.move(str(undistilled), ctx.out / "undistilled")
    metrics["verifier"] = recipe.draft.verifier
    metrics["source"] = recipe.draft.source if recipe.draft.init == "model" else None
    metrics["dtype"] = recipe.draft.dtype
    if recipe.draft.measure.compare_fp_distilled and recipe.draft.verifier != "baseline":
        metrics["fp_distilled"] = fp_distilled(ctx, recipe, texts)
    return metrics


def fp_distilled(ctx: UnitContext, recipe, texts: list[str]) -> dict:
    """The same draft (settings, budget, seed) distilled against the full-precision baseline instead of the
    quantized verifier, into draft/fp-distilled (never exported): validate measures it with the quantized
    verifier, showing what distilling against the deployed model buys. Its scratch is ctx.work/fp."""
    from pipeline.speculative.stage_api import build_draft

    cfg = recipe.draft.model_copy(update={"verifier": "baseline"})
    log.info("draft: also distilling against the full-precision baseline (draft.measure.compare_fp_distilled)")
    metrics = build_draft(ctx.dep("load"), cfg, texts, ctx.out / "fp-distilled", ctx.work / "fp", ctx.seed,
                          log=log.info, base_dir=ctx.dep("load"))
    metrics.pop("undistilled_dir")  # the same layers as draft/undistilled: not kept twice
    return metrics

