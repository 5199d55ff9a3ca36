"""quantize: one resumable unit per [[quantize]] variant; weights only (evaluation is validate's job)."""
from __future__ import annotations

import functools
import json
import logging

from safetensors.torch import load_file

from pipeline.base.unit import Unit, UnitContext
from pipeline.quant.api import quantize_variant
from pipeline.quant.registry import method_code, needs_calibration, runtimes
from pipeline.quant.shapes import linear_shapes_from_config
from pipeline.stages.kinds import Calibrate, Load, Quantize

# the entry module; what it imports is found by pipeline/base/codehash.py. Each unit adds its own method's file
# (pipeline/quant/methods/<name>.py), and only that one: editing one method reruns that method's variants, no other
CODE = ("stages/quantize.py",)

log = logging.getLogger("compress")


def units(recipe) -> list[Unit]:
    # not in the units' identity: offloading changes how the weights are computed, not what they are
    limit = recipe.run.memory_limit_bytes
    out = []
    for v in recipe.quantize:
        deps = [Load.key()] + ([Calibrate.key()] if needs_calibration(v) else [])
        out.append(Unit(Quantize.key(v.name), {"variant": v.model_dump(mode="json")},
                        functools.partial(run, variant=v, memory_limit=limit), deps=deps, code=CODE + method_code(v)))
    return out


def run(ctx: UnitContext, variant, memory_limit: int | None = None) -> dict:
    calib = None
    if Calibrate.key() in ctx.manifests:
        calib = load_file(ctx.dep(Calibrate.key()) / "calibration.safetensors")["input_ids"]
    metrics = quantize_variant(ctx.dep(Load.key()), variant, calib, ctx.out, log, ctx.seed, device=ctx.device,
                               memory_limit=memory_limit)
    metrics["runtimes"] = serving_runtimes(ctx.dep(Load.key()), variant)
    return metrics


def serving_runtimes(model_dir, variant) -> list[dict]:
    """Which runtimes can serve this checkpoint, and with which kernel (from the model's shapes)."""
    config = json.loads((model_dir / "config.json").read_text())
    return runtimes(variant, linear_shapes_from_config(config))

