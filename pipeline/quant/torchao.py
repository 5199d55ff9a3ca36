"""torchao (PyTorch-native quantization) through transformers' TorchAoConfig.

Schemes (limits and kernels in caps_torchao.TORCHAO_SCHEMES): int8 weight-only, int8 dynamic activation +
int8 weight, int4 weight-only (CUDA only in torchao 0.18). torchao swaps each quantized nn.Linear weight
for a tensor subclass (Int8Tensor, Int4TilePackedTo4dTensor) while the weights load; save_pretrained
flattens the subclasses into plain safetensors tensors with JSON metadata in the file header
(torchao.prototype.safetensors), and from_pretrained rebuilds them from it: no pickled weights.

transformers matches modules_to_not_convert against parameter names ("...down_proj.weight") by prefix or
suffix, so a dotted suffix such as "mlp.down_proj" would match nothing there: the skip list handed to
transformers is the full names of the linears our own rule (capabilities.is_skipped) skips.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import torch
import torchao  # at import: a missing torchao is then one line from api.implementation

from pipeline.dtypes import torch_dtype
from pipeline.quant.caps_torchao import TORCHAO_SCHEMES
from pipeline.quant.common import base_dtype, finish_checkpoint, nullcontext_session, skipped_linears

ENGINE = "torchao"

session = nullcontext_session


def ao_config(variant):
    """The torchao config of the variant's scheme. set_inductor_config=False: nothing here compiles, and
    torchao would otherwise change torch._inductor's global settings in this process."""
    from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                      Int8WeightOnlyConfig, MappingType, PerRow)

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


def quantize(base_dir: Path, variant, calib_ids: torch.Tensor | None, console: IO[str], device: str):
    """Quantized while loading (no calibration)."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    qc = TorchAoConfig(ao_config(variant), modules_to_not_convert=skipped_linears(base_dir, variant.modules_to_skip))
    dtype = torch_dtype(variant.dtype or base_dtype(base_dir))
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qc, device_map={"": device}, dtype=dtype)


def save(model, base_dir: Path, out_dir: Path, variant) -> dict:
    model.save_pretrained(out_dir, safe_serialization=True)
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    dtype = variant.dtype or base_dtype(base_dir)
    finish_checkpoint(base_dir, out_dir, qc, dtype)
    return {"engine": ENGINE, "engine_version": torchao.__version__, "engine_config": qc, "dtype": dtype}
