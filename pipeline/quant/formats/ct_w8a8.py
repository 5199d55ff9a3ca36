"""A W8A8 variant's checkpoint written by compressed-tensors itself: its preset schemes (`W8A8`: int8 weights per
output channel, int8 activations per token, dynamic; `FP8_DYNAMIC`: the same with float8_e4m3fn) or the W8A8 preset
with static per-tensor input scales, `QuantizationConfig`, `apply_quantization_config` and `ModelCompressor`
(formats `int-quantized`, `float-quantized`).

The model handed in holds, in float32, each quantized linear's q * s (pipeline/quant/w8a8_layers.py); its scale s
is set as the linear's `weight_scale` (in the checkpoint's dtype, which it was rounded to), and compressed-tensors'
compressor divides and rounds back to q: exact in float32 (an 8-bit integer or float8 value times a 16-bit scale),
and checked after writing (`_verify`) against the q the algorithm chose.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from safetensors.torch import load_file, save_file

from pipeline.quant import kv_fp8
from pipeline.quant.w8a8_layers import W8A8Result

# scheme -> (compressed-tensors preset, checkpoint format)
SCHEMES = {"int8-dynamic": ("W8A8", "int-quantized"), "int8-static": ("W8A8", "int-quantized"),
           "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized")}


def ct_config(scheme: str, ignore: list[str]) -> QuantizationConfig:
    preset, fmt = SCHEMES[scheme]
    s = preset_name_to_scheme(preset, ["Linear"])
    if scheme == "int8-static":  # the product's static quantization: one calibrated input scale per tensor
        s = QuantizationScheme(targets=["Linear"], weights=s.weights, input_activations=QuantizationArgs(
            num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False))
    return QuantizationConfig(config_groups={"group_0": s}, ignore=ignore, format=fmt,
                              quantization_status="initialized")


@torch.no_grad()
def write(result: W8A8Result, scheme: str, dtype: torch.dtype, out_dir: Path) -> dict:
    """Save the quantized model as compressed-tensors into out_dir (weights and config.json, whose
    quantization_config is returned; the caller finishes the folder)."""
    model = result.model
    quantized = {name for name in result.weights}
    for name, p in model.named_parameters():  # everything but the quantized weights in the checkpoint's dtype
        if name.removesuffix(".weight") not in quantized:
            p.data = p.data.to(dtype)
    ignore = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in quantized)
    qcfg = ct_config(scheme, ignore)
    apply_quantization_config(model, qcfg)
    for name, (_q, s) in result.weights.items():
        lin = model.get_submodule(name)
        lin.weight_scale = torch.nn.Parameter(s.to(dtype), requires_grad=False)
        if scheme == "int8-static":
            lin.input_scale = torch.nn.Parameter(result.input_scales[name].to(dtype), requires_grad=False)
    fmt = SCHEMES[scheme][1]
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.dtype = dtype
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    if result.kv_scales is not None:
        add_kv_cache(out_dir, result.kv_scales)
    _verify(out_dir, result, scheme)
    return json.loads((out_dir / "config.json").read_text())["quantization_config"]


def _verify(out_dir: Path, result: W8A8Result, scheme: str) -> None:
    state = {k: v for f in sorted(out_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    want = torch.int8 if scheme.startswith("int8") else torch.float8_e4m3fn
    for name, (q, s) in result.weights.items():
        w = state[f"{name}.weight"]
        if (w.dtype != want or not torch.equal(w.float(), q)
                or not torch.equal(state[f"{name}.weight_scale"].float(), s)):
            raise RuntimeError(f"{name}: the compressed-tensors checkpoint does not hold the chosen {want} values "
                               "and scales")
        if scheme == "int8-static" and f"{name}.input_scale" not in state:
            raise RuntimeError(f"{name}: no input_scale written for the static scheme")
    if result.kv_scales is not None and kv_fp8.read(out_dir) != {
            n: (float(torch.tensor(k)), float(torch.tensor(v))) for n, (k, v) in result.kv_scales.items()}:
        raise RuntimeError(f"{out_dir}: the FP8 KV cache scales read back differ from those calibrated")


def add_kv_cache(out_dir: Path, scales: dict[str, tuple[float, float]]) -> None:
    """The FP8 KV cache into a written folder: compressed-tensors' kv_cache_scheme (validated by its own
    QuantizationArgs) in config.json, and the per-layer k/v scales beside the weights (pipeline/quant/kv_fp8.py).
    compressed-tensors 0.20 writes neither for transformers 5.24's attention, which it does not find."""
    files = sorted(out_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"{out_dir}: the FP8 KV cache scales go into a single-file checkpoint; found {len(files)}")
    state = load_file(files[0])
    state.update(kv_fp8.tensors(scales))
    save_file(state, str(files[0]), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = QuantizationArgs(**kv_fp8.SCHEME).model_dump(exclude_none=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
