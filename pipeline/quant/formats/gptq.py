"""What the methods that write GPTQModel-loaded checkpoints share (GPTQ, RTN and AutoRound write the GPTQ format;
AWQ its GEMM layout, loaded by the same library): the runtime table of the GPTQ format, the card's usage text, and
the reload hook. GPTQ, RTN and AutoRound also write the same integers as a compressed-tensors checkpoint when the
variant says `format = "compressed-tensors"` (pipeline/quant/formats/ct.py). Torch-free."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pipeline.base.env import tame
from pipeline.base.problem import Problem
from pipeline.base.registry import load_work
from pipeline.model.architecture import architecture_of
from pipeline.quant.formats.ct import CompressedTensorsOption, MarlinLimits
from pipeline.quant.method import LLAMA_CPP_ROW, bits_tags, grouped_bits
from pipeline.quant.shapes import Arch, quantized_linears

# GPTQModel 7.6 QuantizeConfig accepts these group sizes; its CPU/torch kernel (TorchLinear) takes them all.
GPTQ_GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


class GPTQMarlinLimits(MarlinLimits):
    bits: tuple[int, ...]  # GPTQ's Marlin kernel also limits the bits


VLLM_MARLIN: GPTQMarlinLimits = {"bits": (4, 8), "group_sizes": (-1, 32, 64, 128), "min_k": 128, "min_n": 64}


class GPTQModelKernels:
    """Mixin of a method whose checkpoints transformers loads through GPTQModel's kernels."""

    repacked_on_cpu = True  # GPTQModel repacks the quantized linears for its CPU kernel at the first forward
    load_module: ClassVar[str | None] = "gptqmodel"
    reload_work: ClassVar[str | None] = "pipeline.quant.work.gptq_kernels"  # GPTQModel.load, for load_own

    def before_load(self) -> None:
        tame()

    def load_own(self, folder: Path, config: dict, device: str):
        """GPTQModel loads (its HF model is returned) what transformers cannot:
        - a checkpoint with per-module bits or group sizes (GPTQModel `dynamic` overrides, a [quantize.mix] variant):
          transformers' loader (optimum) builds every module with the base bits and refuses the shapes;
        - a Mixture-of-Experts checkpoint: its experts are one quantized linear per expert (as GPTQModel writes and
          vLLM reads them), and transformers 5.24 builds its MoE classes with fused 3D expert parameters, leaves those
          uninitialized and drops the per-expert tensors (checkpoint.uninitialized, found serving the matrix).
          GPTQModel builds per-expert modules for them (its defuser) and loads every tensor."""
        if not per_module_formats(config.get("quantization_config") or {}) and not architecture_of(config).is_moe:
            return None
        assert self.reload_work is not None  # this mixin's, above
        return load_work(self.reload_work).load_own(folder, config, device)


def per_module_formats(qc: dict) -> bool:
    """Whether a GPTQ quantization_config gives some modules their own bits or group size."""
    return any(isinstance(v, dict) and ({"bits", "group_size"} & v.keys()) for k, v in (qc.get("dynamic") or {}).items()
               if str(k).startswith("+:") or not str(k).startswith("-:"))


GPTQ_FUSED_REASON = ("GPTQModel 7.6 quantizes a fused gate_up_proj as two modules, gate_proj and up_proj, and neither "
                     "it nor transformers loads that GPTQ checkpoint back (IndexError in GPTQModel's loader; measured "
                     "on phi3); format = 'compressed-tensors' writes the fused linear back and reloads")


class GPTQFormatMethod(CompressedTensorsOption, GPTQModelKernels):
    """Mixin of the methods that write the GPTQ checkpoint format (GPTQ, RTN, AutoRound): its bits, group sizes,
    runtimes, bits on disk, Hub tags and card usage; a variant may ask for the same integers as compressed-tensors
    instead (CompressedTensorsOption answers for that format)."""

    checkpoint_format = "gptq"
    bits: tuple[int, ...] = (2, 3, 4, 8)
    group_sizes: ClassVar[tuple[int, ...]] = GPTQ_GROUP_SIZES
    hub_tag_names: tuple[str, ...] = ()  # the Hub tags before "<bits>-bit"
    made = ""  # how the card says the checkpoint was made, after "The checkpoint"

    arch_limit_reasons: ClassVar[dict[str, str]] = {}

    def arch_limits(self, variant) -> dict[str, str]:
        """A GPTQ-format checkpoint of a fused gate_up_proj does not reload; its compressed-tensors form does."""
        if variant.format != "gptq":
            return self.arch_limit_reasons
        return {**self.arch_limit_reasons, "fused_gate_up": GPTQ_FUSED_REASON}

    def own_runtimes(self, variant, arch: Arch) -> list[dict]:
        return gptq_runtimes(variant, arch)

    def own_bits_per_weight(self, variant) -> float:
        return grouped_bits(variant)

    def own_hub_tags(self, params: dict) -> list[str]:
        return bits_tags(params, *self.hub_tag_names)

    def own_card_usage(self, repo: str, params: dict) -> list[str]:
        return gptq_usage(repo, self.made)


class GPTQModelDriven:
    """Mixin of the methods GPTQModel's driver quantizes and saves (pipeline/quant/gptqmodel_driver.py: their work
    modules take its session and save)."""

    engine = "gptqmodel"
    engine_modules: ClassVar[tuple[str, ...]] = ("pipeline.quant.gptqmodel_driver",)
    needs_definition: ClassVar[str] = "gptqmodel"  # GPTQModel quantizes what its definition for the model_type lists


def gptq_runtimes(variant, arch: Arch) -> list[dict]:
    b, g, sym = variant.bits, variant.group_size, variant.sym
    aten = b == 4 and g in (16, 32, 64, 128)
    cpu_kernel = ("GPTQModel TorchAtenLinear (aten int4 matmul)" if aten
                  else "GPTQModel TorchLinear (dequantize then matmul; torch.compile'd, needs dynamo)")
    cuda_kernel = "GPTQModel Marlin" if b in (4, 8) and sym and g in (-1, 32, 64, 128) else "GPTQModel Triton/Torch"
    moe = arch.architecture is not None and arch.architecture.is_moe
    fused = ("none: transformers 5.24 builds this MoE's experts as fused 3D parameters and leaves them "
             "uninitialized from the per-expert quantized linears")
    out = [
        {"runtime": "transformers (CPU)", "kernel": fused if moe else cpu_kernel,
         "note": "load it with GPTQModel.load" if moe else "via GPTQModel's kernels; measured here"},
        {"runtime": "transformers (CUDA)", "kernel": fused if moe else cuda_kernel,
         "note": "load it with GPTQModel.load" if moe else "via GPTQModel's kernels"},
        {"runtime": "GPTQModel.load", "kernel": f"CPU: {cpu_kernel.split(' (')[0]}; CUDA: {cuda_kernel}",
         "note": "per-expert modules; measured here (in the checkpoint's dtype)" if moe else
                 "float16/bfloat16 (its torch kernels refuse float32; bfloat16 is its CPU default)"},
        _vllm(variant, arch),
        dict(LLAMA_CPP_ROW),
    ]
    return out


def _vllm(variant, arch: Arch) -> dict:
    b, g, sym = variant.bits, variant.group_size, variant.sym
    if b not in (2, 3, 4, 8):
        return {"runtime": "vLLM (CUDA)", "kernel": "none", "note": f"vLLM's GPTQ kernels take 2/3/4/8 bits, not {b}"}
    m = VLLM_MARLIN
    if b not in m["bits"] or not sym or g not in m["group_sizes"]:
        why = f"{b}-bit" if b not in m["bits"] else ("asymmetric" if not sym else f"group_size {g}")
        return {"runtime": "vLLM (CUDA)", "kernel": "gptq (ExLlama)",
                "note": f"Marlin does not take {why}; the slower gptq kernel serves it"}
    linears = quantized_linears(arch, variant.modules_to_skip) if arch.shapes_known else {}
    bad = [f"{k.split('.')[-1]} ({i}x{o})" for k, (i, o) in linears.items() if i % m["min_k"] or o % m["min_n"]]
    if bad:
        return {"runtime": "vLLM (CUDA)", "kernel": "gptq_marlin for some layers, slower fallback for others",
                "note": f"Marlin needs in-features divisible by {m['min_k']} and out-features by {m['min_n']}; "
                        f"not {', '.join(bad)}: those layers fall back to a slower kernel (Machete/ExLlama), "
                        "or older vLLM refuses the model unless run with --quantization gptq"}
    note = "" if linears else "model shapes unknown: Marlin needs in-features divisible by 128"
    return {"runtime": "vLLM (CUDA)", "kernel": "gptq_marlin", "note": note}


def gptq_usage(repo: str, made: str = "") -> list[str]:
    return [f"The checkpoint{made} is in the GPTQ format (`quantization_config` in config.json). transformers "
            "loads it through GPTQModel (`pip install gptqmodel optimum`). Directly:", "",
            "```python", "from gptqmodel import GPTQModel", f'model = GPTQModel.load("{repo}")', "```", "",
            f"vLLM (CUDA): `vllm serve {repo}`.", "",
            "**Kernel compatibility:** fast kernels depend on bits, group size, symmetry and act-order "
            "(e.g. Marlin takes symmetric 4/8-bit with group size -1/32/64/128); other settings fall back to "
            "slower kernels or are refused. What this run recorded:", ""]


def lm_head_rule(variant, method: str) -> list[Problem]:
    """AWQ and AutoRound: transformers' loader builds no quantized lm_head for them."""
    if "lm_head" in variant.modules_to_skip:
        return []
    return [Problem("modules_to_skip", "lm-head-not-skipped",
                    f"{method} leaves lm_head in full precision here (transformers' {method} loader builds no "
                    f"quantized lm_head): keep 'lm_head' in modules_to_skip (it is {variant.modules_to_skip})")]
