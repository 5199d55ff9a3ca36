"""torchao's work (pipeline/quant/methods/torchao.py): quantized while transformers loads the weights
(TorchAoConfig), saved as safetensors; and the footprint of a reloaded model, which the method's reload hook
installs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import torch
import torchao
from torchao.quantization import (
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    MappingType,
    PerRow,
)
from transformers import AutoModelForCausalLM, TorchAoConfig

from pipeline.base.fileio import canonical_safetensors
from pipeline.model.dtypes import torch_dtype
from pipeline.quant.common import base_dtype, finish_checkpoint, skipped_linears
from pipeline.quant.methods.torchao import ENGINE, TORCHAO_SCHEMES


def quantize(base_dir: Path, variant, calib_ids, console: IO[str], device: str, offload: Path | None = None):
    """Quantized while loading (no calibration)."""
    qc = TorchAoConfig(ao_config(variant), modules_to_not_convert=skipped_linears(base_dir, variant.modules_to_skip))
    dtype = torch_dtype(variant.dtype or base_dtype(base_dir))
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qc, device_map={"": device},
                                                dtype=dtype)


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in sorted(out_dir.glob("*.safetensors")):  # one metadata entry per tensor, in hash-map order: sorted,
        canonical_safetensors(f)  # so the same checkpoint is the same bytes in every run
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    dtype = variant.dtype or base_dtype(base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": torchao.__version__, "engine_config": qc, "dtype": dtype}


def ao_config(variant):
    """The torchao config of the variant's scheme. set_inductor_config=False: nothing here compiles, and
    torchao would otherwise change torch._inductor's global settings in this process."""
    name = TORCHAO_SCHEMES[variant.scheme].config
    if name == "Int8WeightOnlyConfig":
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    if name == "Int8DynamicActivationInt8WeightConfig":
        return Int8DynamicActivationInt8WeightConfig(granularity=PerRow(), set_inductor_config=False,
                                                     act_mapping_type=MappingType[variant.act_mapping.upper()])
    if name == "Int4WeightOnlyConfig":  # tinygemm layout: the one int4 packing torch's own CUDA kernel runs
        return Int4WeightOnlyConfig(group_size=variant.group_size, int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    raise ValueError(f"no torchao config for scheme {variant.scheme!r}")


def footprint_bytes(model, return_buffers: bool = True) -> int:
    """get_memory_footprint that counts a wrapper tensor subclass (torchao's Int8Tensor, ...) by the
    inner tensors it stores (int8 data, scales), not by its nominal dtype."""
    tensors = list(model.parameters()) + (list(model.buffers()) if return_buffers else [])
    return sum(_stored_bytes(t) for t in tensors)


def _stored_bytes(t) -> int:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_stored_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
    return t.nelement() * t.element_size()
