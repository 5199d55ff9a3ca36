"""The torch side of the GPTQModel-loaded formats' reload hook (pipeline/quant/formats/gptq.py GPTQModelKernels)."""
from __future__ import annotations

import logging
from pathlib import Path

from gptqmodel import BACKEND, GPTQModel

from pipeline.model.dtypes import config_dtype, torch_dtype
from pipeline.quant.defuser_scope import transformers_restored

log = logging.getLogger("compress")
# the group sizes torch's int4 CPU matmul (_weight_int4pack_mm_cpu, GPTQModel's TorchFusedLinear) takes
FUSED_GROUP_SIZES = (32, 64, 128, 256)


def group_sizes(config: dict) -> set[int]:
    """Every group size a GPTQ checkpoint's modules use (its config.json): its base one and its `dynamic` overrides'."""
    qc = config.get("quantization_config") or {}
    found = {int(qc.get("group_size", -1))}
    found |= {int(v["group_size"]) for v in (qc.get("dynamic") or {}).values()
              if isinstance(v, dict) and "group_size" in v}
    return found


def load_own(folder: Path, config: dict, device: str):
    """GPTQModel's own loader (transformers put back as it was afterwards: pipeline/quant/defuser_scope.py)."""
    with transformers_restored(config):
        return _load_own(folder, config, device)


def _load_own(folder: Path, config: dict, device: str):
    """GPTQModel's own loader, for a checkpoint with per-module bits or group sizes: its HF model. On a CPU, a
    group size torch's fused int4 matmul does not take (a per-channel -1 on 576 in-features) would fail in the first
    forward with GPTQModel's automatic choice of kernel: its plain torch kernel (dequantize, then matmul) is asked
    for instead, for the whole model."""
    odd = sorted(g for g in group_sizes(config) if g not in FUSED_GROUP_SIZES)
    if device == "cpu" and odd:
        log.info("load: %s has group sizes %s, which torch's fused int4 CPU kernel does not take: GPTQModel's torch "
                 "kernel (dequantize, then matmul) runs it", Path(folder).name, odd)
        return GPTQModel.load(str(folder), device=device, backend=BACKEND.TORCH).model  # its torch kernel: 16 bits only
    # a uniform 4-bit checkpoint (a MoE's) in its own dtype, as transformers loads a GPTQ checkpoint: GPTQModel's fused
    # int4 kernel takes float32; its other kernels (8-bit, per-module mixes) take 16 bits only, its default
    qc = config.get("quantization_config") or {}
    uniform4 = int(qc.get("bits", 4)) == 4 and not qc.get("dynamic") and group_sizes(config) <= set(FUSED_GROUP_SIZES)
    kw = {"dtype": torch_dtype(config_dtype(config))} if uniform4 else {}
    return GPTQModel.load(str(folder), device=device, **kw).model
