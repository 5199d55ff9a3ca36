"""W8A8's work (pipeline/quant/methods/w8a8.py): the layers quantized in float32 (pipeline/quant/w8a8_layers.py),
written by compressed-tensors' config and compressor (pipeline/quant/formats/ct_w8a8.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import compressed_tensors
import torch
from transformers import AutoModelForCausalLM

from pipeline.model.architecture import architecture_of
from pipeline.model.dtypes import torch_dtype
from pipeline.quant.common import base_dtype, finish_checkpoint
from pipeline.quant.formats.ct_w8a8 import write
from pipeline.quant.methods.w8a8 import KV_MEASURED, MEASURED, W8A8Method
from pipeline.quant.w8a8_layers import W8A8Plan, quantize_model


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    arch = architecture_of(json.loads((base_dir / "config.json").read_text()))
    if not arch.known:  # refused by compress check (pipeline/quant/arch_support.py)
        raise ValueError(f"{base_dir}: model_type {arch.model_type!r} has no architecture definition; W8A8 needs "
                         "its layers")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    plan = W8A8Plan(kind=variant.scheme.split("-")[0], rounding=variant.rounding,
                    static=variant.scheme == "int8-static",
                    alphas=variant.smoothquant_alphas if variant.smoothquant else None,
                    modules_to_skip=variant.modules_to_skip,
                    dtype=torch_dtype(variant.dtype or base_dtype(base_dir)), damp=variant.damp_percent,
                    min_static_tokens=variant.static_min_tokens, kv_cache=variant.kv_cache == "fp8")
    return quantize_model(model, arch, calib_ids, plan, console)


def save(result, base_dir: Path, out_dir: Path, variant) -> dict:
    dtype = variant.dtype or base_dtype(base_dir)
    qc = write(result, variant.scheme, torch_dtype(dtype), out_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    chosen = [a for a in result.alphas.values()]
    return {"engine": W8A8Method.engine, "engine_version": compressed_tensors.__version__, "engine_config": qc,
            "dtype": dtype, "calibration_tokens": result.tokens,
            "smoothquant": {"alphas": result.alphas, "errors": result.errors,
                            "smoothed": sum(a is not None for a in chosen), "points": len(chosen)}
            if variant.smoothquant else None,
            "kv_cache": kv_record(result.kv_scales),
            "measured_with": MEASURED.format(how="") + (KV_MEASURED if result.kv_scales else "")}


def kv_record(scales: dict | None) -> dict | None:
    """What the report keeps of an FP8 KV cache: the scheme and the range of its calibrated scales."""
    if not scales:
        return None
    ks, vs = [k for k, _ in scales.values()], [v for _, v in scales.values()]
    return {"dtype": "float8_e4m3fn", "strategy": "tensor (one k and one v scale per layer)", "layers": len(scales),
            "k_scale": [min(ks), max(ks)], "v_scale": [min(vs), max(vs)]}
