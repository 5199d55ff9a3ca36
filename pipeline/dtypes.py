"""The one table of dtype names: what recipes, config.json files and reports call a torch dtype.

Torch-free at import (`compress check` reads DTYPE_NAMES); `torch_dtype` imports torch when called.
"""
from __future__ import annotations

from typing import Any

# Names of the floating-point dtypes a model's weights may be loaded, computed or saved in.
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# bitsandbytes 4-bit packs its weights in one of these ([[quantize]] quant_storage).
STORAGE_DTYPE_NAMES: tuple[str, ...] = ("uint8", *DTYPE_NAMES)


def torch_dtype(name: str) -> Any:
    """"bfloat16" -> torch.bfloat16. Unknown names fail with the known ones listed."""
    import torch

    if name not in STORAGE_DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(STORAGE_DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 (or "torch.bfloat16", or "bfloat16") -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def config_dtype(config: dict, default: str = "float32") -> str:
    """The weights' dtype a config.json declares (`dtype`, or the older `torch_dtype`), or `default` when it
    declares none or one outside DTYPE_NAMES."""
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPE_NAMES else default
