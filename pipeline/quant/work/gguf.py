"""GGUF's work (pipeline/quant/methods/gguf.py), after the method's rules are applied again to the checkpoint
itself: for llama and qwen2, the converter and writer of pipeline/quant/formats/gguf_export.py (our port); for every
other architecture, llama.cpp's own converter (pipeline/quant/formats/gguf_convert.py, run by
gguf_export.write_converted)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.base.fileio import atomic_write_json
from pipeline.quant.formats.gguf_export import convert, write, write_converted
from pipeline.quant.methods.gguf import GGUF_ARCHS, GGUF_KQUANT_TYPES, gguf_problems
from pipeline.quant.mix import gguf_plan
from pipeline.quant.mix.plan import cache_beside
from pipeline.quant.shapes import linear_shapes_from_config


@dataclass
class ByConverter:
    """A variant llama.cpp's own converter writes (in `save`: it writes the file itself)."""

    config: dict
    console: IO[str]


def session(out_dir: Path):
    return cache_beside(out_dir)  # a [quantize.mix] sensitivity table is shared by the variants


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    """The whole file in memory (pipeline/quant/formats/gguf_export.py Converted); with [quantize.mix], each linear in
    the type the allocation chose (pipeline/quant/mix/gguf_plan.py)."""
    config = json.loads((base_dir / "config.json").read_text())
    problems = gguf_problems(variant, linear_shapes_from_config(config))
    if problems:  # the rules `compress check` applied to the recipe's source, now on the checkpoint itself
        raise ValueError("; ".join(map(str, problems)))
    if config["model_type"] not in GGUF_ARCHS:
        return ByConverter(config, console)
    mix = gguf_plan.plan(base_dir, variant, calib_ids, console) if variant.mix is not None else None
    conv = convert(base_dir, variant, config, variant.type in GGUF_KQUANT_TYPES, GGUF_ARCHS[config["model_type"]],
                   console, mix["types"] if mix else None)
    conv.mix = mix
    return conv


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    """Write the file (through llama.cpp's quantizer for K-quants), the tokenizer files beside it, and
    describe what the file holds, read back from it."""
    if isinstance(model, ByConverter):
        return write_converted(base_dir, out_dir, variant, model.config, model.console)
    details = write(model, base_dir, out_dir, variant, variant.type in GGUF_KQUANT_TYPES)
    if model.mix is not None:
        atomic_write_json(out_dir / "mix.json", model.mix)
        details["mix"] = gguf_plan.summary(model.mix)
    return details
