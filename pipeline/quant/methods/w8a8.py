"""W8A8 in compressed-tensors, vLLM's native format: weights and activations both 8-bit, for compute-bound serving.

Schemes (`scheme`):
- int8-dynamic: int8 weights per output channel, int8 activations per token computed at run time (compressed-tensors'
  `W8A8` preset, `int-quantized`);
- int8-static: the same weights, one calibrated int8 scale per linear input (the product's "static quantization",
  in a format an engine reads);
- fp8-dynamic: float8_e4m3fn weights per output channel, float8 activations per token (`FP8_DYNAMIC`,
  `float-quantized`); vLLM runs it as W8A8 on Ada/Hopper GPUs only.

Weights are rounded to nearest or by GPTQ at 8 bits (`rounding`, int8 only); SmoothQuant (`smoothquant`) first moves
activation outliers into the weights, its alpha searched per fold point on the calibration rows. This is a method and
not a `format` of the GPTQ-family variants: those promise the GPTQ checkpoint's integers rewritten as they are, while
W8A8 changes the model (smoothing), quantizes activations and calibrates their scales: a quantization of its own,
written by compressed-tensors' own config and compressor (pipeline/quant/formats/ct_w8a8.py). The work is
pipeline/quant/work/w8a8.py over pipeline/quant/w8a8_layers.py; the maths w8a8_math.py and smoothquant.py.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.base.problem import Problem
from pipeline.quant.formats.ct import CT, LOAD, CompressedTensorsLoad
from pipeline.quant.method import LLAMA_CPP_ROW, QuantMethod
from pipeline.quant.shapes import Arch, quantized_linears
from pipeline.quant.variant import Calibrated, Dtype, VariantBase

SCHEMES = ("int8-dynamic", "int8-static", "fp8-dynamic")
FP8_FORMAT = "compressed-tensors-fp8"  # what the serving plan calls an FP8 compressed-tensors checkpoint
ALPHAS = [round(0.1 * i, 1) for i in range(11)]
TILE = 16  # vLLM's CUTLASS scaled-mm kernels (int8 and fp8 W8A8) take in/out features in multiples of 16
MEASURED = ("perplexity, KL and tasks ran with the activations quantized in the forward pass (transformers' "
            "compressed-tensors loader with dequantize=False: compressed-tensors' own forward quantizes each "
            "quantized linear's input{how}); the weights are the checkpoint's, decompressed to dense at the first "
            "forward")


class W8A8Variant(Calibrated, VariantBase):
    """8-bit weights and activations, written as compressed-tensors (int-quantized / float-quantized)."""

    method: Literal["w8a8"]
    scheme: Literal[SCHEMES] = Field(  # type: ignore[valid-type]
        "int8-dynamic", description="int8-dynamic (int8 weights per channel, int8 activations per token at run time), "
                                    "int8-static (one calibrated activation scale per linear input) or fp8-dynamic "
                                    "(float8_e4m3fn weights per channel and activations per token)")
    rounding: Literal["rtn", "gptq"] = Field("rtn", description="how the int8 weights are chosen: round to nearest, "
                                                                "or GPTQ at 8 bits per channel (int8 schemes only)")
    smoothquant: bool = Field(False, description="SmoothQuant: migrate activation outliers into the weights, folded "
                                                 "into the preceding RMSNorm (q/k/v, gate/up) and v_proj (o_proj)")
    smoothquant_alphas: list[float] = Field(ALPHAS, min_length=1, description="SmoothQuant's migration strengths "
                                            "searched per fold point on the calibration rows (no smoothing is always "
                                            "a candidate); one value = fixed")
    damp_percent: float = Field(0.01, gt=0, lt=1, description="GPTQ's Hessian dampening (rounding = 'gptq')")
    static_min_tokens: int = Field(4096, ge=1, description="int8-static: the fewest calibration tokens its per-tensor "
                                                           "activation maxima are taken from")
    dtype: Dtype | None = Field(None, description="dtype of the checkpoint's unquantized tensors and scales; "
                                                  "None = the loaded checkpoint's")
    kv_cache: Literal["fp8"] | None = Field(
        None, description="'fp8': an FP8 KV cache (float8_e4m3fn keys and values, one calibrated scale per layer for "
                          "each, compressed-tensors' kv_cache_scheme; vLLM stores its cache in fp8 with them); the "
                          "quality stages read keys and values through float8 too (pipeline/quant/kv_fp8.py)")


class W8A8Method(QuantMethod):
    name = "w8a8"
    variant = W8A8Variant
    engine = "compressed_tensors"
    needs_definition = "architecture"  # its layer loop reads the decoder layers and linears
    arch_limit_reasons = {"moe": "its layer loop quantizes nn.Linear modules (compressed-tensors' linear schemes), so "
                                 "the routed experts would stay 16-bit"}
    engine_modules = ("pipeline.quant.w8a8_layers", "pipeline.quant.formats.ct_w8a8")
    checkpoint_format = CT
    bits = (8,)
    needs_calibration = True
    note = "W8A8 int8/fp8 (optionally SmoothQuant, GPTQ, static scales) in compressed-tensors; computed on the CPU"
    load_module = LOAD.load_module
    before_load = CompressedTensorsLoad.before_load  # a compressed-tensors folder reloads the same whoever wrote it
    after_load = CompressedTensorsLoad.after_load
    work = "pipeline.quant.work.w8a8"

    def format_of(self, variant) -> str:
        return FP8_FORMAT if variant.scheme.startswith("fp8") else CT

    def reload_of(self, variant):
        return LOAD

    def serve_needs(self, variant) -> tuple[str, ...]:
        return ("fp8_kv",) if variant.kv_cache == "fp8" else ()

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        p: list[Problem] = []
        if "lm_head" not in variant.modules_to_skip:
            p.append(Problem("modules_to_skip", "w8a8-lm-head-quantized",
                             f"method 'w8a8' keeps lm_head and the embeddings in 16 bits: add 'lm_head' to "
                             f"modules_to_skip (it is {variant.modules_to_skip})"))
        if variant.scheme.startswith("fp8") and variant.rounding == "gptq":
            p.append(Problem("rounding", "w8a8-fp8-with-gptq",
                             "rounding = 'gptq' with scheme = 'fp8-dynamic': GPTQ here rounds to the int8 grid; use "
                             "rounding = 'rtn' for float8 weights"))
        bad = [a for a in variant.smoothquant_alphas if not 0 <= a <= 1]
        if variant.smoothquant and bad:
            p.append(Problem("smoothquant_alphas", "smoothquant-alpha-out-of-range",
                             f"smoothquant_alphas {bad}: SmoothQuant's alpha lies in [0, 1]"))
        if variant.smoothquant and not arch.shapes_known:
            p.append(Problem("smoothquant", "smoothquant-unknown-family",
                             f"smoothquant = true on model_type {arch.model_type!r}: its fold points (norms before "
                             "q/k/v and gate/up) are unknown (no architecture definition: "
                             "pipeline/model/architecture.py); set smoothquant = false"))
        if variant.kv_cache and not arch.shapes_known:
            p.append(Problem("kv_cache", "kv-fp8-unknown-family",
                             f"kv_cache = 'fp8' on model_type {arch.model_type!r}: its attention layers (self_attn) "
                             "are unknown (no architecture definition: pipeline/model/architecture.py); drop kv_cache"))
        if arch.shapes_known:
            linears = quantized_linears(arch, variant.modules_to_skip)
            bad_tiles = [f"{k} ({i}x{o})" for k, (i, o) in linears.items() if i % TILE or o % TILE]
            if bad_tiles:
                p.append(Problem("modules_to_skip", "w8a8-shape-does-not-tile",
                                 f"W8A8 kernels (vLLM's CUTLASS scaled_mm, int8 and fp8) tile in- and out-features in "
                                 f"multiples of {TILE}; not {', '.join(bad_tiles)}: skip those layers in "
                                 "modules_to_skip"))
        return p

    def check_calibration(self, variant, rows: int, seq_len: int) -> list[Problem]:
        if variant.scheme != "int8-static" or rows * seq_len >= variant.static_min_tokens:
            return []
        return [Problem("calibration_rows", "static-scales-calibration-too-short",
                        f"scheme = 'int8-static' takes its activation scales from the calibration tokens: {rows} rows "
                        f"x {seq_len} = {rows * seq_len} is fewer than static_min_tokens = "
                        f"{variant.static_min_tokens}; raise calibration.num_samples (or calibration_rows) or use "
                        "scheme = 'int8-dynamic'")]

    def runtimes(self, variant, arch: Arch) -> list[dict]:
        rows = self._runtimes(variant)
        if variant.kv_cache == "fp8":
            rows.append({"runtime": "vLLM (FP8 KV cache)", "kernel": "the checkpoint's kv_cache_scheme turns fp8 KV "
                         "storage on with its k/v scales", "note": "CPU build: x86 with AVX-512 or AMX and a head "
                         "size divisible by 32; CUDA: any GPU vLLM supports"})
        return rows

    def _runtimes(self, variant) -> list[dict]:
        if variant.scheme.startswith("fp8"):
            return fp8_runtimes()
        how = "per token at run time" if variant.scheme == "int8-dynamic" else "one calibrated scale per tensor"
        return [
            {"runtime": "transformers (CPU)", "kernel": "compressed-tensors forward: int8 weights decompressed to "
             "dense, activations fake-quantized to int8 " + how, "note": "the accuracy of W8A8, not its speed (no "
             "int8 matmul); measured here"},
            {"runtime": "transformers (CUDA)", "kernel": "as on CPU", "note": "not measured here"},
            {"runtime": "vLLM (CPU)", "kernel": "compressed-tensors W8A8 int8 (oneDNN int8 GEMM, x86)",
             "note": "vLLM's documented x86 CPU support; served here when [validate.serve] asks for it"
                     + ("; its FP8 KV cache needs an AVX-512 or AMX CPU" if variant.kv_cache == "fp8" else "")},
            {"runtime": "vLLM (CUDA)", "kernel": "compressed-tensors W8A8 int8 (CUTLASS scaled_mm, sm75+)",
             "note": "expected (not run here)"},
            {"runtime": "GPTQModel.load", "kernel": "none", "note": "reads GPTQ checkpoints only"},
            dict(LLAMA_CPP_ROW),
        ]

    def bits_per_weight(self, variant) -> float:
        return 8.0  # plus one 16-bit scale per output row: under 0.03 bits for rows of 576 or more

    def hub_tags(self, params: dict) -> list[str]:
        scheme = str(params.get("scheme") or "int8-dynamic")
        return (["w8a8", scheme.split("-")[0], "8-bit", CT] + (["smoothquant"] if params.get("smoothquant") else [])
                + (["fp8-kv-cache"] if params.get("kv_cache") == "fp8" else []))

    def card_usage(self, repo: str, params: dict, quantize: dict) -> list[str]:
        scheme = str(params.get("scheme") or "int8-dynamic")
        how = {"int8-dynamic": ", int8 per token", "int8-static": ", int8 with its calibrated per-tensor scale",
               "fp8-dynamic": ", float8_e4m3fn per token"}[scheme]
        serve = ("vLLM on an Ada/Hopper GPU (compute capability >= 8.9) runs it as FP8 W8A8; older GPUs run the "
                 "weights only (FP8 Marlin); vLLM's CPU build cannot serve it" if scheme.startswith("fp8") else
                 f"vLLM (CUDA, or its x86 CPU build): `vllm serve {repo}` (compressed-tensors W8A8 int8)")
        return [f"The checkpoint is W8A8 in the compressed-tensors format (`{scheme}`): transformers loads it with "
                "`pip install compressed-tensors` and quantizes the activations in its forward pass.", "",
                serve + ".", "", f"How this card's quality figures were measured: {MEASURED.format(how=how)}"
                f"{KV_MEASURED if params.get('kv_cache') == 'fp8' else ''}.", "",
                "What this run recorded:", ""]


KV_MEASURED = ("; keys (after RoPE) and values went through float8_e4m3fn with the checkpoint's per-layer "
               "k_scale and v_scale in every attention (pipeline/quant/kv_fp8.py: compressed-tensors 0.20 applies "
               "no kv_cache_scheme to transformers 5.24's attention)")


def fp8_runtimes() -> list[dict]:
    """What FP8 W8A8 needs on each device."""
    return [
        {"runtime": "transformers (CPU)", "kernel": "compressed-tensors forward: float8 weights decompressed to "
         "dense, activations fake-quantized to float8 per token", "note": "the accuracy of FP8, not its speed; "
         "measured here"},
        {"runtime": "transformers (CUDA)", "kernel": "CompressedTensorsFP8Linear (torch scaled_mm) with "
         "use_optimized_inference=True on compute capability >= 8.9; else decompressed", "note": "not measured here"},
        {"runtime": "vLLM (CPU)", "kernel": "none", "note": "vLLM's CPU build does not serve FP8 W8A8 (its x86 "
         "quantization support is INT8 W8A8 and W4A16): serve the int8-dynamic variant on a CPU"},
        {"runtime": "vLLM (CUDA)", "kernel": "compressed-tensors W8A8 FP8 (CUTLASS scaled_mm)", "note": "needs an "
         "Ada or Hopper GPU (compute capability >= 8.9); Ampere runs the weights only (FP8 Marlin W8A16); expected, "
         "not run here"},
        {"runtime": "GPTQModel.load", "kernel": "none", "note": "reads GPTQ checkpoints only"},
        dict(LLAMA_CPP_ROW),
    ]


METHODS = (W8A8Method(),)
