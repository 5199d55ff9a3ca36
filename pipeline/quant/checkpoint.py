"""Loading a checkpoint folder a stage wrote, whatever its format: plain, quantized by one of the registered methods
(its reload hook runs around the load), or one .gguf file. It sits above the methods (pipeline/quant/registry.py)
because a quantized checkpoint loads only with its method's hook; loading from a recipe source is
pipeline/model/models.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipeline.base.errors import StageError
from pipeline.base.memory import MappedPagesTrimmed
from pipeline.model.dtypes import config_dtype, torch_dtype
from pipeline.model.models import load_gguf, single_gguf
from pipeline.quant import kv_fp8
from pipeline.quant.registry import checkpoint_method


def load_checkpoint(folder: Path, device: str = "cpu", dtype: torch.dtype | None = None,
                    offload: tuple[int, Path] | None = None):
    """A checkpoint folder written by a stage (plain, GPTQ, bitsandbytes, or one .gguf file), ready for inference.
    offload (a plain checkpoint on the CPU only): (bytes of weights to keep in memory, a scratch folder): accelerate
    keeps the first layers in memory and reads the others from the checkpoint's own safetensors files at each
    forward (nothing is copied when the files are safetensors in the loaded dtype; anything else it writes goes to
    the scratch folder)."""
    gguf_file = single_gguf(folder)
    if gguf_file is not None:
        return load_gguf(folder, gguf_file, device, dtype)
    config = json.loads((folder / "config.json").read_text())
    kwargs: dict = {}
    if "quantization_config" not in config:
        kwargs["dtype"] = dtype or torch_dtype(config_dtype(config))
    if offload is not None:
        if "quantization_config" in config or device != "cpu":
            raise StageError(f"{folder}: only a plain checkpoint on the CPU is offloaded to disk here")
        in_memory, scratch = offload
        with MappedPagesTrimmed(folder):
            model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": in_memory},
                                                         offload_folder=str(scratch), **kwargs)
        return model.eval()
    method = checkpoint_method(config)  # its reload hook: e.g. GPTQModel tamed before its kernels load
    if method is not None:
        method.before_load()
        own = method.load_own(folder, config, device)
        if own is not None:
            return own.eval()
    # pages of the mapped checkpoint are not the model's memory (pipeline/base/memory.py)
    with MappedPagesTrimmed(folder):
        model, info = AutoModelForCausalLM.from_pretrained(folder, device_map=device, output_loading_info=True,
                                                           **kwargs)
    if method is not None:
        uninitialized(folder, info, str(config["quantization_config"].get("quant_method") or method.name))
        method.after_load(model)
    kv = kv_fp8.read(folder, config)  # an FP8 KV cache the checkpoint declares: its keys and values go through float8
    if kv is not None:
        kv_fp8.install(model, kv)
    return model.eval()


def uninitialized(folder: Path, info: dict, fmt: str) -> None:
    """StageError when transformers left parameters of a quantized checkpoint uninitialized: the model it returned is
    not the checkpoint (its weights are whatever the memory held). Found serving the architecture matrix: a GPTQ
    qwen3_moe checkpoint holds its experts as per-expert quantized linears, transformers 5.24 builds fused 3D expert
    parameters, reports the quantized ones unexpected and the fused ones missing, and returned a model whose greedy
    output differed from one process to the next."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        unexpected = len(info.get("unexpected_keys") or [])
        raise StageError(f"{folder}: transformers cannot load this {fmt} checkpoint into its model class: it left "
                         f"{len(missing)} parameter(s) uninitialized ({shown}), while {unexpected} tensor(s) of the "
                         "checkpoint matched no parameter; the model would not be the checkpoint")

