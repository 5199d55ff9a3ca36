"""torchao (PyTorch-native quantization) through transformers' TorchAoConfig: its schemes, what each takes and
which kernel runs it where and `compress check`'s rules for them; the work is pipeline/quant/work/torchao.py.

Schemes: int8 weight-only, int8 dynamic activation + int8 weight, int4 weight-only (CUDA only in torchao 0.18).
torchao swaps each quantized nn.Linear weight for a tensor subclass (Int8Tensor, Int4TilePackedTo4dTensor) while the
weights load; save_pretrained flattens the subclasses into plain safetensors tensors with JSON metadata in the file
header (torchao.prototype.safetensors), and from_pretrained rebuilds them from it: no pickled weights.

transformers matches modules_to_not_convert against parameter names ("...down_proj.weight") by prefix or suffix, so
a dotted suffix such as "mlp.down_proj" would match nothing there: the skip list handed to transformers is the full
names of the linears our own rule (shapes.is_skipped) skips.
"""
from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from pipeline.base.problem import Problem
from pipeline.model.dtypes import DTYPE_NAMES
from pipeline.quant.method import LLAMA_CPP_ROW, QuantMethod
from pipeline.quant.shapes import Arch
from pipeline.quant.variant import Dtype, VariantBase

ENGINE = "torchao"
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


class TorchAoVariant(VariantBase):
    """PyTorch-native quantization through torchao (transformers' TorchAoConfig), no calibration; what each
    scheme takes and where it runs is in TORCHAO_SCHEMES."""

    method: Literal["torchao"]
    scheme: Literal[tuple(TORCHAO_SCHEMES)] = Field(  # type: ignore[valid-type]
        description="int8-weight-only (int8 weights, 16/32-bit matmul), int8-dynamic (int8 weights and per-token "
                    "int8 activations, integer matmul) or int4-weight-only (CUDA only)")
    group_size: int = Field(-1, description="-1 = one scale per output channel (the int8 schemes); "
                                            "int4-weight-only takes 32, 64, 128 or 256")
    dtype: Dtype | None = Field(None, description="dtype the model is loaded and run in; None = the loaded "
                                                  "checkpoint's (int4-weight-only needs bfloat16)")
    act_mapping: Literal["asymmetric", "symmetric"] = Field(
        "asymmetric", description="int8-dynamic only: each token's activation grid, with a zero point (asymmetric) "
                                  "or centred on 0; on SmolLM2 (recipes/methods.toml) asymmetric measured a perplexity "
                                  "ratio of 1.018 vs 1.039 symmetric")


class TorchAoMethod(QuantMethod):
    name = "torchao"
    variant = TorchAoVariant
    engine = ENGINE
    arch_limit_reasons = {"moe": "torchao's quantize_ swaps nn.Linear weights only, so the routed experts would stay "
                                 "16-bit"}
    checkpoint_format = "torchao"
    bits = (4, 8)
    group_sizes = (-1, *TORCHAO_GROUP_SIZES)
    note = "PyTorch-native quantization (torchao) through transformers' TorchAoConfig"
    work = "pipeline.quant.work.torchao"

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        problems = []
        if importlib.util.find_spec("torchao") is None:
            problems.append(Problem("method", "torchao-not-installed",
                                    "method 'torchao' needs the torchao package, which is not installed: "
                                    "pip install torchao==0.18.0 (a dependency of compress: pip install -e .)"))
        s = TORCHAO_SCHEMES[variant.scheme]
        label = f"torchao {variant.scheme}"
        if device not in s.kernels:
            why = s.refused.get(device) or f"it runs on: {', '.join(s.kernels)}"
            problems.append(Problem("scheme", "torchao-scheme-device",
                                    f"scheme = {variant.scheme!r} cannot run on device {device!r}: {why}"
                                    + (f". {s.detail}" if s.detail else "")))
        if variant.group_size not in s.group_sizes:
            what = "-1 (one scale per output channel)" if s.group_sizes == (-1,) else ", ".join(map(str, s.group_sizes))
            problems.append(Problem("group_size", "torchao-group-size-unsupported",
                                    f"group_size = {variant.group_size} is not supported by {label} "
                                    f"(supported: {what})"))
        default_act = type(variant).model_fields["act_mapping"].default
        if variant.act_mapping != default_act and not s.activations:
            problems.append(Problem("act_mapping", "torchao-act-mapping-unused",
                                    f"act_mapping = {variant.act_mapping!r} sets the int8-dynamic scheme's activation "
                                    f"grid; {label} quantizes no activations: drop act_mapping"))
        if s.dtypes != DTYPE_NAMES and variant.dtype not in s.dtypes:
            given = f"dtype = {variant.dtype!r}" if variant.dtype else "dtype unset (the checkpoint's)"
            problems.append(Problem("dtype", "torchao-dtype-unsupported",
                                    f"{given}: {label} packs {', '.join(s.dtypes)} weights only; "
                                    f"set dtype = {s.dtypes[0]!r}"))
        return problems

    def runtimes(self, variant, arch: Arch) -> list[dict]:
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
            dict(LLAMA_CPP_ROW),
        ]

    def bits_per_weight(self, variant) -> float:
        return TORCHAO_SCHEMES[variant.scheme].bits + 0.25

    def hub_tags(self, params: dict) -> list[str]:
        scheme = TORCHAO_SCHEMES.get(params.get("scheme", ""))
        return ["torchao", f"{scheme.bits}-bit", params["scheme"]] if scheme else ["torchao"]

    def card_usage(self, repo: str, params: dict, quantize: dict) -> list[str]:
        version = quantize.get("engine_version")
        pin = f"torchao=={version}" if version else "torchao"
        return [f"The checkpoint is quantized with torchao (`quant_method: \"torchao\"` in config.json, scheme "
                f"`{params.get('scheme') or '?'}`): `pip install {pin}` and load as above; no `TorchAoConfig` "
                "is needed. transformers rebuilds torchao's quantized tensors from the safetensors metadata, so "
                "the torchao that reads it must understand this version's format. torchao's kernels are fastest "
                "under `torch.compile(model)`.", "",
                f"vLLM (CUDA): `vllm serve {repo}` (its `torchao` quantization method). What this run recorded:", ""]

    def after_load(self, model) -> None:
        # transformers counts a torchao weight (a tensor subclass) at the dense dtype it stands for
        model.get_memory_footprint = types.MethodType(self.load_work().footprint_bytes, model)


METHODS = (TorchAoMethod(),)
