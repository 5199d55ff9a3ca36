"""draft: build a small draft model from the verifier and distil it against that verifier."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline import data
from pipeline.base.unit import Unit, UnitContext
from pipeline.data.calib import training_documents
from pipeline.model.sources import content_identity, parse
from pipeline.quant.registry import model_code
from pipeline.speculative.stage_api import build_draft
from pipeline.stages.kinds import Draft, Load, Quantize

CODE = ("stages/draft.py",)  # the entry module: what it imports is found by pipeline/base/codehash.py
# [draft] fields only the speculative measurement reads (validate/draft/speculative): changing them never
# re-distils. measure.compare_fp_distilled is not among them: the draft stage distils the fp comparison draft.
MEASURE_ONLY = {"gamma": True, "measure": {"num_prompts", "prompts", "prompt_len", "new_tokens", "temperatures",
                                           "repeats", "warmup", "compare_undistilled", "compare_hf_assisted"}}
# the [calibration] fields training_documents() reads (the distillation corpus)
CORPUS_FIELDS = {"dataset", "text_field", "held_out_docs"}

log = logging.getLogger("compress")


def verifier_key(recipe) -> str:
    v = recipe.draft.verifier
    return Load.key() if v == "baseline" else Quantize.key(v)


def verifier_code(recipe) -> tuple[str, ...]:
    """The verifier's method file (its checkpoint is loaded by that method's reload hook), () for the baseline."""
    return model_code(recipe, recipe.draft.verifier)


def unit(recipe) -> Unit:
    return Unit(Draft.key(), unit_config(recipe), lambda ctx: run(ctx, recipe),
                deps=sorted({Load.key(), verifier_key(recipe)}),
                code=CODE + verifier_code(recipe))


def unit_config(recipe) -> dict:
    """The draft's identity: the recipe fields distillation reads (not gamma or how the draft is measured), the
    training corpus by content, and an init='model' source by content."""
    cfg, cal = recipe.draft, recipe.calibration
    return {"draft": cfg.model_dump(mode="json", exclude=MEASURE_ONLY),
            "calibration": cal.model_dump(mode="json", include=CORPUS_FIELDS),
            "corpus": data.identity(data.resolve(cal.dataset, cal.text_field)),
            "source_sha256": content_identity(parse(cfg.source)) if cfg.init == "model" else None}


def run(ctx: UnitContext, recipe) -> dict:
    texts = training_documents(recipe.calibration)
    # layers are copied from the unquantized model (a GPTQ verifier's packed weights cannot be sliced);
    # distillation targets come from the verifier itself. ctx.work survives a kill: checkpoints live there.
    metrics = build_draft(ctx.dep(verifier_key(recipe)), recipe.draft, texts, ctx.out, ctx.work, ctx.seed,
                          log=log.info, base_dir=ctx.dep(Load.key()), device=ctx.device)
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
    cfg = recipe.draft.model_copy(update={"verifier": "baseline"})
    log.info("draft: also distilling against the full-precision baseline (draft.measure.compare_fp_distilled)")
    metrics = build_draft(ctx.dep(Load.key()), cfg, texts, ctx.out / "fp-distilled", ctx.work / "fp", ctx.seed,
                          log=log.info, base_dir=ctx.dep(Load.key()), device=ctx.device)
    metrics.pop("undistilled_dir")  # the same layers as draft/undistilled: not kept twice
    return metrics

