"""Every routed expert quantized, counted in the written checkpoint: the fix for the field's silent MoE failure
(experts left 16-bit while the attention is quantized). Torch-free: the safetensors headers only.

An expert linear counts as quantized when its module holds an integer or 8-bit-float tensor (GPTQ's qweight,
compressed-tensors' weight_packed, bitsandbytes' int8/uint8 weights, W8A8's int8/fp8 weight); routed experts kept
as fused 3D float parameters (transformers 5's `experts.gate_up_proj`) count as unquantized.
"""
from __future__ import annotations

import re
from pathlib import Path

from pipeline.model.architecture import Architecture
from pipeline.model.sources import safetensors_header, weight_files

QUANTIZED_DTYPES = {"I32", "I16", "I8", "U8", "U16", "U32", "F8_E4M3", "F8_E5M2", "I64"}
FUSED_PAIR = {"gate_up_proj": 2}  # one fused tensor per expert holding two linears


def count_experts(folder: Path, arch: Architecture) -> dict | None:
    """{"declared": routed expert linears the architecture has, "quantized": those stored quantized, "unquantized":
    the first few (layer, expert, linear) that are not} for an MoE checkpoint folder; None for a dense model."""
    e = arch.experts
    if e is None:
        return None
    moe_layers = [i for i in range(int(arch.config.get("num_hidden_layers") or 0)) if i not in e.dense_layers]
    leaves = [n.rsplit(".", 1)[-1] for n in e.linears]
    alias = dict(e.aliases)  # mixtral's w1/w3/w2 are gate_proj/up_proj/down_proj
    per_expert = re.compile(rf"^{re.escape(arch.layers)}\.(\d+)\.[\w.]*?experts\.(\d+)\.(\w+)\.")
    found: dict[tuple[int, int, str], bool] = {}
    for f in weight_files(folder):
        for name, meta in safetensors_header(f).items():
            m = per_expert.match(name)
            if m:
                key = (int(m.group(1)), int(m.group(2)), alias.get(m.group(3), m.group(3)))
                found[key] = found.get(key, False) or meta["dtype"] in QUANTIZED_DTYPES
    quantized, missing = 0, list[str]()
    for i in moe_layers:
        for x in range(e.count):
            for leaf in leaves:
                fused = next((k for k in FUSED_PAIR if leaf in ("gate_proj", "up_proj") and (i, x, k) in found), None)
                ok = found.get((i, x, fused or leaf), False)
                quantized += ok
                if not ok and len(missing) < 8:
                    missing.append(f"layer {i} expert {x} {leaf}")
    return {"declared": len(moe_layers) * e.count * len(leaves), "quantized": quantized, "unquantized": missing}


def experts_problem(counted: dict | None) -> str | None:
    """The error line when some routed expert is not stored quantized; None when all are (or the model is dense)."""
    if counted is None or counted["quantized"] == counted["declared"]:
        return None
    return (f"{counted['declared'] - counted['quantized']} of {counted['declared']} routed expert linears are not "
            f"stored quantized in the checkpoint (first: {', '.join(counted['unquantized'])}): refusing to pass off "
            "a partly quantized MoE")
