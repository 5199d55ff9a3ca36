"""The runtime rows of a mixed-precision variant ([quantize.mix] on GPTQ or AutoRound), in either format it is written
in: what loads per-module settings, and what vLLM's CPU build serves of them (measured: tests/slow/test_vllm_mix.py).
Torch-free."""
from __future__ import annotations

from pipeline.quant.formats.ct import CT


def mix_runtimes(variant) -> list[dict]:
    """GPTQ format (GPTQModel `dynamic` overrides) or compressed-tensors (a config group per setting)."""
    if variant.format == CT:
        return ct_mix_runtimes(variant)
    return [{"runtime": "transformers (CPU/CUDA)", "kernel": "none",
             "note": "its GPTQ loader (optimum) builds every linear with the base bits and refuses per-module "
                     "bits"},
            {"runtime": "GPTQModel.load", "kernel": "per module: TorchAtenLinear (4-bit) or TorchLinear (CPU); "
             "Marlin or Triton/Torch (CUDA)", "note": "reads the `dynamic` overrides; what this run measures with"},
            {"runtime": "vLLM (CUDA)", "kernel": "gptq / gptq_marlin per module",
             "note": f"vLLM documents GPTQModel's `dynamic` overrides; {_fused_note(variant)}; not served here"},
            {"runtime": "vLLM (CPU, 0.32)", "kernel": "CPUWNA16 per module",
             "note": "reads the overrides (under its fused names: qkv_proj, gate_up_proj, which the overrides "
                     "match); its CPU kernel takes 4-bit only: a 4-bit mix of group sizes is served, an 8-bit "
                     "module refused ('Marlin does not support weight_bits = uint8b128'), both measured here; "
                     + _fused_note(variant)},
            {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only"}]


def _fused_note(variant) -> str:
    if variant.mix.granularity != "module":
        return f"q/k/v and gate/up share a setting (granularity {variant.mix.granularity!r})"
    return ("granularity 'module' can give q/k/v or gate/up different settings, which vLLM refuses for its fused "
            "qkv_proj/gate_up_proj: use granularity 'fused' or 'block' for vLLM")


def ct_mix_runtimes(variant) -> list[dict]:
    """A mix written as compressed-tensors: one config group per setting, each naming its linears."""
    fused = _fused_note(variant)
    return [{"runtime": "transformers (CPU/CUDA)", "kernel": "compressed-tensors decompressor (dense matmul)",
             "note": "reads a config group per setting and decompresses each linear with its own bits and group "
                     "size at the first forward; what this run measures with"},
            {"runtime": "vLLM (CPU, 0.32)", "kernel": "CPUWNA16 per config group",
             "note": "4-bit modules only (the kernel takes uint4/uint4b8): a 4-bit mix of group sizes is served, an "
                     "8-bit module refused ('Quant type (uint8b128) not supported by CPUWNA16'), measured here; "
                     f"{fused}"},
            {"runtime": "vLLM (CUDA)", "kernel": "compressed-tensors WNA16 per config group (Marlin/Machete)",
             "note": f"{fused}; not served here"},
            {"runtime": "GPTQModel.load", "kernel": "none", "note": "reads the GPTQ format: set format = 'gptq'"},
            {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only"}]
