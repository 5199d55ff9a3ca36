"""What each quantization method can do, and the checks that follow from it. Torch-free.

Every method declares its bits, group sizes, dtypes, devices and whether it needs calibration
(the GPTQModel `SUPPORTS_*` habit). `check_variant` turns a recipe variant plus the model's
linear shapes (`linear_shapes_from_config`, read from config.json) into a list of problems,
so `compress check` rejects the impossible before any weight is loaded. `runtimes` says which
serving runtimes can load the checkpoint and with which kernel.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Callable, Optional

from pipeline.dtypes import DTYPE_NAMES
from pipeline.registry import Registry

# GPTQModel 7.6 QuantizeConfig accepts these group sizes; its CPU/torch kernel (TorchLinear) takes them all.
GPTQ_GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class MethodCaps:
    name: str
    engine: str  # the library that does the work, recorded in the manifest
    impl: str  # module with session(out_dir), quantize(...) -> model, save(model, ...) -> dict; imported on use
    checkpoint_format: str
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]  # () = the method has no group size
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]
    needs_calibration: bool
    note: str = ""
    check: Optional[Callable[..., list[str]]] = None  # method-specific rules: check(variant, arch, device) -> problems


METHODS: Registry[MethodCaps] = Registry("quantization method")

_GPTQ_DTYPES = DTYPE_NAMES
_BNB_DTYPES = DTYPE_NAMES

for _caps in (
    MethodCaps("gptq", "gptqmodel", "pipeline.quant.gptq", "gptq", (2, 3, 4, 8), GPTQ_GROUP_SIZES,
               _GPTQ_DTYPES, ("cpu", "cuda"), True, "GPTQ (Frantar et al. 2022) through GPTQModel"),
    MethodCaps("rtn", "gptqmodel", "pipeline.quant.rtn", "gptq", (2, 3, 4, 8), GPTQ_GROUP_SIZES,
               _GPTQ_DTYPES, ("cpu", "cuda"), False, "round-to-nearest, min/max scales, GPTQ checkpoint format"),
    MethodCaps("bnb-int8", "bitsandbytes", "pipeline.quant.bnb", "bitsandbytes", (8,), (),
               _BNB_DTYPES, ("cpu", "cuda"), False, "LLM.int8() (Dettmers et al. 2022), quantized while loading"),
    MethodCaps("bnb-nf4", "bitsandbytes", "pipeline.quant.bnb", "bitsandbytes", (4,), (),
               _BNB_DTYPES, ("cpu", "cuda"), False, "4-bit NormalFloat, blocks of 64 (QLoRA)"),
    MethodCaps("bnb-fp4", "bitsandbytes", "pipeline.quant.bnb", "bitsandbytes", (4,), (),
               _BNB_DTYPES, ("cpu", "cuda"), False, "4-bit float (e2m1), blocks of 64"),
):
    METHODS.register(_caps.name)(_caps)
# torchao is registered in its own section at the end of this file (it declares per-scheme limits and a check).


def caps(variant) -> MethodCaps:
    return METHODS.get(variant.method)


def needs_calibration(variant) -> bool:
    return caps(variant).needs_calibration


# ---------------------------------------------------------------- model shapes

# Decoder families whose linear layers are named and shaped like Llama's.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2")


def linear_shapes_from_config(config: dict) -> dict:
    """In/out features of every linear of a Llama-family config.json, keyed by name inside a layer.

    {"model_type", "shapes_known", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
     "linear_in_features": {"self_attn.q_proj": 576, ..., "lm_head": 576}, "linear_out_features": {...},
     "rope_type" (None or "default" = plain RoPE), "attention_bias", "mlp_bias"}
    For other model types shapes_known is False and the shape checks are skipped (said by check_variant's caller).
    """
    mt = config.get("model_type", "")
    out = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                      "tie_word_embeddings")}
    out.update(model_type=mt, shapes_known=False, linear_in_features={}, linear_out_features={})
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 / older config.json
    out.update(rope_type=rope.get("rope_type", rope.get("type")), attention_bias=config.get("attention_bias"),
               mlp_bias=config.get("mlp_bias"))
    if mt not in LLAMA_LIKE or not config.get("hidden_size") or not config.get("intermediate_size"):
        return out
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config.get("num_attention_heads") or 1
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    shapes = {  # name: (in_features, out_features)
        "self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd), "self_attn.v_proj": (h, kv * hd),
        "self_attn.o_proj": (heads * hd, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h), "lm_head": (h, config.get("vocab_size") or 0),
    }
    out.update(shapes_known=True, linear_in_features={k: v[0] for k, v in shapes.items()},
               linear_out_features={k: v[1] for k, v in shapes.items()})
    return out


def module_names(arch: dict) -> list[str]:
    """Full names of the linear modules (model.layers.<i>.<name>, lm_head)."""
    n = arch.get("num_hidden_layers") or 0
    inner = [k for k in arch["linear_in_features"] if k != "lm_head"]
    names = [f"model.layers.{i}.{k}" for i in range(n) for k in inner]
    return names + (["lm_head"] if "lm_head" in arch["linear_in_features"] else [])


def skip_pattern(entry: str) -> str:
    """Regex for one modules_to_skip entry: the module name itself or any name ending in '.<entry>'."""
    return rf"^(?:.*\.)?{re.escape(entry)}$"


def is_skipped(name: str, modules_to_skip: list[str]) -> bool:
    return any(re.match(skip_pattern(e), name) for e in modules_to_skip)


def quantized_linears(arch: dict, modules_to_skip: list[str]) -> dict[str, tuple[int, int]]:
    """{kind (e.g. 'self_attn.q_proj'): (in, out)} of the linears the variant quantizes."""
    kinds = {}
    for full in module_names(arch):
        if not is_skipped(full, modules_to_skip):
            kind = full.split(".", 3)[-1] if full.startswith("model.layers.") else full
            kinds[kind] = (arch["linear_in_features"][kind], arch["linear_out_features"][kind])
    return kinds


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

VLLM_MARLIN = {"bits": (4, 8), "group_sizes": (-1, 32, 64, 128), "min_k": 128, "min_n": 64}


def runtimes(variant, arch: dict) -> list[dict]:
    """Which runtimes can serve this checkpoint, with which kernel: [{"runtime", "kernel", "note"}]."""
    if caps(variant).checkpoint_format == "gptq":
        return _gptq_runtimes(variant, arch)
    if caps(variant).checkpoint_format == "gguf":
        return _gguf_runtimes(variant, arch)
    if caps(variant).checkpoint_format == "torchao":
        return _torchao_runtimes(variant)
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


def _gptq_runtimes(variant, arch: dict) -> list[dict]:
    b, g, sym = variant.bits, variant.group_size, variant.sym
    aten = b == 4 and g in (16, 32, 64, 128)
    cpu_kernel = ("GPTQModel TorchAtenLinear (aten int4 matmul)" if aten
                  else "GPTQModel TorchLinear (dequantize then matmul; torch.compile'd, needs dynamo)")
    cuda_kernel = "GPTQModel Marlin" if b in (4, 8) and sym and g in (-1, 32, 64, 128) else "GPTQModel Triton/Torch"
    out = [
        {"runtime": "transformers (CPU)", "kernel": cpu_kernel, "note": "via GPTQModel's kernels; measured here"},
        {"runtime": "transformers (CUDA)", "kernel": cuda_kernel, "note": "via GPTQModel's kernels"},
        {"runtime": "GPTQModel.load", "kernel": f"CPU: {cpu_kernel.split(' (')[0]}; CUDA: {cuda_kernel}",
         "note": "float16/bfloat16 (its torch kernels refuse float32; bfloat16 is its CPU default)"},
        _vllm(variant, arch),
        {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only: add a method = \"gguf\" variant"},
    ]
    return out


def _vllm(variant, arch: dict) -> dict:
    b, g, sym = variant.bits, variant.group_size, variant.sym
    if b not in (2, 3, 4, 8):
        return {"runtime": "vLLM (CUDA)", "kernel": "none", "note": f"vLLM's GPTQ kernels take 2/3/4/8 bits, not {b}"}
    m = VLLM_MARLIN
    if b not in m["bits"] or not sym or g not in m["group_sizes"]:
        why = f"{b}-bit" if b not in m["bits"] else ("asymmetric" if not sym else f"group_size {g}")
        return {"runtime": "vLLM (CUDA)", "kernel": "gptq (ExLlama)",
                "note": f"Marlin does not take {why}; the slower gptq kernel serves it"}
    linears = quantized_linears(arch, variant.modules_to_skip) if arch.get("shapes_known") else {}
    bad = [f"{k.split('.')[-1]} ({i}x{o})" for k, (i, o) in linears.items() if i % m["min_k"] or o % m["min_n"]]
    if bad:
        return {"runtime": "vLLM (CUDA)", "kernel": "gptq_marlin for some layers, slower fallback for others",
                "note": f"Marlin needs in-features divisible by {m['min_k']} and out-features by {m['min_n']}; "
                        f"not {', '.join(bad)}: those layers fall back to a slower kernel (Machete/ExLlama), "
                        "or older vLLM refuses the model unless run with --quantization gptq"}
    note = "" if linears else "model shapes unknown: Marlin needs in-features divisible by 128"
    return {"runtime": "vLLM (CUDA)", "kernel": "gptq_marlin", "note": note}


# ---------------------------------------------------------------- torchao

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


METHODS.register("torchao")(MethodCaps(
    "torchao", "torchao", "pipeline.quant.torchao", "torchao", (4, 8), (-1, *TORCHAO_GROUP_SIZES), DTYPE_NAMES,
    ("cpu", "cuda"), False, "PyTorch-native quantization (torchao) through transformers' TorchAoConfig",
    check=_check_torchao))


# ---------------------------------------------------------------- GGUF (llama.cpp)

# config.json model_type -> whether llama.cpp permutes the Q/K rows (its LlamaModel does, Qwen2Model does not);
# the llama.cpp architecture has the same name. transformers' GGUF loader reads both back.
GGUF_ARCHS = {"llama": True, "qwen2": False}
GGUF_WRITTEN_TYPES = {"F16": 1, "Q8_0": 32}  # written here by gguf's numpy quantizer: type -> values per block
# Made by llama.cpp's own quantizer (llama_model_quantize, the gguf-kquants extra), in super-blocks of QK_K.
GGUF_KQUANT_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
GGUF_TYPES = (*GGUF_WRITTEN_TYPES, *GGUF_KQUANT_TYPES)
QK_K = 256
GGUF_KQUANTS_INSTALL = ("pip install -e '.[gguf-kquants]' (llama-cpp-python 0.3.36 has no wheel: it builds "
                        "llama.cpp from source, about 8 minutes on 2 cores)")
# llama.cpp's llama-quant.cpp: a tensor whose rows are not a multiple of QK_K is written in this type instead.
KQUANT_FALLBACK = "Q2_K/Q3_K -> IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0"


def gguf_problems(variant, arch: dict, device: str = "cpu") -> list[str]:
    """What makes a GGUF variant impossible for this model (checked by `compress check` on the recipe's source and
    again by the converter on the baseline checkpoint)."""
    mt = arch.get("model_type")
    if mt not in GGUF_ARCHS:
        return [f"method 'gguf' converts Llama-family checkpoints only (model_type {' or '.join(GGUF_ARCHS)}: "
                f"llama.cpp's LlamaModel and Qwen2Model); this model is {mt!r}"]
    problems = []
    if arch.get("rope_type") not in (None, "default"):
        problems.append(f"rope_type {arch['rope_type']!r}: RoPE scaling is not converted to GGUF here yet "
                        "(plain RoPE only)")
    if mt == "llama" and (arch.get("attention_bias") or arch.get("mlp_bias")):
        problems.append("attention_bias/mlp_bias = true: transformers' GGUF loader rebuilds a llama model without "
                        "biases, so the file could not be measured")
    kquant = variant.type in GGUF_KQUANT_TYPES
    if kquant and importlib.util.find_spec("llama_cpp") is None:
        problems.append(f"type = {variant.type!r} is made by llama.cpp's quantizer (llama-cpp-python), which is not "
                        f"installed: {GGUF_KQUANTS_INSTALL}; or use type = 'Q8_0' (written without it)")
    if kquant and variant.modules_to_skip:
        problems.append(f"type = {variant.type!r}: llama.cpp's quantizer takes no per-module skip list here; "
                        f"leave modules_to_skip empty (it is {variant.modules_to_skip})")
    if arch.get("shapes_known") and not variant.allow_fallback:
        problems += _gguf_block_problems(variant, arch)
    return problems


def _gguf_rows(variant, arch: dict) -> dict[str, int]:
    """Row length (in-features) of every tensor the type quantizes: the quantized linears and the embedding."""
    rows = {k: i for k, (i, _) in quantized_linears(arch, variant.modules_to_skip).items()}
    tied = arch.get("tie_word_embeddings")
    if tied:  # one tensor, token_embd, serves as both: it is skipped with lm_head
        rows.pop("lm_head", None)
    if arch.get("hidden_size") and not (tied and is_skipped("lm_head", variant.modules_to_skip)):
        rows["embed_tokens"] = arch["hidden_size"]
    return rows


def _gguf_block_problems(variant, arch: dict) -> list[str]:
    kquant = variant.type in GGUF_KQUANT_TYPES
    block = QK_K if kquant else GGUF_WRITTEN_TYPES[variant.type]
    bad = {k: n for k, n in _gguf_rows(variant, arch).items() if n % block}
    if not bad:
        return []
    what = ", ".join(f"{k} ({n})" for k, n in bad.items())
    instead = (f"llama.cpp writes those tensors in a fallback type ({KQUANT_FALLBACK})" if kquant
               else "the converter writes those tensors in F16")
    return [f"type = {variant.type!r} quantizes rows in blocks of {block} values, and these rows are not a multiple "
            f"of {block}: {what}. Use type = 'Q8_0' (blocks of 32), or set allow_fallback = true to accept that "
            f"{instead}"]


def _gguf_runtimes(variant, arch: dict) -> list[dict]:
    t = variant.type
    bad = {} if not arch.get("shapes_known") else {
        k: n for k, n in _gguf_rows(variant, arch).items()
        if n % (QK_K if t in GGUF_KQUANT_TYPES else GGUF_WRITTEN_TYPES[t])}
    mixed = f"; rows of {', '.join(bad)} do not fit its blocks: written in a fallback type" if bad else ""
    return [
        {"runtime": "llama.cpp", "kernel": f"{t} (CPU, CUDA, Metal, Vulkan)",
         "note": f"llama-cli / llama-server -m <file>.gguf{mixed}"},
        {"runtime": "Ollama", "kernel": f"llama.cpp {t}", "note": "ollama run hf.co/<repo>, or a Modelfile FROM ./<file>.gguf"},
        {"runtime": "LM Studio", "kernel": f"llama.cpp {t}", "note": "loads the .gguf as it is"},
        {"runtime": "transformers", "kernel": "none: dequantizes every tensor on load (float32)",
         "note": "from_pretrained(repo, gguf_file=...); measured here this way"},
        {"runtime": "vLLM (CUDA)", "kernel": "GGUF (experimental)",
         "note": "single-file GGUF: vllm serve <file>.gguf --tokenizer <repo>"},
        {"runtime": "GPTQModel", "kernel": "none", "note": "GPTQModel does not load GGUF files"},
    ]


METHODS.register("gguf")(MethodCaps(
    "gguf", "gguf", "pipeline.quant.gguf_export", "gguf", (2, 3, 4, 5, 6, 8, 16), (), DTYPE_NAMES, ("cpu", "cuda"),
    False, "a GGUF file for llama.cpp, Ollama and LM Studio, converted from the baseline", check=gguf_problems))
