"""RTN's work (pipeline/quant/methods/rtn.py): GPTQModel's RTNConfig through the shared driver."""
from __future__ import annotations

from pathlib import Path
from typing import IO

from gptqmodel import RTNConfig

from pipeline.quant.common import base_dtype
from pipeline.quant.gptqmodel_driver import common_kwargs, quantize_with, save, session

__all__ = ("quantize", "save", "session")


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    rtn_config = RTNConfig(**common_kwargs(variant))  # no smoother: plain min/max scales
    return quantize_with(base_dir, rtn_config, None, console, variant.name,
                         variant.dtype or base_dtype(base_dir), device, offload=offload)
