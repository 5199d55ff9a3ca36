"""The fields every `[[quantize]]` variant shares, and the groups of fields several methods share. Torch-free.

Each method's own variant model lives in its file (pipeline/quant/methods/<name>.py) and extends these; the
recipe's variant union is built from the registry (pipeline/quant/registry.py). These models check types and
ranges only; what a method can actually do (bits, group sizes, devices, the model's shapes) is declared by the
method and checked by `check_variant` before any weight is loaded. Defaults here are the recipe's defaults (the
best settings measured, see benchmarks/README_quant.md); nothing else repeats them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Dtype = Literal["float32", "bfloat16", "float16"]

SKIP_HELP = ("modules left unquantized, each a module name or a dotted suffix of one "
             "('lm_head', 'mlp.down_proj', 'model.layers.0.self_attn.q_proj')")


class VariantBase(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="unique; the folder artifacts/<run>/quantize/<name>/")
    modules_to_skip: list[str] = Field(["lm_head"], description=SKIP_HELP)


class Calibrated(BaseModel):
    """Shared by the methods that read the calibration rows."""

    calibration_rows: int | None = Field(
        None, ge=1, description="use only the first N of the run's calibration rows (random windows, so a random "
                                "subset; at most calibration.num_samples); None = all. For a method whose time "
                                "grows with the calibration tokens, e.g. AWQ's scale search on a CPU")
    moe_all_experts: bool = Field(
        False, description="Mixture-of-Experts models: calibrate every expert on every calibration token instead of "
                           "the tokens its router sends it (GPTQModel's MoEConfig(ExpertsRoutingOverride('all')); "
                           "each layer's output still follows the model's own routing); gptq and awq only. The "
                           "min_expert_tokens gate then counts every token for every expert")


class GPTQFormat(VariantBase):
    """Shared by the methods that write the GPTQ checkpoint format (qweight/qzeros/scales/g_idx)."""

    bits: int = Field(4, ge=1, le=16, description="2, 3, 4 or 8 (see capabilities)")
    group_size: int = Field(64, description="-1 = one scale per output channel; else columns per scale group")
    sym: bool = Field(True, description="symmetric (zero point fixed at the middle of the grid)")
    dtype: Dtype | None = Field(None, description="dtype the model runs in while quantizing; "
                                                  "None = the loaded checkpoint's dtype")
    format: Literal["gptq", "compressed-tensors"] = Field(
        "gptq", description="checkpoint format written: 'gptq' (qweight/qzeros/scales/g_idx, loaded through "
                            "GPTQModel) or 'compressed-tensors' (pack-quantized W4A16/W8A16 with the same integers, "
                            "scales and group size, loaded by transformers' and vLLM's own compressed-tensors code; "
                            "4 or 8 bits, desc_act off, lm_head skipped)")
