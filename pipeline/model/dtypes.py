"""The one table of dtype names: what recipes, config.json files and reports call a torch dtype.

Torch-free at import (`compress check` reads DTYPE_NAMES); `torch_dtype` imports torch when called.
"""
from __future__ import annotations

from typing import Any, overload

# Names of the floating-point dtypes a model's weights may be loaded, computed or saved in.
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# bitsandbytes 4-bit packs its weights in one of these ([[quantize]] quant_storage).
STORAGE_DTYPE_NAMES: tuple[str, ...] = ("uint8", *DTYPE_NAMES)


def torch_dtype(name: str) -> Any:
    """"bfloat16" -> torch.bfloat16. Unknown names fail with the known ones listed."""
    # late: `compress check` imports this module for the dtype names
    import torch

    if name not in STORAGE_DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(STORAGE_DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 (or "torch.bfloat16", or "bfloat16") -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


@overload
def config_dtype(config: dict, default: str = "float32") -> str: ...
@overload
def config_dtype(config: dict, default: None) -> str | None: ...


def config_dtype(config: dict, default: str | None = "float32") -> str | None:
    """The weights' dtype a config.json declares (`dtype`, or the older `torch_dtype`), or `default` when it
    declares none or one outside DTYPE_NAMES."""
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPE_NAMES else default


# [model] dtype: "auto" (the precision follows the checkpoint) or one of DTYPE_NAMES.
AUTO = "auto"
MODEL_DTYPES: tuple[str, ...] = (AUTO, *DTYPE_NAMES)
# A GGUF's blocks are 2-8 bit integers with fp16 scales: no stored float dtype to keep. "auto" dequantizes
# them to this (half the memory of float32; recipes whose figures need float32 say so) where the device computes
# it natively, else to float32: on a CPU without bfloat16 units torch emulates bfloat16 matmuls (measured on a
# 2-core AVX2 machine: 1-6 GFLOPS against 38-53 in float32; GPTQ on SmolLM2 65 s per layer against 20).
GGUF_AUTO_DTYPE = "bfloat16"
# CPU flags (/proc/cpuinfo) of the units that run 16-bit float matmuls natively
HALF_UNITS: dict[str, tuple[str, ...]] = {"bfloat16": ("avx512_bf16", "amx_bf16"),
                                          "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:  # pragma: no cover - not Linux
        pass
    return set()


def native_half(device: str, dtype: str = "bfloat16") -> bool:
    """Whether `device` computes `dtype` matmuls in hardware (CUDA: yes; a CPU: only with the units for it)."""
    return device != "cpu" or bool(cpu_flags() & set(HALF_UNITS[dtype]))


# safetensors header dtype codes of the floating-point dtypes above
SAFETENSORS_DTYPES: dict[str, str] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


def resolve_dtype(requested: str, source_kind, stored: str | None, device: str = "cpu") -> str:
    """The dtype a recipe's baseline is loaded, measured and saved in: [model].dtype with "auto" resolved.

    requested    [model].dtype: "auto" or a name in DTYPE_NAMES (kept as asked)
    source_kind  the source's SourceKind (pipeline/model/sources.py, ModelSource.source_kind): its is_gguf
                 says whether its weights are a GGUF file (gguf:, pkg:) or not (checkpoint folders, config:)
    stored       the dtype the source declares or stores (config.json `dtype`/`torch_dtype`, else the
                 safetensors header); None when unknown or not a float dtype (a GGUF)
    device       the run's resolved device ("cpu" or "cuda")
    "auto": a checkpoint folder or a config keeps `stored` (float32 when it declares none, as transformers
    does: keeping a stored half dtype is what halves the memory); a GGUF is dequantized to GGUF_AUTO_DTYPE where
    `device` computes it natively (native_half), else to float32.
    """
    if isinstance(source_kind, str):  # a kind name: ask pipeline.model.sources.SOURCE_KINDS for its SourceKind
        raise TypeError(f"resolve_dtype takes the source's SourceKind (src.source_kind), not its name {source_kind!r}")
    if requested != AUTO:
        if requested not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {requested!r}; known: {', '.join(MODEL_DTYPES)}")
        return requested
    if source_kind.is_gguf:
        return GGUF_AUTO_DTYPE if native_half(device, GGUF_AUTO_DTYPE) else "float32"
    return stored if stored in DTYPE_NAMES else "float32"


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named in STORAGE_DTYPE_NAMES."""
    return _BYTES[name]
