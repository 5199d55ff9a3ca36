"""Which architectures a method can take: the traits of an architecture (pipeline/model/architecture.py) that a
method declares it cannot handle (`QuantMethod.arch_limits`), and the definition it needs
(`QuantMethod.needs_definition`), applied by `compress check` (registry.check_variant). Torch-free.

A refusal names the architecture, the method and the missing capability; each declared limit says where it was
measured (docs/architectures.md: the matrix run on transformers' own config classes). Nothing that check can know
from the config is left to fail at run time.
"""
from __future__ import annotations

from pipeline.base.problem import Problem
from pipeline.model.architecture import GPTQMODEL_GAPS, Architecture, gptqmodel_definitions
from pipeline.quant.shapes import Arch

# trait -> how check describes it in a refusal
TRAITS = {
    "moe": "Mixture-of-Experts (routed experts held as fused 3D parameters by transformers 5)",
    "mla": "multi-head latent attention (low-rank q/kv projections)",
    "fused_qkv": "a fused qkv_proj",
    "fused_gate_up": "a fused gate_up_proj",
    "per_layer_rope": "per-layer-type rotary embeddings (a rope setting per attention type)",
    "attention_bias": "q/k/v biases",
    "shared_experts": "shared experts beside the routed ones",
}


def traits(a: Architecture) -> set[str]:
    """The traits of an architecture that some method declares it cannot take."""
    out = set()
    if a.is_moe:
        out.add("moe")
        if a.experts is not None and a.experts.shared:
            out.add("shared_experts")
    if a.mla:
        out.add("mla")
    if a.fused_qkv:
        out.add("fused_qkv")
    if a.fused_gate_up:
        out.add("fused_gate_up")
    if a.attention_bias:
        out.add("attention_bias")
    rope = a.config.get("rope_parameters")
    layer_types = set(a.config.get("layer_types") or [])
    if isinstance(rope, dict) and layer_types and layer_types <= set(rope):
        out.add("per_layer_rope")
    return out


def arch_problems(method, variant, arch: Arch) -> list[Problem]:
    """What keeps this method from this architecture ([] = it can take it)."""
    a = arch.architecture
    if a is None or not arch.model_type:
        return []
    mt, name = arch.model_type, method.name
    need = method.needs_definition
    if need == "gptqmodel" and mt not in gptqmodel_definitions()[0]:
        return [Problem("method", "architecture-not-in-gptqmodel",
                        f"method {name!r} runs through GPTQModel, which has no definition for model_type {mt!r} "
                        "(its models/definitions/); use a method that does not need one (bnb-int8, bnb-nf4)")]
    if need == "gptqmodel" and mt in GPTQMODEL_GAPS:
        return [unsupported(name, mt, GPTQMODEL_GAPS[mt])]
    if mt in method.model_type_limits:
        return [unsupported(name, mt, method.model_type_limits[mt])]
    if need in ("gptqmodel", "architecture") and not a.known:
        return [Problem("method", "architecture-unknown",
                        f"method {name!r} needs the decoder's layers and linears, and model_type {mt!r} has no "
                        "architecture definition (GPTQModel's or pipeline/model/architecture.py LOCAL)")]
    limits = dict(method.arch_limits(variant))
    if getattr(variant, "mix", None) is not None:
        limits.setdefault("moe", "[quantize.mix] measures each unit's sensitivity by running and rounding its "
                                 "nn.Linear modules; routed experts are fused 3D parameters, so they have no units yet")
    return [unsupported(name, f"{mt} ({TRAITS[trait]})", limits[trait]) for trait in sorted(traits(a))
            if trait in limits]


def unsupported(method: str, what: str, why: str) -> Problem:
    """The one refusal of a method an architecture cannot take: the method, the architecture, why."""
    return Problem("method", "architecture-unsupported", f"method {method!r} cannot take {what}: {why}")
