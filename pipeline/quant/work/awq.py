"""AWQ's work (pipeline/quant/methods/awq.py): GPTQModel's AWQConfig through the shared driver, with the clipping
search as matrix products (pipeline/quant/awq_clip.py); `format = "compressed-tensors"` rewrites the saved GEMM
checkpoint in place (pipeline/quant/formats/ct_export.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from gptqmodel import BACKEND
from gptqmodel.quantization.config import AWQConfig

from pipeline.quant.awq_clip import matmul_clip_search
from pipeline.quant.common import base_dtype, finish_checkpoint, skipped_linears
from pipeline.quant.formats.ct_export import rewrite_in_place
from pipeline.quant.gptqmodel_driver import (
    ENGINE,
    append_file,
    calibration_rows,
    common_kwargs,
    engine_version,
    quantize_with,
    session,
)
from pipeline.quant.methods.awq import AWQ_DTYPES

__all__ = ("quantize", "run_dtype", "save", "session")


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    backend = BACKEND.AWQ_TORCH if device == "cpu" else None
    with matmul_clip_search():  # the clipping search as matrix products (pipeline/quant/awq_clip.py)
        awq_config = AWQConfig(**common_kwargs(variant, sym=not variant.zero_point))
        return quantize_with(base_dir, awq_config, calibration_rows(calib_ids), console, variant.name,
                             run_dtype(variant, base_dir), device, backend=backend)


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    model.save(str(out_dir.resolve()))
    append_file(out_dir / "quant_log.csv", out_dir / f"{ENGINE}.log")
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    skipped = skipped_linears(base_dir, variant.modules_to_skip)
    extra = {}
    if variant.format == "compressed-tensors":  # the same integers, rewritten (formats/ct_export.py)
        extra["awq_config"], qc = qc, rewrite_in_place(out_dir)
    elif skipped:  # transformers' AWQ loader ignores GPTQModel's `dynamic` skips; it honours this list
        qc["modules_to_not_convert"] = skipped
    dtype = run_dtype(variant, base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": engine_version(), "engine_config": qc, "dtype": dtype, **extra}


def run_dtype(variant, base_dir: Path) -> str:
    """The variant's dtype, else the checkpoint's when it is 16-bit, else bfloat16."""
    base = base_dtype(base_dir)
    return variant.dtype or (base if base in AWQ_DTYPES else "bfloat16")
