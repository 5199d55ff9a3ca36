"""bitsandbytes' work (pipeline/quant/methods/bnb.py): quantized while transformers loads the weights, saved before
any forward (see the method's note)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import bitsandbytes
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from pipeline.base.memory import MappedPagesTrimmed
from pipeline.model.dtypes import torch_dtype
from pipeline.quant.common import base_dtype, finish_checkpoint
from pipeline.quant.methods.bnb import ENGINE


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    """Quantized while loading; not run (see the method's note)."""
    # transformers maps the whole checkpoint and reads it tensor by tensor: without trimming, every page it read
    # stays resident (a 1.7 B bfloat16 model: 5.0 GiB peak instead of 2.0)
    with MappedPagesTrimmed(base_dir):
        return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=bnb_config(variant),
                                                    device_map={"": device}, dtype=torch_dtype(base_dtype(base_dir)))


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    model.save_pretrained(out_dir, safe_serialization=True)
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    dtype = base_dtype(base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": bitsandbytes.__version__, "engine_config": qc, "dtype": dtype}


def bnb_config(variant):
    skip = list(variant.modules_to_skip) or None
    if variant.method == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=variant.threshold, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=variant.method.removeprefix("bnb-"),
        bnb_4bit_use_double_quant=variant.double_quant, bnb_4bit_compute_dtype=torch_dtype(variant.compute_dtype),
        bnb_4bit_quant_storage=torch_dtype(variant.quant_storage), llm_int8_skip_modules=skip)
