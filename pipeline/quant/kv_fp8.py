"""An FP8 KV cache with calibrated per-layer scales: keys and values stored as float8_e4m3fn, one scale per layer for
the keys and one for the values (compressed-tensors' `kv_cache_scheme`: 8-bit float, per tensor, symmetric, static).

Written as the checkpoint's `quantization_config.kv_cache_scheme` and `model.layers.<i>.self_attn.{k,v}_scale`
tensors, the names llm-compressor writes and vLLM reads (it then stores its KV cache in fp8 with these scales,
`--kv-cache-dtype auto` included; its CPU build needs AVX-512 or AMX and a head size divisible by 32).

compressed-tensors 0.20 applies no kv_cache_scheme to transformers 5.24's attention (it looks for a forward parameter
5.24 renamed), so the quality stages would measure a checkpoint with an FP8 KV cache as if it had none. Here the
attention goes through transformers' AttentionInterface instead: an attention function registered under its own name
quantizes the keys (after RoPE, as a KV cache holds them) and the values to float8 with the layer's scales, then
runs the model's own attention (sdpa or eager). Every key and value an attention reads passes through it, prefill
and decode, with or without a cache: what a model whose cache holds fp8 computes. Calibration runs the same function
in recording mode: the scale of a layer is its largest |key| (|value|) on the calibration rows / 448, e4m3's largest
finite value.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
PREFIX = "compress_fp8kv_"  # the registered attention's name: PREFIX + the model's own ("sdpa", "eager")


def quantize_dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x through float8_e4m3fn with one scale (x / scale rounded to e4m3, saturated at +-448, times scale)."""
    s = scale.to(x.device, torch.float32)
    return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def _attention(base: str):
    inner = ALL_ATTENTION_FUNCTIONS[base]

    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        kv = getattr(module, "compress_kv", None)
        if isinstance(kv, dict):  # recording: the largest |key| and |value| this layer saw
            kv["k"] = max(kv["k"], float(key.detach().abs().max()))
            kv["v"] = max(kv["v"], float(value.detach().abs().max()))
        elif kv is not None:
            key, value = quantize_dequantize(key, kv[0]), quantize_dequantize(value, kv[1])
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    return forward


def _route(model, name: str) -> None:
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def _use(model) -> str:
    """Route the model's attention through the fp8 function (registered once per base implementation); returns the
    model's own implementation."""
    base = model.config._attn_implementation or "sdpa"
    if base.startswith(PREFIX):
        return base[len(PREFIX):]
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _attention(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    _route(model, name)
    return base


def attention_layers(model) -> dict[str, torch.nn.Module]:
    """{"model.layers.<i>.self_attn": module} of every attention that reads keys and values."""
    return {n: m for n, m in model.named_modules() if n.endswith("self_attn") and hasattr(m, "layer_idx")}


def calibrate(model, calib_ids: torch.Tensor) -> dict[str, tuple[float, float]]:
    """{attention module name: (k_scale, v_scale)} from the calibration rows (one forward pass each)."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError("FP8 KV cache: the model has no attention module with a layer index (self_attn)")
    base = _use(model)
    seen = {n: {"k": 0.0, "v": 0.0} for n in layers}  # each layer's largest |key| and |value|, recorded by forward
    for n, m in layers.items():
        m.compress_kv = seen[n]  # type: ignore[assignment]  # torch types module attributes as Tensor | Module
    try:
        with torch.no_grad():
            for row in calib_ids:
                model(row[None].to(model.device))
        found = {n: (kv["k"], kv["v"]) for n, kv in seen.items()}
    finally:
        for m in layers.values():
            m.compress_kv = None  # type: ignore[assignment]  # (as above)
        _route(model, base)  # the model leaves as it came: its own attention, nothing saved of this
    if any(k <= 0 or v <= 0 for k, v in found.values()):
        raise ValueError("FP8 KV cache: a layer saw only zero keys or values on the calibration rows")
    return {n: (k / FP8_MAX, v / FP8_MAX) for n, (k, v) in found.items()}


def install(model, scales: dict[str, tuple[float, float]]) -> None:
    """Every attention of the model reads its keys and values through float8 with these scales."""
    layers = attention_layers(model)
    missing = sorted(set(layers) - set(scales))
    if missing:
        raise ValueError(f"FP8 KV cache: no k/v scales for {', '.join(missing[:3])}")
    _use(model)
    for n, m in layers.items():
        kv = tuple(torch.tensor(s, dtype=torch.float32) for s in scales[n])
        m.compress_kv = kv  # type: ignore[assignment]  # torch types module attributes as Tensor | Module


def tensors(scales: dict[str, tuple[float, float]], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The checkpoint's scale tensors, "<attention>.k_scale" and ".v_scale", 0-d, the names llm-compressor writes;
    float32 by default: a bfloat16 scale would round the calibrated value (vLLM reads either)."""
    out = {}
    for n, (k, v) in scales.items():
        out[f"{n}.k_scale"] = torch.tensor(k, dtype=dtype)
        out[f"{n}.v_scale"] = torch.tensor(v, dtype=dtype)
    return out


def read(folder: Path, config: dict | None = None) -> dict[str, tuple[float, float]] | None:
    """The k/v scales of a checkpoint whose config declares an FP8 kv_cache_scheme; None when it declares none.
    config: its config.json, when the caller has read it already."""
    if config is None:
        config = json.loads((Path(folder) / "config.json").read_text())
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    if not scheme:
        return None
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8 or scheme.get("strategy") != "tensor":
        raise ValueError(f"{folder}: kv_cache_scheme {scheme} is not an 8-bit float per-tensor scheme (the only one "
                         "measured here)")
    k: dict[str, float] = {}
    v: dict[str, float] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not iterable
                if key.endswith(".k_scale"):
                    k[key[: -len(".k_scale")]] = float(st.get_tensor(key).float())
                elif key.endswith(".v_scale"):
                    v[key[: -len(".v_scale")]] = float(st.get_tensor(key).float())
    if not k or set(k) != set(v):
        raise ValueError(f"{folder}: its config declares an FP8 KV cache but its k_scale/v_scale tensors are missing "
                         "or unpaired")
    return {n: (k[n], v[n]) for n in k}
