"""Round-to-nearest into the GPTQ checkpoint format, with no calibration: the honest baseline that shows what GPTQ's
error feedback buys.

GPTQModel's own weight-only RTN path (`RTNConfig`) does the work: the same min/max quantizer grid GPTQ uses, the
same packing code and the same checkpoint layout (qweight/qzeros/scales/g_idx), so RTN vs GPTQ at equal bits and
group size isolates what GPTQ's error feedback buys.
"""
from __future__ import annotations

from pathlib import Path
from typing import IO, Literal

from pipeline.quant.gptq_format import GPTQFormatMethod, GPTQModelDriven
from pipeline.quant.method import QuantMethod
from pipeline.quant.variant import GPTQFormat


class RTNVariant(GPTQFormat):
    """Round-to-nearest with min/max scales, no calibration: the baseline that shows what GPTQ buys."""

    method: Literal["rtn"]


class RTNMethod(GPTQModelDriven, GPTQFormatMethod, QuantMethod):
    name = "rtn"
    variant = RTNVariant
    hub_tag_names = ("rtn",)
    note = "round-to-nearest, min/max scales, GPTQ checkpoint format"
    offload = True
    memory = "layerwise"

    def quantize(self, base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
        # late: torch and the engine load only to quantize; `compress check` imports this file for its declarations
        from gptqmodel import RTNConfig

        from pipeline.quant.common import base_dtype
        from pipeline.quant.gptqmodel_driver import common_kwargs, quantize_with

        rtn_config = RTNConfig(**common_kwargs(variant))  # no smoother: plain min/max scales
        return quantize_with(base_dir, rtn_config, None, console, variant.name,
                             variant.dtype or base_dtype(base_dir), device, offload=offload)


METHODS = (RTNMethod(),)
