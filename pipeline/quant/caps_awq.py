"""AWQ (through GPTQModel) and AutoRound (through auto-round): what each takes, which runtimes serve the checkpoint,
and `compress check`'s rules for them. Torch-free; registered into caps_base.METHODS when capabilities is
imported.

AWQ is written in the GEMM layout (qweight/qzeros/scales, 4-bit, zero points by default): the AWQ format
transformers (through GPTQModel's kernels), vLLM and GPTQModel load. GPTQModel's AWQ packer builds float16/bfloat16
modules only, so a float32 checkpoint is quantized in bfloat16. AutoRound writes the GPTQ format (auto-round's
`auto_gptq` export): every runtime that serves a GPTQ checkpoint serves it, with the same kernel rules.
"""
from __future__ import annotations

import importlib.util
import os
import shutil

from pipeline.quant.caps_base import (GPTQ_GROUP_SIZES, METHODS, MethodCaps, bits_tags, gptq_runtimes, gptq_usage,
                                      grouped_bits, quantized_linears)

AWQ_GROUP_SIZES = (-1, 16, 32, 64, 128)  # GPTQModel 7.6 AwqTorchLinear (its CPU kernel) takes these
AWQ_DTYPES = ("bfloat16", "float16")  # GPTQModel's AWQ modules refuse float32
AUTOROUND_PIN = "auto-round==0.16.1"
VLLM_AWQ_MARLIN_GROUPS = (-1, 32, 64, 128)


def _missing(package: str, module: str, method: str) -> list[str]:
    if importlib.util.find_spec(module) is not None:
        return []
    return [f"method {method!r} needs the {package} package, which is not installed: pip install {package} "
            f"(a dependency of compress: pip install -e .)"]


def _lm_head_rule(variant, method: str) -> list[str]:
    if "lm_head" in variant.modules_to_skip:
        return []
    return [f"{method} leaves lm_head in full precision here (transformers' {method} loader builds no quantized "
            f"lm_head): keep 'lm_head' in modules_to_skip (it is {variant.modules_to_skip})"]


def _check_awq(variant, arch: dict, device: str) -> list[str]:
    # (dtype: the generic check refuses float32 with AWQ_DTYPES)
    # (GPTQModel's own clipping search asserts out-features in multiples of 64; ours, pipeline/quant/awq_clip.py,
    # takes any)
    return _missing("gptqmodel", "gptqmodel", "awq") + _lm_head_rule(variant, "AWQ")


def _check_autoround(variant, arch: dict, device: str) -> list[str]:
    problems = _missing(AUTOROUND_PIN, "auto_round", "autoround") + _lm_head_rule(variant, "AutoRound")
    if variant.bits == 8 and not variant.sym:
        problems.append("bits = 8 with sym = false: auto-round refuses to export asymmetric 8-bit in the GPTQ "
                        "format; set sym = true")
    if variant.torch_compile and device == "cpu" and cpp_compiler() is None:
        problems.append("torch_compile = true: torch.compile on a CPU builds C++ kernels, and no C++ compiler was "
                        f"found ({os.environ.get('CXX') or 'g++'} not on PATH): install one (apt install g++) or set "
                        "torch_compile = false (about 2.8x slower on a CPU)")
    return problems


def cpp_compiler() -> str | None:
    """The compiler torch inductor would call on a CPU ($CXX, else g++), or None if it is not on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


def _awq_runtimes(variant, arch: dict) -> list[dict]:
    g = variant.group_size
    linears = quantized_linears(arch, variant.modules_to_skip) if arch.get("shapes_known") else {}
    bad = [f"{k.split('.')[-1]} ({i}x{o})" for k, (i, o) in linears.items() if i % 128 or o % 64]
    if g not in VLLM_AWQ_MARLIN_GROUPS:
        vllm = {"runtime": "vLLM (CUDA)", "kernel": "awq (GEMM)", "note": f"awq_marlin does not take group_size {g}"}
    elif bad:
        vllm = {"runtime": "vLLM (CUDA)", "kernel": "awq_marlin for some layers, awq GEMM for others",
                "note": f"Marlin needs in-features divisible by 128 and out-features by 64; not {', '.join(bad)}"}
    else:
        vllm = {"runtime": "vLLM (CUDA)", "kernel": "awq_marlin", "note": ""}
    return [
        {"runtime": "transformers (CPU)", "kernel": "GPTQModel TorchAtenAwqLinear (aten int4 matmul)",
         "note": "via GPTQModel's kernels (transformers' AWQ loader needs gptqmodel); measured here"},
        {"runtime": "transformers (CUDA)", "kernel": "GPTQModel AWQ GEMM / Marlin", "note": "via GPTQModel's kernels"},
        {"runtime": "GPTQModel.load", "kernel": "CPU: AwqTorchLinear; CUDA: AWQ GEMM/Marlin", "note": ""},
        vllm,
        {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only: add a method = \"gguf\" variant"},
    ]


def _awq_usage(repo: str, params: dict, quantize: dict) -> list[str]:
    return ["The checkpoint is in the AWQ GEMM format (`quant_method: \"awq\"` in config.json). transformers "
            "loads it through GPTQModel's AWQ kernels (`pip install gptqmodel`). Directly:", "",
            "```python", "from gptqmodel import GPTQModel", f'model = GPTQModel.load("{repo}")', "```", "",
            f"vLLM (CUDA): `vllm serve {repo}` (awq_marlin where the shapes allow, else awq). "
            "What this run recorded:", ""]


METHODS.register("awq")(MethodCaps(
    "awq", "gptqmodel", "quant/awq.py", "awq", (4,), AWQ_GROUP_SIZES, AWQ_DTYPES, ("cpu", "cuda"), True,
    "AWQ (Lin et al. 2023): activation-aware per-channel scales, then 4-bit round-to-nearest, through GPTQModel",
    check=_check_awq, runtimes=_awq_runtimes, hub_tags=bits_tags("awq"),  # the Hub's AWQ filter is the `awq` tag
    card_usage=_awq_usage, disk_bits=grouped_bits, memory="layerwise", half_only=True))

METHODS.register("autoround")(MethodCaps(
    "autoround", "auto_round", "quant/autoround.py", "gptq", (2, 3, 4, 8), GPTQ_GROUP_SIZES,
    ("float32", "bfloat16", "float16"), ("cpu", "cuda"), True,
    "AutoRound (Cheng et al. 2023): rounding and min/max tuned by signed gradient descent per block, "
    "through auto-round; GPTQ checkpoint format",
    check=_check_autoround, runtimes=gptq_runtimes,
    hub_tags=bits_tags("autoround", "gptq"),  # a GPTQ-format checkpoint: found under both tags
    card_usage=gptq_usage(" (tuned by auto-round, exported in the GPTQ format)"), disk_bits=grouped_bits))
