"""GPTQ's work (pipeline/quant/methods/gptq.py): GPTQModel's GPTQConfig through the shared driver, with the
[quantize.mix] plan (pipeline/quant/mix/plan.py) when the variant asks for one."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import IO

from gptqmodel import GPTQConfig
from gptqmodel.quantization.config import FOEMConfig, GPTAQConfig

from pipeline.base.fileio import atomic_write_json
from pipeline.quant import gptqmodel_driver
from pipeline.quant.common import base_dtype
from pipeline.quant.gptqmodel_driver import calibration_rows, common_kwargs, quantize_with
from pipeline.quant.methods.gptq import act_group_aware
from pipeline.quant.mix.plan import cache_beside, plan, summary


def session(out_dir: Path):
    stack = contextlib.ExitStack()
    stack.enter_context(gptqmodel_driver.session(out_dir))
    stack.enter_context(cache_beside(out_dir))  # a [quantize.mix] sensitivity table is shared by the variants
    return stack


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    mix = None
    if variant.mix is not None:
        mix = plan(base_dir, variant, calib_ids, console)
    model = quantize_with(base_dir, gptq_config(variant, mix["dynamic"] if mix else None),
                          calibration_rows(calib_ids), console, variant.name,
                          variant.dtype or base_dtype(base_dir), device, offload=offload)
    model.compress_mix = mix
    return model


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    details = gptqmodel_driver.save(model, base_dir, out_dir, variant)
    mix = getattr(model, "compress_mix", None)
    if mix is not None:
        atomic_write_json(out_dir / "mix.json", mix)
        details["mix"] = summary(mix)
    return details


def gptq_config(variant, mix_dynamic: dict | None = None):
    extra = {}
    if variant.foem_beta > 0:  # GPTQModel: FOEM with alpha > 0 is FOEM + GPTAQ
        extra["foem"] = FOEMConfig(alpha=variant.gptaq_alpha, beta=variant.foem_beta, device="cpu")
    elif variant.gptaq_alpha > 0:
        extra["gptaq"] = GPTAQConfig(alpha=variant.gptaq_alpha, device="cpu")
    kwargs = common_kwargs(variant)
    if mix_dynamic:  # after the skips: GPTQModel takes the first pattern that matches a module
        kwargs["dynamic"] = {**(kwargs["dynamic"] or {}), **mix_dynamic}
    return GPTQConfig(**kwargs, desc_act=variant.desc_act, act_group_aware=act_group_aware(variant),
                      damp_percent=variant.damp_percent, true_sequential=variant.true_sequential, mse=variant.mse,
                      **extra)
