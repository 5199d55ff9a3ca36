"""AWQ (Lin et al. 2023) through GPTQModel (its AWQConfig), GEMM checkpoint layout.

GPTQModel's AWQ searches, per decoder layer, the input-channel scales that minimise the layer's output error on the
calibration activations, folds them into the preceding norm or linear, and rounds to the 4-bit grid; it packs the
result for the kernel it is told. On CPU that is its portable torch kernel (AWQ_TORCH: its default GEMM kernel is
CUDA-only and refuses a CPU run); the checkpoint is the same GEMM layout either way, the AWQ format transformers
(through GPTQModel's kernels), vLLM and GPTQModel load. GPTQModel's AWQ packer builds float16/bfloat16 modules only,
so a float32 checkpoint is quantized in bfloat16. The driver, session, logs and checkpoint finishing are GPTQModel's
(pipeline/quant/gptqmodel_driver.py); the clipping search runs as matrix products (pipeline/quant/awq_clip.py).
With `format = "compressed-tensors"` the same integers, scales and zero points are rewritten as a compressed-tensors
pack-quantized W4A16 checkpoint (asymmetric, zero points packed; pipeline/quant/formats/ct_export.py), the format vLLM
reads natively. The work is pipeline/quant/work/awq.py.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.base.problem import Problem
from pipeline.quant.formats.ct import CompressedTensorsOption
from pipeline.quant.formats.gptq import GPTQModelKernels, lm_head_rule
from pipeline.quant.method import LLAMA_CPP_ROW, QuantMemory, QuantMethod, bits_tags, grouped_bits, missing_package
from pipeline.quant.shapes import Arch, quantized_linears
from pipeline.quant.variant import Calibrated, VariantBase

AWQ_GROUP_SIZES = (-1, 16, 32, 64, 128)  # GPTQModel 7.6 AwqTorchLinear (its CPU kernel) takes these
AWQ_DTYPES = ("bfloat16", "float16")  # GPTQModel's AWQ modules refuse float32
VLLM_AWQ_MARLIN_GROUPS = (-1, 32, 64, 128)
DRIVER = "pipeline.quant.gptqmodel_driver"


class AWQVariant(Calibrated, VariantBase):
    """AWQ through GPTQModel: per-input-channel scales searched on the calibration activations, folded into the
    previous op, then round-to-nearest; GEMM checkpoint layout."""

    method: Literal["awq"]
    bits: int = Field(4, description="4 (the AWQ GEMM layout packs 4-bit values)")
    group_size: int = Field(64, description="-1 = one scale per output channel; else columns per scale group")
    zero_point: bool = Field(True, description="asymmetric grid with a zero point per group (AWQ's default)")
    dtype: Literal["bfloat16", "float16"] | None = Field(
        None, description="dtype the model runs in while quantizing; None = the checkpoint's if 16-bit, else "
                          "bfloat16 (GPTQModel's AWQ modules take no float32)")
    format: Literal["awq", "compressed-tensors"] = Field(
        "awq", description="checkpoint format written: 'awq' (the GEMM layout, loaded through GPTQModel's AWQ "
                           "kernels) or 'compressed-tensors' (pack-quantized W4A16 with the same integers, scales "
                           "and zero points, loaded by transformers' and vLLM's own compressed-tensors code; "
                           "lm_head skipped)")

    @property
    def sym(self) -> bool:
        """The grid's symmetry in the GPTQ family's terms (what the compressed-tensors rules read)."""
        return not self.zero_point


class AWQMethod(CompressedTensorsOption, GPTQModelKernels, QuantMethod):
    name = "awq"
    variant = AWQVariant
    engine = "gptqmodel"
    needs_definition = "gptqmodel"
    model_type_limits = {
        "olmoe": "GPTQModel 7.6's AWQ scale search fails on OLMoE's full-width q/k norms (RuntimeError: The size of "
                 "tensor a (32) must match the size of tensor b (64); measured); GPTQ and RTN take it",
        "gpt_oss": "GPTQModel 7.6's AWQ fails on gpt-oss's experts (RuntimeError: cannot reshape tensor of 0 elements "
                   "into shape [-1, 0]; measured); GPTQ and RTN take it",
    }
    arch_limit_reasons = {"fused_gate_up": "GPTQModel 7.6's AWQ packer fails on a fused gate_up_proj / qkv_proj "
                                           "(KeyError 'q_zeros'; measured on phi3)",
                          "mla": "GPTQModel 7.6's AWQ scale search multiplies the low-rank q/kv projections in "
                                 "the wrong shapes (RuntimeError: mat1 and mat2 shapes cannot be multiplied; measured "
                                 "on deepseek_v3; GPTQ and RTN take it)",
                          "per_layer_rope": "GPTQModel 7.6's AWQ scale search calls the rotary embedding without the "
                                            "layer type Gemma 3's takes (Gemma3RotaryEmbedding.forward() missing "
                                            "'layer_type'; measured on gemma3_text)"}
    engine_modules = (DRIVER,)
    checkpoint_format = "awq"
    bits = (4,)
    group_sizes = AWQ_GROUP_SIZES
    dtypes = AWQ_DTYPES
    needs_calibration = True
    note = "AWQ (Lin et al. 2023): activation-aware per-channel scales, then 4-bit round-to-nearest, through GPTQModel"
    memory = QuantMemory.LAYERWISE
    half_only = True
    work = "pipeline.quant.work.awq"
    made_by = " (AWQ, through GPTQModel)"

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        # (dtype: the generic check refuses float32 with AWQ_DTYPES)
        # (GPTQModel's own clipping search asserts out-features in multiples of 64; ours, pipeline/quant/awq_clip.py,
        # takes any)
        return missing_package("gptqmodel", "gptqmodel", "awq") + super().check(variant, arch, device)

    def own_check(self, variant, arch: Arch, device: str) -> list[Problem]:
        return lm_head_rule(variant, "AWQ")

    def own_runtimes(self, variant, arch: Arch) -> list[dict]:
        g = variant.group_size
        linears = quantized_linears(arch, variant.modules_to_skip) if arch.shapes_known else {}
        bad = [f"{k.split('.')[-1]} ({i}x{o})" for k, (i, o) in linears.items() if i % 128 or o % 64]
        if g not in VLLM_AWQ_MARLIN_GROUPS:
            vllm = {"runtime": "vLLM (CUDA)", "kernel": "awq (GEMM)",
                    "note": f"awq_marlin does not take group_size {g}"}
        elif bad:
            vllm = {"runtime": "vLLM (CUDA)", "kernel": "awq_marlin for some layers, awq GEMM for others",
                    "note": f"Marlin needs in-features divisible by 128 and out-features by 64; not {', '.join(bad)}"}
        else:
            vllm = {"runtime": "vLLM (CUDA)", "kernel": "awq_marlin", "note": ""}
        return [
            {"runtime": "transformers (CPU)", "kernel": "GPTQModel TorchAtenAwqLinear (aten int4 matmul)",
             "note": "via GPTQModel's kernels (transformers' AWQ loader needs gptqmodel); measured here"},
            {"runtime": "transformers (CUDA)", "kernel": "GPTQModel AWQ GEMM / Marlin",
             "note": "via GPTQModel's kernels"},
            {"runtime": "GPTQModel.load", "kernel": "CPU: AwqTorchLinear; CUDA: AWQ GEMM/Marlin", "note": ""},
            vllm,
            dict(LLAMA_CPP_ROW),
        ]

    def own_bits_per_weight(self, variant) -> float:
        return grouped_bits(variant)

    def own_hub_tags(self, params: dict) -> list[str]:
        return bits_tags(params, "awq")  # the Hub's AWQ filter is the `awq` tag

    def own_card_usage(self, repo: str, params: dict) -> list[str]:
        return ["The checkpoint is in the AWQ GEMM format (`quant_method: \"awq\"` in config.json). transformers "
                "loads it through GPTQModel's AWQ kernels (`pip install gptqmodel`). Directly:", "",
                "```python", "from gptqmodel import GPTQModel", f'model = GPTQModel.load("{repo}")', "```", "",
                f"vLLM (CUDA): `vllm serve {repo}` (awq_marlin where the shapes allow, else awq). "
                "What this run recorded:", ""]


METHODS = (AWQMethod(),)
