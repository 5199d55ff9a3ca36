"""The compressed-tensors export format of the GPTQ-family and AWQ variants (`format = "compressed-tensors"` on gptq,
rtn, autoround and awq): what `compress check` asks of it, its runtime rows, its card text, how its checkpoints load
back, and the mixin through which those methods answer for it (CompressedTensorsOption).
Torch-free; the work is pipeline/quant/formats/ct_export.py.

A pack-quantized checkpoint holds, per linear, the int4/int8 values packed in int32 (`weight_packed`), one scale
per group (`weight_scale`) and, for an asymmetric grid, packed zero points: GPTQ's representation without g_idx.
It is written from the variant's GPTQ checkpoint (same integers, scales and group size), so what it can hold is
what both formats can: 4 or 8 bits (vLLM's WNA16 schemes), columns in order (desc_act off), and lm_head and the
embeddings left in 16 bits.

Architectures (measured on the matrix's tiny models, tests/unit/quant/test_ct_architectures.py): the checkpoint holds
every tensor under the name transformers' own save_pretrained gives it. A fused linear GPTQModel quantizes as
parts (phi3's gate_up_proj as gate_proj + up_proj) is written fused, its parts' rows stacked. A Mixture of Experts
whose experts transformers 5.24 holds as fused 3D parameters is written one linear per expert, under the per-expert
names its conversion mapping reads (mixtral: block_sparse_moe.experts.<e>.w1/w2/w3; qwen3_moe, olmoe:
mlp.experts.<e>.gate_proj/up_proj/down_proj; vLLM reads the same names); transformers decompresses those experts
while it loads, into the fused parameters. What it cannot load is refused at check (`ct_arch_problems`).
"""
from __future__ import annotations

from typing import TypedDict, get_args

from pipeline.base.problem import Problem
from pipeline.base.registry import load_work
from pipeline.quant.method import LLAMA_CPP_ROW
from pipeline.quant.shapes import Arch, quantized_linears

CT = "compressed-tensors"
CT_BITS = (4, 8)  # vLLM's compressed-tensors WNA16 schemes; compressed-tensors 0.20 packs 3-bit values across words


class MarlinLimits(TypedDict):
    """What vLLM's Marlin kernel takes: group sizes, and in-features (k) / out-features (n) divisible by these."""
    group_sizes: tuple[int, ...]
    min_k: int
    min_n: int


MARLIN: MarlinLimits = {"group_sizes": (-1, 32, 64, 128), "min_k": 128, "min_n": 64}


class CompressedTensorsLoad:
    """How a compressed-tensors checkpoint loads back (the reload facts pipeline/quant/registry.py `by_format`
    returns): transformers' own compressed-tensors quantizer applies the config, keeps the packed tensors, and
    decompresses the whole model to dense weights in its dtype at the first forward (no int4 kernel on CPU).

    A checkpoint with an asymmetric pack-quantized group (AWQ's zero points, sym = false) loads the same way inside
    `packed_zero_points_on_meta` (pipeline/quant/formats/ct_export.py): compressed-tensors 0.20 compresses transformers'
    meta-device model without packing the zero points, so the checkpoint's packed weight_zero_point does not fit
    the place made for it and the load stops with a size mismatch. (transformers' `dequantize=True` loads it too,
    but decompresses in the scales' dtype: float16 products in a float32 model, not the exact weights.)"""

    name = CT
    checkpoint_format = CT
    load_module = "compressed_tensors"
    repacked_on_cpu = False
    decompressed_on_load = True  # in memory it is the dense model once it has run
    reload_work = "pipeline.quant.formats.ct_export"  # its torch side (load_own)

    def before_load(self) -> None:
        pass

    def after_load(self, model) -> None:
        pass

    def load_own(self, folder, config: dict, device: str):
        if not packed_zero_points(config.get("quantization_config") or {}):
            return None  # transformers' compressed-tensors quantizer loads it (pipeline/quant/checkpoint.py)
        return load_work(self.reload_work).load_own(folder, device)


def packed_zero_points(qc: dict) -> bool:
    """A pack-quantized config with an asymmetric weight group (its zero points packed)."""
    groups = (qc.get("config_groups") or {}).values()
    return qc.get("format") == "pack-quantized" and any(
        not (g.get("weights") or {}).get("symmetric", True) for g in groups)


LOAD = CompressedTensorsLoad()


class CompressedTensorsOption:
    """Mixin of a method whose variants choose their checkpoint `format`: its own, or "compressed-tensors" (the same
    integers rewritten, pipeline/quant/formats/ct_export.py). Every format-dependent answer is compressed-tensors'
    for such a variant and the method's own (`own_*`) otherwise; the method defines the own_* answers."""

    made_by = ""  # how the card says a compressed-tensors checkpoint was made, after "The checkpoint"

    def format_of(self, variant) -> str:
        return variant.format

    def reload_of(self, variant):
        return LOAD if variant.format == CT else self

    def serve_needs(self, variant) -> tuple[str, ...]:
        return ("wna16",) if variant.format == CT else ()  # the same integer weights, activations in 16 bits

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        return ct_problems(variant, arch) if variant.format == CT else self.own_check(variant, arch, device)

    def runtimes(self, variant, arch: Arch) -> list[dict]:
        return ct_runtimes(variant, arch) if variant.format == CT else self.own_runtimes(variant, arch)

    def bits_per_weight(self, variant) -> float:
        return ct_bits_per_weight(variant) if variant.format == CT else self.own_bits_per_weight(variant)

    def hub_tags(self, params: dict) -> list[str]:
        tags = self.own_hub_tags(params)
        return [*tags, CT] if params.get("format") == CT else tags

    def card_usage(self, repo: str, params: dict, quantize: dict) -> list[str]:
        return ct_usage(repo, self.made_by) if params.get("format") == CT else self.own_card_usage(repo, params)

    def own_check(self, variant, arch: Arch, device: str) -> list[Problem]:
        return []

    def own_runtimes(self, variant, arch: Arch) -> list[dict]:
        raise NotImplementedError

    def own_bits_per_weight(self, variant) -> float:
        raise NotImplementedError

    def own_hub_tags(self, params: dict) -> list[str]:
        raise NotImplementedError

    def own_card_usage(self, repo: str, params: dict) -> list[str]:
        raise NotImplementedError


def ct_problems(variant, arch: Arch) -> list[Problem]:
    """What a `format = "compressed-tensors"` variant cannot be (group size vs in-features is the registry's rule)."""
    where = "format = 'compressed-tensors'"
    problems = []
    if variant.bits not in CT_BITS:
        problems.append(Problem("bits", "ct-bits-unsupported",
                                f"bits = {variant.bits} with {where}: its pack-quantized W{{4,8}}A16 checkpoints take "
                                f"{' or '.join(map(str, CT_BITS))} bits (the engines' WNA16 kernels); use format = "
                                "'gptq' for other widths"))
    if getattr(variant, "desc_act", False):
        problems.append(Problem("desc_act", "ct-desc-act",
                                f"desc_act = true with {where}: pack-quantized stores no g_idx, so act-order columns "
                                "cannot be written; set desc_act = false (act_group_aware keeps columns in order) or "
                                "format = 'gptq'"))
    if "lm_head" not in variant.modules_to_skip:
        problems.append(Problem("modules_to_skip", "ct-lm-head-not-skipped",
                                f"{where} keeps lm_head and the embeddings in 16 bits: add 'lm_head' to "
                                f"modules_to_skip (it is {variant.modules_to_skip})"))
    return problems + ct_arch_problems(variant, arch)


FUSED_ONLY_REASON = ("compressed-tensors 0.20 quantizes nn.Linear modules; transformers 5.24 holds {mt}'s experts as "
                     "fused 3D parameters and its conversion mapping reads no per-expert names for them (its "
                     "checkpoints store them fused), so a checkpoint with one quantized linear per expert cannot load")
# MoE model_types whose experts transformers 5.24 reads only fused (no per-expert source names in its
# conversion_mapping.py), measured: gpt_oss's export stops at its first expert, granitemoe's checkpoint layout is
# block_sparse_moe.input_linear / output_linear [E, ...]
CT_EXPERTS_FUSED_ONLY = frozenset({"gpt_oss", "granitemoe", "granitemoeshared", "granitemoehybrid"})
# MoE model_types measured to export and reload (every expert quantized); any MoE when the architecture says so
CT_PER_EXPERT_MOE = frozenset({"mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3"})
ASYM_EXPERTS_REASON = ("transformers 5.24 decompresses a fused-experts MoE's per-expert compressed-tensors weights "
                       "from weight_packed and weight_scale only (its CompressedTensorsDequantize has no zero "
                       "point), so {mt}'s experts with an asymmetric grid cannot load (measured: its loader stops "
                       "on every experts parameter)")


def ct_arch_problems(variant, arch: Arch) -> list[Problem]:
    """What compressed-tensors (as transformers loads it) cannot hold of this architecture. The facts it needs:
    is the model a MoE whose experts transformers holds fused (3D parameters), and does transformers read
    per-expert checkpoint names for them (pipeline/quant/formats/ct_export.py finds them in its conversion mapping)."""
    mt, own = arch.model_type, own_format(variant)
    if mt in CT_EXPERTS_FUSED_ONLY:
        why = f"cannot take {mt}: {FUSED_ONLY_REASON.format(mt=mt)}; use format = '{own}'"
    elif (arch.is_moe or mt in CT_PER_EXPERT_MOE) and not variant.sym:
        why = (f"with an asymmetric grid ({'AWQ' if own == 'awq' else 'sym = false'}) cannot take {mt}: "
               f"{ASYM_EXPERTS_REASON.format(mt=mt)}; use {'sym = true or ' if own != 'awq' else ''}format = '{own}'")
    else:
        return []
    return [Problem("format", "ct-architecture-unsupported", f"format = 'compressed-tensors' {why}")]


def own_format(variant) -> str:
    """The variant's method's own checkpoint format (its `format` field's other choice)."""
    return next(f for f in get_args(type(variant).model_fields["format"].annotation) if f != CT)


def ct_bits_per_weight(variant) -> float:
    """Packed values, a 16-bit scale per group, and a packed zero point per group when asymmetric."""
    g = variant.group_size
    if not g or g <= 0:
        return float(variant.bits)
    return variant.bits + (16 + (0 if variant.sym else variant.bits)) / g


def ct_runtimes(variant, arch: Arch) -> list[dict]:
    b, g, sym = variant.bits, variant.group_size, variant.sym
    w = f"W{b}A16"
    linears = quantized_linears(arch, variant.modules_to_skip) if arch.shapes_known else {}
    m = MARLIN
    bad = [f"{k.split('.')[-1]} ({i}x{o})" for k, (i, o) in linears.items() if i % m["min_k"] or o % m["min_n"]]
    if g not in m["group_sizes"]:
        cuda = {"runtime": "vLLM (CUDA)", "kernel": f"compressed-tensors {w}: no Marlin kernel",
                "note": f"Marlin does not take group_size {g}; vLLM picks another WNA16 kernel or refuses it"}
    elif bad:
        cuda = {"runtime": "vLLM (CUDA)", "kernel": f"compressed-tensors {w} (Marlin/Machete for some layers)",
                "note": f"Marlin needs in-features divisible by {m['min_k']} and out-features by {m['min_n']}; not "
                        f"{', '.join(bad)}: vLLM chooses another WNA16 kernel per layer or refuses the model"}
    else:
        cuda = {"runtime": "vLLM (CUDA)", "kernel": f"compressed-tensors {w} (Marlin; Machete on Hopper)",
                "note": "" if sym else "asymmetric: Marlin with zero points"}
    return [
        {"runtime": "transformers (CPU)", "kernel": "compressed-tensors decompressor (dense matmul)",
         "note": "the whole model is decompressed to dense 16-bit weights at its first forward: a dense model's "
                 "memory and speed; measured here"},
        {"runtime": "transformers (CUDA)", "kernel": "compressed-tensors decompressor (dense matmul)",
         "note": "as on CPU (transformers keeps only FP8 schemes compressed)"},
        {"runtime": "vLLM (CPU)", "kernel": f"compressed-tensors {w} (vLLM's CPU WNA16 kernel)",
         "note": "x86 CPU build on AVX-512 CPUs (its AVX2 build has no weight-only kernel); see "
                 "benchmarks/README_quant.md for what was measured"},
        cuda,
        {"runtime": "GPTQModel.load", "kernel": "none", "note": "reads the GPTQ format: set format = 'gptq'"},
        dict(LLAMA_CPP_ROW),
    ]


def ct_usage(repo: str, made: str = "") -> list[str]:
    return [f"The checkpoint{made} is in the compressed-tensors format (`pack-quantized`, "
            "`quantization_config.quant_method = \"compressed-tensors\"` in config.json): transformers loads it with "
            "`pip install compressed-tensors` and decompresses it to dense weights at the first forward.", "",
            f"vLLM (CUDA, or its x86 CPU build): `vllm serve {repo}` (its compressed-tensors WNA16 kernels).", "",
            "**Kernel compatibility:** vLLM's fast WNA16 kernels (Marlin, Machete) take 4/8 bits with group size "
            "-1/32/64/128 and need in-features divisible by 128; other layers get a slower kernel. What this run "
            "recorded:", ""]
