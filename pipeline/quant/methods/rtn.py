"""Round-to-nearest into the GPTQ checkpoint format, with no calibration: the honest baseline that shows what GPTQ's
error feedback buys.

GPTQModel's own weight-only RTN path (`RTNConfig`) does the work: the same min/max quantizer grid GPTQ uses, the
same packing code and the same checkpoint layout (qweight/qzeros/scales/g_idx), so RTN vs GPTQ at equal bits and
group size isolates what GPTQ's error feedback buys.
"""
from __future__ import annotations

from pathlib import Path
from typing import IO, Literal

from pipeline.quant.gptq_format import GPTQ_GROUP_SIZES, GPTQModelKernels, gptq_runtimes, gptq_usage
from pipeline.quant.method import QuantMethod, bits_tags, grouped_bits
from pipeline.quant.variant import GPTQFormat


class RTNVariant(GPTQFormat):
    """Round-to-nearest with min/max scales, no calibration: the baseline that shows what GPTQ buys."""

    method: Literal["rtn"]


class RTNMethod(GPTQModelKernels, QuantMethod):
    name = "rtn"
    variant = RTNVariant
    engine = "gptqmodel"
    engine_modules = ("pipeline.quant.gptqmodel_driver",)
    checkpoint_format = "gptq"
    bits = (2, 3, 4, 8)
    group_sizes = GPTQ_GROUP_SIZES
    note = "round-to-nearest, min/max scales, GPTQ checkpoint format"
    offload = True
    memory = "layerwise"

    def runtimes(self, variant, arch: dict) -> list[dict]:
        return gptq_runtimes(variant, arch)

    def bits_per_weight(self, variant) -> float:
        return grouped_bits(variant)

    def hub_tags(self, params: dict) -> list[str]:
        return bits_tags(params, "rtn")

    def card_usage(self, repo: str, params: dict, quantize: dict) -> list[str]:
        return gptq_usage(repo)

    def session(self, out_dir: Path):
        from pipeline.quant.gptqmodel_driver import session

        return session(out_dir)

    def quantize(self, base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
        from gptqmodel import RTNConfig

        from pipeline.quant.common import base_dtype
        from pipeline.quant.gptqmodel_driver import common_kwargs, quantize_with

        rtn_config = RTNConfig(**common_kwargs(variant))  # no smoother: plain min/max scales
        return quantize_with(base_dir, rtn_config, None, console, variant.name,
                             variant.dtype or base_dtype(base_dir), device, offload=offload)

    def save(self, model, base_dir: Path, out_dir: Path, variant) -> dict:
        from pipeline.quant.gptqmodel_driver import save

        return save(model, base_dir, out_dir, variant)


METHODS = (RTNMethod(),)
