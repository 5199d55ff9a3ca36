"""What each quantization method can do, and the checks that follow from it. Torch-free.

Every method declares its bits, group sizes, dtypes, devices and whether it needs calibration
(the GPTQModel `SUPPORTS_*` habit). `check_variant` turns a recipe variant plus the model's
linear shapes (`linear_shapes_from_config`, read from config.json) into a list of problems,
so `compress check` rejects the impossible before any weight is loaded. `runtimes` says which
serving runtimes can load the checkpoint and with which kernel.
"""
from __future__ import annotations

import re

# the shared declarations (re-exported: the rest of the code reads them from here) and, imported for their
# registrations into METHODS, each other method's own declarations
import pipeline.quant.caps_awq  # noqa: F401
import pipeline.quant.caps_gguf  # noqa: F401
import pipeline.quant.caps_torchao  # noqa: F401
from pipeline.quant.caps_base import (GPTQ_GROUP_SIZES, LLAMA_LIKE, METHODS, VLLM_MARLIN, MethodCaps,  # noqa: F401
                                      caps, gptq_runtimes, impl_module, is_skipped, linear_shapes_from_config, module_names,
                                      needs_calibration, quantized_linears, skip_pattern)

# ---------------------------------------------------------------- checks


def check_variant(variant, arch: dict, device: str) -> list[str]:
    """Problems that make this variant impossible on this model and device ([] = fine)."""
    c = caps(variant)
    problems = []
    if device not in c.devices:
        problems.append(f"{c.name} cannot run on device {device!r} (it runs on: {', '.join(c.devices)})")
    for field in ("dtype", "compute_dtype"):
        value = getattr(variant, field, None)
        if value is not None and value not in c.dtypes:
            problems.append(f"{field} = {value!r} is not supported by {c.name} (supported: {', '.join(c.dtypes)})")
    bits = getattr(variant, "bits", None)
    if bits is not None and bits not in c.bits:
        problems.append(f"bits = {bits} is not supported by {c.name} (supported: {', '.join(map(str, c.bits))})")
    if getattr(variant, "act_group_aware", None):
        if variant.desc_act:
            problems.append("desc_act = true and act_group_aware = true exclude each other: drop act_group_aware")
        if variant.group_size <= 0:
            problems.append(f"act_group_aware reorders columns inside groups: it needs group_size > 0, "
                            f"not {variant.group_size}; drop act_group_aware")
    if c.check is not None:
        problems += c.check(variant, arch, device)
    if arch.get("shapes_known"):
        problems += _check_skips(variant, arch)
        problems += _check_group_size(variant, arch, c)
    elif getattr(variant, "group_size", None) is not None and variant.group_size not in c.group_sizes:
        problems.append(f"group_size = {variant.group_size} is not supported by {c.name} "
                        f"(supported: {', '.join(map(str, c.group_sizes))})")
    return problems


def _check_skips(variant, arch: dict) -> list[str]:
    names = module_names(arch)
    bad = [e for e in variant.modules_to_skip if not any(re.match(skip_pattern(e), n) for n in names)]
    if not bad:
        return []
    kinds = ", ".join(arch["linear_in_features"])
    return [f"modules_to_skip entries {bad} match no linear layer of this {arch['model_type']} model "
            f"(linear names end in: {kinds})"]


def _check_group_size(variant, arch: dict, c: MethodCaps) -> list[str]:
    g = getattr(variant, "group_size", None)
    if g is None:
        return []
    linears = quantized_linears(arch, variant.modules_to_skip)
    ins = sorted({i for i, _ in linears.values()})
    ok = [s for s in c.group_sizes if s != -1 and all(i % s == 0 for i in ins)]
    suggest = " or ".join(map(str, sorted(ok, reverse=True)[:2])) or "-1"
    if g not in c.group_sizes:
        return [f"group_size = {g} is not supported by {c.name} (supported: {', '.join(map(str, c.group_sizes))}); "
                f"for this model use {suggest}"]
    if g == -1:
        return []
    bad = {k: i for k, (i, _) in linears.items() if i % g}
    if not bad:
        return []
    sizes = sorted(set(bad.values()))
    what = "; ".join(f"{i} ({', '.join(k for k, v in bad.items() if v == i)})" for i in sizes)
    hidden = arch.get("hidden_size")
    first = f"hidden size {hidden}" if hidden in sizes else f"in-features {sizes[0]}"
    why = f"{first} is not a multiple of {g}"
    return [f"group_size = {g} does not divide the in-features of every quantized linear: {what}; the {why}. "
            f"Use group_size = {suggest} (or -1 for per-channel)"]


# ---------------------------------------------------------------- serving runtimes

def runtimes(variant, arch: dict) -> list[dict]:
    """Which runtimes can serve this checkpoint, with which kernel: [{"runtime", "kernel", "note"}]."""
    if caps(variant).checkpoint_format == "gptq":
        return gptq_runtimes(variant, arch)
    if caps(variant).runtimes is not None:
        return caps(variant).runtimes(variant, arch)
    kind = {"bnb-int8": "Linear8bitLt (LLM.int8)", "bnb-nf4": "Linear4bit nf4", "bnb-fp4": "Linear4bit fp4"}
    k = kind[variant.method]
    return [
        {"runtime": "transformers (CPU)", "kernel": f"bitsandbytes {k}", "note": "measured here"},
        {"runtime": "transformers (CUDA)", "kernel": f"bitsandbytes {k}", "note": ""},
        {"runtime": "GPTQModel", "kernel": "none", "note": "GPTQModel does not load bitsandbytes checkpoints"},
        {"runtime": "vLLM (CUDA)", "kernel": "bitsandbytes", "note": "pre-quantized bnb checkpoints (int8, nf4, fp4); "
                                                                    "slower than GPTQ Marlin"},
        {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only: add a method = \"gguf\" variant"},
    ]
