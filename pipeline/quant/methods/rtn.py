"""Round-to-nearest into the GPTQ checkpoint format, with no calibration: the honest baseline that shows what GPTQ's
error feedback buys.

GPTQModel's own weight-only RTN path (`RTNConfig`) does the work: the same min/max quantizer grid GPTQ uses, the
same packing code and the same checkpoint layout (qweight/qzeros/scales/g_idx), so RTN vs GPTQ at equal bits and
group size isolates what GPTQ's error feedback buys.
"""
from __future__ import annotations

from typing import Literal

from pipeline.quant.formats.gptq import GPTQFormatMethod, GPTQModelDriven
from pipeline.quant.method import QuantMemory, QuantMethod
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
    memory = QuantMemory.LAYERWISE
    work = "pipeline.quant.work.rtn"


METHODS = (RTNMethod(),)
