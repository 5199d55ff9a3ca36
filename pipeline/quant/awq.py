"""AWQ through GPTQModel (its AWQConfig), GEMM checkpoint layout.

GPTQModel's AWQ searches, per decoder layer, the input-channel scales that minimise the layer's output error on the
calibration activations, folds them into the preceding norm or linear, and rounds to the 4-bit grid; it packs the
result for the kernel it is told. On CPU that is its portable torch kernel (AWQ_TORCH: its default GEMM kernel is
CUDA-only and refuses a CPU run); the checkpoint is the same GEMM layout either way. The driver, session, logs and
checkpoint finishing are GPTQ's (pipeline/quant/gptq.py); the clipping search runs as matrix products
(pipeline/quant/awq_clip.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import torch

from pipeline.quant.awq_clip import matmul_clip_search
from pipeline.quant.caps_awq import AWQ_DTYPES
from pipeline.quant.common import base_dtype, finish_checkpoint, skipped_linears
from pipeline.quant.gptq import ENGINE, _append_file, calibration_rows, common_kwargs, engine_version, quantize_with
from pipeline.quant.gptq import session  # noqa: F401  (the method module's session)


def awq_config(variant):
    from gptqmodel.quantization.config import AWQConfig

    return AWQConfig(**common_kwargs(variant, sym=not variant.zero_point))


def run_dtype(variant, base_dir: Path) -> str:
    """The variant's dtype, else the checkpoint's when it is 16-bit, else bfloat16."""
    base = base_dtype(base_dir)
    return variant.dtype or (base if base in AWQ_DTYPES else "bfloat16")


def quantize(base_dir: Path, variant, calib_ids: torch.Tensor, console: IO[str], device: str):
    from gptqmodel import BACKEND

    backend = BACKEND.AWQ_TORCH if device == "cpu" else None
    with matmul_clip_search():  # the clipping search as matrix products (pipeline/quant/awq_clip.py)
        return quantize_with(base_dir, awq_config(variant), calibration_rows(calib_ids), console, variant.name,
                             run_dtype(variant, base_dir), device, backend=backend)


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    model.save(str(out_dir.resolve()))
    _append_file(out_dir / "quant_log.csv", out_dir / f"{ENGINE}.log")
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    skipped = skipped_linears(base_dir, variant.modules_to_skip)
    if skipped:  # transformers' AWQ loader ignores GPTQModel's `dynamic` skips; it honours this list
        qc["modules_to_not_convert"] = skipped
    dtype = run_dtype(variant, base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": engine_version(), "engine_config": qc, "dtype": dtype}
