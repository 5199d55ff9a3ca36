"""The declarations every quantization method shares: `MethodCaps`, the `METHODS` registry with the built-in
methods (GPTQ, RTN, bitsandbytes), model shapes read from config.json, skip patterns, and the GPTQ-format runtime
rows (AWQ and AutoRound reuse them). Torch-free.

The other methods' declarations (caps_awq, caps_gguf, caps_torchao) import this module; pipeline.quant.capabilities
imports them all and is what the rest of the code reads, so no module imports one that imports it back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from pipeline.dtypes import DTYPE_NAMES
from pipeline.families import LLAMA, family_of, linear_shapes
from pipeline.registry import Registry

# GPTQModel 7.6 QuantizeConfig accepts these group sizes; its CPU/torch kernel (TorchLinear) takes them all.
GPTQ_GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class MethodCaps:
    name: str
    engine: str  # the library that does the work, recorded in the manifest
    # the method's module, as a path under pipeline/ ("quant/gptq.py"): session(out_dir), quantize(...) -> model,
    # save(model, ...) -> dict; imported on use. A path, not a module name, on purpose: pipeline/codehash.py follows
    # "pipeline.x" strings, and this table must not put every method's code in every unit's identity; the quantize
    # unit of a variant names its own method's file (stages/quantize.py)
    impl: str
    checkpoint_format: str
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]  # () = the method has no group size
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]
    needs_calibration: bool
    note: str = ""
    check: Optional[Callable[..., list[str]]] = None  # method-specific rules: check(variant, arch, device) -> problems
    runtimes: Optional[Callable[..., list[dict]]] = None  # runtimes(variant, arch) -> rows; None = by format below
    offload: bool = False  # quantize(..., offload=folder) streams the model from disk layer by layer
    # the Hub card: tags from the variant's recorded params, and what the "How to use" section adds after the
    # transformers snippet: card_usage(repo, params, quantize) -> lines (quantize: the variant's recorded manifest)
    hub_tags: Optional[Callable[[dict], list[str]]] = None
    card_usage: Optional[Callable[[str, dict, dict], list[str]]] = None
    disk_bits: Optional[Callable[..., float]] = None  # bits per weight on disk (the disk plan); None: from bits/group
    # how quantizing holds the model, for the memory plan: "layerwise" (GPTQModel's layer-by-layer loop),
    # "while_loading" (quantized tensor by tensor as transformers loads it), "whole" (loaded whole, then quantized)
    memory: str = "whole"
    half_only: bool = False  # computes in 16 bits only: a float32 baseline is quantized in bfloat16


def bits_tags(*tags: str) -> Callable[[dict], list[str]]:
    """Hub tags of a method whose variants have `bits`: the method's tags, then "<bits>-bit"."""
    def get(params: dict) -> list[str]:
        bits = params.get("bits")
        return [*tags, f"{bits}-bit"] if bits else list(tags)
    return get


def grouped_bits(variant) -> float:
    """Bits per quantized weight on disk of a grouped integer format: a 16-bit scale and a packed zero per group."""
    g = getattr(variant, "group_size", -1)
    return variant.bits + (32 / g if g and g > 0 else 0.0)


def gptq_usage(made: str = "") -> Callable[[str, dict, dict], list[str]]:
    def usage(repo: str, params: dict, quantize: dict) -> list[str]:
        return [f"The checkpoint{made} is in the GPTQ format (`quantization_config` in config.json). transformers "
                "loads it through GPTQModel (`pip install gptqmodel optimum`). Directly:", "",
                "```python", "from gptqmodel import GPTQModel", f'model = GPTQModel.load("{repo}")', "```", "",
                f"vLLM (CUDA): `vllm serve {repo}`.", "",
                "**Kernel compatibility:** fast kernels depend on bits, group size, symmetry and act-order "
                "(e.g. Marlin takes symmetric 4/8-bit with group size -1/32/64/128); other settings fall back to "
                "slower kernels or are refused. What this run recorded:", ""]
    return usage


def _bnb_usage(repo: str, params: dict, quantize: dict) -> list[str]:
    return ["The checkpoint is pre-quantized with bitsandbytes (`quantization_config` in config.json): "
            "`pip install bitsandbytes` and load as above; no `BitsAndBytesConfig` is needed. "
            "LLM.int8() picks outlier columns per batch, so outputs can differ slightly with batch composition.", ""]


def _bnb_tags(kind: str) -> Callable[[dict], list[str]]:
    return lambda params: ["bitsandbytes", "8-bit" if kind == "int8" else "4-bit", kind]


METHODS: Registry[MethodCaps] = Registry("quantization method")

_GPTQ_DTYPES = DTYPE_NAMES
_BNB_DTYPES = DTYPE_NAMES

for _caps in (
    MethodCaps("gptq", "gptqmodel", "quant/gptq.py", "gptq", (2, 3, 4, 8), GPTQ_GROUP_SIZES,
               _GPTQ_DTYPES, ("cpu", "cuda"), True, "GPTQ (Frantar et al. 2022) through GPTQModel", offload=True,
               hub_tags=bits_tags("gptq"), card_usage=gptq_usage(), disk_bits=grouped_bits, memory="layerwise"),
    MethodCaps("rtn", "gptqmodel", "quant/rtn.py", "gptq", (2, 3, 4, 8), GPTQ_GROUP_SIZES,
               _GPTQ_DTYPES, ("cpu", "cuda"), False, "round-to-nearest, min/max scales, GPTQ checkpoint format",
               offload=True, hub_tags=bits_tags("rtn"), card_usage=gptq_usage(), disk_bits=grouped_bits,
               memory="layerwise"),
    # bits per weight on disk, scales included: int8 8.0, nf4/fp4 4.5 (a 32-bit absmax per block of 64)
    MethodCaps("bnb-int8", "bitsandbytes", "quant/bnb.py", "bitsandbytes", (8,), (),
               _BNB_DTYPES, ("cpu", "cuda"), False, "LLM.int8() (Dettmers et al. 2022), quantized while loading",
               hub_tags=_bnb_tags("int8"), card_usage=_bnb_usage, disk_bits=lambda variant: 8.0,
               memory="while_loading"),
    MethodCaps("bnb-nf4", "bitsandbytes", "quant/bnb.py", "bitsandbytes", (4,), (),
               _BNB_DTYPES, ("cpu", "cuda"), False, "4-bit NormalFloat, blocks of 64 (QLoRA)",
               hub_tags=_bnb_tags("nf4"), card_usage=_bnb_usage, disk_bits=lambda variant: 4.5,
               memory="while_loading"),
    MethodCaps("bnb-fp4", "bitsandbytes", "quant/bnb.py", "bitsandbytes", (4,), (),
               _BNB_DTYPES, ("cpu", "cuda"), False, "4-bit float (e2m1), blocks of 64",
               hub_tags=_bnb_tags("fp4"), card_usage=_bnb_usage, disk_bits=lambda variant: 4.5,
               memory="while_loading"),
):
    METHODS.register(_caps.name)(_caps)
# torchao, GGUF, AWQ and AutoRound declare per-method limits, checks and runtimes in their own modules
# (caps_*.py), registered when pipeline.quant.capabilities imports them.


def caps(variant) -> MethodCaps:
    return METHODS.get(variant.method)


def impl_module(c: MethodCaps) -> str:
    """The importable name of a method's module ("quant/gptq.py" -> "pipeline.quant.gptq")."""
    return "pipeline." + c.impl.removesuffix(".py").replace("/", ".")


def needs_calibration(variant) -> bool:
    return caps(variant).needs_calibration


# ---------------------------------------------------------------- model shapes

# Decoder families whose linear layers are named and shaped like Llama's (pipeline/families.py is the table).
LLAMA_LIKE = LLAMA.model_types


def linear_shapes_from_config(config: dict) -> dict:
    """In/out features of every linear of a config.json whose family pipeline/families.py knows, keyed by name
    inside a layer.

    {"model_type", "shapes_known", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
     "linear_in_features": {"self_attn.q_proj": 576, ..., "lm_head": 576}, "linear_out_features": {...},
     "layers" (the decoder layers' module path), "rope_type" (None or "default" = plain RoPE), "attention_bias",
     "mlp_bias"}
    For other model types shapes_known is False and the shape checks are skipped (said by check_variant's caller).
    """
    mt = config.get("model_type", "")
    out = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                      "tie_word_embeddings")}
    out.update(model_type=mt, shapes_known=False, linear_in_features={}, linear_out_features={})
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 / older config.json
    out.update(rope_type=rope.get("rope_type", rope.get("type")), attention_bias=config.get("attention_bias"),
               mlp_bias=config.get("mlp_bias"))
    shapes = linear_shapes(config)
    if shapes is None:
        return out
    out.update(shapes_known=True, layers=family_of(config).layers,
               linear_in_features={k: v[0] for k, v in shapes.items()},
               linear_out_features={k: v[1] for k, v in shapes.items()})
    return out


def module_names(arch: dict) -> list[str]:
    """Full names of the linear modules (<layers>.<i>.<name>, lm_head)."""
    n, layers = arch.get("num_hidden_layers") or 0, arch.get("layers", LLAMA.layers)
    inner = [k for k in arch["linear_in_features"] if k != "lm_head"]
    names = [f"{layers}.{i}.{k}" for i in range(n) for k in inner]
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
            prefix = arch.get("layers", LLAMA.layers) + "."
            kind = full[len(prefix):].split(".", 1)[-1] if full.startswith(prefix) else full
            kinds[kind] = (arch["linear_in_features"][kind], arch["linear_out_features"][kind])
    return kinds



# ---------------------------------------------------------------- GPTQ-format runtimes

VLLM_MARLIN = {"bits": (4, 8), "group_sizes": (-1, 32, 64, 128), "min_k": 128, "min_n": 64}


def gptq_runtimes(variant, arch: dict) -> list[dict]:
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
