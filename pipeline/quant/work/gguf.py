"""GGUF's work (pipeline/quant/methods/gguf.py): the converter and writer of pipeline/quant/gguf_export.py, after
the method's rules are applied again to the checkpoint itself."""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from pipeline.quant.gguf_export import convert, write
from pipeline.quant.methods.gguf import GGUF_ARCHS, GGUF_KQUANT_TYPES, gguf_problems
from pipeline.quant.shapes import linear_shapes_from_config


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    """The whole file in memory (pipeline/quant/gguf_export.py Converted)."""
    config = json.loads((base_dir / "config.json").read_text())
    problems = gguf_problems(variant, linear_shapes_from_config(config))
    if problems:  # the rules `compress check` applied to the recipe's source, now on the checkpoint itself
        raise ValueError("; ".join(map(str, problems)))
    return convert(base_dir, variant, config, variant.type in GGUF_KQUANT_TYPES, GGUF_ARCHS[config["model_type"]],
                   console)


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    """Write the file (through llama.cpp's quantizer for K-quants), the tokenizer files beside it, and
    describe what the file holds, read back from it."""
    return write(model, base_dir, out_dir, variant, variant.type in GGUF_KQUANT_TYPES)
