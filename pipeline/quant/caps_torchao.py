"""torchao's schemes: what each takes, which kernel runs it where, and `compress check`'s rules for them.
Torch-free; registered into caps_base.METHODS when capabilities is imported."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pipeline.dtypes import DTYPE_NAMES
from pipeline.quant.caps_base import METHODS, MethodCaps

TORCHAO_GROUP_SIZES = (32, 64, 128, 256)  # Int4WeightOnlyConfig's documented group sizes


@dataclass(frozen=True)
class TorchAoScheme:
    """One torchao scheme (torchao 0.18 through transformers' TorchAoConfig): what it takes and what runs it."""

    config: str  # the torchao config class
    bits: int
    group_sizes: tuple[int, ...]  # -1 = one scale per output channel
    dtypes: tuple[str, ...]
    kernels: dict[str, str]  # device -> the kernel transformers runs it with; a device not here is refused
    refused: dict[str, str]  # device -> why the scheme cannot be run or saved there (one line)
    detail: str = ""  # what `compress check` adds to a refusal: the evidence and what to use instead
    activations: bool = False  # quantizes activations too (per token, at run time): act_mapping applies


_INT4_CPU_DETAIL = (
    "Int4WeightOnlyConfig packs for CUDA "
    "(tile_packed_to_4d: tinygemm, compute capability >= 8.0; plain: the mslk package's kernels) or XPU/NPU "
    "(plain_int32), and its CPU route (IntxWeightOnlyConfig with int4) stores each 4-bit value in an int8, "
    "saving nothing over int8. On CPU use method = 'gptq' or 'rtn' with bits = 4 (aten int4 kernel) or "
    "'bnb-nf4'; for this scheme set run.device = 'cuda'")

TORCHAO_SCHEMES: dict[str, TorchAoScheme] = {
    "int8-weight-only": TorchAoScheme(
        "Int8WeightOnlyConfig", 8, (-1,), DTYPE_NAMES,
        {"cpu": "torchao Int8Tensor: int8 weights cast to the activation dtype, then aten mm (eager)",
         "cuda": "torchao Int8Tensor: int8 weights cast to the activation dtype, then aten mm (eager); "
                 "torch.compile fuses the cast into the matmul"}, {}),
    "int8-dynamic": TorchAoScheme(
        "Int8DynamicActivationInt8WeightConfig", 8, (-1,), DTYPE_NAMES,
        {"cpu": "torchao Int8Tensor: per-token int8 activations, int8 x int8 -> int32 matmul "
                "(torchao _int_scaled_matmul_cpu; u8s8 on CPUs with AVX512-VNNI and no AMX), zero-point "
                "correction for asymmetric activations",
         "cuda": "torchao Int8Tensor: per-token int8 activations, torch._int_mm (cuBLAS int8) or torchao's "
                 "Triton int_scaled_matmul"}, {}, activations=True),
    "int4-weight-only": TorchAoScheme(
        "Int4WeightOnlyConfig", 4, TORCHAO_GROUP_SIZES, ("bfloat16",),
        {"cuda": "torchao Int4TilePackedTo4dTensor: tinygemm aten._weight_int4pack_mm (compute capability >= 8.0)"},
        {"cpu": "torchao 0.18 has no CPU kernel for an int4 checkpoint it can save"}, _INT4_CPU_DETAIL),
}


def _check_torchao(variant, arch: dict, device: str) -> list[str]:
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append("method 'torchao' needs the torchao package, which is not installed: "
                        "pip install torchao==0.18.0 (a dependency of compress: pip install -e .)")
    s = TORCHAO_SCHEMES[variant.scheme]
    label = f"torchao {variant.scheme}"
    if device not in s.kernels:
        why = s.refused.get(device) or f"it runs on: {', '.join(s.kernels)}"
        problems.append(f"scheme = {variant.scheme!r} cannot run on device {device!r}: {why}"
                        + (f". {s.detail}" if s.detail else ""))
    if variant.group_size not in s.group_sizes:
        what = "-1 (one scale per output channel)" if s.group_sizes == (-1,) else ", ".join(map(str, s.group_sizes))
        problems.append(f"group_size = {variant.group_size} is not supported by {label} (supported: {what})")
    default_act = type(variant).model_fields["act_mapping"].default
    if variant.act_mapping != default_act and not s.activations:
        problems.append(f"act_mapping = {variant.act_mapping!r} sets the int8-dynamic scheme's activation grid; "
                        f"{label} quantizes no activations: drop act_mapping")
    if s.dtypes != DTYPE_NAMES and variant.dtype not in s.dtypes:
        given = f"dtype = {variant.dtype!r}" if variant.dtype else "dtype unset (the checkpoint's)"
        problems.append(f"{given}: {label} packs {', '.join(s.dtypes)} weights only; set dtype = {s.dtypes[0]!r}")
    return problems


def _torchao_runtimes(variant) -> list[dict]:
    s = TORCHAO_SCHEMES[variant.scheme]
    rows = []
    for dev, label, note in (("cpu", "CPU", "measured here"), ("cuda", "CUDA", "")):
        kernel, why = s.kernels.get(dev, "none"), "" if dev in s.kernels else s.refused.get(dev, "")
        rows.append({"runtime": f"transformers ({label})", "kernel": kernel, "note": why or note})
    return rows + [
        {"runtime": "vLLM (CUDA)", "kernel": f"torchao ({s.config})",
         "note": "vLLM's torchao quantization method reads quant_type from config.json and loads the torchao "
                 "safetensors; needs a torchao that reads this version's format; not measured here"},
        {"runtime": "GPTQModel", "kernel": "none", "note": "GPTQModel does not load torchao checkpoints"},
        {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only: add a method = \"gguf\" variant"},
    ]


def _torchao_tags(params: dict) -> list[str]:
    scheme = TORCHAO_SCHEMES.get(params.get("scheme"))
    return ["torchao", f"{scheme.bits}-bit", params["scheme"]] if scheme else ["torchao"]


def _torchao_usage(repo: str, params: dict, quantize: dict) -> list[str]:
    version = quantize.get("engine_version")
    pin = f"torchao=={version}" if version else "torchao"
    return [f"The checkpoint is quantized with torchao (`quant_method: \"torchao\"` in config.json, scheme "
            f"`{params.get('scheme') or '?'}`): `pip install {pin}` and load as above; no `TorchAoConfig` "
            "is needed. transformers rebuilds torchao's quantized tensors from the safetensors metadata, so "
            "the torchao that reads it must understand this version's format. torchao's kernels are fastest "
            "under `torch.compile(model)`.", "",
            f"vLLM (CUDA): `vllm serve {repo}` (its `torchao` quantization method). What this run recorded:", ""]


METHODS.register("torchao")(MethodCaps(
    "torchao", "torchao", "quant/torchao.py", "torchao", (4, 8), (-1, *TORCHAO_GROUP_SIZES), DTYPE_NAMES,
    ("cpu", "cuda"), False, "PyTorch-native quantization (torchao) through transformers' TorchAoConfig",
    check=_check_torchao, runtimes=lambda variant, arch: _torchao_runtimes(variant), hub_tags=_torchao_tags,
    card_usage=_torchao_usage, disk_bits=lambda variant: TORCHAO_SCHEMES[variant.scheme].bits + 0.25))


