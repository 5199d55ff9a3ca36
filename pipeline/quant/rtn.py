"""Round-to-nearest into the GPTQ checkpoint format, with no calibration.

GPTQModel's own weight-only RTN path (`RTNConfig`) does the work: the same min/max quantizer
grid GPTQ uses, the same packing code and the same checkpoint layout (qweight/qzeros/scales/
g_idx), so RTN vs GPTQ at equal bits and group size isolates what GPTQ's error feedback buys.
"""
from __future__ import annotations

from pathlib import Path
from typing import IO

import torch

from pipeline.quant.common import base_dtype
from pipeline.quant.gptq import common_kwargs, inference_model, quantize_with, save, session  # noqa: F401


def rtn_config(variant):
    from gptqmodel import RTNConfig

    return RTNConfig(**common_kwargs(variant))  # no smoother: plain min/max scales


def quantize(base_dir: Path, variant, calib_ids: torch.Tensor | None, console: IO[str], device: str,
             offload: Path | None = None):
    return quantize_with(base_dir, rtn_config(variant), None, console, variant.name,
                         variant.dtype or base_dtype(base_dir), device, offload=offload)
